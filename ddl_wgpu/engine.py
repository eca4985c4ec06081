"""The GPU engine: `Net` (parameters, gradients and AdamW moments resident on the GPU) and `Work`
(activations for one (batch, seq) shape, with every launch prepared once).

Layout (style.md rule 5): the parameter table of `ddl_ref.params` is laid out into flat *arenas*, one
buffer each for parameters, gradients, first and second moments; offsets are aligned to 256 bytes so any
tensor can be bound as a sub-range on any adapter. A model too large for one buffer spans several arenas
(the H200 caps a buffer just under 4 GiB and a binding at 2 GiB, wgpu.md §4).

A training step (`Work.step`) is: per-step host data written with `queue.write_buffer` (ids, targets,
weights, the embedding's buckets, the loss scale), then ONE command encoder holding zero-grads, the
forward, the backward, and optionally the global gradient norm, clipping and AdamW; one submit; one small
read-back (loss sum, gradient norm, clip multiplier, finite flag). Nothing reads the GPU inside a step.

The model's forward (`_forward_calls`) and backward (`_backward_calls`) sit next to each other and mirror
each other op for op, like `ddl_ref.model`; the reference is the specification and the tests compare
every loss, logit and gradient with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ddl_ref import ops as ref_ops
from ddl_ref.config import ModelConfig
from ddl_ref.params import init_params, param_table
from ddl_wgpu.gpu import Call, Gpu, GpuError
from ddl_wgpu.ops import adamw as k_adamw
from ddl_wgpu.ops import attention as k_attn
from ddl_wgpu.ops import crossentropy as k_ce
from ddl_wgpu.ops import elementwise as k_ew
from ddl_wgpu.ops import embedding as k_emb
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.ops import reduce as k_red
from ddl_wgpu.ops import rmsnorm as k_norm
from ddl_wgpu.ops import rope as k_rope
from ddl_wgpu.ops import swiglu as k_swiglu

ALIGN = 256  # WebGPU's default min-storage-buffer-offset-alignment; lavapipe needs 32, NVIDIA 32-256
F32 = 4


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives: arena index and byte range (the same in every arena kind)."""

    name: str
    shape: tuple
    arena: int
    offset: int
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * F32


@dataclass(frozen=True)
class AdamW:
    """The optimizer's hyper-parameters for one step (`step` counts from 1)."""

    lr: float
    step: int
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-5
    weight_decay: float = 0.1
    grad_clip: float = 1.0


@dataclass
class StepResult:
    loss: float  # mean over valid predictions
    count: int  # valid predictions
    grad_norm: float  # global gradient norm before clipping (nan when not computed)
    finite: bool  # loss and gradients finite


class Net:
    """Parameters, gradients and AdamW moments of one model on the GPU.

    `trainable` (names, or a predicate on names) limits the optimizer and the gradient norm to a subset;
    the others stay frozen (their gradients are still computed where the backward passes through them).
    """

    def __init__(
        self,
        gpu: Gpu,
        cfg: ModelConfig,
        params: dict | None = None,
        seed: int = 0,
        trainable=None,
        arena_bytes: int | None = None,
    ):
        self.gpu, self.cfg = gpu, cfg
        self.table = param_table(cfg)
        limit = min(gpu.max_buffer, arena_bytes or gpu.max_buffer)
        limit = limit // ALIGN * ALIGN
        self.slots: dict[str, Slot] = {}
        sizes: list[int] = [0]
        for spec in self.table:
            nbytes = spec.numel * F32
            if nbytes > gpu.max_binding:
                raise GpuError(
                    f"parameter {spec.name} needs {nbytes} bytes, more than this adapter's storage binding "
                    f"limit {gpu.max_binding}; row-chunked binding of such tensors is not supported yet"
                )
            if sizes[-1] + _align(nbytes) > limit and sizes[-1] > 0:
                sizes.append(0)
            self.slots[spec.name] = Slot(spec.name, tuple(spec.shape), len(sizes) - 1, sizes[-1], spec.numel)
            sizes[-1] += _align(nbytes)
        self.arena_sizes = sizes
        mk = gpu.buffer
        self.p = [mk(s, label=f"params{i}") for i, s in enumerate(sizes)]
        self.g = [mk(s, label=f"grads{i}") for i, s in enumerate(sizes)]
        self.m = [mk(s, label=f"adam_m{i}") for i, s in enumerate(sizes)]
        self.v = [mk(s, label=f"adam_v{i}") for i, s in enumerate(sizes)]
        if trainable is None:
            self.trainable = [s.name for s in self.table]
        elif callable(trainable):
            self.trainable = [s.name for s in self.table if trainable(s.name)]
        else:
            wanted = set(trainable)
            unknown = wanted - set(self.slots)
            if unknown:
                raise GpuError(f"unknown trainable parameter(s): {sorted(unknown)}")
            self.trainable = [s.name for s in self.table if s.name in wanted]
        self.scalars = gpu.buffer(k_red.SCALARS_BYTES, label="scalars")  # norm, clip mult, finite, sumsq
        self.load(params if params is not None else init_params(cfg, seed))
        self._opt = None
        self._zero = None

    def work(self, batch: int, seq: int) -> Work:
        """The Work for this (batch, seq), built on first use and cached."""
        if not hasattr(self, "_works"):
            self._works = {}
        if (batch, seq) not in self._works:
            self._works[(batch, seq)] = Work(self, batch, seq)
        return self._works[(batch, seq)]

    def export_snapshot(self, snapshot: list) -> dict[str, np.ndarray]:
        arenas = [self.gpu.download(b, np.float32) for b in snapshot]
        return {
            name: arenas[s.arena][s.offset // F32 : s.offset // F32 + s.numel].reshape(s.shape).copy()
            for name, s in self.slots.items()
        }

    # -- views ------------------------------------------------------------------------------------------

    def view(self, name: str, kind: str = "p"):
        """(buffer, byte offset, nbytes) of a parameter in arena kind 'p', 'g', 'm' or 'v'."""
        s = self.slots[name]
        return (getattr(self, kind)[s.arena], s.offset, s.nbytes)

    @property
    def head_name(self) -> str:
        return "model.embed_tokens.weight" if self.cfg.tie_embeddings else "lm_head.weight"

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in self.slots.values())

    # -- host transfers ---------------------------------------------------------------------------------

    def load(self, params: dict):
        """Write every parameter (float arrays of the table's shapes); moments and gradients are zeroed."""
        missing = [n for n in self.slots if n not in params]
        if missing:
            raise GpuError(f"missing parameter(s): {missing[:5]}{' …' if len(missing) > 5 else ''}")
        for name, s in self.slots.items():
            a = np.asarray(params[name])
            if tuple(a.shape) != s.shape:
                raise GpuError(f"parameter {name} has shape {tuple(a.shape)}, the config needs {s.shape}")
            self.gpu.write(self.p[s.arena], a.astype(np.float32), s.offset)
        for bufs in (self.g, self.m, self.v):
            for b in bufs:
                self.gpu.write(b, np.zeros(b.size // F32, np.float32))

    def _export(self, kind: str) -> dict[str, np.ndarray]:
        arenas = [self.gpu.download(b, np.float32) for b in getattr(self, kind)]
        out = {}
        for name, s in self.slots.items():
            start = s.offset // F32
            out[name] = arenas[s.arena][start : start + s.numel].reshape(s.shape).copy()
        return out

    def export(self) -> dict[str, np.ndarray]:
        """Every parameter as float32 numpy arrays, in table order."""
        return self._export("p")

    def grads(self) -> dict[str, np.ndarray]:
        return self._export("g")

    def moments(self) -> tuple[dict, dict]:
        return self._export("m"), self._export("v")

    def load_moments(self, m: dict, v: dict):
        for kind, src in (("m", m), ("v", v)):
            for name, s in self.slots.items():
                self.gpu.write(getattr(self, kind)[s.arena], np.asarray(src[name], np.float32), s.offset)

    def snapshot(self) -> list:
        """A GPU-side copy of the parameters (no host round trip)."""
        copies = [self.gpu.buffer(b.size, label="snapshot") for b in self.p]
        rec = self.gpu.recorder()
        for src, dst in zip(self.p, copies, strict=True):
            rec.copy(src, 0, dst, 0, src.size)
        rec.submit()
        return copies

    def restore(self, snapshot: list):
        rec = self.gpu.recorder()
        for src, dst in zip(snapshot, self.p, strict=True):
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
        return [tuple(r) for r in runs]

    def zero_grads_call(self) -> Call:
        if self._zero is None:
            call = Call()
            for b in self.g:
                call = call + k_ew.fill(self.gpu, b, b.size // F32, 0.0)
            self._zero = call
        return self._zero

    def optimizer_call(self, hyper: AdamW) -> Call:
        """Global gradient norm over the trainable tensors, clip multiplier, AdamW; built once, its
        uniforms rewritten per step (the clip threshold and the AdamW hyper-parameters)."""
        values = k_adamw.adamw_uniform_values(
            hyper.lr, hyper.step, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay
        )
        if self._opt is None:
            runs = self._trainable_runs()
            ranges = [((self.g[a], off, n), n // F32) for a, off, n in runs]
            parts = self.gpu.buffer(k_red.total_partials([n for _, n in ranges]) * F32, label="norm_partials")
            norm_call = k_red.grad_norm_clip(self.gpu, self.scalars, parts, ranges, hyper.grad_clip)
            self._clip_uniform = norm_call.uniforms[-1]
            self._norm_count = k_red.total_partials([n for _, n in ranges])
            self._hyper_buf = self.gpu.uniform(k_adamw.ADAMW_FMT, *values)
            call = norm_call
            for a, off, n in runs:
                views = [(buf[a], off, n) for buf in (self.p, self.g, self.m, self.v)]
                call = call + k_adamw.adamw(self.gpu, *views, self.scalars, n // F32, self._hyper_buf)
            self._opt = call
        self.gpu.write_uniform(self._clip_uniform, k_red.FINALIZE_FMT, self._norm_count, hyper.grad_clip, 0, 0)
        self.gpu.write_uniform(self._hyper_buf, k_adamw.ADAMW_FMT, *values)
        return self._opt

    def read_scalars(self) -> tuple[float, float, bool]:
        s = self.gpu.download(self.scalars, np.float32, 3)
        return float(s[0]), float(s[1]), bool(s[2] != 0)


class Work:
    """Activations and scratch for one (batch, seq) shape; every Call built once here, recorded per step.

    Shapes are fixed: a different (B, T) is an error, not a silent reallocation (style.md rule 4).
    """

    def __init__(self, net: Net, batch: int, seq: int, chunk_rows: int | None = None):
        cfg = net.cfg
        if seq > cfg.max_seq_len:
            raise GpuError(f"sequence length {seq} exceeds the model's max_seq_len {cfg.max_seq_len}")
        if cfg.residual != "add" or cfg.mtp is not None:
            raise GpuError("this engine build runs residual='add' models without an MTP draft only")
        self.net, self.gpu, self.cfg = net, net.gpu, cfg
        self.B, self.T = batch, seq
        self.N = N = batch * seq  # rows (tokens)
        C, H, K, D, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden, cfg.vocab_size
        gpu = self.gpu
        buf = gpu.buffer

        def act(n, label):
            return buf(n * F32, label=label)

        # per-step inputs
        self.ids = buf(N * 4, label="ids")
        self.targets = buf(N * 4, label="targets")
        self.weights = act(N, "weights")
        self.scale = act(4, "loss_scale")
        self.order = buf(N * 4, label="emb_order")
        self.starts = buf((V + 1) * 4, label="emb_starts")
        cos, sin = ref_ops.rope_tables(seq, D, cfg.rope_theta, np.float64)
        self.cos = gpu.upload(cos.astype(np.float32), "rope_cos")
        self.sin = gpu.upload(sin.astype(np.float32), "rope_sin")
        # saved activations, per layer (names follow ddl_ref.model's cache)
        self.L = []
        for i in range(cfg.n_layers):
            a = {
                "x": act(N * C, f"x{i}"),  # block input (residual stream)
                "h": act(N * C, f"h{i}"),
                "r1": act(N, f"rstd1_{i}"),
                "q": act(N * H * D, f"q{i}"),
                "k": act(N * K * D, f"k{i}"),
                "v": act(N * K * D, f"v{i}"),
                "a": act(N * H * D, f"att{i}"),
                "lse": act(batch * H * seq, f"lse{i}"),
                "xm": act(N * C, f"xm{i}"),  # stream after the attention residual
                "h2": act(N * C, f"h2{i}"),
                "r2": act(N, f"rstd2_{i}"),
                "gate": act(N * F, f"gate{i}"),
                "up": act(N * F, f"up{i}"),
                "s": act(N * F, f"swiglu{i}"),
            }
            # q/k after each op of their chain (rope; norm before or after it)
            for t, n_heads in (("q", H), ("k", K)):
                a[t + "1"] = act(N * n_heads * D, f"{t}1_{i}")
                if cfg.qk_norm != "none":
                    a[t + "2"] = act(N * n_heads * D, f"{t}2_{i}")
                    a[t + "r"] = act(N * n_heads, f"{t}rstd{i}")
            self.L.append(a)
        self.xL = act(N * C, "x_final")
        self.xf = act(N * C, "x_normed")
        self.rf = act(N, "rstd_final")
        self.row_loss = act(N, "row_loss")
        self.loss_sum = act(4, "loss_sum")
        # backward scratch, shared by every layer
        self.dx = act(N * C, "dx")
        self.dxf = act(N * C, "dxf")
        self.dh = act(N * C, "dh")
        self.da = act(N * H * D, "da")
        self.dq = [act(N * H * D, "dq0"), act(N * H * D, "dq1")]
        self.dk = [act(N * K * D, "dk0"), act(N * K * D, "dk1")]
        self.dv = act(N * K * D, "dv")
        self.ds = act(N * F, "ds")
        self.dgate = act(N * F, "dgate")
        self.dup = act(N * F, "dup")
        # the LM head runs in row chunks so full logits never exist: chunks are multiples of 64 rows
        # (64·C·4 bytes keeps every chunk's view offset 256-aligned) and bounded to ~64 MiB of logits
        budget = min(64 << 20, gpu.max_binding)
        rows = max(64, budget // (V * F32) // 64 * 64)
        self.chunk = min(N, chunk_rows or rows)
        self.logit_chunk = act(self.chunk * V, "logits_chunk")
        self.readback = gpu.buffer(16, label="readback")  # loss sum, grad norm, clip multiplier, finite
        self._fwd = self._forward_calls()
        self._head_train = self._head_calls(train=True)
        self._head_eval = self._head_calls(train=False)
        self._bwd = self._backward_calls()
        self._sum = k_red.sum_rows(gpu, self.loss_sum, self.row_loss, N)

    # -- per-step host data -----------------------------------------------------------------------------

    def _upload(self, ids: np.ndarray, lengths: np.ndarray | None, train: bool) -> int:
        ids = np.asarray(ids)
        if ids.shape != (self.B, self.T):
            raise GpuError(f"batch of shape {ids.shape}, this Work was built for {(self.B, self.T)}")
        lengths = np.full(self.B, self.T) if lengths is None else np.asarray(lengths)
        V = self.cfg.vocab_size
        if ids.size and int(ids.max()) >= V:
            raise GpuError(f"token id {int(ids.max())} out of range for vocab_size {V}")
        ids32 = ids.astype(np.uint32)
        targets = np.zeros((self.B, self.T), np.uint32)
        targets[:, :-1] = ids32[:, 1:]
        pos = np.arange(self.T)[None, :]
        valid = pos < np.minimum(lengths[:, None] - 1, self.T - 1)  # (B, T): position predicts p+1
        weights = valid.astype(np.float32)
        count = int(valid.sum())
        g = self.gpu
        g.write(self.ids, ids32.reshape(-1))
        g.write(self.targets, targets.reshape(-1))
        g.write(self.weights, weights.reshape(-1))
        g.write(self.scale, np.array([1.0 / max(count, 1)], np.float32))
        if train:
            order, starts = k_emb.embedding_buckets(ids32.reshape(-1), V)
            g.write(self.order, order.astype(np.uint32))
            g.write(self.starts, starts.astype(np.uint32))
        return count

    # -- the model: forward and backward, mirrored ------------------------------------------------------

    def _forward_calls(self) -> Call:
        cfg, g, net, N = self.cfg, self.gpu, self.net, self.N
        C, H, K, D, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        eps, style, B, T = cfg.rms_eps, cfg.norm_style, self.B, self.T
        P = net.view
        call = k_emb.embedding_forward(g, self.L[0]["x"] if self.L else self.xL, self.ids,
                                       P("model.embed_tokens.weight"), N, C)
        for i, a in enumerate(self.L):
            p = f"model.layers.{i}."
            out = self.L[i + 1]["x"] if i + 1 < len(self.L) else self.xL
            # attention sublayer
            call += k_norm.rmsnorm_forward(g, a["h"], a["r1"], a["x"], P(p + "input_layernorm.weight"), N, C, eps, style)
            call += k_mm.linear_forward(g, a["q"], a["h"], P(p + "self_attn.q_proj.weight"), N, H * D, C)
            call += k_mm.linear_forward(g, a["k"], a["h"], P(p + "self_attn.k_proj.weight"), N, K * D, C)
            call += k_mm.linear_forward(g, a["v"], a["h"], P(p + "self_attn.v_proj.weight"), N, K * D, C)
            for t, nh in (("q", H), ("k", K)):
                call += self._qk_chain_forward(a, t, nh, p)
            qf, kf = self._qk_final(a, "q"), self._qk_final(a, "k")
            call += k_attn.attention_forward(g, a["a"], a["lse"], qf, kf, a["v"], B, T, H, K, D)
            call += k_ew.copy(g, a["xm"], a["x"], N * C)
            call += k_mm.matmul(g, a["xm"], a["a"], P(p + "self_attn.o_proj.weight"), N, C, H * D,
                                trans_b=True, accumulate=True)
            # MLP sublayer
            call += k_norm.rmsnorm_forward(g, a["h2"], a["r2"], a["xm"], P(p + "post_attention_layernorm.weight"),
                                           N, C, eps, style)
            call += k_mm.linear_forward(g, a["gate"], a["h2"], P(p + "mlp.gate_proj.weight"), N, F, C)
            call += k_mm.linear_forward(g, a["up"], a["h2"], P(p + "mlp.up_proj.weight"), N, F, C)
            call += k_swiglu.swiglu_forward(g, a["s"], a["gate"], a["up"], N * F)
            call += k_ew.copy(g, out, a["xm"], N * C)
            call += k_mm.matmul(g, out, a["s"], P(p + "mlp.down_proj.weight"), N, C, F,
                                trans_b=True, accumulate=True)
        call += k_norm.rmsnorm_forward(g, self.xf, self.rf, self.xL, P("model.norm.weight"), N, C, eps, style)
        return call

    def _qk_order(self) -> list[str]:
        return {"none": ["rope"], "pre_rope": ["norm", "rope"], "post_rope": ["rope", "norm"]}[self.cfg.qk_norm]

    def _qk_final(self, a: dict, t: str):
        return a[t + str(len(self._qk_order()))]

    def _qk_chain_forward(self, a: dict, t: str, nh: int, p: str) -> Call:
        cfg, g, N, D = self.cfg, self.gpu, self.N, self.cfg.head_dim
        call, src = Call(), a[t]
        for j, op in enumerate(self._qk_order(), start=1):
            dst = a[t + str(j)]
            if op == "rope":
                call += k_rope.rope_forward(g, dst, src, self.cos, self.sin, self.B, self.T, nh, D)
            else:
                w = self.net.view(p + f"self_attn.{t}_norm.weight")
                call += k_norm.rmsnorm_forward(g, dst, a[t + "r"], src, w, N * nh, D, cfg.rms_eps, cfg.norm_style)
            src = dst
        return call

    def _qk_chain_backward(self, a: dict, t: str, nh: int, p: str, dfinal, scratch) -> tuple[Call, object]:
        """Reverse of `_qk_chain_forward`: from d(final q/k) to d(projection output)."""
        cfg, g, N, D = self.cfg, self.gpu, self.N, self.cfg.head_dim
        order = self._qk_order()
        call, dcur = Call(), dfinal
        for j in range(len(order), 0, -1):
            op = order[j - 1]
            src = a[t + str(j - 1)] if j > 1 else a[t]
            dnext = scratch if dcur is dfinal else dfinal
            if op == "rope":
                call += k_rope.rope_backward(g, dnext, dcur, self.cos, self.sin, self.B, self.T, nh, D)
            else:
                w = self.net.view(p + f"self_attn.{t}_norm.weight")
                dw = self.net.view(p + f"self_attn.{t}_norm.weight", "g")
                call += k_norm.rmsnorm_backward(g, dnext, dw, dcur, src, w, a[t + "r"], N * nh, D, cfg.norm_style)
            dcur = dnext
        return call, dcur

    def _head_calls(self, train: bool) -> Call:
        """LM head + cross-entropy in row chunks; with `train`, also the head's backward per chunk."""
        cfg, g, net = self.cfg, self.gpu, self.net
        C, V, N = cfg.d_model, cfg.vocab_size, self.N
        W = net.view(net.head_name)
        dW = net.view(net.head_name, "g")
        call = Call()
        for r0 in range(0, N, self.chunk):
            n = min(self.chunk, N - r0)
            xf = (self.xf, r0 * C * F32, n * C * F32)
            logits = (self.logit_chunk, 0, n * V * F32)
            call += k_mm.matmul(g, logits, xf, W, n, V, C, trans_b=True)
            if train:
                call += k_ce.cross_entropy(g, self.row_loss, logits, self.targets, self.weights, n, V,
                                           self.scale, row_offset=r0)
                dxf = (self.dxf, r0 * C * F32, n * C * F32)
                call += k_mm.matmul(g, dxf, logits, W, n, C, V)  # dxf = dlogits · W
                call += k_mm.matmul(g, dW, logits, xf, V, C, n, trans_a=True, accumulate=True)
            else:
                call += k_ce.cross_entropy_eval(g, self.row_loss, logits, self.targets, self.weights, n, V,
                                                row_offset=r0)
        return call

    def _backward_calls(self) -> Call:
        cfg, g, net, N = self.cfg, self.gpu, self.net, self.N
        C, H, K, D, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        style, B, T = cfg.norm_style, self.B, self.T
        P = net.view

        def G(name):
            return net.view(name, "g")

        call = k_norm.rmsnorm_backward(g, self.dx, G("model.norm.weight"), self.dxf, self.xL,
                                       P("model.norm.weight"), self.rf, N, C, style)
        for i in reversed(range(len(self.L))):
            a, p = self.L[i], f"model.layers.{i}."
            # MLP sublayer (reverse): the residual passes dx through; the branch adds to it
            call += k_mm.linear_backward(g, self.ds, G(p + "mlp.down_proj.weight"), self.dx, a["s"],
                                         P(p + "mlp.down_proj.weight"), N, C, F, accumulate_dw=True)
            call += k_swiglu.swiglu_backward(g, self.dgate, self.dup, self.ds, a["gate"], a["up"], N * F)
            call += k_mm.linear_backward(g, self.dh, G(p + "mlp.up_proj.weight"), self.dup, a["h2"],
                                         P(p + "mlp.up_proj.weight"), N, F, C, accumulate_dw=True)
            call += k_mm.linear_backward(g, self.dh, G(p + "mlp.gate_proj.weight"), self.dgate, a["h2"],
                                         P(p + "mlp.gate_proj.weight"), N, F, C, accumulate_dx=True,
                                         accumulate_dw=True)
            call += k_norm.rmsnorm_backward(g, self.dx, G(p + "post_attention_layernorm.weight"), self.dh,
                                            a["xm"], P(p + "post_attention_layernorm.weight"), a["r2"], N, C,
                                            style, accumulate_dx=True)
            # attention sublayer (reverse)
            call += k_mm.linear_backward(g, self.da, G(p + "self_attn.o_proj.weight"), self.dx, a["a"],
                                         P(p + "self_attn.o_proj.weight"), N, C, H * D, accumulate_dw=True)
            qf, kf = self._qk_final(a, "q"), self._qk_final(a, "k")
            call += k_attn.attention_backward(g, self.dq[0], self.dk[0], self.dv, self.da, a["a"], a["lse"],
                                              qf, kf, a["v"], B, T, H, K, D)
            c_q, dq = self._qk_chain_backward(a, "q", H, p, self.dq[0], self.dq[1])
            c_k, dk = self._qk_chain_backward(a, "k", K, p, self.dk[0], self.dk[1])
            call += c_q + c_k
            call += k_mm.linear_backward(g, self.dh, G(p + "self_attn.v_proj.weight"), self.dv, a["h"],
                                         P(p + "self_attn.v_proj.weight"), N, K * D, C, accumulate_dw=True)
            call += k_mm.linear_backward(g, self.dh, G(p + "self_attn.k_proj.weight"), dk, a["h"],
                                         P(p + "self_attn.k_proj.weight"), N, K * D, C, accumulate_dx=True,
                                         accumulate_dw=True)
            call += k_mm.linear_backward(g, self.dh, G(p + "self_attn.q_proj.weight"), dq, a["h"],
                                         P(p + "self_attn.q_proj.weight"), N, H * D, C, accumulate_dx=True,
                                         accumulate_dw=True)
            call += k_norm.rmsnorm_backward(g, self.dx, G(p + "input_layernorm.weight"), self.dh, a["x"],
                                            P(p + "input_layernorm.weight"), a["r1"], N, C, style,
                                            accumulate_dx=True)
        call += k_emb.embedding_backward(g, G("model.embed_tokens.weight"), self.dx, self.order, self.starts,
                                         cfg.vocab_size, C, accumulate=True)
        return call

    # -- steps ------------------------------------------------------------------------------------------

    def _finish(self, rec, with_scalars: bool):
        rec.copy(self.loss_sum, 0, self.readback, 0, 4)
        if with_scalars:
            rec.copy(self.net.scalars, 0, self.readback, 4, 12)
        rec.submit()
        return self.gpu.download(self.readback, np.float32, 4)

    def step(self, ids, lengths=None, update: AdamW | None = None) -> StepResult:
        """Forward + backward (gradients overwritten, not accumulated), and with `update` the global
        gradient norm, clipping and AdamW, all in one encoder and one submit."""
        count = self._upload(ids, lengths, train=True)
        rec = self.gpu.recorder()
        self.net.zero_grads_call().record(rec)
        self._fwd.record(rec)
        self._head_train.record(rec)
        self._sum.record(rec)
        self._bwd.record(rec)
        if update is not None:
            self.net.optimizer_call(update).record(rec)
        out = self._finish(rec, update is not None)
        loss = float(out[0]) / max(count, 1)
        finite = bool(np.isfinite(loss)) and (update is None or out[3] != 0)
        norm = float(out[1]) if update is not None else math.nan
        return StepResult(loss=loss, count=count, grad_norm=norm, finite=finite)

    def loss_sum(self, ids, lengths=None) -> tuple[float, int]:
        """Sum of the per-prediction losses and the number of predictions (evaluation; no gradients)."""
        count = self._upload(ids, lengths, train=False)
        rec = self.gpu.recorder()
        self._fwd.record(rec)
        self._head_eval.record(rec)
        self._sum.record(rec)
        out = self._finish(rec, False)
        return float(out[0]), count

    def logits(self, ids) -> np.ndarray:
        """Full logits (B, T, V) — for tests and small models only (downloads chunk by chunk)."""
        self._upload(ids, None, train=False)
        cfg, g, net = self.cfg, self.gpu, self.net
        C, V, N = cfg.d_model, cfg.vocab_size, self.N
        rec = g.recorder()
        self._fwd.record(rec)
        rec.submit()
        out = np.empty((N, V), np.float32)
        W = net.view(net.head_name)
        for r0 in range(0, N, self.chunk):
            n = min(self.chunk, N - r0)
            xf = (self.xf, r0 * C * F32, n * C * F32)
            k_mm.matmul(g, (self.logit_chunk, 0, n * V * F32), xf, W, n, V, C, trans_b=True).run(g)
            out[r0 : r0 + n] = g.download(self.logit_chunk, np.float32, n * V).reshape(n, V)
        return out.reshape(self.B, self.T, V)

    def hidden(self) -> tuple[np.ndarray, np.ndarray]:
        """The last forward's (pre-norm, post-norm) final hidden rows, each (B, T, C)."""
        C = self.cfg.d_model
        shape = (self.B, self.T, C)
        return (self.gpu.download(self.xL, np.float32, self.N * C).reshape(shape),
                self.gpu.download(self.xf, np.float32, self.N * C).reshape(shape))
