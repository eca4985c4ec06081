"""The one place that chooses the backend of every command and builds its objects.

Two backends run the same model: "wgpu", the GPU engine (`net.Net` and its works `trunk.TrunkWork`,
`inference.InferenceWork`; heal's `heal_gpu.WgpuTeacher` and `heal_gpu.WgpuDraft` over `draft.DraftWork`;
generate's `decode.WgpuEngine`), and "ref", the numpy reference (`refnet.RefNet`, `refnet.RefTeacher`,
`refnet.RefDraft`, `refnet.RefEngine`). "auto" picks wgpu
on any real GPU adapter and numpy where the only adapters are CPU implementations of Vulkan/D3D
(llvmpipe/lavapipe, WARP, SwiftShader), which run the engine about a hundred times slower than numpy, or
where there is none.

Importing this module imports no wgpu (the GPU modules are imported inside the functions that need them).

Public API
- `BACKENDS = ("auto", "wgpu", "ref")`; `BackendError(ValueError)`, `UnknownBackendError(BackendError)`.
- `BackendChoice(name, reason, adapter)`: frozen; `name` "wgpu" | "ref", `reason` human text (e.g.
  "NVIDIA H200 (DiscreteGPU, Vulkan)", "only CPU adapters (llvmpipe ...): numpy is faster"), `adapter` the
  chosen adapter's description or None.
- `choose_backend(requested="auto", device=None, runtime=None) -> BackendChoice`: on wgpu also the WebGPU
  runtime (`runtime`: "auto", "native" or "dawn", set for the whole process and its workers through env
  DDL_WGPU_RUNTIME; `BackendChoice.runtime` and `runtime_reason` say which and why, None on ref);
  `runtime_name(backend, device)` the runtime a job's device runs on (None on ref), for its report; `choose_from_adapters(infos) ->
  BackendChoice` (the "auto" rule on wgpu adapter-info dicts); `cpu_implementation(info) -> str | None`
  (why an adapter is a CPU implementation, None for a real GPU).
- `require_backend(name, device=None, kind=None) -> (BackendChoice, device)`: the backend (and adapter kind)
  a run recorded, or BackendError when this machine cannot run it; `device_kind(info)` the recorded kind.
- `open_gpu(device=None) -> gpu.Gpu`: the process's device for an adapter choice, opened once.
- `make_net(cfg, params, backend, device, seed=0, mtp_weight=0.0) -> TrainNet`: the training net.
- `PRECISIONS`; `apply_precision(precision, backend, device=None) -> PrecisionChoice`: what "auto", "f32" or
  "mixed" means on this backend and adapter, and the Gpu's products set to match (docs/precision.md).
- `make_teacher(backend, model, batch=4, device=None, trunk_dtype="f32") -> Teacher`: heal's frozen trunk.
- `make_draft(backend, model, init=None, batch=4, device=None, kl_form="full", teacher=None) -> Draft`: heal's
  draft trained alone (on wgpu it shares `teacher`'s embedding/head).
- `make_accept_backend(backend, model, batch=8, device=None, trunk_dtype="f32") -> (Teacher | None,
  AcceptDraft | None)`: accept's trunk and draft; (None, None) on "ref" (accept runs numpy inline).
- `make_engine(backend, model, depth=0, device=None, trunk_dtype="f32", capacity=None) -> Engine`: generate's
  decoding engine (trunk and draft caches).
- Protocols: `TrainNet`, `TrainWork`, `Teacher`, `Draft`, `Runner`, `AcceptTeacher`, `AcceptDraft`, `Engine`.
`backend` arguments take "auto" too (resolved by `choose_backend`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ddl_ref.config import ModelConfig
from ddl_ref.params import init_params
from ddl_wgpu.engine.step import AdamW, Eagle3Batch, StepResult
from ddl_wgpu.runtime.runtimes import tensor_core_configs

if TYPE_CHECKING:
    from ddl_wgpu.files.modelfile import Model
    from ddl_wgpu.runtime.gpu import Gpu

BACKENDS = ("auto", "wgpu", "ref")
# The WebGPU runtimes (runtime/runtimes.py, which imports wgpu: its names are repeated here) and their variable
RUNTIMES = ("auto", "native", "dawn")
ENV_RUNTIME = "DDL_WGPU_RUNTIME"
TRUNK_DTYPES = ("f32", "f16")
# Adapter names of CPU implementations of a GPU API (word-wise, lower case).
_CPU_NAMES = ("llvmpipe", "lavapipe", "swiftshader", "microsoft basic render driver", "warp")
# Adapter types, best first, among real GPUs.
_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2}
# wgpu's OpenGL backend is a fallback the engine does not use by choice (as `python -m ddl_wgpu.runtime.gpu --check`).
_GL_BACKENDS = ("OpenGL", "OpenGLES")


class BackendError(ValueError):
    """A backend that cannot be chosen or built, with one clear line."""


class UnknownBackendError(BackendError):
    """A backend name that is not one of `BACKENDS`."""


class UnknownRuntimeError(BackendError):
    """A runtime name that is not one of `RUNTIMES`."""


# ----------------------------------------------------------------------------------------------------------
# what a backend provides


class TrainWork(Protocol):
    """One (batch, seq) shape of a training net: a step, evaluation and diagnostics."""

    def step(self, ids, lengths=None, update: AdamW | None = None) -> StepResult: ...

    def loss_sum(self, ids, lengths=None) -> tuple[float, int]: ...

    def eval_batch(self, ids, lengths=None, spectral: bool = False) -> tuple[float, int, dict | None]: ...

    def spectral(self, ids, lengths=None) -> dict | None: ...

    def logits(self, ids) -> np.ndarray: ...


class TrainNet(Protocol):
    """A model's parameters and optimizer state (`net.Net` on wgpu, `refnet.RefNet` on numpy)."""

    cfg: ModelConfig
    trainable: list[str]
    mtp_weight: float

    @property
    def num_params(self) -> int: ...

    def work(self, batch: int, seq: int) -> TrainWork: ...

    def load(self, params: dict) -> None: ...

    def export(self) -> dict[str, np.ndarray]: ...

    def grads(self) -> dict[str, np.ndarray]: ...

    def moments(self) -> tuple[dict, dict]: ...

    def load_moments(self, m: dict, v: dict) -> None: ...

    def snapshot(self): ...  # the current weights, in host memory

    def restore(self, snapshot) -> None: ...

    def export_snapshot(self, snapshot) -> dict[str, np.ndarray]: ...


class Teacher(Protocol):
    def topk_hidden(self, ids_batch: np.ndarray, k: int):
        """ids (B, T) -> (top_ids (B, T, k) int32, top_probs (B, T, k) f32, hidden_pre, hidden_post, each
        (B, T, C))."""
        ...

    def topk_rows(self, ids_batch: np.ndarray, lengths, k: int):
        """ids (B, T), lengths (B,) -> (top_ids, top_probs, the draft's step-1 block input rows (B, T, C)
        float32)."""
        ...

    def release(self) -> None:
        """The trunk has run: free what only its pass needed (the GPU trunk's blocks' weights)."""
        ...


class Draft(Protocol):
    """heal's draft trained alone. `chain` = 0: x_rows (B, T, C) are one step's rows, causal attention.
    chain = j >= 1: the stacked rows of steps 1..j of each window (B, j·W, C), the runtime's diagonal mask at
    positions p + σ − 1 (`ddl_ref.mtp.draft_forward`); teacher and weights are per stacked row."""

    def step(self, x_rows, teacher_ids, teacher_probs, weights, lr: float, step: int, grad_scale: float,
             chain: int = 0):  # fmt: skip
        """Forward, backward and (when finite) one Adam update -> (loss, grad_norm, finite)."""
        ...

    def loss_sum(self, x_rows, teacher_ids, teacher_probs, weights, chain: int = 0) -> float: ...

    def hidden_out(self, x_rows, chain: int = 0): ...  # -> (pre (B, T, C), post (B, T, C))

    def next_rows(self, x_rows, next_tokens, valid, chain: int = 0): ...  # -> next step's rows (B, T, C)

    def loss_sum_next(self, x_rows, teacher_ids, teacher_probs, weights, next_tokens, valid, chain: int = 0):
        """`loss_sum` and `next_rows` from one forward -> (loss sum, next step's rows (B, T, C))."""
        ...

    def loss_chain(self, x_rows, steps, stacked: bool) -> list[float]:
        """One batch's KL sum per chain step, step 1 on x_rows, each later step on rows built from the one
        before (float16-rounded); steps[j − 1] = (teacher ids, probs, weights, next (tokens, valid) or None)."""
        ...

    def loss_chains(
        self, batches, stacked: bool
    ) -> list[list[float]]: ...  # loss_chain of each (x_rows, steps)

    def prepare(self, T: int, k: int, chain: int, stacked: bool) -> None: ...  # heal's draft phase allocated

    def snapshot(self): ...  # the current weights, in host memory

    def restore(self, snap) -> None: ...

    def using(self, snap): ...  # a context: the forwards within it run on the weights `snap`

    def export(self) -> dict: ...  # {model.mtp.* name: float32 array} of the trained tensors


# accept's draft step: runner(x_rows, chain=0) -> (argmax (B, T'), pre, post)
Runner = Callable[..., tuple]


class AcceptTeacher(Protocol):
    """accept's trunk on the GPU (`heal_gpu.WgpuTeacher`): its greedy tokens, the hidden rows left there."""

    def greedy_hidden(self, ids_batch: np.ndarray, which: str):
        """ids (b, T) -> (greedy (b, T) int32, a GPU buffer of the `which` hidden rows of the batch)."""
        ...

    def hidden_rows(self, b: int, T: int): ...  # -> the last forward's (pre, post) (b, T, C), downloaded


class AcceptDraft(Protocol):
    """accept's draft on the GPU (`heal_gpu.WgpuDraft`): one step on host rows (`greedy`, a `Runner`) or the
    whole greedy chain from the trunk's hidden rows on the GPU (`greedy_chain`)."""

    B: int  # windows per GPU batch

    def greedy(self, x_rows, chain: int = 0) -> tuple: ...

    def greedy_chain(self, hidden, tokens, valid, depth: int, stacked: bool = False, mtp=None,
                     rows=None) -> np.ndarray:  # fmt: skip
        """-> the draft's argmax per chain step (b, depth, T) int32."""
        ...


class Engine(Protocol):
    """generate's decoding engine (`refnet.RefEngine`, `decode.WgpuEngine`; what `generate.run` drives, its
    module docstring says how). `feed` returns per row: head "argmax" the ids (n,), "logits" or "top<k>"
    (n, V) logits; `last_only` the last row's alone (what a prompt needs); `ahead` promises that the argmax
    returned is fed next and that no roll-back reaches into this token (plain greedy decoding: the GPU
    engine then runs the next token before the host asks)."""

    backend: str  # "ref" or "wgpu": what generate reports
    length: int  # positions fed so far

    def feed(self, ids, head: str, last_only: bool = False, ahead: bool = False) -> np.ndarray: ...

    def rollback(self, length: int) -> None: ...

    def draft(self, token: int, depth: int, head: str, pick: Callable | None) -> tuple[list[int], list]: ...

    def round(self, token: int, depth: int) -> tuple[list[int], np.ndarray]: ...  # greedy draft + verify


# ----------------------------------------------------------------------------------------------------------
# choosing


@dataclass(frozen=True)
class BackendChoice:
    name: str  # "wgpu" or "ref"
    reason: str  # why, for the resolved configuration
    adapter: str | None = None  # the adapter the choice looked at, when one
    runtime: str | None = None  # on wgpu: the WebGPU runtime, "native" or "dawn" (runtime/runtimes.py)
    runtime_reason: str | None = None  # why that runtime


def cpu_implementation(info: dict) -> str | None:
    """Why the adapter described by `info` (a wgpu adapter-info dict: device, vendor, description,
    adapter_type, backend_type) is a CPU implementation of a GPU API; None for a real GPU."""
    if info.get("adapter_type") == "CPU":
        return "a CPU adapter"
    text = " ".join(str(info.get(k, "")) for k in ("device", "vendor", "description")).lower()
    for name in _CPU_NAMES:
        if re.search(rf"\b{re.escape(name)}\b", text):
            return f"a CPU rasteriser ({name})"
    return None


def _describe(info: dict) -> str:
    return f"{info.get('device') or info.get('vendor') or 'unnamed adapter'} " \
           f"({info.get('adapter_type', '?')}, {info.get('backend_type', '?')})"  # fmt: skip


def choose_from_adapters(infos: list[dict]) -> BackendChoice:
    """The "auto" rule over wgpu adapter-info dicts: wgpu on the best real GPU (discrete, integrated,
    virtual), else numpy."""
    usable = [i for i in infos if i.get("backend_type") not in _GL_BACKENDS]
    real = [i for i in usable if cpu_implementation(i) is None]
    if real:
        best = min(real, key=lambda i: _TYPE_RANK.get(i.get("adapter_type"), len(_TYPE_RANK)))
        return BackendChoice("wgpu", _describe(best), _describe(best))
    if usable:
        names = ", ".join(dict.fromkeys(str(i.get("device") or i.get("vendor")) for i in usable))
        return BackendChoice("ref", f"only CPU adapters ({names}): numpy is faster", _describe(usable[0]))
    return BackendChoice("ref", "no GPU adapter found: numpy", None)


def choose_backend(
    requested: str = "auto", device: str | None = None, runtime: str | None = None
) -> BackendChoice:
    """The backend for `requested` ("auto", "wgpu" or "ref"); with "auto", `device` (an adapter index or
    name substring, else the environment's DDL_WGPU_ADAPTER) limits the adapters looked at. `runtime`, when
    given, becomes the process's WebGPU runtime request (env DDL_WGPU_RUNTIME, which every device opened after,
    and every worker process, reads); on wgpu the choice names the runtime resolved and why."""
    if requested not in BACKENDS:
        raise UnknownBackendError(f"unknown backend {requested!r}: one of {', '.join(BACKENDS)}")
    set_runtime(runtime)
    return _with_runtime(_choose(requested, device), device)


def set_runtime(runtime: str | None) -> None:
    """Make `runtime` ("auto", "native", "dawn"; None: leave it) the process's WebGPU runtime request: env
    DDL_WGPU_RUNTIME, which every device opened after and every worker process reads."""
    if runtime is None:
        return
    if runtime not in RUNTIMES:
        raise UnknownRuntimeError(f"unknown runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
    os.environ[ENV_RUNTIME] = runtime


def _with_runtime(choice: BackendChoice, device: str | None) -> BackendChoice:
    if choice.name != "wgpu":
        return choice
    name, reason = _runtime(device)
    return BackendChoice(choice.name, choice.reason, choice.adapter, name, reason)


def _choose(requested: str, device: str | None) -> BackendChoice:
    if requested != "auto":
        return BackendChoice(requested, f"{requested} requested", None)
    try:
        from ddl_wgpu.runtime import gpu as gpu_mod
    except ImportError as e:  # no wgpu package or no loader: the numpy backend runs anyway
        return BackendChoice("ref", f"wgpu unavailable ({e}): numpy", None)
    choice = device if device not in (None, "") else os.environ.get(gpu_mod.ENV_ADAPTER) or None
    if choice is None:
        infos = [dict(a.info) for a in gpu_mod.enumerate_adapters()]
    else:
        try:
            infos = [dict(gpu_mod.select_adapter(choice).info)]
        except gpu_mod.NoAdapterError as e:
            raise BackendError(f"adapter {choice!r}: {e}") from e
    return choose_from_adapters(infos)


def _runtime(device: str | None) -> tuple[str, str]:
    """(runtime name, reason) of the device `device` names, resolved once per process (runtimes.resolve)."""
    try:
        from ddl_wgpu.runtime import gpu as gpu_mod
    except ImportError as e:
        raise BackendError(f"wgpu unavailable ({e})") from None
    try:
        rt, reason = gpu_mod.resolve(None, device, gpu_mod.select_adapter)
    except gpu_mod.GpuError as e:  # --runtime dawn where Dawn cannot run
        raise BackendError(str(e).splitlines()[0]) from None
    return rt.name, reason


def runtime_name(backend: str, device: str | None = None) -> str | None:
    """The WebGPU runtime a job's device runs on ("native" or "dawn"), None on the numpy backend: what a report
    records next to the backend."""
    return open_gpu(device).runtime_name if backend == "wgpu" else None


def device_kind(info: dict) -> str:
    """An adapter's kind as a training checkpoint records it (`gpu.Gpu.name`): name, backend and type, from
    `gpu.describe_adapter`'s dict."""
    return f"{info['name']} ({info['backend']}, {info['type']})"


def require_backend(name: str, device: str | None = None, kind: str | None = None):
    """The backend a run recorded, here, or BackendError when this machine cannot run it; on wgpu the adapter
    `device` (or DDL_WGPU_ADAPTER) names, else the first of the recorded `kind`, else the default adapter.
    -> (the choice, its `adapter` the adapter's kind ("numpy" on ref); the device to open)."""
    if name == "ref":
        return BackendChoice("ref", "the numpy backend, as the run", "numpy"), device
    if name != "wgpu":
        raise UnknownBackendError(f"unknown backend {name!r}: one of wgpu, ref")
    try:
        from ddl_wgpu.runtime import gpu as gpu_mod
    except ImportError as e:
        raise BackendError(f"wgpu unavailable ({e})") from None
    if device in (None, "") and not os.environ.get(gpu_mod.ENV_ADAPTER) and kind is not None:
        infos = [gpu_mod.describe_adapter(a) for a in gpu_mod.enumerate_adapters()]
        device = next((str(i) for i, info in enumerate(infos) if device_kind(info) == kind), None)
    try:
        info = gpu_mod.describe_adapter(gpu_mod.select_adapter(device))
    except gpu_mod.NoAdapterError as e:
        raise BackendError(str(e).splitlines()[0]) from None
    choice = BackendChoice("wgpu", f"the run's backend, on {device_kind(info)}", device_kind(info))
    return _with_runtime(choice, device), device


def _resolve(backend: str, device: str | None) -> str:
    """The backend's name; on numpy, its BLAS on one thread from here on (`refnet.one_blas_thread`: the bits of
    a job must not depend on the process's thread settings)."""
    name = choose_backend(backend, device).name
    if name == "ref":
        from ddl_wgpu.engine.refnet import one_blas_thread

        one_blas_thread()
    return name


# ----------------------------------------------------------------------------------------------------------
# precision (docs/precision.md)

PRECISIONS = ("auto", "f32", "mixed")


@dataclass(frozen=True)
class PrecisionChoice:
    """`name` "f32" | "mixed" (what a run records); `products` where the matrix products run: "matrix" (the
    GPU's matrix units, f16 operands, f32 accumulation), "simt" (f32 on the GPU's SIMT cores) or "numpy";
    `reason` human text for the resolved-configuration print."""

    name: str
    products: str
    reason: str


def apply_precision(precision: str, backend: str, device: str | None = None) -> PrecisionChoice:
    """Resolve `precision` on `backend` (and on wgpu the adapter `device`), and set the Gpu's `products` to
    match, so that `ops.matmul` routes the run's products. "auto" is "mixed" where the Gpu lists a subgroup
    matrix configuration (`matrix_configs`, the Dawn runtime's), else "f32"; "mixed" without one still runs
    the loss scaling, its products f32 on the SIMT cores (or numpy's)."""
    if precision not in PRECISIONS:
        raise BackendError(f"unknown precision {precision!r}: one of {', '.join(PRECISIONS)}")
    if _resolve(backend, device) == "ref":
        name = "f32" if precision == "auto" else precision
        why = "float32 numpy" + (", dynamic loss scaling as on the GPU" if name == "mixed" else "")
        return PrecisionChoice(name, "numpy", why)
    gpu = open_gpu(device)
    configs = _matrix_units(gpu)
    name = ("mixed" if configs else "f32") if precision == "auto" else precision
    gpu.products = "matrix" if name == "mixed" and configs else "simt"
    if name == "f32":
        why = "f32 products" + (
            "" if configs or precision != "auto" else " (the adapter has no subgroup matrix)"
        )
    elif configs:
        why = "f16 products on the matrix units, f32 accumulation, f32 weights and optimizer, loss scaling"
    else:
        why = "no subgroup matrix on this adapter: products stay f32 on the SIMT cores; loss scaling runs"
    return PrecisionChoice(name, gpu.products, why)


# ----------------------------------------------------------------------------------------------------------
# building

_GPU: dict = {}


def open_gpu(device: str | None = None) -> Gpu:
    """The process's device for an adapter choice, opened on first use and shared by every net after."""
    from ddl_wgpu.runtime.gpu import Gpu

    if device not in _GPU:
        _GPU[device] = Gpu(device)
    return _GPU[device]


def make_net(cfg: ModelConfig, params: dict | None, backend: str, device: str | None, seed: int = 0,
             mtp_weight: float = 0.0) -> TrainNet:  # fmt: skip
    """A training net on the backend; fresh parameters from `seed` when `params` is None. A model with an
    MTP draft (`cfg.mtp`) trains it jointly, its loss weighted by `mtp_weight`."""
    backend = _resolve(backend, device)
    if params is None:
        params = init_params(cfg, seed)
    if backend == "ref":
        from ddl_wgpu.engine.refnet import RefNet

        return RefNet(cfg, params, mtp_weight=mtp_weight)
    from ddl_wgpu.engine.net import Net
    from ddl_wgpu.engine.trunk import TrunkWork

    return Net(open_gpu(device), cfg, params, mtp_weight=mtp_weight, work_class=TrunkWork)


def _matrix_units(gpu) -> tuple:
    """The Gpu's subgroup-matrix configurations that the matrix-unit kernels take (`runtimes.TENSOR_CORE_CONFIGS`;
    none on wgpu-native): what both a mixed-precision run and an f16 trunk ask before routing products there."""
    return tuple(tensor_core_configs(getattr(gpu, "matrix_configs", ()) or ()))


def trunk_products(gpu, trunk_dtype: str) -> None:
    """An f16 trunk (heal's, accept's, generate's: inference only) runs its products on the matrix units where
    the Gpu lists a configuration the kernels take (`ops/matmul_tc.py`: activations rounded to f16 as they are
    staged, f32 accumulation); an f32 trunk keeps f32 products on the SIMT cores, as its dtype asks. The switch
    is the device's, shared by every net on it: set both ways, so an f32 trunk after an f16 one (a library user's
    process, the tests) does not inherit the matrix units; what a net builds later follows the last setting."""
    gpu.products = "matrix" if trunk_dtype == "f16" and _matrix_units(gpu) else "simt"


def check_trunk_dtype(backend: str, trunk_dtype: str) -> None:
    if trunk_dtype not in TRUNK_DTYPES:
        raise BackendError(f"trunk dtype must be one of {list(TRUNK_DTYPES)}, got {trunk_dtype!r}")
    if trunk_dtype != "f32" and backend != "wgpu":
        raise BackendError(f"a {trunk_dtype} trunk needs the wgpu backend (the numpy trunk is f32)")


def make_teacher(backend: str, model: Model, batch: int = 4, device: str | None = None,
                 trunk_dtype: str = "f32", plan=None, checkpoint=None) -> Teacher:  # fmt: skip
    """heal's frozen trunk: its next-token top-k and hidden rows per batch of `batch` windows; on wgpu an
    inference-only trunk (`stream.Trunk`), its big matrices in `trunk_dtype` ("f16" needs the adapter feature
    shader-f16), run by the `gpumem.TrunkPlan` `plan` when given (resident or streamed, its block of windows)
    and reading the trunk's tensors from the open `checkpoint` (the model's file, through its memory map) when
    given, else from the model's params."""
    backend = _resolve(backend, device)
    check_trunk_dtype(backend, trunk_dtype)
    if backend == "ref":
        from ddl_wgpu.engine.refnet import RefTeacher

        return RefTeacher(model.params, model.cfg)
    from ddl_wgpu.engine.heal_gpu import WgpuTeacher
    from ddl_wgpu.engine.stream import WeightSource
    from ddl_wgpu.runtime.gpu import GpuError, GpuOutOfMemory

    source = WeightSource(checkpoint=checkpoint) if checkpoint is not None else None
    gpu = open_gpu(device)
    trunk_products(gpu, trunk_dtype)
    try:
        return WgpuTeacher(gpu, model.params, model.cfg, batch, trunk_dtype, plan, source)
    except GpuOutOfMemory:
        raise
    except GpuError as e:
        raise BackendError(f"trunk on the GPU: {e}") from e


def plan_trunk(backend: str, job: str, cfg: ModelConfig, device: str | None, trunk_dtype: str, windows: int,
               window: int, batch: int, gpu_memory: int | None, k: int = 1, rows: bool = True,
               draft: dict | None = None):  # fmt: skip
    """The GPU memory plan (`gpumem.TrunkPlan`) of heal's or accept's trunk pass over `windows` windows of
    `window` tokens within `gpu_memory` bytes (None: no budget), its top-k of width k and (`rows`) the draft's
    step-1 rows, and (`draft`: heal's {"k", "chain", "stacked", "kl_form"}) the draft's phase after it; None
    on the numpy backend."""
    if _resolve(backend, device) != "wgpu":
        return None
    from ddl_wgpu.engine.heal_gpu import plan_trunk_job

    return plan_trunk_job(open_gpu(device), job, cfg, trunk_dtype, windows, window, batch, gpu_memory, k, rows,
                          draft)  # fmt: skip


def make_draft(backend: str, model: Model, init: dict | None = None, batch: int = 4,
               device: str | None = None, kl_form: str = "full",
               teacher: Teacher | None = None) -> Draft:  # fmt: skip
    """heal's draft (block + final norm) trained alone, from `init` weights when given, else the model's;
    `kl_form` the top-k KL's form ("full" or "topk", `ddl_ref.ops.KL_FORMS`); on wgpu, given heal's
    `teacher`, the draft reads the trunk's embedding/head instead of holding a copy."""
    backend = _resolve(backend, device)
    if backend == "ref":
        from ddl_wgpu.engine.refnet import RefDraft

        return RefDraft(model.params, model.cfg, init, kl_form)
    from ddl_wgpu.engine.heal_gpu import WgpuDraft

    return WgpuDraft(open_gpu(device), model.params, model.cfg, init, batch, kl_form, teacher)


def make_accept_backend(backend: str, model: Model, batch: int = 8, device: str | None = None,
                        trunk_dtype: str = "f32") -> tuple[AcceptTeacher | None, AcceptDraft | None]:  # fmt: skip
    """accept's trunk and draft on the backend: (teacher, draft) on wgpu; (None, None) on numpy, where accept
    runs `ddl_ref.mtp` inline (`refnet.ref_runner` where it needs a runner)."""
    backend = _resolve(backend, device)
    check_trunk_dtype(backend, trunk_dtype)
    if backend == "ref":
        return None, None
    teacher = make_teacher("wgpu", model, batch, device, trunk_dtype)
    return teacher, make_draft("wgpu", model, None, batch, device)


def make_engine(backend: str, model: Model, depth: int = 0, device: str | None = None,
                trunk_dtype: str = "f32", capacity: int | None = None) -> Engine:  # fmt: skip
    """generate's decoding engine on the backend: the trunk's cache and, `depth` > 0, the MTP draft's for
    speculating `depth` deep; `capacity` positions (default the model's max_seq_len); on wgpu an
    inference-only net, its big matrices in `trunk_dtype`."""
    backend = _resolve(backend, device)
    check_trunk_dtype(backend, trunk_dtype)
    if backend == "ref":
        from ddl_wgpu.engine.refnet import RefEngine

        return RefEngine(model, depth, capacity)
    from ddl_wgpu.engine.decode import WgpuEngine
    from ddl_wgpu.runtime.gpu import GpuError

    gpu = open_gpu(device)
    trunk_products(gpu, trunk_dtype)
    try:
        return WgpuEngine(gpu, model, depth, trunk_dtype, capacity)
    except GpuError as e:
        raise BackendError(f"decoding on the GPU: {e}") from e


# ----------------------------------------------------------------------------------------------------------
# EAGLE-3 drafts (`jobs/draft.py`, accept and generate with `--draft`): training and acceptance on both
# engines (docs/eagle3.md#the-gpu-engine), generate's speculating engine too

EAGLE3_GPU_TOPK = 64  # the GPU teacher's default top-k width over the draft vocabulary (`ops.topk_kl.KMAX`)


class Eagle3Target(Protocol):
    """The frozen target of an EAGLE-3 draft: ids (B, T) -> `step.Eagle3Batch` (the aux rows where the backend
    keeps them, the full-vocabulary argmax, and the teacher: full logits or a top-k over the draft vocabulary)."""

    def __call__(self, ids) -> Eagle3Batch: ...


class Eagle3Trainee(Protocol):
    """An EAGLE-3 draft trained alone (`refnet.RefEagle3Draft`, `engine.eagle3.WgpuEagle3Draft`), fed by its
    target's `Eagle3Batch`."""

    def step(self, batch: Eagle3Batch, ids, loss_mask, lr: float, step: int) -> tuple[float, float, bool]: ...

    def losses(self, batch: Eagle3Batch, ids, loss_mask) -> tuple[float, list[float]]: ...

    def greedy_chain(self, batch: Eagle3Batch, ids, depth: int) -> np.ndarray: ...  # (B, depth, T) target ids

    def snapshot(self): ...

    def restore(self, snap) -> None: ...

    def export(self) -> dict: ...

    def moments(self) -> tuple[dict, dict]: ...

    def load_moments(self, m: dict, v: dict) -> None: ...


def eagle3_teacher_k(backend: str, requested: int | None, draft_vocab: int, device: str | None = None) -> int:
    """The teacher's top-k width: `requested`, else the backend's default (numpy 0: the full logits, SpecForge's
    loss exactly; the GPU `EAGLE3_GPU_TOPK`), at most the draft vocabulary. The GPU teacher gives 1..64."""
    name = choose_backend(backend, device).name
    k = (0 if name == "ref" else EAGLE3_GPU_TOPK) if requested is None else int(requested)
    k = min(k, int(draft_vocab))
    if name != "ref" and not 1 <= k <= EAGLE3_GPU_TOPK:
        raise BackendError(f"the GPU teacher gives a top-k of 1..{EAGLE3_GPU_TOPK} over the draft vocabulary, "
                           f"got --teacher-k {requested}")  # fmt: skip
    if k < 0:
        raise BackendError(f"--teacher-k must be >= 0 (0: the full logits), got {requested}")
    return k


def make_eagle3_target(backend: str, model: Model, aux_layers, device: str | None = None, d2t=None, t2d=None,
                       k: int = 0, batch: int = 4, trunk_dtype: str = "f32",
                       streamed: bool = False) -> Eagle3Target:  # fmt: skip
    """The target's aux rows at the inputs of `aux_layers` and its teacher, per batch of windows: the full
    logits (k = 0, numpy only) or the top-k over the draft vocabulary `d2t` (k >= 1). On wgpu the frozen trunk
    (`stream.Trunk`, resident or `streamed`, its big matrices in `trunk_dtype`) over blocks of `batch` windows."""
    backend = _resolve(backend, device)
    if backend == "ref":
        from ddl_wgpu.engine.refnet import RefEagle3Target

        return RefEagle3Target(model, aux_layers, d2t, t2d, k)
    check_trunk_dtype(backend, trunk_dtype)
    from ddl_wgpu.engine.eagle3 import WgpuEagle3Target
    from ddl_wgpu.runtime.gpu import GpuError, GpuOutOfMemory

    try:
        return WgpuEagle3Target(open_gpu(device), model.params, model.cfg, aux_layers, d2t, k, batch, trunk_dtype,
                                streamed)  # fmt: skip
    except GpuOutOfMemory:
        raise
    except GpuError as e:
        raise BackendError(f"EAGLE-3 target on the GPU: {e}") from e


def make_eagle3_draft(backend: str, params: dict, cfg, embed, d2t, t2d, device: str | None = None,
                      target=None, batch: int = 4, k: int = 0, **optim) -> Eagle3Trainee:  # fmt: skip
    """An EAGLE-3 draft to train or measure, from `params` (float32), the target's `embed` shared (on wgpu read
    where `target`, a `make_eagle3_target` of the same backend, keeps it; `batch` windows, top-k width k)."""
    backend = _resolve(backend, device)
    if backend == "ref":
        from ddl_wgpu.engine.refnet import RefEagle3Draft

        return RefEagle3Draft(params, cfg, embed, d2t, t2d, **optim)
    from ddl_wgpu.engine.eagle3 import WgpuEagle3Draft
    from ddl_wgpu.runtime.gpu import GpuError, GpuOutOfMemory

    try:
        return WgpuEagle3Draft(target, params, cfg, d2t, t2d, batch, k, **optim)
    except GpuOutOfMemory:
        raise
    except GpuError as e:
        raise BackendError(f"EAGLE-3 draft on the GPU: {e}") from e


def make_eagle3_engine(backend: str, model: Model, draft, depth: int, device: str | None = None,
                       capacity: int | None = None, trunk_dtype: str = "f32") -> Engine:  # fmt: skip
    """generate's engine speculating with an EAGLE-3 draft (`files.eagle3file.Eagle3Draft`) `depth` deep: numpy's
    `refnet.RefEagle3Engine`, or on wgpu `decode_eagle3.WgpuEagle3Engine` (its trunk's big matrices in
    `trunk_dtype`)."""
    backend = _resolve(backend, device)
    check_trunk_dtype(backend, trunk_dtype)
    if backend == "ref":
        from ddl_wgpu.engine.refnet import RefEagle3Engine

        return RefEagle3Engine(model, draft, depth, capacity)
    from ddl_wgpu.engine.decode_eagle3 import WgpuEagle3Engine
    from ddl_wgpu.runtime.gpu import GpuError

    gpu = open_gpu(device)
    trunk_products(gpu, trunk_dtype)
    try:
        return WgpuEagle3Engine(gpu, model, draft, depth, trunk_dtype, capacity)
    except GpuError as e:
        raise BackendError(f"decoding with an EAGLE-3 draft on the GPU: {e}") from e
