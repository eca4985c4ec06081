"""The GPU device layer: one `Gpu` per process, WGSL kernels, buffers, recording and read-back.

What lives here and why:
- the WebGPU runtime (`runtimes.py`: wgpu-native, `native.py`, or Dawn, `dawn.py`; `--runtime` / env
  DDL_WGPU_RUNTIME), whose calls every runtime-specific step below goes through;
- adapter choice (`--device` / env `DDL_WGPU_ADAPTER`: an index or a name substring; by default a discrete
  GPU, then integrated, then a CPU adapter such as Mesa's lavapipe; Vulkan/Metal/DX12 before OpenGL);
- the device, with the adapter's own limits (wgpu-py requests them all by default), or WebGPU's default
  limits in the portability mode (`limits_mode="webgpu"` / env `DDL_WGPU_LIMITS=webgpu`: what every conformant
  Vulkan, Metal and DX12 device offers), and the optional features we use when present (shader-f16,
  subgroup, timestamp-query; Dawn's subgroup matrices);
- kernels: WGSL loaded from `shaders/` (`shader_files`), compiled once and cached by (file, entry point,
  constants, template values), each with an explicit bind-group layout built from a signature string, so one
  layout rule holds everywhere: read-only storage inputs first, then read-write outputs, then one uniform;
- buffers, uploads, and downloads through one persistent staging buffer
  (docs/wgpu-notes.md#reading-back-and-waiting: `queue.read_buffer` makes a temporary buffer per call), and
  read-back buffers waited for on the calling thread (`readback.Readback`);
- a `Recorder` that encodes many dispatches into one compute pass and submits once (the only pattern that
  scales: docs/wgpu-notes.md#dispatch-cost);
- a blocking wait, for everything submitted or for one submission (`wait`, `submit_indexed`, `wait_for`);
- GPU timestamps for benchmarks.

What it deliberately does not do: know anything about models. Kernels' launchers live in `ddl_wgpu/ops/`.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field

import numpy as np

# The Vulkan loader's WSI layer complains on stderr when this is unset (headless CI); we never present.
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

import wgpu  # noqa: E402

from ddl_wgpu.runtime import sizes  # noqa: E402
from ddl_wgpu.runtime.gpu_errors import GpuError, GpuOutOfMemory, KernelError, NoAdapterError  # noqa: E402
from ddl_wgpu.runtime.host_writes import HostWrites  # noqa: E402
from ddl_wgpu.runtime.readback import Readback  # noqa: E402
from ddl_wgpu.runtime.runtimes import ENV_RUNTIME, RUNTIMES, RuntimeUnavailable, load, resolve  # noqa: E402, F401
from ddl_wgpu.runtime.shader_files import dump_shader, shader_source, trusted_files  # noqa: E402
from ddl_wgpu.runtime.uniform import Uniform  # noqa: E402  (re-exported: launchers use gpu.Uniform)

ENV_ADAPTER = "DDL_WGPU_ADAPTER"
# Lower the adapter's storage-binding / buffer limits (bytes), for tests of the row-chunked paths on small
# shapes; the constructor's `max_binding` / `max_buffer` do the same. Never raises a limit.
ENV_MAX_BINDING = "DDL_WGPU_MAX_BINDING"
ENV_MAX_BUFFER = "DDL_WGPU_MAX_BUFFER"
# Pretend the device holds this many bytes for the buffers the engine creates (`Gpu.buffer`):
# past it a buffer raises GpuOutOfMemory as a full card does (the tests of the out-of-memory path on lavapipe,
# whose "device memory" is the host's). Never raises the driver's own limit.
ENV_DEVICE_MEMORY = "DDL_WGPU_DEVICE_MEMORY"
# "adapter" (default): request the adapter's own limits; "webgpu": request WebGPU's default limits instead,
# so a run on a large GPU exercises the kernel shapes every conformant device can run (portability mode).
ENV_LIMITS = "DDL_WGPU_LIMITS"
LIMIT_MODES = ("adapter", "webgpu")
# The WebGPU specification's default limits for what a compute program uses (buffers, bindings, workgroups);
# texture, vertex and render limits are left at the adapter's (no kernel uses them).
WEBGPU_LIMITS = {
    "max-bind-groups": 4,
    "max-bindings-per-bind-group": 1000,
    "max-dynamic-uniform-buffers-per-pipeline-layout": 8,
    "max-dynamic-storage-buffers-per-pipeline-layout": 4,
    "max-storage-buffers-per-shader-stage": 8,
    "max-uniform-buffers-per-shader-stage": 12,
    "max-uniform-buffer-binding-size": 64 << 10,
    "max-storage-buffer-binding-size": 128 << 20,
    "min-uniform-buffer-offset-alignment": 256,
    "min-storage-buffer-offset-alignment": 256,
    "max-buffer-size": 256 << 20,
    "max-compute-workgroup-storage-size": 16 << 10,
    "max-compute-invocations-per-workgroup": 256,
    "max-compute-workgroup-size-x": 256,
    "max-compute-workgroup-size-y": 256,
    "max-compute-workgroup-size-z": 64,
    "max-compute-workgroups-per-dimension": 65535,
}
# The read-back staging buffer grows to the largest download, at most this; a larger one goes through it in pieces
READBACK_MAX = 64 << 20
# The device-wide scratch the launchers keep in a Gpu's __dict__ (`Gpu.drop_scratch`): dicts of buffers grown
# to the largest use (`ops.matmul`'s split-K partials, `ops.attention_scores`' scores) or one buffer
# (`ops.gated_delta`'s stand-in for an unused binding)
SCRATCH_CACHES = ("_splitk_scratch", "_attention_scores", "_gated_delta_unused")


DRIVER_HINT = (
    "no GPU adapter found (Vulkan, Metal or DX12). Install a driver: on Debian/Ubuntu "
    "`sudo apt-get install mesa-vulkan-drivers` gives Mesa's lavapipe (a CPU Vulkan driver); "
    "on a GPU machine install the vendor's Vulkan driver"
)
DAWN_HINT = (
    "Dawn accepts no adapter here (it refuses Mesa's lavapipe before Mesa 25: "
    "scripts/bootstrap.sh installs Mesa 25 from bookworm-backports on Debian 12)"
)

# Features we use when the adapter has them, by the project's names (wgpu-native's; a runtime maps its own to
# these, `runtimes.py`). Dawn's device also gets chromium-experimental-subgroup-matrix and host-mapped-pointer
# where the adapter has them (`dawn.DAWN_FEATURES`).
OPTIONAL_FEATURES = (
    "shader-f16",
    "subgroup",
    "timestamp-query",
    "timestamp-query-inside-passes",
    "timestamp-query-inside-encoders",
)

# Limits worth printing (`ddl-wgpu devices`).
KEY_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroups-per-dimension",
    "max-storage-buffers-per-shader-stage",
    "min-storage-buffer-offset-alignment",
)

# Order in which adapter types are preferred when the user names none.
_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3, "Unknown": 4}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 2, "OpenGLES": 2}

MAX_GROUPS = 65535  # WebGPU's default max-compute-workgroups-per-dimension

STORAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


# ---------------------------------------------------------------------------------------------------------
# adapters


def _info(adapter) -> dict:
    i = adapter.info
    return {
        "name": i.get("device", ""),
        "vendor": i.get("vendor", ""),
        "backend": i.get("backend_type", ""),
        "type": i.get("adapter_type", ""),
        "driver": i.get("description", ""),
    }


def enumerate_adapters(runtime=None) -> list:
    """All adapters a runtime (default wgpu-native) can see, in a stable order (the order `--device N` indexes)."""
    try:
        return (runtime or load("native")).enumerate_adapters()
    except Exception:  # a broken loader is the same as no adapter for the user
        return []


def describe_adapter(adapter, index: int | None = None, runtime=None) -> dict:
    """A JSON-able summary: name, backend, type, driver, features (the runtime's own names) and the limits that
    matter; with `runtime`, its name and the adapter's subgroup-matrix configurations."""
    d = {"index": index, **_info(adapter)}
    d["features"] = sorted(str(f) for f in adapter.features)
    d["limits"] = {k: int(adapter.limits[k]) for k in KEY_LIMITS if k in adapter.limits}
    if runtime is not None:
        d["runtime"] = runtime.name
        d["subgroup_matrix_configs"] = [list(c) for c in runtime.matrix_configs(adapter)]
    return d


def runtime_toggles(runtime) -> list:
    """The toggles a device of `runtime` gets (Dawn's; none on wgpu-native): `disable_robustness` where there
    are trusted shader files (shader_files.TRUSTED_FILES, DDL_WGPU_TRUSTED)."""
    return runtime.planned_toggles(bool(trusted_files()))


def _rank(adapter) -> tuple:
    i = _info(adapter)
    return (_BACKEND_RANK.get(i["backend"], 1), _TYPE_RANK.get(i["type"], 4))


def select_adapter(choice: str | int | None = None, runtime=None):
    """Pick an adapter of `runtime` (default wgpu-native): `choice` (or env DDL_WGPU_ADAPTER) is an index or a
    case-insensitive substring of the adapter's name, vendor, driver or backend. With no choice, the best by type
    and backend."""
    adapters = enumerate_adapters(runtime)
    if not adapters:
        if runtime is not None and runtime.name == "dawn":
            raise NoAdapterError(DAWN_HINT)
        raise NoAdapterError(DRIVER_HINT)
    if choice is None or choice == "":
        choice = os.environ.get(ENV_ADAPTER) or None
    if choice is None:
        return min(enumerate(adapters), key=lambda ia: (_rank(ia[1]), ia[0]))[1]
    text = str(choice).strip()
    if text.isdigit():
        idx = int(text)
        if idx >= len(adapters):
            raise NoAdapterError(f"adapter index {idx} out of range: {len(adapters)} adapter(s) found")
        return adapters[idx]
    needle = text.lower()
    matches = [a for a in adapters if any(needle in str(v).lower() for v in _info(a).values())]
    if not matches:
        names = ", ".join(f"{i}: {_info(a)['name']} ({_info(a)['backend']})" for i, a in enumerate(adapters))
        raise NoAdapterError(f"no adapter matches {text!r}; found {names}")
    return min(matches, key=_rank)


# ---------------------------------------------------------------------------------------------------------
# the device


def limit_mode(mode: str | None = None) -> str:
    """The limits to request: `mode`, else env DDL_WGPU_LIMITS, else "adapter"."""
    value = (mode or os.environ.get(ENV_LIMITS) or "adapter").strip().lower()
    if value not in LIMIT_MODES:
        raise GpuError(
            f"unknown limits mode {value!r} (from {ENV_LIMITS} or Gpu(limits_mode=...)); use one of {LIMIT_MODES}"
        )
    return value


def _uniform(layout) -> Uniform:
    if not isinstance(layout, Uniform):
        raise GpuError(f"a uniform is described by a gpu.Uniform (fields by name), not {layout!r}")
    return layout


def _lowered(limit: int, override: int | None, env: str) -> int:
    """The adapter's `limit`, lowered (never raised) by an explicit override or else the environment (a size,
    read as every size is: `sizes.from_env`)."""
    value = override if override is not None else sizes.from_env(env, least=1)
    return int(limit) if value is None else min(int(limit), int(value))


@dataclass
class Kernel:
    """A compiled entry point with its explicit bind-group layout.

    `sig` has one char per binding, in binding order: 'r' read-only storage, 'w' read-write storage,
    'u' uniform. The layout rule (inputs, outputs, then Params) makes most signatures look like 'rrwu'.
    """

    name: str
    sig: str
    workgroup: tuple
    pipeline: object
    layout: object


@dataclass
class Gpu:
    """The process's device. Build once (`Gpu()`), share everywhere; tests use one per session.

    `max_binding` / `max_buffer` (or env DDL_WGPU_MAX_BINDING / DDL_WGPU_MAX_BUFFER) lower the adapter's
    storage-binding and buffer size limits: a test hook, so a CPU adapter exercises the row-chunked paths
    of tensors larger than a binding with a tiny model. After construction they hold the limits in force;
    `bind` and `buffer` enforce them.

    `limits_mode` (or env DDL_WGPU_LIMITS) is "adapter" (the adapter's own limits) or "webgpu" (WebGPU's
    default limits, WEBGPU_LIMITS: the portability mode, in which every kernel picks shapes any conformant
    device can run). Either way the kernels read the limits in force from `self.limits`.

    `runtime` (or env DDL_WGPU_RUNTIME) is "auto", "native" or "dawn" (`runtimes.py`); after construction
    `runtime_name` is the one in use, `runtime_reason` why, `matrix_configs` the adapter's subgroup-matrix
    configurations ((m, n, k, component_type, result_type) tuples, empty on wgpu-native) and `toggles` the Dawn
    toggles in force."""

    choice: str | int | None = None
    max_binding: int | None = None
    max_buffer: int | None = None
    limits_mode: str | None = None
    runtime: str | None = None
    # where ops.matmul runs the products: "simt" (f32 on the SIMT cores) or "matrix" (the matrix units, f16
    # operands, f32 accumulation); a mixed-precision run sets it (`backend.apply_precision`)
    products: str = "simt"
    adapter: object = field(init=False)
    device: object = field(init=False)

    def __post_init__(self):
        self.rt, self.runtime_reason = resolve(self.runtime, self.choice, select_adapter)
        self.runtime_name = self.rt.name
        self.adapter = select_adapter(self.choice, self.rt)
        self.matrix_configs = list(self.rt.matrix_configs(self.adapter))
        feats = [f for f in OPTIONAL_FEATURES if f in self.rt.features(self.adapter.features)]
        self.limits_mode = limit_mode(self.limits_mode)
        required = {}
        if self.limits_mode == "webgpu":
            # never ask for more than the adapter has (a device below WebGPU's defaults is not conformant,
            # but requesting beyond the adapter would fail outright)
            available = self.adapter.limits
            for k, v in WEBGPU_LIMITS.items():
                if k in available:
                    better_is_lower = k.startswith("min-")
                    required[k] = max(v, int(available[k])) if better_is_lower else min(v, int(available[k]))
        self.device = self.rt.request_device(self.adapter, feats, required, bool(trusted_files()))
        self.queue = self.device.queue
        self.features = self.rt.features(self.device.features)
        # whether `host_buffer` gives buffers on host memory here (a streamed trunk's uploads and its plan ask)
        self.host_buffers = self.rt.host_feature is not None and self.rt.host_feature in self.features
        self.toggles = self.rt.device_toggles(self.device)
        self._pass_calls = self.rt.pass_calls()
        self.limits = {k: int(v) for k, v in self.device.limits.items() if isinstance(v, int | float)}
        self.info = describe_adapter(self.adapter)
        self.info["runtime"] = self.runtime_name
        self._kernels: dict = {}
        self._modules: dict = {}
        self._layouts: dict = {}
        self._staging = None
        self._host_writes = HostWrites(self)  # `write(..., via_host=True)`'s host buffers
        self.allocated = 0  # bytes of storage buffers created through `buffer`, all told (memory reports)
        # bytes of the engine's buffers alive now (`buffer`, `external`; down when one is released or
        # collected) and the most at any moment: the engine's own count of its peak (`reset_peak` restarts it)
        self.live = 0
        self.peak = 0
        self.memory_cap = sizes.from_env(ENV_DEVICE_MEMORY, least=1)
        self.max_binding = _lowered(
            self.limits.get("max-storage-buffer-binding-size", 128 << 20), self.max_binding, ENV_MAX_BINDING
        )
        self.max_buffer = _lowered(
            self.limits.get("max-buffer-size", 256 << 20), self.max_buffer, ENV_MAX_BUFFER
        )
        self.align = self.limits.get("min-storage-buffer-offset-alignment", 256)

    @property
    def name(self) -> str:
        return f"{self.info['name']} ({self.info['backend']}, {self.info['type']})"

    # -- kernels ------------------------------------------------------------------------------------------

    def _layout(self, sig: str):
        if sig not in self._layouts:
            kinds = {"r": "read-only-storage", "w": "storage", "u": "uniform"}
            entries = [
                {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": kinds[c]}}
                for i, c in enumerate(sig)
            ]
            bgl = self.device.create_bind_group_layout(entries=entries)
            pl = self.device.create_pipeline_layout(bind_group_layouts=[bgl])
            self._layouts[sig] = (bgl, pl)
        return self._layouts[sig]

    def _create_module(self, src: str, file: str):
        """A shader module; files in the trusted set skip the compiler's bounds checks (`runtimes.py`: a trusted
        module on wgpu-native, the device's `disable_robustness` on Dawn)."""
        return self.rt.shader_module(self.device, src, file, file in trusted_files())

    def kernel(
        self,
        file: str,
        entry: str,
        sig: str,
        constants: dict | None = None,
        templates: dict | None = None,
        workgroup: tuple = (64, 1, 1),
        uniforms: tuple = (),
    ) -> Kernel:
        """Compile (once) and return an entry point. `constants` fill WGSL `override`s (workgroup sizes,
        tile sizes); `templates` fill `{{name}}` placeholders for generated straight-line code; `uniforms`
        (`Uniform` descriptions: every one the file declares) fill its `{{struct NAME}}` holes. `workgroup`
        is recorded for the launcher's arithmetic; it must agree with the shader."""
        assert set(sig) <= set("rwu"), sig
        if uniforms:
            templates = {**(templates or {}), **{f"struct {u.name}": u.wgsl() for u in uniforms}}
        ckey = tuple(sorted((constants or {}).items()))
        tkey = tuple(sorted((templates or {}).items()))
        key = (file, entry, sig, ckey, tkey)
        if key in self._kernels:
            return self._kernels[key]
        mkey = (file, tkey)
        try:
            if mkey not in self._modules:
                src = shader_source(file, templates)
                self._modules[mkey] = (self._create_module(src, file), src)
            module, src = self._modules[mkey]
            dump_shader(file, entry, constants, templates, src)
            bgl, pl = self._layout(sig)
            compute = {"module": module, "entry_point": entry}
            if constants:
                compute["constants"] = {k: float(v) for k, v in constants.items()}
            pipe = self.device.create_compute_pipeline(layout=pl, compute=compute, label=f"{file}:{entry}")
        except KernelError:
            raise
        except Exception as e:  # wgpu raises GPUValidationError (and friends) with the naga report
            first = str(e).strip().splitlines()
            detail = " | ".join(line.strip() for line in first[:6] if line.strip())
            raise KernelError(f"{file}:{entry}: {detail}") from e
        k = Kernel(name=f"{file}:{entry}", sig=sig, workgroup=workgroup, pipeline=pipe, layout=bgl)
        self._kernels[key] = k
        return k

    def bind(self, kernel: Kernel, *resources, label: str = ""):
        """A bind group for `kernel`: one resource per char of its signature, each a buffer or a
        (buffer, offset, size) range. Build these once per shape, never per step. `label` names the launch
        (a benchmark's per-dispatch profile shows it)."""
        if len(resources) != len(kernel.sig):
            raise GpuError(f"{kernel.name}: {len(resources)} buffers given, signature {kernel.sig!r}")
        entries = []
        for i, r in enumerate(resources):
            buf, off, size = r if isinstance(r, tuple) else (r, 0, r.size)
            if size > self.max_binding and kernel.sig[i] != "u":
                raise GpuError(
                    f"{kernel.name}: binding {i} ({getattr(buf, 'label', '')!r}, {size} bytes) exceeds the "
                    f"storage binding limit {self.max_binding}; bind such a tensor in row chunks"
                )
            entries.append({"binding": i, "resource": {"buffer": buf, "offset": off, "size": size}})
        return self.device.create_bind_group(layout=kernel.layout, entries=entries, label=label)

    # -- buffers ------------------------------------------------------------------------------------------

    def buffer(self, nbytes: int, label: str = "", usage=STORAGE):
        """A zero-initialised storage buffer (WebGPU zero-fills new buffers). Sizes are rounded up to 16
        bytes; a zero-size binding is invalid, so an empty tensor still gets 16 bytes."""
        size = max(16, (int(nbytes) + 15) // 16 * 16)
        if size > self.max_buffer:
            raise GpuError(
                f"buffer {label!r} of {size} bytes exceeds this adapter's max-buffer-size {self.max_buffer}"
            )
        buf = self._create(size, usage, label)
        self.allocated += size
        return buf

    def _create(self, size: int, usage, label: str):
        """Create a buffer counted in `live` and `peak` until it is released (`release`) or collected; the
        driver's out-of-memory (or the `DDL_WGPU_DEVICE_MEMORY` cap) becomes GpuOutOfMemory."""
        if self.memory_cap is not None and self.live + size > self.memory_cap:
            raise GpuOutOfMemory(self._oom(label, size, f"the {self.memory_cap}-byte device"))
        try:
            buf = self.device.create_buffer(size=size, usage=usage, label=label)
        except MemoryError as e:  # both runtimes' GPUOutOfMemoryError derive from it
            raise GpuOutOfMemory(self._oom(label, size, self.name)) from e
        self.live += size
        self.peak = max(self.peak, self.live)
        buf._ddl_freed = weakref.finalize(buf, self._freed, size)
        return buf

    def _oom(self, label: str, size: int, where: str) -> str:
        return (f"the GPU is out of memory: buffer {label!r} of {size / 2**20:.1f} MiB did not fit {where} "
                f"({self.live / 2**30:.2f} GiB in use by this process)")  # fmt: skip

    def _freed(self, size: int) -> None:
        self.live -= size

    def release(self, *bufs) -> None:
        """Give the memory of these buffers back now (not when Python collects them); `live` goes down. A
        released buffer must not be used again."""
        for b in bufs:
            fin = getattr(b, "_ddl_freed", None)
            if fin is not None and fin.alive:
                fin()
                b.destroy()

    def reset_peak(self) -> None:
        self.peak = self.live

    def external(self, nbytes: int) -> None:
        """Count `nbytes` (negative: give back) that wgpu allocates for us outside our buffers in `live` and
        `peak`: the staging of `queue.write_buffer` a streamed trunk keeps bounded (`stream.LayerStream`)."""
        self.live += int(nbytes)
        self.peak = max(self.peak, self.live)

    def uniform(self, layout: Uniform, *, label: str = "params", **fields):
        """A uniform buffer holding `layout.pack(**fields)`; rewrite it whole with `write_uniform`, or some
        fields in place with `write_fields`."""
        data = _uniform(layout).pack(**fields)
        buf = self.device.create_buffer(
            size=len(data), usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST, label=label
        )
        self.queue.write_buffer(buf, 0, data)
        return buf

    def write_uniform(self, buf, layout: Uniform, **fields):
        """Rewrite a uniform buffer with `layout.pack(**fields)` (every field, by name)."""
        self.queue.write_buffer(buf, 0, _uniform(layout).pack(**fields))

    def write_fields(self, buf, layout: Uniform, **fields):
        """Rewrite only the named fields of a uniform buffer, each at its `Uniform.offset`; the others keep
        the values they were packed with (a per-step value such as a clip threshold)."""
        for name, value in fields.items():
            self.queue.write_buffer(buf, *_uniform(layout).pack_field(name, value))

    def upload(self, array: np.ndarray, label: str = ""):
        """A new storage buffer holding `array` (C-contiguous bytes)."""
        buf = self.buffer(np.asarray(array).nbytes, label=label)
        self.write(buf, array)
        return buf

    def write(self, buf, array: np.ndarray, offset: int = 0, via_host: bool = False):
        """Copy host data into `buf` at byte `offset` (queued before the next submit): through
        `queue.write_buffer`, or with `via_host`, from `host_writes.MIN` bytes on and where the device has host
        buffers, through them (`host_writes.HostWrites`). A caller asks for `via_host` where the queue is idle when it
        writes (a heal draft's inputs, after the previous step's read-back); a streamed trunk's pass, whose
        queue is never idle, was not measured with it."""
        a = np.ascontiguousarray(array)
        if via_host and self._host_writes.applies(a.nbytes, offset):
            self._host_writes.write(buf, a.reshape(-1).view(np.uint8), offset)
            return
        if a.nbytes % 4:  # WebGPU writes whole words
            data = a.tobytes() + b"\0" * (-a.nbytes % 4)
        else:  # the array's own memory, not a copy (a 27B model's weights are 54 GB)
            data = memoryview(a.reshape(-1).view(np.uint8))
        if len(data):
            self.queue.write_buffer(buf, offset, data)

    def upload_ranges(self, arrays) -> tuple[object, list]:
        """Several flat arrays in one new buffer as float32, each at a 256-byte-aligned offset (WebGPU's
        default storage-offset alignment) -> (buffer, [((buffer, offset, nbytes), n), ...]): the views an
        arena of tensors is bound through (tests and tools)."""
        offsets, end = [], 0
        for a in arrays:
            offsets.append(end)
            end += -(-np.asarray(a).size * 4 // 256) * 256
        arena = self.buffer(end)
        views = []
        for a, o in zip(arrays, offsets, strict=True):
            a = np.ascontiguousarray(a, dtype=np.float32)
            self.write(arena, a, o)
            views.append(((arena, o, a.size * 4), a.size))
        return arena, views

    def read(self, buf, shape, dtype=np.float32) -> np.ndarray:
        """The first prod(shape) items of `buf` as an array of `shape` (a download; tests and tools)."""
        return self.download(buf, dtype, int(np.prod(shape))).reshape(shape)

    def download(self, buf, dtype=np.float32, count: int | None = None, offset: int = 0) -> np.ndarray:
        """Read `count` items of `dtype` from `buf` at byte `offset` through the persistent staging buffer.
        This waits for all submitted work: never call it inside a training step."""
        dtype = np.dtype(dtype)
        if count is None:
            count = (buf.size - offset) // dtype.itemsize
        nbytes = count * dtype.itemsize
        if nbytes == 0:
            return np.zeros(0, dtype)
        out = np.empty(nbytes, np.uint8)
        chunk = min(self.max_buffer, READBACK_MAX)
        done = 0
        while done < nbytes:
            n = min(chunk, nbytes - done)
            padded = (n + 3) // 4 * 4
            stg = self._stage(padded)
            enc = self.device.create_command_encoder()
            enc.copy_buffer_to_buffer(buf, offset + done, stg, 0, padded)
            self.queue.submit([enc.finish()])
            stg.map_sync("READ_NOSYNC", 0, padded)  # the copy is submitted: no extra empty submit
            out[done : done + n] = np.frombuffer(stg.read_mapped(0, padded, copy=False), np.uint8)[:n]
            stg.unmap()
            done += n
        return out.view(dtype)

    def host_buffer(self, nbytes: int, label: str = "host") -> tuple | None:
        """Host memory the GPU copies from without a staging copy: (a writable uint8 array of `nbytes`, a COPY_SRC
        buffer on those pages) where the runtime's device has it (Dawn's host-mapped-pointer), else None. Host
        memory, not the device's: not counted in `live`. Copy out of it with `Recorder.copy`; its bytes may be
        rewritten once the submits that copy them are done (bench/upload.py measures this way against `write`)."""
        return self.rt.host_buffer(self.device, int(nbytes), label)

    def readback(self, nbytes: int, label: str = "readback") -> Readback:
        """A mappable buffer a recording copies results into (`Recorder.copy`), read after that recording's
        submit (`Readback.read`): a result comes back in the submit that made it, without the extra copy and
        submit of `download`."""
        return Readback(self, nbytes, label)

    def reserve_staging(self, nbytes: int) -> None:
        """Grow the read-back staging buffer now to what a download of `nbytes` uses (`download`; a job that plans
        its memory allocates it up front, `gpumem`)."""
        n = min(int(nbytes), min(self.max_buffer, READBACK_MAX))
        self._stage((n + 3) // 4 * 4)

    def drop_scratch(self) -> None:
        """Let go of the device-wide scratch (the read-back staging, the split-K partials, attention's scores):
        after one phase of a job (heal's trunk pass) the next allocates them to its own needs. A Call built
        earlier that binds them keeps them alive (`Call.scratch` aside, the caches are their only holders in
        Python: drop them only when such Calls are gone)."""
        if self._staging is not None:
            self.release(self._staging)
            self._staging = None
        for name in SCRATCH_CACHES:
            self.__dict__.pop(name, None)

    def _stage(self, nbytes: int):
        """The read-back staging buffer, grown to the largest download (at most READBACK_MAX), counted in `live`."""
        if self._staging is None or self._staging.size < nbytes:
            if self._staging is not None:
                self.release(self._staging)
            size = max(nbytes, 1 << 16)
            usage = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
            self._staging = self._create(size, usage, "staging")
        return self._staging

    def wait(self):
        """Block until the queue is empty."""
        self.rt.wait(self.device)

    def submit_indexed(self, command_buffer) -> int:
        """Submit one finished command buffer (`Recorder.finish`) -> its submission index, for `wait_for`."""
        return self.rt.submit_indexed(self.queue, command_buffer)

    def wait_for(self, index: int) -> None:
        """Block until submission `index` has finished (later submissions may still run: a decoder reads
        one token's result while the GPU already computes the next)."""
        self.rt.wait_for(self.device, index)

    def timestamp_period_ns(self) -> float:
        return self.rt.timestamp_period_ns(self.queue)

    # -- recording ----------------------------------------------------------------------------------------

    def recorder(self, timestamps: bool = False) -> Recorder:
        return Recorder(self, timestamps=timestamps)

    def run(self, kernel: Kernel, resources: list, groups):
        """Test helper: bind, dispatch once, submit. Never use this in a training step."""
        rec = self.recorder()
        rec.dispatch(kernel, self.bind(kernel, *resources), groups)
        rec.submit()


@dataclass
class Call:
    """A launch prepared once: its dispatches (kernel, bind group, workgroup counts), plus the uniforms it
    owns (kept alive here, rewritten by field name, `gpu.write_fields`, when a per-step value changes)."""

    dispatches: list = field(default_factory=list)
    uniforms: list = field(default_factory=list)
    # buffers its bind groups refer to that nothing else holds (a launcher's own scratch): wgpu-py's bind groups
    # keep no Python reference, and a buffer Python collects leaves `Gpu.live` while the driver still holds it
    scratch: object = None

    def record(self, rec: Recorder):
        rec.dispatch_all(self.dispatches)

    def __add__(self, other: Call) -> Call:
        kept = [c.scratch for c in (self, other) if c.scratch is not None]
        return Call(self.dispatches + other.dispatches, self.uniforms + other.uniforms, kept or None)

    def run(self, gpu: Gpu):
        """Test helper: record this call alone and submit it."""
        rec = gpu.recorder()
        self.record(rec)
        rec.submit()


def grid(n_groups: int) -> tuple[int, int, int]:
    """Spread `n_groups` workgroups over x and y (each axis is capped at 65535). Shaders recover the linear
    index as `wid.x + wid.y * nwg.x` and guard against the overshoot."""
    n_groups = max(1, int(n_groups))
    if n_groups <= MAX_GROUPS:
        return (n_groups, 1, 1)
    y = -(-n_groups // MAX_GROUPS)
    x = -(-n_groups // y)
    return (x, y, 1)


class Recorder:
    """Encodes dispatches into one compute pass of one command encoder and submits once.

    A copy (`copy`) has to sit outside a compute pass, so it closes the current pass; the next dispatch
    opens a new one. With `timestamps=True` (adapter permitting) the whole recording is timed with a pair
    of timestamp writes and `elapsed_ms()` returns the GPU time after `submit()`.
    """

    def __init__(self, gpu: Gpu, timestamps: bool = False):
        self.gpu = gpu
        self.enc = gpu.device.create_command_encoder()
        self.pass_ = None
        self.n_dispatches = 0
        self.timed = bool(timestamps) and "timestamp-query" in gpu.features
        if self.timed:
            self.qs = gpu.device.create_query_set(type=wgpu.QueryType.timestamp, count=2)
            self.qbuf = gpu.device.create_buffer(
                size=16, usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
            )
            self._started = False

    def _open(self):
        if self.pass_ is None:
            kw = {}
            if self.timed and not self._started:
                kw["timestamp_writes"] = {"query_set": self.qs, "beginning_of_pass_write_index": 0}
                self._started = True
            self.pass_ = self.enc.begin_compute_pass(**kw)
        return self.pass_

    def _close(self):
        if self.pass_ is not None:
            self.pass_.end()
            self.pass_ = None

    def dispatch(self, kernel: Kernel, bind_group, groups):
        self.dispatch_all(((kernel, bind_group, groups),))

    def dispatch_all(self, dispatches):
        """Record (kernel, bind group, workgroups) triples into the open pass. The replay of a prebuilt step
        (a decoding pass is ~1000 of them at the Qwen3.8-27B shape) calls the runtime's C functions directly
        (`runtimes.py`, `pass_calls`): through
        wgpu-py's wrappers (argument checks, a cffi array per bind group, an error check per call) a dispatch
        cost ~6.6 µs of host time on the 2-core development machine (lavapipe), ~1.7 µs this way; a pipeline
        already set is not set again. wgpu-native reports a bad command when the pass ends or the encoder finishes, through
        wgpu-py's checked calls."""
        handle = self._open()._internal
        set_pipeline, set_group, run, null = self.gpu._pass_calls
        last = None
        for kernel, bind_group, groups in dispatches:
            if type(groups) is int:
                groups = grid(groups)
            pipe = kernel.pipeline._internal
            if pipe != last:
                set_pipeline(handle, pipe)
                last = pipe
            set_group(handle, 0, bind_group._internal, 0, null)
            run(handle, *groups)
            self.n_dispatches += 1

    def copy(self, src, src_offset: int, dst, dst_offset: int, nbytes: int):
        self._close()
        self.enc.copy_buffer_to_buffer(src, src_offset, dst, dst_offset, nbytes)

    def finish(self):
        """The recording as a command buffer, to submit later (`gpu.queue.submit([cb])`, once): a step recorded
        while the GPU still runs the one before."""
        if self.timed:
            # the end timestamp goes on a last empty pass so it covers every dispatch recorded
            self._close()
            self.enc.begin_compute_pass(
                timestamp_writes={"query_set": self.qs, "end_of_pass_write_index": 1}
            ).end()
            self.enc.resolve_query_set(self.qs, 0, 2, self.qbuf, 0)
        self._close()
        return self.enc.finish()

    def submit(self):
        self.gpu.queue.submit([self.finish()])

    def elapsed_ms(self) -> float:
        """GPU time between the first dispatch and the end of the recording (waits for the GPU)."""
        if not self.timed:
            raise GpuError("this adapter has no timestamp-query feature")
        t = self.gpu.download(self.qbuf, np.uint64, 2)
        return float(t[1] - t[0]) * self.gpu.timestamp_period_ns() / 1e6


def _main(argv: list[str]) -> int:
    """`python -m ddl_wgpu.runtime.gpu --check`: exit 0 when a Vulkan, Metal or DX12 adapter exists (bootstrap uses
    it to decide whether to install a driver; the OpenGL fallback adapter does not count). `--check-dawn`: exit 0
    when Dawn starts and accepts an adapter, else print why and exit 1."""
    if "--check-dawn" in argv:  # exit 0 when Dawn starts and accepts an adapter (bootstrap: Mesa for Dawn)
        try:
            resolve("dawn", None, select_adapter)
        except GpuError as e:
            print(str(e).splitlines()[0])
            return 1
        return 0
    adapters = [_info(a) for a in enumerate_adapters()]
    real = [a for a in adapters if a["backend"] not in ("OpenGL", "OpenGLES")]
    if "--check" in argv:
        return 0 if real else 1
    for i, a in enumerate(adapters):
        print(i, a)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_main(sys.argv[1:]))
