"""A training run's output folder, claimed before any work: a lock against a second run writing into it
(stale after kill -9: its process is gone), proof that it is writable, and the refusal to train into a
folder that already holds a run unless asked to overwrite it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from pathlib import Path

from ddl_ref.config import ModelVariant
from ddl_wgpu.errors import UserError
from ddl_wgpu.files.safeio import is_temp_of, write_atomic

CHECKPOINT = "checkpoint.ddlw"
REPORT = "report.json"
SWEEP = "sweep.json"  # a sweep's record (`sweep.Sweep`)
LOCK = ".lock"
# The files a run writes, in its folder and its job folders: what shows that a folder holds a run, and what
# --overwrite removes (with the sweep's plots, `plots.write_plots`). `.partial`: a write cut short.
RUN_FILES = (SWEEP, REPORT, CHECKPOINT)
PLOTS = ("loss.png", "beta.png", "beta_histogram.png")
# No live process has an id above this: Linux's largest pid_max is 2^22 (other systems stay below 2^31)
MAX_PID = (1 << 31) - 1


class OutputError(UserError):
    """An output folder that cannot take the run; `kind` says why (out_not_folder, not_writable, locked,
    run_exists)."""


def _pid_alive(pid: int) -> bool:
    if not 0 < pid <= MAX_PID:  # no process can have it: a damaged lock, not a live run
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    except (OverflowError, ValueError):
        return False  # a pid this OS cannot even name
    return True


def _lock_pid(path: Path) -> int:
    """The process id a lock file holds (0: none readable); a lock that is not a regular file (a folder, a
    FIFO) is refused: reading or replacing it would block or fail with a raw errno."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    if not stat.S_ISREG(st.st_mode):
        raise OutputError(f"the lock {path} is not a regular file; remove it if no run is writing into "
                          f"{path.parent}", kind="locked")  # fmt: skip
    try:
        with open(path, "rb") as f:
            return int(f.read(64).strip() or b"0")
    except (OSError, ValueError):
        return 0


class RunLock:
    """`FOLDER/.lock` holding this process's id while a run writes into FOLDER: a second run on the same
    folder is refused up front instead of dying late on the first's partial files. A lock whose process is
    gone (kill -9) is stale and taken over. Creating it also proves the folder writable before any work."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.held = False
        self.created: list[Path] = []  # the folders this lock created, deepest first

    def __enter__(self) -> RunLock:
        if self.held:  # `claim_output` hands over a lock already taken
            return self
        if self.folder.exists() and not self.folder.is_dir():
            raise OutputError(f"output {self.folder} is a file, not a folder", kind="out_not_folder")
        missing = [d for d in (self.folder, *self.folder.parents) if not d.exists()]
        for _ in range(3):
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                self.created = missing
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                pid = _lock_pid(self.path)
                if pid > 0 and pid != os.getpid() and _pid_alive(pid):
                    raise OutputError(
                        f"{self.folder} is in use by another run (process {pid}; lock {self.path})",
                        kind="locked",
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its process is gone
                continue
            except OSError as e:
                raise OutputError(
                    f"cannot write to {self.folder}: {e.strerror or e}", kind="not_writable"
                ) from None
            try:
                os.write(fd, str(os.getpid()).encode())
            finally:
                os.close(fd)
            self.held = True
            return self
        raise OutputError(f"{self.folder}: cannot take the lock {self.path}", kind="locked")

    def __exit__(self, *exc) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False
            # a command refused or interrupted before it wrote anything leaves no empty folder behind
            for d in self.created:
                try:
                    d.rmdir()
                except OSError:  # it holds what the run wrote (or someone else's files): it stays
                    break
            self.created = []


def _subfolders(folder: Path) -> list[Path]:
    try:
        return sorted(d for d in folder.iterdir() if d.is_dir() and not d.is_symlink())
    except OSError:
        return []


def run_folders(folder: Path) -> list[Path]:
    """Where a run keeps its files, deepest first: `folder` itself (a sweep's record and ranked report, or
    the job of `resume --out`), each variant's folder (VARIANT/) and each job's of a seed sweep
    (VARIANT/seed-S/)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for d in _subfolders(folder):
        found += [s for s in _subfolders(d) if any((s / n).exists() for n in RUN_FILES)]
        found.append(d)
    return [*found, folder]


def holds_run(folder: Path) -> Path | None:
    """The file that shows `folder` holds a run, or None: any of a sweep's record, a report or a checkpoint
    (finished, stopped or interrupted), in the folder, a variant's folder or a job's folder of a seed
    sweep."""
    for d in reversed(run_folders(folder)):
        for name in RUN_FILES:
            if (d / name).exists():
                return d / name
    return None


def _is_variant(name: str) -> bool:
    try:
        return ModelVariant.parse(name).slug == name
    except ValueError:
        return False


def _job_folder(d: Path, folder: Path) -> bool:
    """`d` is where a run of ours wrote a job: VARIANT/ or VARIANT/seed-S/ under `folder`, with a run file."""
    rel = d.relative_to(folder).parts
    if not rel or not _is_variant(rel[0]) or not any((d / n).exists() for n in RUN_FILES):
        return False
    return len(rel) == 1 or (len(rel) == 2 and re.fullmatch(r"seed-\d+", rel[1]) is not None)


def clear_run(folder: Path) -> None:
    """--overwrite: remove the old run's files (every job's report and checkpoint, the sweep's record, report
    and plots) and the job folders they leave empty, so that nothing of the old run stays beside the new one
    (a stale job's checkpoint would otherwise resume into the new run's ranked report). Only job folders
    named as ours (VARIANT/, VARIANT/seed-S/) are touched, and in them only the files a run writes: other
    files stay, and so do their folders."""
    folder = Path(folder)
    for d in run_folders(folder):
        if d == folder:
            names = [*RUN_FILES, *PLOTS]
        elif _job_folder(d, folder):
            names = [REPORT, CHECKPOINT]
        else:
            continue
        for name in names + [n + ".partial" for n in names]:
            (d / name).unlink(missing_ok=True)
        for p in d.glob(".*.partial"):  # a write cut short (`safeio.temp_name`); the run's lock is held here
            if any(is_temp_of(p.name, n) for n in names):
                p.unlink(missing_ok=True)
        if d != folder:
            with contextlib.suppress(OSError):  # not empty: it holds files the run did not write
                d.rmdir()
    for d in _subfolders(folder):  # a seed sweep's variant folders, once their jobs are gone
        if _is_variant(d.name):
            with contextlib.suppress(OSError):
                d.rmdir()


def claim_output(folder: Path, overwrite: bool) -> RunLock:
    """The locked output folder of a new run, before any work: refused when it is a file, not writable, in
    use by another run, or holds a run (unless `overwrite`: then the old run's files go at once, so that
    none of them describes or joins the new run). Use the result in a `with`."""
    lock = RunLock(folder).__enter__()
    try:
        found = holds_run(folder)
        if found is not None and not overwrite:
            raise OutputError(f"{folder} already holds a training run ({found})", kind="run_exists")
        if overwrite and found is not None:
            clear_run(folder)
    except BaseException:
        lock.__exit__()
        raise
    return lock


def write_json(path: Path, obj) -> None:
    """Atomic JSON write: a file of this writer's own, then a rename (`safeio.write_atomic`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(obj, indent=2, allow_nan=True).encode()
    write_atomic(path, lambda f: f.write(data))  # a full disk or a Ctrl-C: no half-written file left behind
