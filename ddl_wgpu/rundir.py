"""A training run's output folder, claimed before any work: a lock against a second run writing into it
(stale after kill -9: its process is gone), proof that it is writable, and the refusal to train into a
folder that already holds a run unless asked to overwrite it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ddl_wgpu.errors import UserError

CHECKPOINT = "checkpoint.ddlw"
REPORT = "report.json"
LOCK = ".lock"


class OutputError(UserError):
    """An output folder that cannot take the run; `kind` says why (out_not_folder, not_writable, locked,
    run_exists)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0  # another user's live process (or a pid this OS cannot even name)
    return True


class RunLock:
    """`FOLDER/.lock` holding this process's id while a run writes into FOLDER: a second run on the same
    folder is refused up front instead of dying late on the first's partial files. A lock whose process is
    gone (kill -9) is stale and taken over. Creating it also proves the folder writable before any work."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.held = False

    def __enter__(self) -> RunLock:
        if self.folder.exists() and not self.folder.is_dir():
            raise OutputError(f"output {self.folder} is a file, not a folder", kind="out_not_folder")
        for _ in range(3):
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    pid = int(self.path.read_text().strip() or "0")
                except (OSError, ValueError):
                    pid = 0
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


def holds_run(folder: Path) -> Path | None:
    """The file that shows `folder` holds a training run (its report, or a variant's checkpoint), or None."""
    folder = Path(folder)
    if (folder / REPORT).is_file():
        return folder / REPORT
    if folder.is_dir():
        for d in sorted(folder.iterdir()):
            if (d / CHECKPOINT).exists():
                return d / CHECKPOINT
    return None


def claim_output(folder: Path, overwrite: bool) -> RunLock:
    """The locked output folder of a new sweep, before any work: refused when it is a file, not writable, in
    use by another run, or holds a run (unless `overwrite`: then its old sweep report goes at once, so it
    never describes the new run). Use the result in a `with`."""
    lock = RunLock(folder).__enter__()
    try:
        found = holds_run(folder)
        if found is not None and not overwrite:
            raise OutputError(f"{folder} already holds a training run ({found})", kind="run_exists")
        if overwrite:
            (Path(folder) / REPORT).unlink(missing_ok=True)
    except BaseException:
        lock.__exit__()
        raise
    return lock


def write_json(path: Path, obj) -> None:
    """Atomic JSON write (temp name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    try:
        tmp.write_text(json.dumps(obj, indent=2, allow_nan=True))
        tmp.replace(path)
    except BaseException:  # a full disk or a Ctrl-C: no half-written partial left behind
        tmp.unlink(missing_ok=True)
        raise
