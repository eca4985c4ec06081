"""Host memory of a job's large arrays: in RAM while they fit a budget, past it in a memory-mapped scratch file
beside the job's output (`HostArrays`).

heal keeps the draft's block-input rows of every window for every chain step on the host (N x T x C float16
per step: 10 GB per step per million tokens at the Qwen3.8-27B width). When they would pass `--host-memory`
(default: HOST_FRACTION of the memory available when the job starts) they live in one scratch file instead,
read and written through its memory map (the operating system's page cache keeps what fits), one region per
chain step, mapped once.

The scratch file is the run's own: `.OUT.<pid>.<random>.scratch` in OUT's folder, created exclusively and
never through a link (`safeio.create_exclusive`), so it never writes into a file that is there (an input, a
planted link) and two runs of one OUT never share one; its name fits the folder's name limit whatever OUT's
length. Its whole size is reserved up front (`reserve`, posix_fallocate): a full disk or a file size limit
(`ulimit -f`) is then one line before any work (`ScratchError`), not a SIGBUS when a page of the map is first
written. The file is removed when the job ends: after success, after a failure, after Ctrl-C or SIGTERM (a
`with` block; the command line turns SIGTERM into an interruption); a kill -9 leaves it, and the next run of
the same output removes it (its process is gone).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

import numpy as np

from ddl_wgpu.errors import UserError
from ddl_wgpu.files.modelfile import available_bytes
from ddl_wgpu.files.safeio import create_exclusive, is_temp_of

HOST_FRACTION = 0.5  # of the memory available at the start: the default --host-memory
SUFFIX = ".scratch"


class ScratchError(UserError):
    """The scratch file cannot be made or its space reserved (a full disk, a file size limit, ...)."""


def default_budget() -> int | None:
    have = available_bytes()
    return None if have is None else int(HOST_FRACTION * have)


def scratch_files(out_path) -> list[Path]:
    """The scratch files of runs writing `out_path` that are there now (this run's, a live run's, or one a
    kill -9 left)."""
    out = Path(out_path)
    try:
        names = os.listdir(out.parent if str(out.parent) else ".")
    except OSError:
        return []
    return sorted(out.with_name(n) for n in names if is_temp_of(n, out.name, SUFFIX))


def _pid_of(path: Path) -> int:
    m = re.search(r"\.(\d+)\.[0-9a-f]{8}" + re.escape(SUFFIX) + "$", path.name)
    return int(m.group(1)) if m else 0


def _gone(pid: int) -> bool:
    """Whether process `pid` is known to have ended (a name without one, or another user's live process: no)."""
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):
        return False
    return False


class HostArrays:
    """Arrays allocated through `zeros`: in RAM when `in_ram(nbytes)` (the caller's decision, against the budget),
    else in the scratch file (made at the first such array, or by `reserve`; grown array by array past what was
    reserved). A context manager: the file goes on exit, however the block ends."""

    def __init__(self, out_path, budget: int | None = None):
        self.out = Path(out_path)
        self.path: Path | None = None  # the scratch file, once made
        self.budget = budget if budget is not None else default_budget()
        self._file = None
        self._size = 0  # bytes reserved in the file
        self._end = 0  # bytes handed out as arrays
        self.maps: list[np.memmap] = []

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` of arrays stay within the budget (no budget known: yes)."""
        return self.budget is None or nbytes <= self.budget

    def reserve(self, nbytes: int) -> None:
        """Make the scratch file now and reserve `nbytes` in it: what does not fit is one line before any work."""
        self._grow(self._end + nbytes)

    def _open(self) -> None:
        for old in scratch_files(self.out):  # left by a kill -9 of a run of this output: its process is gone
            if _gone(_pid_of(old)):
                with contextlib.suppress(OSError):
                    os.unlink(old)
        try:
            fd, self.path = create_exclusive(self.out, SUFFIX, 0o600)
        except OSError as e:
            raise ScratchError(
                f"{self.out}: cannot create the scratch file beside it: {e.strerror or e}"
            ) from None
        self._file = os.fdopen(fd, "r+b")

    def _grow(self, end: int) -> None:
        if self._file is None:
            self._open()
        if end <= self._size:
            return
        fd = self._file.fileno()
        try:
            try:
                os.posix_fallocate(fd, self._size, end - self._size)
            except AttributeError:  # no posix_fallocate (macOS, Windows): a sparse file, as before
                os.ftruncate(fd, end)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                    raise
                os.ftruncate(fd, end)  # a file system that cannot reserve: sparse
        except OSError as e:
            path = self.path
            self.close()
            why = {errno.EFBIG: "file too large (past the file size limit, ulimit -f)",
                   errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded"}.get(
                e.errno, e.strerror or str(e))  # fmt: skip
            raise ScratchError(f"{path}: cannot reserve {end:,} bytes for the scratch file: {why}; free space "
                               "there, write --out on another disk, or raise --host-memory") from None  # fmt: skip
        self._size = end

    def zeros(self, shape, dtype, in_ram: bool) -> np.ndarray:
        """A zero array in RAM, or (`in_ram` False) a memory map of the scratch file's next bytes."""
        if in_ram:
            return np.zeros(shape, dtype)
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self._grow(self._end + n)  # reserved: reads as zeros until written
        m = np.memmap(self._file, dtype=dtype, mode="r+", offset=self._end, shape=tuple(shape))
        self._end += n
        self.maps.append(m)
        return m

    @property
    def scratch_bytes(self) -> int:
        """The bytes the arrays in the scratch file occupy."""
        return self._end

    def close(self) -> None:
        for m in self.maps:
            mm = getattr(m, "_mmap", None)
            if mm is not None:  # a view that still refers to it keeps it until the process ends
                with contextlib.suppress(BufferError, ValueError):
                    mm.close()
        self.maps = []
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def __enter__(self) -> HostArrays:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
