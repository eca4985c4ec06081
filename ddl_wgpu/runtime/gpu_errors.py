"""The GPU layer's errors (`gpu`, `shader_files`, `readback` raise them; the jobs and the CLI catch them).
Defined apart from `gpu` so the modules `gpu` is built from can raise them without importing it; `gpu` names
them too, and `from ddl_wgpu.runtime.gpu import GpuError` is how the rest of the package reaches them."""

from __future__ import annotations


class GpuError(RuntimeError):
    """Base class of the device layer's errors."""


class NoAdapterError(GpuError):
    """No adapter at all, or none matching the user's choice."""


class KernelError(GpuError):
    """A WGSL module or pipeline failed to build; the message names the file and entry point."""


class GpuOutOfMemory(GpuError):
    """The device could not give a buffer (the driver's out-of-memory, or `DDL_WGPU_DEVICE_MEMORY`). `kind` lets a
    front end say what gets the user further (the CLI: a smaller --gpu-memory budget)."""

    kind = "gpu_memory"
