"""Parameters, gradients and AdamW moments of one model resident on the GPU (`Net`), laid out from the
parameter table.

Layout (`layout.plan`, a pure function of the table and the adapter's limits; where each tensor lives is a
`layout.Slot`): the parameter table of `ddl_ref.params` is laid out into flat *arenas*, one buffer each for
parameters, gradients, first and second moments; offsets are aligned to 256 bytes so any tensor can be bound
as a sub-range on any adapter. A model too large for one buffer spans several arenas (the H200 caps a buffer
just under 4 GiB and a binding at 2 GiB, docs/wgpu-notes.md#buffers-and-bindings), and a tensor larger than
one binding is bound in row chunks (`Net.row_views`).

Inference nets (`Net(..., inference=True, dtype="f32"|"f16")`, the heal teacher's frozen trunk): only the
parameter arenas exist (no gradients, no moments: 4 or ~2 bytes per parameter instead of 16); the optimizer
and gradient views raise GpuError. With dtype="f16" the large 2-D matrices (`layout.F16_SUFFIXES`) are stored
as f16 and read by the f16-B matmul / f16 embedding gather (f32 accumulation); every 1-D tensor and the small
DDL/compressor/conv weights stay f32. f16 needs the adapter's shader-f16.

The activations and the model's forward/backward live in the per-job works: `trunk.TrunkWork` (training),
`inference.InferenceWork` (forward only), `draft.DraftWork` (heal's draft), over `blocks.Blocks`. This module
imports none of them: a net is given its work class (`Net(work_class=...)`, see `Net.work`).
"""

from __future__ import annotations

import numpy as np

from ddl_ref.blocks import head_name
from ddl_ref.config import ModelConfig
from ddl_ref.params import init_params, param_table, trainable_names
from ddl_wgpu.engine import layout
from ddl_wgpu.engine.layout import F32
from ddl_wgpu.engine.layout import align as _align
from ddl_wgpu.engine.step import AdamW
from ddl_wgpu.ops import adamw as k_adamw
from ddl_wgpu.ops import elementwise as k_ew
from ddl_wgpu.ops import reduce as k_red
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError

DTYPES = ("f32", "f16")


class Net:
    """Parameters, gradients and AdamW moments of one model on the GPU.

    `trainable` (names, or a predicate on names) limits the optimizer and the gradient norm to a subset;
    the others stay frozen (their gradients are still computed where the backward passes through them).
    `frozen_state=False` gives the frozen tensors no gradient or moment storage at all: the trainable
    tensors are laid out first in the arenas and the gradient and moment arenas stop where they end. Only
    for Works that never write a frozen tensor's gradient: the input-rows draft (heal), whose frozen
    embedding/head is most of its bytes (a 152 K x 2048 embedding: 3.7 GB of gradients and moments).

    `inference=True`: parameters only (no gradient or moment arenas), frozen, forward-only Works; `dtype`
    "f16" (inference only) stores the `layout.F16_SUFFIXES` matrices as f16 (see the module docstring).

    `shared` {name: owner Net}: frozen tensors this net reads from the owner's parameter arena instead of
    holding a copy (heal's draft reads the trunk's embedding/head, in the trunk's dtype). They get no storage
    here, are never written (`load`, `restore`) and are read back from the owner (`export`).

    `names` (a predicate on names) keeps only part of the table (a streamed trunk's resident tensors);
    `loader(net)` fills the parameter arenas instead of `load(params)` (a checkpoint read tensor by tensor,
    never whole in host memory: `stream.WeightSource`).
    """

    def __init__(
        self,
        gpu: Gpu,
        cfg: ModelConfig,
        params: dict | None = None,
        seed: int = 0,
        trainable=None,
        arena_bytes: int | None = None,
        mtp_weight: float = 0.0,
        inference: bool = False,
        dtype: str = "f32",
        frozen_state: bool = True,
        shared: dict | None = None,
        work_class: type | None = None,
        names=None,
        loader=None,
        table=None,
    ):
        if dtype not in DTYPES:
            raise GpuError(f"parameter dtype {dtype!r} is not one of {list(DTYPES)}")
        if dtype != "f32" and not inference:
            raise GpuError(f"a {dtype} Net is inference-only: pass inference=True (training keeps f32)")
        if dtype == "f16" and "shader-f16" not in gpu.features:
            raise GpuError(
                f"f16 weights (--trunk-dtype f16) need the adapter feature shader-f16, which {gpu.name} "
                "does not offer; use f32"
            )
        if inference and trainable:
            raise GpuError("an inference Net has no trainable parameters")
        self.inference, self.dtype = bool(inference), dtype
        self.gpu, self.cfg = gpu, cfg
        self.mtp_weight = float(mtp_weight)  # weight of the draft's loss in joint training (cfg.mtp set)
        # `names` (a predicate): the part of the table this net holds (a streamed trunk's resident embedding,
        # final norm and head, `stream.TrunkWeights`); every tensor by default
        # `table` (ParamSpecs): a parameter table of its own instead of cfg's (the EAGLE-3 draft's,
        # `eagle3.DraftParams`: not a model's table, but the same arenas, gradient norm and AdamW)
        full = param_table(cfg) if table is None else list(table)
        self.table = [t for t in full if names is None or names(t.name)]
        self.trainable = self._trainable_names(trainable, inference)
        self.shared = dict(shared or {})
        for name, owner in self.shared.items():
            spec = next((t for t in self.table if t.name == name), None)
            if spec is None or owner.gpu is not gpu or tuple(spec.shape) != owner.slots[name].shape:
                raise GpuError(
                    f"shared tensor {name}: not in this net's table, or of another shape or device"
                )
            if name in self.trainable:
                raise GpuError(f"shared tensor {name} is frozen here: it cannot be trainable")
        owners = {name: owner.slots[name] for name, owner in self.shared.items()}
        try:
            lay = layout.plan(
                self.table, gpu.max_buffer, arena_bytes, dtype, self.trainable, frozen_state, owners
            )
        except layout.LayoutError as e:
            raise GpuError(str(e)) from e
        self.slots, self.arena_sizes, self.has_state = lay.slots, lay.arena_sizes, lay.has_state
        mk = gpu.buffer
        self.p = [mk(s, label=f"params{i}") for i, s in enumerate(lay.arena_sizes)]
        # the owners' arenas of the shared tensors, as arena indices len(p), len(p) + 1, ... ('p' views only)
        self.p_shared = [owner.p[owner.slots[name].arena] for name, owner in self.shared.items()]
        if inference:
            self.g, self.m, self.v = [], [], []
        else:
            self.g = [mk(s, label=f"grads{i}") for i, s in enumerate(lay.state_sizes)]
            self.m = [mk(s, label=f"adam_m{i}") for i, s in enumerate(lay.state_sizes)]
            self.v = [mk(s, label=f"adam_v{i}") for i, s in enumerate(lay.state_sizes)]
        self.scalars = gpu.buffer(k_red.SCALARS_BYTES, label="scalars")  # norm, clip mult, finite, sumsq
        if loader is not None:  # fills the arenas itself (tensor by tensor from a checkpoint, `stream`)
            loader(self)
        else:
            # new buffers are zero (WebGPU zero-fills them): no gradient or moment to clear
            self.load(params if params is not None else init_params(cfg, seed), clear_state=False)
        self._opt = None
        self._zero = None
        self.work_class = work_class
        self._works: dict = {}

    def _trainable_names(self, trainable, inference: bool) -> list[str]:
        return [] if inference else trainable_names([s.name for s in self.table], trainable)

    def work(self, batch: int, seq: int):
        """The work of this net's job for (batch, seq), built on first use and cached: `work_class(net, batch,
        seq)`, the class the net was built with (`trunk.TrunkWork`, training step and evaluation, from
        `backend.make_net`; `inference.InferenceWork`, forward only, for heal's and accept's trunk).

        The class is handed in rather than imported: the works are built on a Net (they read its slots and
        views), so net.py stays the layer below them, knows no work, and a new work needs no change here. A
        net whose works are built directly (generate's `decode.TrunkRows`, heal's `draft.DraftWork`) needs
        none."""
        if self.work_class is None:
            raise GpuError(
                "this Net was built without a work class: Net(..., work_class=TrunkWork or InferenceWork)"
            )
        if (batch, seq) not in self._works:
            self._works[(batch, seq)] = self.work_class(self, batch, seq)
        return self._works[(batch, seq)]

    def export_snapshot(self, snapshot: list) -> dict[str, np.ndarray]:
        return self._decode(snapshot)

    def _decode(self, bufs: list, names=None) -> dict[str, np.ndarray]:
        """The tensors `names` (default all) of arenas `bufs` (laid out like the parameters) as float32
        arrays of their shapes."""
        arenas = [self.gpu.download(b, np.uint8) for b in bufs]
        out = {}
        for spec in self.table:  # table order, whatever the arena layout
            name, s = spec.name, self.slots[spec.name]
            if names is not None and name not in names:
                continue
            if name in self.shared:  # from the owner's arena (frozen: the same in any snapshot)
                buf = self.p_shared[s.arena - len(self.p)]
                raw = self.gpu.download(buf, np.uint8, s.bind_bytes, s.offset)[: s.nbytes]
            else:
                raw = arenas[s.arena][s.offset : s.offset + s.nbytes]
            a = raw.view(np.float16 if s.dtype == "f16" else np.float32)
            out[name] = a.astype(np.float32).reshape(s.shape)
        return out

    def wdtype(self, name: str) -> str:
        """The stored dtype of a parameter: "f16" for the big matrices of an f16 inference Net, else "f32"."""
        return self.slots[name].dtype

    def _require_training(self, what: str, name: str | None = None) -> None:
        if self.inference:
            raise GpuError(f"{what}: this Net is inference-only (no gradients or optimizer state)")
        if name is not None and name not in self.has_state:
            raise GpuError(f"{what}: {name} is frozen and this Net keeps no gradient or moments for it")

    # -- views ------------------------------------------------------------------------------------------

    def view(self, name: str, kind: str = "p"):
        """(buffer, byte offset, nbytes) of a parameter in arena kind 'p', 'g', 'm' or 'v'. A parameter
        larger than the storage-binding limit has no whole view: bind it through `row_views`. An f16
        tensor's view is numel·2 bytes rounded up to 4."""
        if kind != "p":
            self._require_training(f"gradient/moment view of {name}", name)
        s = self.slots[name]
        if s.nbytes > self.gpu.max_binding:
            raise GpuError(
                f"parameter {name} ({s.nbytes} bytes) exceeds this adapter's storage binding limit "
                f"{self.gpu.max_binding}: a kernel cannot bind it whole; bind it in row chunks (Net.row_views)"
            )
        return (self._arenas(kind)[s.arena], s.offset, s.bind_bytes)

    def _arenas(self, kind: str) -> list:
        """The buffers of arena kind 'p' (own, then the shared tensors' owners'), 'g', 'm' or 'v'."""
        return self.p + self.p_shared if kind == "p" else getattr(self, kind)

    def row_views(self, name: str, kind: str = "p") -> list[tuple[int, int, tuple]]:
        """A parameter (in arena kind 'p', 'g', 'm' or 'v') as row chunks [(row0, rows, view)], each view
        256-byte aligned and within the storage-binding limit; one chunk when the parameter fits a binding."""
        if kind != "p":
            self._require_training(f"gradient/moment view of {name}", name)
        s = self.slots[name]
        buf = self._arenas(kind)[s.arena]
        total = s.shape[0] if s.shape else 1
        row_bytes = s.nbytes // max(total, 1)
        try:
            step = layout.chunk_rows(s, self.gpu.max_binding)
        except layout.LayoutError as e:
            raise GpuError(str(e)) from e
        out = []
        for r0 in range(0, total, step):
            n = min(step, total - r0)
            out.append((r0, n, (buf, s.offset + r0 * row_bytes, -(-n * row_bytes // 4) * 4)))
        return out

    @property
    def head_name(self) -> str:
        return head_name(self.cfg)

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in self.slots.values())

    # -- host transfers ---------------------------------------------------------------------------------

    def load(self, params: dict, clear_state: bool = True):
        """Write every parameter (float arrays of the table's shapes); moments and gradients are zeroed
        (`clear_state`)."""
        missing = [n for n in self.slots if n not in params and n not in self.shared]
        if missing:
            raise GpuError(f"missing parameter(s): {missing[:5]}{' …' if len(missing) > 5 else ''}")
        for name, s in self.slots.items():
            if name in self.shared:  # the owner's
                continue
            a = np.asarray(params[name])
            if tuple(a.shape) != s.shape:
                raise GpuError(f"parameter {name} has shape {tuple(a.shape)}, the config needs {s.shape}")
            if s.dtype == "f16":
                # no copy, and nothing that can overflow, when the array is float16 already
                with np.errstate(over="ignore"):  # reported below, in one line
                    h = a.astype(np.float16, copy=False)
                if h is not a and not np.isfinite(h).all() and np.isfinite(a).all():
                    raise GpuError(
                        f"parameter {name} overflows float16 (max |x| {float(np.abs(a).max()):.4g})"
                    )
                self.gpu.write(self.p[s.arena], h, s.offset)
            else:
                self.gpu.write(self.p[s.arena], a.astype(np.float32, copy=False), s.offset)
        for bufs in (self.g, self.m, self.v) if clear_state else ():
            for b in bufs:
                self.gpu.write(b, np.zeros(b.size // F32, np.float32))

    def _export(self, kind: str, names=None) -> dict[str, np.ndarray]:
        """Parameters (`names`, default all), or the gradients/moments of every tensor that has them
        (`frozen_state`)."""
        if kind != "p":
            self._require_training("gradients/moments")
            return self._decode(getattr(self, kind), self.has_state)
        return self._decode(self.p, names)

    def export(self, names=None) -> dict[str, np.ndarray]:
        """The parameters `names` (default every one) as float32 numpy arrays, in table order."""
        return self._export("p", names)

    def grads(self) -> dict[str, np.ndarray]:
        return self._export("g")

    def moments(self) -> tuple[dict, dict]:
        return self._export("m"), self._export("v")

    def load_moments(self, m: dict, v: dict):
        self._require_training("load_moments")
        for kind, src in (("m", m), ("v", v)):
            for name, s in self.slots.items():
                if name not in self.has_state:
                    continue
                self.gpu.write(getattr(self, kind)[s.arena], np.asarray(src[name], np.float32), s.offset)

    def snapshot(self, into: list | None = None) -> list:
        """A GPU-side copy of the parameters (no host round trip), into the buffers of an earlier snapshot
        `into` when given (a copy kept again and again allocates once)."""
        copies = into if into is not None else [self.gpu.buffer(b.size, label="snapshot") for b in self.p]
        self._copy_all(self.p, copies)
        return copies

    def restore(self, snapshot: list):
        self._copy_all(snapshot, self.p)

    def _copy_all(self, sources: list, targets: list) -> None:
        rec = self.gpu.recorder()
        for src, dst in zip(sources, targets, strict=True):
            rec.copy(src, 0, dst, 0, src.size)
        rec.submit()

    # -- optimizer --------------------------------------------------------------------------------------

    def _trainable_runs(self):
        """Contiguous byte ranges of trainable tensors, per arena: [(arena, offset, nbytes)]."""
        runs: list[list[int]] = []
        for name in self.trainable:
            s = self.slots[name]
            if runs and runs[-1][0] == s.arena and runs[-1][1] + runs[-1][2] == s.offset:
                runs[-1][2] = s.offset + _align(s.nbytes) - runs[-1][1]
            else:
                runs.append([s.arena, s.offset, _align(s.nbytes)])
        return [piece for a, off, n in runs for piece in self._pieces(a, off, n)]

    def _pieces(self, arena: int, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
        return layout.pieces(arena, offset, nbytes, self.gpu.max_binding)

    def zero_grads_call(self) -> Call:
        self._require_training("zero_grads_call")
        if self._zero is None:
            call = Call()
            for a, b in enumerate(self.g):
                for _, off, n in self._pieces(a, 0, b.size):
                    call = call + k_ew.fill(self.gpu, (b, off, n), n // F32, 0.0)
            self._zero = call
        return self._zero

    def optimizer_call(self, hyper: AdamW) -> Call:
        """Gradient norm over the trainable tensors, clip multipliers, AdamW; built once per clip mode, its
        uniforms rewritten per step (the clip threshold and the AdamW hyper-parameters).

        "global": one norm over contiguous runs of trainable tensors, one multiplier (`scalars`) for all.
        "per-tensor": each tensor's own norm and multiplier (`reduce.tensor_norm_clip`, one record per
        tensor), AdamW over each tensor reading its record; `scalars` still gets the global norm and the
        finite flag, so the step's reported norm and non-finite skip are those of "global"."""
        self._require_training("optimizer_call")
        mode = hyper.grad_clip_mode
        if mode not in ("per-tensor", "global"):
            raise GpuError(f"grad_clip_mode must be 'per-tensor' or 'global', got {mode!r}")
        fields = k_adamw.adamw_fields(
            hyper.lr, hyper.step, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay
        )
        if self._opt is None:
            self._opt = {}
            self._hyper_buf = self.gpu.uniform(k_adamw.ADAMW, **fields, label="adamw")
        if mode not in self._opt:
            self._opt[mode] = self._global_clip() if mode == "global" else self._tensor_clip()
        call, clip_uniforms = self._opt[mode]
        # only the threshold and the loss scale's inverse change; counts and strides stay as built
        for buf, desc in clip_uniforms:
            self.gpu.write_fields(buf, desc, clip=hyper.grad_clip, unscale=1.0 / hyper.loss_scale)
        self.gpu.write_uniform(self._hyper_buf, k_adamw.ADAMW, **fields)
        return call

    def _global_clip(self):
        """The "global" optimizer call over contiguous runs of trainable tensors, and its clip uniforms."""
        runs = self._trainable_runs()
        ranges = [((self.g[a], off, n), n // F32) for a, off, n in runs]
        count = k_red.total_partials([n for _, n in ranges])
        parts = self.gpu.buffer(count * F32, label="norm_partials")
        # the Call keeps its partials alive (its bind groups alone do not: `gpu.Call.scratch`)
        call = Call(scratch=parts) + k_red.grad_norm_clip(self.gpu, self.scalars, parts, ranges, 1.0)
        clip_uniforms = [(call.uniforms[-1], k_red.FINALIZE)]
        for a, off, n in runs:
            views = [(buf[a], off, n) for buf in (self.p, self.g, self.m, self.v)]
            call = call + k_adamw.adamw(self.gpu, *views, self.scalars, n // F32, self._hyper_buf)
        return call, clip_uniforms

    def _tensor_clip(self):
        """The "per-tensor" optimizer call (one clip record per trainable tensor), and its clip uniforms."""
        pieces = []
        for name in self.trainable:
            s = self.slots[name]
            pieces.append(self._pieces(s.arena, s.offset, s.numel * F32))
        tensors = [[((self.g[a], off, n), n // F32) for a, off, n in ps] for ps in pieces]
        count = k_red.total_partials([n for ps in tensors for _, n in ps])
        parts = self.gpu.buffer(count * F32, label="norm_partials_tensors")
        self._records = self.gpu.buffer(len(tensors) * k_red.RECORD_BYTES, label="clip_records")
        call = Call(scratch=parts) + k_red.tensor_norm_clip(self.gpu, self.scalars, self._records, parts, tensors,
                                                             1.0)  # fmt: skip
        clip_uniforms = [(call.uniforms[-3], k_red.FINALIZE), (call.uniforms[-2], k_red.TENSOR_CLIP)]
        for t, ps in enumerate(pieces):
            record = (self._records, t * k_red.RECORD_BYTES, k_red.SCALARS_BYTES)
            for a, off, n in ps:
                views = [(buf[a], off, n) for buf in (self.p, self.g, self.m, self.v)]
                call = call + k_adamw.adamw(self.gpu, *views, record, n // F32, self._hyper_buf)
        return call, clip_uniforms
