"""Host memory of a job's large arrays: in RAM while they fit a budget, past it in a memory-mapped scratch file
beside the job's output (`HostArrays`).

heal keeps the draft's block-input rows of every window for every chain step on the host (N x T x C float16
per step: 10 GB per step per million tokens at the Qwen3.8-27B width). When they would pass `--host-memory`
(default: HOST_FRACTION of the memory available when the job starts) they live in one scratch file instead,
`.OUT.scratch` in OUT's folder, read and written through its memory map (the operating system's page cache
keeps what fits). The file is removed when the job ends: after success, after a failure, after Ctrl-C (a
`with` block); a kill -9 leaves it, and the next run of the same output replaces it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from ddl_wgpu.files.modelfile import available_bytes

HOST_FRACTION = 0.5  # of the memory available at the start: the default --host-memory


def default_budget() -> int | None:
    have = available_bytes()
    return None if have is None else int(HOST_FRACTION * have)


def scratch_path(out_path) -> Path:
    out = Path(out_path)
    return out.with_name(f".{out.name}.scratch")


class HostArrays:
    """Arrays allocated through `zeros`: in RAM when `in_ram(nbytes)` (the caller's decision, against the budget),
    else in the scratch file (grown array by array). A context manager: the file goes on exit, however the
    block ends."""

    def __init__(self, out_path, budget: int | None = None):
        self.path = scratch_path(out_path)
        self.budget = budget if budget is not None else default_budget()
        self._file = None
        self._end = 0
        self.maps: list[np.memmap] = []

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` of arrays stay within the budget (no budget known: yes)."""
        return self.budget is None or nbytes <= self.budget

    def zeros(self, shape, dtype, in_ram: bool) -> np.ndarray:
        """A zero array in RAM, or (`in_ram` False) a memory map of the scratch file's next bytes."""
        if in_ram:
            return np.zeros(shape, dtype)
        if self._file is None:
            self._file = open(self.path, "w+b")  # noqa: SIM115 (open until `close`); replaces a killed run's
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self._file.truncate(self._end + n)  # sparse: reads as zeros until written
        m = np.memmap(self._file, dtype=dtype, mode="r+", offset=self._end, shape=tuple(shape))
        self._end += n
        self.maps.append(m)
        return m

    @property
    def scratch_bytes(self) -> int:
        return self._end

    def close(self) -> None:
        for m in self.maps:
            mm = getattr(m, "_mmap", None)
            if mm is not None:  # a view that still refers to it keeps it until the process ends
                with contextlib.suppress(BufferError, ValueError):
                    mm.close()
        self.maps = []
        if self._file is not None:
            self._file.close()
            self._file = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> HostArrays:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
