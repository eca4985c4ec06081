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
    `read` (waits for the GPU). The map goes through wgpu-native on the calling thread, its callback fired
    by this thread's own device polls: wgpu-py's map wakes its poll thread, whose blocking poll of every
    submission holds the device's fence while the caller would submit the next token, and hands the result
    over between threads (docs/kernels.md#the-decode-path)."""

    def __init__(self, gpu, nbytes: int, label: str = "readback"):
        from wgpu.backends.wgpu_native import ffi, lib

        self.gpu, self.nbytes = gpu, max(16, (int(nbytes) + 15) // 16 * 16)
        usage = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        self.buffer = gpu.device.create_buffer(size=self.nbytes, usage=usage, label=label)
        self.spin = wait_mode(gpu) == "spin"
        done = self._done = []

        @ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
        def mapped(status, _message, _u1, _u2):
            done.append(int(status))

        self._callback = mapped  # kept alive with the buffer
        self._info = ffi.new("WGPUBufferMapCallbackInfo *", {"mode": lib.WGPUCallbackMode_AllowProcessEvents,
                                                             "callback": mapped})  # fmt: skip

    def read(self, dtype, count: int, offset: int = 0, after: int | None = None) -> np.ndarray:
        """`count` items of `dtype` at byte `offset`, once the submit that wrote them has finished (the map
        completes then). `after`, that submission's index (`Gpu.submit_indexed`): a blocking wait waits for
        it alone, not for later submissions; the spinning wait needs no index."""
        from wgpu.backends.wgpu_native import ffi, lib

        dtype = np.dtype(dtype)
        n = count * dtype.itemsize
        lo, hi = offset // 8 * 8, -(-(offset + n) // 8) * 8  # map ranges are 8-byte aligned
        buf, dev, done = self.buffer._internal, self.gpu.device._internal, self._done
        done.clear()
        lib.wgpuBufferMapAsync(buf, lib.WGPUMapMode_Read, lo, hi - lo, self._info[0])
        if self.spin:
            while not done:
                lib.wgpuDevicePoll(dev, False, ffi.NULL)
        else:
            lib.wgpuDevicePoll(
                dev, True, ffi.NULL if after is None else ffi.new("WGPUSubmissionIndex *", after)
            )
            while not done:
                lib.wgpuDevicePoll(dev, True, ffi.NULL)
        if done[0] != lib.WGPUMapAsyncStatus_Success:
            raise GpuError(f"could not map the read-back buffer (status {done[0]})")
        try:
            raw = ffi.buffer(lib.wgpuBufferGetConstMappedRange(buf, lo, hi - lo), hi - lo)
            return np.frombuffer(raw, np.uint8)[offset - lo : offset - lo + n].copy().view(dtype)
        finally:
            lib.wgpuBufferUnmap(buf)
