"""Which WebGPU implementation runs the device: wgpu-native (`native.py`) or Dawn (`dawn.py`), and why.

Both run every kernel; Dawn also exposes subgroup matrices (tensor cores, issue 39). `--runtime` / env
DDL_WGPU_RUNTIME is "auto" (default), "native" or "dawn". "auto" takes Dawn where the chosen adapter lists a
subgroup-matrix configuration in TENSOR_CORE_CONFIGS (what the tensor-core GEMM kernels run on), and
wgpu-native everywhere else, including where wgpudawn is missing or cannot start (the reason says which).

A runtime object holds the calls that differ between the two (docs/runtimes.md#the-seam):
    enumerate_adapters()                      the adapters it sees, in the order `--device N` indexes
    features(names) -> set                    adapter/device features under the project's names (`subgroup`)
    matrix_configs(adapter) -> list           (m, n, k, component_type, result_type) tuples; [] on native
    request_device(adapter, features, limits, trusted)
    planned_toggles(trusted) -> list          the project's toggles a device will get ([] on native)
    device_toggles(device) -> list            the toggles in force that the project asked for ([] on native)
    submit_indexed(queue, cb) -> int; wait(device); wait_for(device, index)
    shader_module(device, src, label, trusted)
    timestamp_period_ns(queue) -> float
    pass_calls() -> (set_pipeline, set_bind_group, dispatch, NULL)   the Recorder's direct C calls
    map_reader(device, buffer, spin) -> .read(lo, size, after) -> bytes
    host_buffer(device, nbytes, label) -> (uint8 array, COPY_SRC buffer on its pages) | None   None on native
    host_feature: the device feature host_buffer needs (None: the runtime has none)
"""

from __future__ import annotations

import os

from ddl_wgpu.runtime.gpu_errors import GpuError

ENV_RUNTIME = "DDL_WGPU_RUNTIME"
RUNTIMES = ("auto", "native", "dawn")
# The subgroup-matrix configurations the tensor-core kernels run on, as Dawn lists them
# (m, n, k, component_type, result_type): f16 operands accumulated in f32 (NVIDIA, AMD, Intel) and f32 8x8x8
# (Apple). `auto` takes Dawn only where the adapter lists one of these.
TENSOR_CORE_CONFIGS = frozenset(
    {
        (16, 16, 16, "f16", "f32"),
        (16, 8, 16, "f16", "f32"),
        (8, 16, 16, "f16", "f32"),
        (16, 16, 8, "f16", "f32"),
        (16, 8, 8, "f16", "f32"),
        (8, 8, 8, "f16", "f32"),
        (8, 8, 8, "f32", "f32"),
    }
)


class RuntimeUnavailable(GpuError):
    """The runtime asked for cannot run here (wgpudawn missing, Dawn refusing every adapter), or is unknown."""


def requested_runtime(requested: str | None = None) -> str:
    """`requested`, else env DDL_WGPU_RUNTIME, else "auto"; an unknown name is RuntimeUnavailable."""
    value = (requested or os.environ.get(ENV_RUNTIME) or "auto").strip().lower()
    if value not in RUNTIMES:
        raise RuntimeUnavailable(
            f"unknown runtime {value!r}: one of {', '.join(RUNTIMES)} (--runtime, {ENV_RUNTIME})"
        )
    return value


def tensor_core_configs(configs) -> list:
    """The configurations of `configs` ((m, n, k, component_type, result_type) tuples) in TENSOR_CORE_CONFIGS."""
    return [tuple(c) for c in configs if tuple(c) in TENSOR_CORE_CONFIGS]


def choose_runtime(
    requested: str, dawn_configs: list | None, dawn_problem: str | None = None
) -> tuple[str, str]:
    """The "auto" rule, a pure function: `dawn_configs` the subgroup-matrix configurations Dawn lists for the
    chosen adapter (None when Dawn could not be asked, `dawn_problem` saying why) -> (runtime, reason)."""
    if requested == "native":
        return "native", "native requested"
    if requested == "dawn":
        if dawn_configs is None:
            raise RuntimeUnavailable(f"--runtime dawn: {dawn_problem}")
        return "dawn", "dawn requested"
    if dawn_configs is None:
        return "native", f"auto: {dawn_problem}"
    tc = tensor_core_configs(dawn_configs)
    if tc:
        shapes = ", ".join(f"{m}x{n}x{k} {a}->{r}" for m, n, k, a, r in tc)
        return "dawn", f"auto: Dawn lists tensor-core subgroup matrices ({shapes})"
    if dawn_configs:
        listed = ", ".join(f"{m}x{n}x{k} {a}->{r}" for m, n, k, a, r in dawn_configs)
        return "native", f"auto: no tensor-core subgroup matrix (Dawn lists only {listed})"
    return "native", "auto: the adapter has no subgroup matrices"


_LOADED: dict = {}
_RESOLVED: dict = {}


def load(name: str):
    """The runtime object `name` ("native" or "dawn"), made once per process; Dawn's failure to import or
    start is RuntimeUnavailable with the reason."""
    if name not in _LOADED:
        if name == "native":
            from ddl_wgpu.runtime.native import Native

            _LOADED[name] = Native()
        elif name == "dawn":
            try:
                from ddl_wgpu.runtime.dawn import Dawn

                _LOADED[name] = Dawn()
            except ImportError as e:
                raise RuntimeUnavailable(f"wgpudawn is not installed ({e}); pip install wgpudawn") from e
            except Exception as e:  # a broken build or a failed instance: the user's machine, not a bug here
                raise RuntimeUnavailable(f"wgpudawn cannot start ({str(e).strip().splitlines()[0]})") from e
        else:
            raise RuntimeUnavailable(f"unknown runtime {name!r}")
    return _LOADED[name]


def resolve(requested: str | None, device, select) -> tuple[object, str]:
    """(runtime object, reason) for `requested` (None: the environment, else auto) and the adapter choice
    `device`; `select(choice, runtime)` picks an adapter on a runtime (gpu.select_adapter) or raises
    NoAdapterError. Resolved once per (request, device) in a process, so the printed choice and the device
    opened later agree."""
    requested = requested_runtime(requested)
    key = (requested, None if device in (None, "") else str(device))
    if key in _RESOLVED:
        return _RESOLVED[key]
    if requested == "native":
        result = (load("native"), choose_runtime("native", None)[1])
    else:
        configs, problem = None, None
        try:
            dawn = load("dawn")
            configs = dawn.matrix_configs(select(device, dawn))
        except RuntimeUnavailable as e:
            problem = str(e)
        except GpuError as e:  # no adapter Dawn accepts (e.g. a lavapipe older than Mesa 25)
            problem = f"Dawn finds no usable adapter ({str(e).splitlines()[0]})"
        name, reason = choose_runtime(requested, configs, problem)
        result = (load(name), reason)
    _RESOLVED[key] = result
    return result
