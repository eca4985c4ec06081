"""wgpu-native (through the `wgpu` package, wgpu-py) as one of the device layer's two WebGPU runtimes.

`Native` holds the calls that differ between runtimes (`runtimes.py` names them; docs/runtimes.md compares them
with Dawn's): adapters, the device, the submission index wgpu-native returns and waits for, trusted modules
without naga's checks, the read-back's map on the calling thread, the timestamp period, and the three
compute-pass functions the `Recorder` calls directly. wgpu-native lists no subgroup-matrix configuration.
"""

from __future__ import annotations

import wgpu
from wgpu.backends.wgpu_native import _api, ffi, lib

from ddl_wgpu.runtime.gpu_errors import GpuError, KernelError


class Native:
    name = "native"
    module = wgpu  # the wgpu-py API module: flags and enums are the same values in both runtimes
    toggles: tuple = ()  # wgpu-native has no toggles
    host_feature = None  # nor buffers on host memory (`host_buffer`)
    # the project's feature names are wgpu-native's (`Gpu.features`, the launchers' tests)
    FEATURES: dict = {}

    def enumerate_adapters(self) -> list:
        return list(wgpu.gpu.enumerate_adapters_sync())

    def features(self, names) -> set:
        return {str(f) for f in names}

    def matrix_configs(self, adapter) -> list:
        return []  # wgpu-native exposes no subgroup matrices (issue 39)

    def request_device(self, adapter, features: list, limits: dict, trusted: bool):
        return adapter.request_device_sync(required_features=features, required_limits=limits)

    def device_toggles(self, device) -> list:
        return []

    def planned_toggles(self, trusted: bool) -> list:
        return []

    def submit_indexed(self, queue, command_buffer) -> int:
        """wgpu-native's `wgpuQueueSubmitForIndex` (wgpu-py wraps only the plain submit)."""
        cbs = ffi.new("WGPUCommandBuffer[]", [command_buffer._internal])
        return int(lib.wgpuQueueSubmitForIndex(queue._internal, 1, cbs))

    def wait(self, device) -> None:
        """Block until the queue is empty (`on_submitted_work_done` is broken in wgpu-py 0.32, #834)."""
        lib.wgpuDevicePoll(device._internal, True, ffi.NULL)

    def done(self, device, index: int) -> bool:
        """Whether submission `index` has finished, without blocking: wgpu-native's poll says only whether the
        whole queue is empty, so a later submission still running answers False."""
        return bool(lib.wgpuDevicePoll(device._internal, False, ffi.NULL))

    def wait_for(self, device, index: int) -> None:
        lib.wgpuDevicePoll(device._internal, True, ffi.new("WGPUSubmissionIndex *", index))

    def shader_module(self, device, src: str, label: str, trusted: bool):
        """A module; a trusted one skips naga's bounds checks and loop bounding
        (`wgpuDeviceCreateShaderModuleTrusted`: wgpu-py has no wrapper for it)."""
        if not trusted:
            return device.create_shader_module(code=src, label=label)
        source = _api.new_struct_p("WGPUShaderSourceWGSL *", code=_api.to_c_string_view(src))
        source[0].chain.next = ffi.NULL
        source[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
        desc = _api.new_struct_p(
            "WGPUShaderModuleDescriptor *",
            nextInChain=ffi.cast("WGPUChainedStruct *", source),
            label=_api.to_c_string_view(label),
        )
        handle = lib.wgpuDeviceCreateShaderModuleTrusted(
            device._internal, desc, lib.WGPUShaderRuntimeChecks_None
        )
        if handle == ffi.NULL:
            raise KernelError(f"{label}: shader module creation failed")
        return _api.GPUShaderModule(label, handle, device)

    def timestamp_period_ns(self, queue) -> float:
        return float(lib.wgpuQueueGetTimestampPeriod(queue._internal))

    def pass_calls(self) -> tuple:
        """(set pipeline, set bind group, dispatch, NULL): the C functions `Recorder.dispatch_all` calls."""
        return (lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
                lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL)  # fmt: skip

    def map_reader(self, device, buffer, spin: bool) -> NativeMap:
        return NativeMap(device, buffer, spin)

    def host_buffer(self, device, nbytes: int, label: str):
        return None  # wgpu-native has no buffer on host memory (Dawn's host-mapped-pointer)


class NativeMap:
    """A MAP_READ buffer mapped through wgpu-native on the calling thread, its callback fired by this thread's
    own device polls: wgpu-py's map wakes its poll thread, whose blocking poll of every submission holds the
    device's fence while the caller would submit the next token (docs/kernels.md#the-decode-path)."""

    def __init__(self, device, buffer, spin: bool):
        self.device, self.buffer, self.spin = device, buffer, spin
        done = self._done = []

        @ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
        def mapped(status, _message, _u1, _u2):
            done.append(int(status))

        self._callback = mapped  # kept alive with the buffer
        self._info = ffi.new("WGPUBufferMapCallbackInfo *", {"mode": lib.WGPUCallbackMode_AllowProcessEvents,
                                                             "callback": mapped})  # fmt: skip

    def read(self, lo: int, size: int, after: int | None) -> bytes:
        """Bytes [lo, lo + size) once the submit that wrote them has finished; `after` its index (a blocking
        wait waits for it alone)."""
        buf, dev, done = self.buffer._internal, self.device._internal, self._done
        done.clear()
        lib.wgpuBufferMapAsync(buf, lib.WGPUMapMode_Read, lo, size, self._info[0])
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
            return bytes(ffi.buffer(lib.wgpuBufferGetConstMappedRange(buf, lo, size), size))
        finally:
            lib.wgpuBufferUnmap(buf)
