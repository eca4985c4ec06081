"""Dawn (through the `wgpudawn` package: wgpu-py's API on Dawn) as one of the device layer's two WebGPU runtimes.

The same calls as `native.Native`, Dawn's way (docs/runtimes.md): Dawn has no submission index, so a submit
registers a queue-done future and waiting for the index waits on that future (`wgpuInstanceWaitAny`); no
blocking device poll (the queue-done future again); no per-module "trusted" switch, so the device toggle
`disable_robustness` plays that role for the whole device; timestamps already in nanoseconds. Dawn names the
subgroup feature `subgroups` (wgpu-native: `subgroup`) and lists the subgroup-matrix configurations
(`chromium-experimental-subgroup-matrix`, behind the instance toggle `allow_unsafe_apis`) that the tensor-core
kernels use. Importing this module starts nothing; `Dawn()` creates Dawn's instance with its toggles.
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import tempfile

import numpy as np
import wgpudawn
from wgpudawn.backends.dawn import _api, extras, ffi, lib
from wgpudawn.backends.dawn._ffi import c_callback, callbacks

from ddl_wgpu.runtime.gpu_errors import GpuError

# Instance and adapter toggles, given before Dawn's instance exists (`set_instance_extras`):
# - allow_unsafe_apis: Dawn offers its experimental features (chromium-experimental-subgroup-matrix) only with it;
# - vulkan_enable_f16_on_nvidia: without it Dawn's Vulkan backend hides shader-f16 and the f16 subgroup-matrix
#   configurations on NVIDIA (only int8 ones are listed), which are the tensor cores' configurations.
INSTANCE_TOGGLES = ("allow_unsafe_apis", "vulkan_enable_f16_on_nvidia")
# Device toggles: disable_robustness where wgpu-native compiles trusted modules (shader_files.TRUSTED_FILES)
# without naga's bounds checks. Dawn's switch is device-wide: every module then runs without Tint's index
# clamping, which the launchers' size checks make safe (docs/runtimes.md#trusted-modules).
# timestamp_quantization off: Dawn otherwise rounds GPU timestamps (a browser's timing-attack defence), which
# would blur the benchmarks' per-kernel times.
TRUSTED_TOGGLE = "disable_robustness"
DISABLED_TOGGLES = ("timestamp_quantization",)
# Dawn's feature names -> the project's (wgpu-native's), and back for the device request
FEATURES = {"subgroups": "subgroup"}
MATRIX_FEATURE = "chromium-experimental-subgroup-matrix"
# Buffers on host memory (`extras.create_buffer_from_host_memory`): an upload then is a copy the GPU's DMA
# engines make from those pages, with no staging of Dawn's (bench/upload.py measures it against
# `queue.write_buffer`). Experimental, behind allow_unsafe_apis like the subgroup matrices.
HOST_POINTER_FEATURE = "host-mapped-pointer"
# Dawn's features a device gets wherever the adapter offers them, besides the project's OPTIONAL_FEATURES
DAWN_FEATURES = (MATRIX_FEATURE, HOST_POINTER_FEATURE)


class Dawn:
    name = "dawn"
    module = wgpudawn
    toggles = INSTANCE_TOGGLES
    host_feature = HOST_POINTER_FEATURE  # what `host_buffer` needs of the device

    def __init__(self):
        try:
            extras.set_instance_extras(enable_toggles=list(INSTANCE_TOGGLES))
        except RuntimeError as e:  # an instance made before us (another user of wgpudawn in this process)
            raise GpuError(
                f"Dawn's instance already exists without the toggles {INSTANCE_TOGGLES}: {e}"
            ) from e
        # one queue-done callback for every submit: a no-op kept registered (`once=False`), so the futures
        # that nobody waits for leave nothing behind
        self._done_info = _api.new_struct(
            "WGPUQueueWorkDoneCallbackInfo",
            mode=lib.WGPUCallbackMode_WaitAnyOnly,
            callback=c_callback("WGPUQueueWorkDoneCallback"),
            userdata1=callbacks.register(lambda *_: None, once=False),
        )
        self._index = itertools.count(1)
        self._futures: dict = {}  # submission index -> its queue-done future's id (until waited for)

    def enumerate_adapters(self) -> list:
        with _filtered_stderr():
            return list(wgpudawn.gpu.enumerate_adapters_sync())

    def features(self, names) -> set:
        return {FEATURES.get(str(f), str(f)) for f in names}

    def matrix_configs(self, adapter) -> list:
        """The adapter's subgroup-matrix configurations as (m, n, k, component_type, result_type) tuples."""
        if MATRIX_FEATURE not in adapter.features:
            return []
        configs = extras.get_adapter_properties(adapter).get("subgroup_matrix_configs", [])
        return [(c["m"], c["n"], c["k"], c["component_type"], c["result_component_type"]) for c in configs]

    def request_device(self, adapter, features: list, limits: dict, trusted: bool):
        back = {v: k for k, v in FEATURES.items()}
        wanted = [back.get(f, f) for f in features]
        wanted += [f for f in DAWN_FEATURES if f in adapter.features]
        return extras.request_device_sync(
            adapter,
            required_features=wanted,
            required_limits=limits,
            enable_toggles=[TRUSTED_TOGGLE] if trusted else [],
            disable_toggles=list(DISABLED_TOGGLES),
        )

    def planned_toggles(self, trusted: bool) -> list:
        """The project's toggles a device gets: the instance's, and disable_robustness when `trusted`."""
        return sorted([*INSTANCE_TOGGLES, *([TRUSTED_TOGGLE] if trusted else [])])

    def device_toggles(self, device) -> list:
        """The toggles in force on the device that this project asks for (Dawn adds its own workarounds)."""
        mine = {*INSTANCE_TOGGLES, TRUSTED_TOGGLE}
        return sorted(t for t in extras.get_toggles(device) if t in mine)

    def submit_indexed(self, queue, command_buffer) -> int:
        queue.submit([command_buffer])
        future = lib.wgpuQueueOnSubmittedWorkDone(queue._internal, self._done_info)
        index = next(self._index)
        self._futures[index] = future.id
        if len(self._futures) > 256:  # submits nobody waited for: forget the oldest (all long finished)
            for old in sorted(self._futures)[:128]:
                del self._futures[old]
        return index

    def _wait_future(self, future_id) -> None:
        info = ffi.new("WGPUFutureWaitInfo *")
        info.future.id = future_id
        instance = _api.get_wgpu_instance()
        while not info.completed:  # in slices of 0.1 s, so that a Ctrl-C comes through
            status = lib.wgpuInstanceWaitAny(instance, 1, info, 100_000_000)
            if status not in (lib.WGPUWaitStatus_Success, lib.WGPUWaitStatus_TimedOut):
                raise GpuError(f"waiting for the GPU failed (Dawn's wait status {status})")

    def wait(self, device) -> None:
        """Block until the queue is empty: a queue-done future, waited for."""
        self._wait_future(lib.wgpuQueueOnSubmittedWorkDone(device.queue._internal, self._done_info).id)
        self._futures.clear()

    def done(self, device, index: int) -> bool:
        """Whether submission `index` has finished, without blocking (its future polled; an index no longer held
        is finished, as in `wait_for`)."""
        future = self._futures.get(index)
        if future is None:
            return True
        info = ffi.new("WGPUFutureWaitInfo *")
        info.future.id = future
        lib.wgpuInstanceWaitAny(_api.get_wgpu_instance(), 1, info, 0)
        if info.completed:
            self.wait_for(device, index)
        return bool(info.completed)

    def wait_for(self, device, index: int) -> None:
        """Block until submission `index` has finished (its queue-done future; later ones may still run). An
        index no longer held (waited for already, or forgotten as long finished) is finished."""
        future = self._futures.pop(index, None)
        for older in [i for i in self._futures if i < index]:  # done when this one is
            del self._futures[older]
        if future is not None:
            self._wait_future(future)

    def shader_module(self, device, src: str, label: str, trusted: bool):
        # robustness is the device's (`request_device`'s toggle), not the module's
        return device.create_shader_module(code=for_tint(src), label=label)

    def timestamp_period_ns(self, queue) -> float:
        return 1.0  # Dawn converts timestamps to nanoseconds itself

    def pass_calls(self) -> tuple:
        """(set pipeline, set bind group, dispatch, NULL): Dawn's webgpu.h functions, unchecked; a bad command
        is reported by the pass's end or the encoder's finish, through wgpudawn's checked calls."""
        return (lib.wgpuComputePassEncoderSetPipeline, lib.wgpuComputePassEncoderSetBindGroup,
                lib.wgpuComputePassEncoderDispatchWorkgroups, ffi.NULL)  # fmt: skip

    def map_reader(self, device, buffer, spin: bool) -> DawnMap:
        return DawnMap(buffer, spin)

    def host_buffer(self, device, nbytes: int, label: str):
        """(a writable uint8 array of `nbytes` host bytes, a COPY_SRC buffer whose memory they are), or None where
        the device lacks host-mapped-pointer. Pages of their own (`extras.allocate_host_memory`): Metal and D3D12
        refuse part of a malloc block. The GPU copies out of them itself: no staging of Dawn's."""
        if HOST_POINTER_FEATURE not in device.features:
            return None
        memory = extras.allocate_host_memory(device, nbytes)
        buffer = extras.create_buffer_from_host_memory(
            device, memory, usage=wgpudawn.BufferUsage.COPY_SRC, label=label
        )
        return np.frombuffer(memory, np.uint8)[:nbytes], buffer


# Tint wants `enable subgroups;` before a subgroup builtin; naga refuses the directive (the `subgroups`
# enable-extension "is not yet implemented"), so the WGSL says nothing and Dawn's modules get it here.
_SUBGROUP_USE = re.compile(r"\bsubgroup[A-Z]\w*\s*\(|@builtin\(\s*subgroup_")
_SUBGROUP_ENABLE = re.compile(r"^\s*enable\s+[^;]*\bsubgroups\b", re.M)


def for_tint(src: str) -> str:
    """The WGSL as Tint wants it: `enable subgroups;` first where the source uses subgroup builtins."""
    if _SUBGROUP_USE.search(src) and not _SUBGROUP_ENABLE.search(src):
        return "enable subgroups;\n" + src
    return src


# What Dawn writes to stderr when it opens an adapter that is noise for our users: on lavapipe it lowers two
# dynamic-offset limits no kernel uses, on every process start
QUIET = ("artificially reduced",)


class _filtered_stderr:
    """Dawn's C++ logs go straight to file descriptor 2: catch them while adapters are opened, then pass on every
    line but the QUIET ones (a refused adapter's reason still shows)."""

    def __enter__(self):
        try:
            sys.stderr.flush()
            self._tmp = tempfile.TemporaryFile()
            self._saved = os.dup(2)
            os.dup2(self._tmp.fileno(), 2)
        except OSError:  # no file descriptor 2 to redirect (an embedding host): leave stderr alone
            self._tmp = None
        return self

    def __exit__(self, *exc):
        if self._tmp is None:
            return False
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._tmp.seek(0)
        text = self._tmp.read().decode(errors="replace")
        self._tmp.close()
        kept = [line for line in text.splitlines() if not any(q in line for q in QUIET)]
        if kept:
            sys.stderr.write("\n".join(kept) + "\n")
        return False


class DawnMap:
    """A MAP_READ buffer mapped through wgpudawn on the calling thread: Dawn calls the map's callback only when
    this thread processes events (spinning) or waits on the map's future (blocking), never from another thread."""

    def __init__(self, buffer, spin: bool):
        self.buffer, self.spin = buffer, spin

    def read(self, lo: int, size: int, after: int | None) -> bytes:
        promise = self.buffer.map_async("READ", lo, size)
        if self.spin:
            while promise._state == "pending":
                _api.process_events()
        promise.sync_wait()  # raises a failed map's error
        try:
            return bytes(self.buffer.read_mapped(lo, size, copy=False))
        finally:
            self.buffer.unmap()
