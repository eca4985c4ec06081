"""Reading a result back in the submit that computed it: `Readback`, a MAP_READ buffer mapped and waited for on
the calling thread (the decoder's per-token read-back, `decode.py`), made by `gpu.Gpu.readback`; `wait_mode`, how
it waits (DDL_WGPU_WAIT: spin or block)."""

from __future__ import annotations

import os

import numpy as np
import wgpu

from ddl_wgpu.runtime.gpu_errors import GpuError

# how `Readback.read` waits: "spin" or "block" (default: spin unless the adapter is a CPU)
ENV_WAIT = "DDL_WGPU_WAIT"


def wait_mode(gpu) -> str:
    """`DDL_WGPU_WAIT`, else "spin" on a GPU (the host polls without blocking until the result is mapped: no
    driver wake-up in the token's path) and "block" on a CPU adapter (whose work runs on the host's cores)."""
    mode = os.environ.get(ENV_WAIT, "").strip() or ("block" if gpu.info.get("type") == "CPU" else "spin")
    if mode not in ("spin", "block"):
        raise GpuError(f"{ENV_WAIT} must be spin or block, got {mode!r}")
    return mode


class Readback:
    """A MAP_READ buffer of `nbytes` (`Gpu.readback`): copy into `.buffer` inside a recording, submit, then
    `read` (waits for the GPU). The map goes through the runtime on the calling thread (`native.NativeMap`,
    `dawn.DawnMap`), its completion seen by this thread's own polls or waits, never handed over between
    threads (docs/kernels.md#the-decode-path)."""

    def __init__(self, gpu, nbytes: int, label: str = "readback"):
        self.gpu, self.nbytes = gpu, max(16, (int(nbytes) + 15) // 16 * 16)
        usage = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        self.buffer = gpu.device.create_buffer(size=self.nbytes, usage=usage, label=label)
        self.spin = wait_mode(gpu) == "spin"
        self._map = gpu.rt.map_reader(gpu.device, self.buffer, self.spin)

    def read(self, dtype, count: int, offset: int = 0, after: int | None = None) -> np.ndarray:
        """`count` items of `dtype` at byte `offset`, once the submit that wrote them has finished (the map
        completes then). `after`, that submission's index (`Gpu.submit_indexed`): a blocking wait waits for
        it alone, not for later submissions; the spinning wait needs no index."""
        dtype = np.dtype(dtype)
        n = count * dtype.itemsize
        lo, hi = offset // 8 * 8, -(-(offset + n) // 8) * 8  # map ranges are 8-byte aligned
        raw = self._map.read(lo, hi - lo, after)
        return np.frombuffer(raw, np.uint8)[offset - lo : offset - lo + n].copy().view(dtype)
