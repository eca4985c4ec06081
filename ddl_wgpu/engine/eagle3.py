"""EAGLE-3 drafts on the GPU (docs/eagle3.md#the-gpu-engine): the frozen target as the draft's teacher
(`WgpuEagle3Target`) and the draft trained by SpecForge's unrolled TTT loss (`WgpuEagle3Draft`), the twins of
`refnet.aux_logits` and `refnet.RefEagle3Draft` on `ddl_ref.eagle3`.

The teacher is heal's frozen trunk (`stream.Trunk`, resident or streamed layer by layer) run with taps: before
layer j of the aux layers runs, its input (the residual stream) is copied into one of three aux buffers (N, C)
(`Trunk.record_forward(tap=...)`). Its head gives the full-vocabulary top-1 (the trunk's own chunked head) and,
over the draft vocabulary, a head of the Vd gathered rows W_head[target_ids(d2t)] (built once, in the trunk's
dtype), the top-k of those logits with their softmax over the Vd columns (`ops.topk_kl.topk`): the top-k teacher
of `ddl_ref.eagle3.teacher_topk`. Only the top-k, the two top-1s and nothing of the aux rows come down.

The draft: one Llama layer whose TTT unroll runs as `ttt` steps of N = B·T rows each, every step with its own
activations (like the layers of a model sharing one set of weights). Two layouts differ from the reference's
tensors, both exact rewrites: fc (H, 3H) is held as three (H, H) blocks (the aux buffers are three, not one
interleaved (N, 3H)), and q/k/v_proj (·, 2H) as their embedding half and hidden half (x = [en; hn] is never
built: q = en·Wq_eᵀ + hn·Wq_hᵀ), so every product is a plain one of the existing kernels (`DraftParams` maps
the names both ways). Attention runs on stacked rows (B, ttt·T) where step i's rows of window b are
b·ttt·T + i·T + p, with the runtime's chain mask (`ops.attention.attention_masked_*`, W = T), which is exactly
`ddl_ref.eagle3.ttt_mask` (`ttt_mask` returns `ops.chain_mask`). Step i writes its rotated keys and values
into the stacks and its queries into an otherwise zero query stack, runs the masked attention over all stacked
rows and copies its own rows out: the other rows' outputs are discarded, and its rows see only steps <= i.
The backward recomputes that attention (the zero query rows give exact zero gradients, so the key and value
gradients of all later steps accumulate in two stacks) and reads its own rows back. Both pass the attention
step i's query rows [i·T, (i+1)·T) (`rows=`): the scores path then computes only those rows against keys
[0, (i+1)·T) (and zero key gradients past them), the values it would compute for them over all stacked rows;
the plain loops, where they run, compute every row. The products run once per step.

The loss is heal's top-k KL in its "full" form (`ops.topk_kl`): the student's log-softmax over all Vd columns
at the teacher's k ids, gradient q − p~ over the whole row: SpecForge's soft cross-entropy gradient with p~
truncated to the top k. Its value is the KL; the draft reports the cross-entropy (KL + the teacher rows'
entropy, added on the host in float64), the value `ddl_ref.eagle3.ttt_forward` reports. Steps are weighted
step_weight^i / (B·T) (a per-step scale buffer), rows by the in-draft flags shifted as the reference shifts
them. The gradient norm, clip and AdamW are `net.Net`'s over the draft's own parameter table.
"""

from __future__ import annotations

import math

import numpy as np

from ddl_ref import eagle3 as e3
from ddl_ref import ops as ref_ops
from ddl_ref.blocks import head_name
from ddl_ref.config import ModelConfig
from ddl_ref.params import ParamSpec
from ddl_wgpu.engine.layout import EMBED, F32
from ddl_wgpu.engine.net import Net
from ddl_wgpu.engine.step import AdamW, Eagle3Batch
from ddl_wgpu.engine.stream import Trunk, WeightSource
from ddl_wgpu.engine.vocab import Vocab, head_chunk_rows
from ddl_wgpu.ops import attention as k_attn
from ddl_wgpu.ops import elementwise as k_ew
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.ops import reduce as k_red
from ddl_wgpu.ops import rmsnorm as k_norm
from ddl_wgpu.ops import rope as k_rope
from ddl_wgpu.ops import swiglu as k_swiglu
from ddl_wgpu.ops import topk_kl as k_topk
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError

KMAX = k_topk.KMAX


def _pad(a, B: int):
    a = np.asarray(a)
    if a.shape[0] > B:
        raise GpuError(f"a batch of {a.shape[0]} windows, this GPU work was built for {B}")
    return a if a.shape[0] == B else np.concatenate([a, np.zeros((B - a.shape[0], *a.shape[1:]), a.dtype)])


def _ahead(a, j: int, fill=0):
    """a (B, T, ...) -> out[:, p] = a[:, p + j] for p < T − j, `fill` after (`ddl_ref.eagle3._ahead`)."""
    out = np.full_like(a, fill)
    if j < a.shape[1]:
        out[:, : a.shape[1] - j] = a[:, j:]
    return out


class GpuAux:
    """The target's aux rows on the GPU: three buffers (B·T, C), the residual stream at each aux layer's input,
    for a batch of B windows of T (valid until the target's next call)."""

    def __init__(self, bufs: list, B: int, T: int):
        self.bufs, self.B, self.T = bufs, B, T


# ----------------------------------------------------------------------------------------------------------
# the teacher


class WgpuEagle3Target:
    """The frozen target on the GPU as an EAGLE-3 teacher (module docstring): ids (b, T) -> `Eagle3Batch` with
    the aux rows kept on the GPU (`GpuAux`), the top-k over the draft vocabulary and the full top-1."""

    def __init__(self, gpu: Gpu, params, cfg: ModelConfig, aux_layers, d2t, k: int, batch: int,
                 dtype: str = "f32", streamed: bool = False, source: WeightSource | None = None):  # fmt: skip
        self.gpu, self.cfg, self.B = gpu, cfg, int(batch)
        self.aux_layers = tuple(int(j) for j in aux_layers)
        self.tids = e3.target_ids(d2t)
        self.Vd = self.tids.size
        if not 1 <= k <= min(KMAX, self.Vd):
            raise GpuError(f"teacher top-k {k} must be in [1, {min(KMAX, self.Vd)}] on the GPU")
        self.k = int(k)
        self.source = source or WeightSource(params)
        self.trunk = Trunk(gpu, cfg, self.source, dtype, streamed=streamed)
        self.net = self.trunk.weights
        # the draft-vocabulary head: the head's rows of the draft ids, as the trunk's table holds them
        hd = self.net.wdtype(head_name(cfg))
        self.hd_dtype = hd
        # a count (`plan_eagle3`): the buffer's size, not Vd gathered rows on the host
        if getattr(gpu, "dry", False):
            self.head_d = gpu.buffer(self.Vd * cfg.d_model * (2 if hd == "f16" else F32), "eagle3_draft_head")
        else:
            rows = self.source.rows(head_name(cfg), self.tids, hd, cfg.d_model)
            rows = rows.astype(np.float16 if hd == "f16" else np.float32)
            self.head_d = gpu.upload(rows, "eagle3_draft_head")
        self._per_T: dict = {}

    def _bufs(self, T: int):
        if T not in self._per_T:
            g, C, N = self.gpu, self.cfg.d_model, self.B * T
            work = self.trunk.work(self.B, T)
            aux = [g.buffer(N * C * F32, label=f"eagle3_aux{j}") for j in range(3)]
            chunk = min(N, head_chunk_rows(g, N, C, self.Vd))
            logits = g.buffer(chunk * self.Vd * F32, label="eagle3_teacher_logits")
            ids = g.buffer(N * self.k * 4, label="eagle3_teacher_ids")
            probs = g.buffer(N * self.k * F32, label="eagle3_teacher_probs")
            call = Call(scratch=logits)  # held: the bind groups alone would let the engine's count drop it
            for r0 in range(0, N, chunk):  # the draft-vocabulary head in row chunks, then its top-k
                n = min(chunk, N - r0)
                x = (work.xf, r0 * C * F32, n * C * F32)
                call += k_mm.matmul(g, logits, x, self.head_d, n, self.Vd, C, trans_b=True, b_dtype=self.hd_dtype,
                                    split_k=1)  # fmt: skip
                call += k_topk.topk(g, ids, probs, logits, n, self.Vd, self.k, row_offset=r0)
            self._per_T[T] = (work, aux, call, ids, probs)
        return self._per_T[T]

    def __call__(self, ids) -> Eagle3Batch:
        ids = np.asarray(ids)
        b, T = ids.shape
        work, aux, head_call, ids_buf, probs_buf = self._bufs(T)
        N, C = self.B * T, self.cfg.d_model
        work.upload_ids(_pad(ids, self.B), None)
        top1, top1_ids, _ = work._topk_call(1)

        def tap(i: int, rec) -> None:
            for j, layer in enumerate(self.aux_layers):
                if layer == i:  # the stream at layer i's input
                    rec.copy(work.L[i]["x"], 0, aux[j], 0, N * C * F32)

        rec = self.trunk.record_forward(work, self.gpu.recorder(), tap=tap)
        top1.record(rec)
        head_call.record(rec)
        rec.submit()
        g = self.gpu
        greedy = g.download(top1_ids, np.uint32, N).reshape(self.B, T).astype(np.int64)
        tid = g.download(ids_buf, np.uint32, N * self.k).reshape(self.B, T, self.k).astype(np.int64)
        tp = g.download(probs_buf, np.float32, N * self.k).reshape(self.B, T, self.k)
        in_draft = self.tids[tid[..., 0]] == greedy
        return Eagle3Batch(GpuAux(aux, self.B, T), greedy[:b], None, tid[:b], tp[:b], in_draft[:b])


# ----------------------------------------------------------------------------------------------------------
# the draft's parameters


class DraftParams:
    """The GPU's table of an EAGLE-3 draft and the map from/to the Hugging Face tensors (module docstring):
    fc as fc.0..2 (H, H), q/k/v_proj as .e (the embedding half) and .h (the hidden half)."""

    SPLIT2 = (e3.Q_PROJ, e3.K_PROJ, e3.V_PROJ)

    def __init__(self, cfg: e3.Eagle3Config):
        self.cfg = cfg
        self.table: list[ParamSpec] = []
        for name, (shape, _init) in e3.eagle3_params(cfg).items():
            if name == e3.FC:
                self.table += [ParamSpec(f"{name}.{j}", (shape[0], cfg.hidden), "zeros") for j in range(3)]
            elif name in self.SPLIT2:
                self.table += [ParamSpec(f"{name}.{h}", (shape[0], cfg.hidden), "zeros") for h in "eh"]
            else:
                self.table.append(ParamSpec(name, tuple(shape), "zeros"))
        self.names = [t.name for t in self.table]

    def split(self, params: dict) -> dict:
        H, out = self.cfg.hidden, {}

        # a dry build's broadcast zeros (`plan_eagle3`) stay views: a copy is what it avoids
        def cols(a, lo, hi):
            return a[:, lo:hi] if 0 in a.strides else np.ascontiguousarray(a[:, lo:hi])

        for name in e3.eagle3_params(self.cfg):
            a = np.asarray(params[name], np.float32)
            if name == e3.FC:
                for j in range(3):
                    out[f"{name}.{j}"] = cols(a, j * H, (j + 1) * H)
            elif name in self.SPLIT2:
                out[f"{name}.e"], out[f"{name}.h"] = cols(a, 0, H), cols(a, H, a.shape[1])
            else:
                out[name] = a
        return out

    def join(self, local: dict) -> dict:
        out = {}
        for name in e3.eagle3_params(self.cfg):
            if name == e3.FC:
                out[name] = np.concatenate([local[f"{name}.{j}"] for j in range(3)], axis=1)
            elif name in self.SPLIT2:
                out[name] = np.concatenate([local[f"{name}.e"], local[f"{name}.h"]], axis=1)
            else:
                out[name] = np.asarray(local[name])
        return out


# ----------------------------------------------------------------------------------------------------------
# the draft's work: activations and Calls of `steps` unrolled steps over B windows of T rows


class Eagle3Work:
    """The unrolled draft over B windows of T rows, `steps` deep (module docstring)."""

    def __init__(self, draft: WgpuEagle3Draft, B: int, T: int, steps: int):
        self.d, self.gpu, self.cfg = draft, draft.gpu, draft.cfg
        cfg, g = draft.cfg, draft.gpu
        self.B, self.T, self.steps = B, T, steps
        self.N = N = B * T
        C, H, K, D, F = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate
        self.S = steps * T  # stacked rows per window
        if draft.max_seq_len < T:
            raise GpuError(f"windows of {T} exceed the target's context {draft.max_seq_len}")
        act = lambda n, label: g.buffer(max(int(n), 1) * F32, label=label)  # noqa: E731
        self.tok = [g.buffer(N * 4, label=f"e3_tok{i}") for i in range(steps)]
        names = dict(e=N * C, en=N * C, ren=N, hn=N * C, rhn=N, q=N * H * D, k=N * K * D, v=N * K * D,
                     qr=N * H * D, kr=N * K * D, att=N * H * D, r=N * C, n2=N * C, rn2=N, gate=N * F, up=N * F,
                     s=N * F, pre=N * C, post=N * C, rpost=N)  # fmt: skip
        self.a = [{key: act(n, f"e3_{key}{i}") for key, n in names.items()} for i in range(steps)]
        self.h0 = act(N * C, "e3_h0")
        for i, a in enumerate(self.a):
            a["hid"] = self.h0 if i == 0 else self.a[i - 1]["pre"]
            cos, sin = ref_ops.rope_tables_at(e3.ttt_positions(i, T), D, cfg.rope_theta, np.float64)
            a["cos"] = g.upload(cos.astype(np.float32), f"e3_cos{i}")
            a["sin"] = g.upload(sin.astype(np.float32), f"e3_sin{i}")
        SQ, SK = B * self.S * H * D, B * self.S * K * D
        self.Qs, self.Os, self.dOs, self.dQs = (act(SQ, f"e3_{n}") for n in ("Qs", "Os", "dOs", "dQs"))
        self.Ks, self.Vs, self.dKs, self.dVs, self.dKacc, self.dVacc = (
            act(SK, f"e3_{n}") for n in ("Ks", "Vs", "dKs", "dVs", "dKacc", "dVacc"))  # fmt: skip
        self.lse = act(B * H * self.S, "e3_lse")
        self.delta = act(B * H * self.S, "e3_delta")
        # backward scratch
        self.dpost, self.dx, self.dnext, self.dn2, self.den, self.dhn, self.junk = (
            act(N * C, f"e3_{n}") for n in ("dpost", "dx", "dnext", "dn2", "den", "dhn", "junk"))  # fmt: skip
        self.ds, self.dgate, self.dup = (act(N * F, f"e3_{n}") for n in ("ds", "dgate", "dup"))
        self.datt, self.dq = act(N * H * D, "e3_datt"), act(N * H * D, "e3_dq")
        self.dk, self.dv = act(N * K * D, "e3_dk"), act(N * K * D, "e3_dv")
        # the loss: per step the teacher's top-k (k wide), the row weights and the step's gradient scale
        self.k = draft.k
        self.t_ids = [g.buffer(N * self.k * 4, label=f"e3_tids{i}") for i in range(steps)]
        self.t_probs = [act(N * self.k, f"e3_tprobs{i}") for i in range(steps)]
        self.w = [act(N, f"e3_w{i}") for i in range(steps)]
        self.scale = [
            g.upload(np.array([cfg.step_weight**i / N, 0, 0, 0], np.float32), f"e3_scale{i}")
            for i in range(steps)
        ]
        self.row_loss = act(N, "e3_row_loss")
        self.loss_acc = act(max(steps, 4), "e3_loss_acc")
        self.readback = g.buffer((max(steps, 4) + 4) * F32, label="e3_readback")
        Vd = cfg.draft_vocab
        self.chunk = min(N, head_chunk_rows(g, N, C, Vd))
        self.logits = act(self.chunk * Vd, "e3_logits")
        self.g_ids, self.g_probs = g.buffer(N * 4, label="e3_greedy_ids"), act(N, "e3_greedy_probs")
        self.partials = g.buffer(k_norm.rmsnorm_partials_size(N, C), label="e3_norm_partials")
        self._aux = None  # the aux buffers the Calls below are bound to (`set_aux`)
        self._fwd: list = []
        self._loss: dict = {}
        self._bwd: dict = {}
        self._greedy = [self.head_greedy(i) for i in range(steps)]

    def prepare(self, aux, train: bool = True) -> None:
        """Every Call `run` (with `train`, its backward and the optimizer's too) and `greedy` record, built now on
        `aux` (a `GpuAux`) rather than on first use: what they allocate as they are built (the device-wide
        attention and split-K scratch, the gradient norm's partials) is then allocated here, where
        `plan_eagle3` counts it."""
        self.set_aux(aux)
        if train:  # in `run`'s order: a scratch cache grown by a later Call leaves the earlier one's alive
            self.d.net.zero_grads_call()
            for i in reversed(range(self.steps)):
                self._head(i, True)
                self.step_backward(i)
            self.d.net.optimizer_call(self.d._hyper(0.0, 1))
        for i in range(self.steps):
            self._head(i, False)

    # -- ops by name -----------------------------------------------------------------------------------

    def P(self, name: str):
        return self.d.net.view(name)

    def G(self, name: str):
        return self.d.net.view(name, "g")

    def _mm(self, out, x, name: str, n_out: int, n_in: int, accumulate: bool = False) -> Call:
        """out (N, n_out) (+)= x (N, n_in) · W[name]ᵀ (K never sliced: a row's sums never depend on N)."""
        return k_mm.matmul(self.gpu, out, x, self.P(name), self.N, n_out, n_in, trans_b=True, accumulate=accumulate,
                           split_k=1)  # fmt: skip

    def _mm_back(self, dx, dout, x, name: str, n_out: int, n_in: int, accumulate_dx: bool = False) -> Call:
        """dx (+)= dout · W[name] (dx None: skipped); dW[name] += doutᵀ · x."""
        return k_mm.linear_backward(self.gpu, dx, self.G(name), dout, x, self.P(name), self.N, n_out, n_in,
                                    accumulate_dx=accumulate_dx, accumulate_dw=True)  # fmt: skip

    def _norm(self, out, rstd, x, name: str) -> Call:
        return k_norm.rmsnorm_forward(
            self.gpu, out, rstd, x, self.P(name), self.N, self.cfg.hidden, self.cfg.rms_eps
        )

    def _norm_back(self, dx, dout, x, rstd, name: str, accumulate_dx: bool = False) -> Call:
        return k_norm.rmsnorm_backward(self.gpu, dx, self.G(name), dout, x, self.P(name), rstd, self.N,
                                       self.cfg.hidden, accumulate_dx=accumulate_dx,
                                       partials=self.partials)  # fmt: skip

    def _rows(self, rec_or_call, src, dst, i: int, width: int, to_stack: bool):
        """Step i's rows between a step buffer (N, width) and a stack (B, S, width): one copy per window."""
        T, S, row = self.T, self.S, width * F32
        for b in range(self.B):
            a, s = b * T * row, (b * S + i * T) * row
            if to_stack:
                rec_or_call.copy(src, a, dst, s, T * row)
            else:
                rec_or_call.copy(src, s, dst, a, T * row)

    # -- forward ---------------------------------------------------------------------------------------

    def step_forward(self, i: int) -> list:
        """Step i's forward as a list of Calls and ("rows", ...) copies, in order (`_record`)."""
        cfg, g, a, N = self.cfg, self.gpu, self.a[i], self.N
        C, H, K, D, F = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate
        out: list = []
        call = self.d.vocab.embed_forward(a["e"], self.tok[i], N)
        call += self._norm(a["en"], a["ren"], a["e"], e3.IN_NORM)
        if i == 0:
            for j in range(3):
                call += self._mm(self.h0, self._aux[j], f"{e3.FC}.{j}", C, C, accumulate=j > 0)
        call += self._norm(a["hn"], a["rhn"], a["hid"], e3.HID_NORM)
        for t, proj, n in (("q", e3.Q_PROJ, H * D), ("k", e3.K_PROJ, K * D), ("v", e3.V_PROJ, K * D)):
            call += self._mm(a[t], a["en"], f"{proj}.e", n, C)
            call += self._mm(a[t], a["hn"], f"{proj}.h", n, C, accumulate=True)
        call += k_rope.rope_forward(g, a["qr"], a["q"], a["cos"], a["sin"], self.B, self.T, H, D)
        call += k_rope.rope_forward(g, a["kr"], a["k"], a["cos"], a["sin"], self.B, self.T, K, D)
        call += k_ew.fill(g, self.Qs, self.B * self.S * H * D, 0.0)
        out.append(call)
        out.append(("rows", a["qr"], self.Qs, i, H * D, True))
        out.append(("rows", a["kr"], self.Ks, i, K * D, True))
        out.append(("rows", a["v"], self.Vs, i, K * D, True))
        out.append(self._attend(i))
        out.append(("rows", self.Os, a["att"], i, H * D, False))
        call = k_ew.copy(g, a["r"], a["hn"] if cfg.norm_before_residual else a["hid"], N * C)
        call += self._mm(a["r"], a["att"], e3.O_PROJ, C, H * D, accumulate=True)
        call += self._norm(a["n2"], a["rn2"], a["r"], e3.POST_NORM)
        call += self._mm(a["gate"], a["n2"], e3.GATE, F, C)
        call += self._mm(a["up"], a["n2"], e3.UP, F, C)
        call += k_swiglu.swiglu_forward(g, a["s"], a["gate"], a["up"], N * F)
        call += k_ew.copy(g, a["pre"], a["r"], N * C)
        call += self._mm(a["pre"], a["s"], e3.DOWN, C, F, accumulate=True)
        call += self._norm(a["post"], a["rpost"], a["pre"], e3.NORM)
        out.append(call)
        return out

    def _rows_of(self, i: int) -> tuple[int, int]:
        """Step i's query rows within a window's stack: the only ones with non-zero queries (and gradients)."""
        return i * self.T, (i + 1) * self.T

    def _attend(self, i: int) -> Call:
        cfg = self.cfg
        return k_attn.attention_masked_forward(self.gpu, self.Os, self.lse, self.Qs, self.Ks, self.Vs, self.B, self.S,
                                               cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, self.T,
                                               rows=self._rows_of(i))  # fmt: skip

    def _head_chunks(self, i: int):
        """Step i's head in row chunks: (first row, rows, the chunk's post-norm rows, its logits view, the Call
        that fills the logits), the one place head_loss and head_greedy cut the rows."""
        g, C, Vd, a = self.gpu, self.cfg.hidden, self.cfg.draft_vocab, self.a[i]
        for r0 in range(0, self.N, self.chunk):
            n = min(self.chunk, self.N - r0)
            x = (a["post"], r0 * C * F32, n * C * F32)
            logits = (self.logits, 0, n * Vd * F32)
            yield (
                r0,
                n,
                x,
                logits,
                k_mm.matmul(g, logits, x, self.P(e3.HEAD), n, Vd, C, trans_b=True, split_k=1),
            )

    def head_loss(self, i: int, train: bool) -> Call:
        """Step i's head in row chunks: logits, the top-k KL in place (loss rows, and the gradient scaled by
        step_weight^i / N), with `train` the head's backward (dpost, dW_head); the step's loss sum into
        loss_acc[i]."""
        g, C, Vd = self.gpu, self.cfg.hidden, self.cfg.draft_vocab
        call = Call()
        for r0, n, x, logits, head in self._head_chunks(i):
            call += head
            call += k_topk.topk_kl(g, self.row_loss, logits, self.t_ids[i], self.t_probs[i], self.w[i], n, Vd,
                                   self.k, self.scale[i], row_offset=r0, form="full", grad=train)  # fmt: skip
            if train:
                dx = (self.dpost, r0 * C * F32, n * C * F32)
                call += k_mm.linear_backward(g, dx, self.G(e3.HEAD), logits, x, self.P(e3.HEAD), n, Vd, C,
                                             accumulate_dw=True)  # fmt: skip
        return call + k_red.sum_rows(g, self.loss_acc, self.row_loss, self.N, index=i)

    def head_greedy(self, i: int) -> Call:
        """Step i's draft argmax per row into g_ids (the top-1 of its logits over the draft vocabulary)."""
        g, Vd = self.gpu, self.cfg.draft_vocab
        call = Call()
        for r0, n, _x, logits, head in self._head_chunks(i):
            call += head
            call += k_topk.topk(g, self.g_ids, self.g_probs, logits, n, Vd, 1, row_offset=r0)
        return call

    # -- backward --------------------------------------------------------------------------------------

    def step_backward(self, i: int) -> list:
        """Step i's backward (after its head's, which wrote dpost); dnext holds d(step i's pre) from step
        i + 1 (when i + 1 < steps) and receives d(step i's hidden input)."""
        if i in self._bwd:
            return self._bwd[i]
        cfg, g, a, N = self.cfg, self.gpu, self.a[i], self.N
        C, H, K, D, F = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate
        last = i == self.steps - 1
        out: list = []
        call = self._norm_back(self.dx, self.dpost, a["pre"], a["rpost"], e3.NORM)
        if not last:
            call += k_ew.add_inplace(g, self.dx, self.dnext, N * C)
        call += self._mm_back(self.ds, self.dx, a["s"], e3.DOWN, C, F)
        call += k_swiglu.swiglu_backward(g, self.dgate, self.dup, self.ds, a["gate"], a["up"], N * F)
        call += self._mm_back(self.dn2, self.dgate, a["n2"], e3.GATE, F, C)
        call += self._mm_back(self.dn2, self.dup, a["n2"], e3.UP, F, C, accumulate_dx=True)
        call += self._norm_back(
            self.dx, self.dn2, a["r"], a["rn2"], e3.POST_NORM, accumulate_dx=True
        )  # dx: dr
        call += self._mm_back(self.datt, self.dx, a["att"], e3.O_PROJ, C, H * D)
        call += k_ew.fill(g, self.Qs, self.B * self.S * H * D, 0.0)
        call += k_ew.fill(g, self.dOs, self.B * self.S * H * D, 0.0)
        out.append(call)
        out.append(("rows", a["qr"], self.Qs, i, H * D, True))
        out.append(("rows", self.datt, self.dOs, i, H * D, True))
        call = self._attend(i)  # recomputed: the forward's rows of this step, bit for bit
        call += k_attn.attention_masked_backward(g, self.dQs, self.dKs, self.dVs, self.dOs, self.Os, self.lse, self.Qs,
                                                 self.Ks, self.Vs, self.B, self.S, H, K, D, self.T,
                                                 scratch=self.delta, rows=self._rows_of(i))  # fmt: skip
        call += k_ew.add_inplace(g, self.dKacc, self.dKs, self.B * self.S * K * D)
        call += k_ew.add_inplace(g, self.dVacc, self.dVs, self.B * self.S * K * D)
        out.append(call)
        out.append(("rows", self.dQs, self.dq, i, H * D, False))
        out.append(("rows", self.dKacc, self.dk, i, K * D, False))
        out.append(("rows", self.dVacc, self.dv, i, K * D, False))
        call = k_rope.rope_backward(g, self.dq, self.dq, a["cos"], a["sin"], self.B, self.T, H, D)
        call += k_rope.rope_backward(g, self.dk, self.dk, a["cos"], a["sin"], self.B, self.T, K, D)
        first = True
        for dt, proj, n in (
            (self.dq, e3.Q_PROJ, H * D),
            (self.dk, e3.K_PROJ, K * D),
            (self.dv, e3.V_PROJ, K * D),
        ):
            call += self._mm_back(self.den, dt, a["en"], f"{proj}.e", n, C, accumulate_dx=not first)
            call += self._mm_back(self.dhn, dt, a["hn"], f"{proj}.h", n, C, accumulate_dx=not first)
            first = False
        if cfg.norm_before_residual:
            call += k_ew.add_inplace(g, self.dhn, self.dx, N * C)
        call += self._norm_back(self.dnext, self.dhn, a["hid"], a["rhn"], e3.HID_NORM)
        if not cfg.norm_before_residual:
            call += k_ew.add_inplace(g, self.dnext, self.dx, N * C)
        call += self._norm_back(self.junk, self.den, a["e"], a["ren"], e3.IN_NORM)
        if i == 0:
            for j in range(3):
                call += self._mm_back(None, self.dnext, self._aux[j], f"{e3.FC}.{j}", C, C)
        out.append(call)
        self._bwd[i] = out
        return out

    # -- recording -------------------------------------------------------------------------------------

    def _record(self, rec, items) -> None:
        for it in items:
            if isinstance(it, tuple):
                _, src, dst, i, width, to_stack = it
                self._rows(rec, src, dst, i, width, to_stack)
            else:
                it.record(rec)

    def upload(self, batch: Eagle3Batch, ids, loss_mask, steps: int) -> list[float]:
        """The tokens of every step, and with a teacher its top-k, row weights and loss sums per step ->
        each step's entropy term (the teacher rows' weighted entropy / N, float64)."""
        g, N, k = self.gpu, self.N, self.k
        ids = _pad(np.asarray(ids, np.int64), self.B)
        for i in range(steps):
            g.write(self.tok[i], _ahead(ids, i + 1).astype(np.uint32).reshape(-1))
        if batch is None:
            return []
        mask = _pad(np.asarray(loss_mask), self.B)
        in_next = _ahead(_pad(np.asarray(batch.in_draft, bool), self.B), 1, fill=False)
        keep = in_next & (mask == 1)
        tid = _ahead(_pad(np.asarray(batch.top_ids, np.int64), self.B), 1)
        tp = _ahead(_pad(np.asarray(batch.top_probs, np.float32), self.B), 1)
        if tid.shape[-1] != k:
            raise GpuError(f"a teacher top-k of width {tid.shape[-1]}, this draft was built for {k}")
        ent = []
        for i in range(steps):
            w = _ahead(keep, i, fill=False).astype(np.float32)
            p = _ahead(tp, i).astype(np.float64)
            g.write(self.t_ids[i], _ahead(tid, i).astype(np.uint32).reshape(-1))
            g.write(self.t_probs[i], p.astype(np.float32).reshape(-1))
            g.write(self.w[i], w.reshape(-1))
            # the renormalised p~ the kernel uses (float64 here): its entropy turns the KL into the CE
            p = p.astype(np.float32).astype(np.float64)
            s = p.sum(axis=-1, keepdims=True)
            pn = np.divide(p, s, out=np.zeros_like(p), where=s > 0)
            plogp = np.where(pn > 0, pn * np.log(np.where(pn > 0, pn, 1.0)), 0.0).sum(axis=-1)
            ent.append(-float(np.sum(w * plogp)) / N)
        return ent

    def set_aux(self, aux) -> None:
        """The aux rows: a `GpuAux` of this batch shape (read where they are) or a host array (b, T, 3C),
        uploaded into the draft's own buffers. The Calls bind the aux buffers: built again on another set."""
        if isinstance(aux, GpuAux):
            if (aux.B, aux.T) != (self.B, self.T):
                raise GpuError(f"aux rows of {aux.B} x {aux.T}, this draft work is {self.B} x {self.T}")
            src = aux.bufs
        else:
            a = _pad(np.asarray(aux, np.float32), self.B)
            C = self.cfg.hidden
            src = self.d.own_aux(self.N)
            for j in range(3):
                self.gpu.write(src[j], np.ascontiguousarray(a[..., j * C : (j + 1) * C]).reshape(-1))
        if self._aux is not src:
            self._aux = src
            # built from the last step down: its attention binds the most keys, so the device-wide scores
            # scratch is sized once, not grown step by step (a replaced one stays bound by the earlier Calls)
            fwd = {i: self.step_forward(i) for i in reversed(range(self.steps))}
            self._fwd = [fwd[i] for i in range(self.steps)]
            self._bwd = {}

    def run(self, batch: Eagle3Batch, ids, loss_mask, update: AdamW | None) -> tuple[list[float], np.ndarray]:
        """Forward and loss of every step, with `update` the backward and AdamW, one submit -> (each step's
        loss, unweighted (the CE / N), the net's scalars (norm, clip, finite))."""
        self.set_aux(batch.aux)
        ent = self.upload(batch, ids, loss_mask, self.steps)
        g, net = self.gpu, self.d.net
        rec = g.recorder()
        if update is not None:
            net.zero_grads_call().record(rec)
            (k_ew.fill(g, self.dKacc, self.dKacc.size // F32, 0.0) + k_ew.fill(g, self.dVacc, self.dVacc.size // F32,
                                                                           0.0)).record(rec)  # fmt: skip
        for i in range(self.steps):
            self._record(rec, self._fwd[i])
        if update is None:
            for i in range(self.steps):
                self._head(i, False).record(rec)
        else:
            for i in reversed(range(self.steps)):
                self._head(i, True).record(rec)
                self._record(rec, self.step_backward(i))
            net.optimizer_call(update).record(rec)
        n = max(self.steps, 4)
        rec.copy(self.loss_acc, 0, self.readback, 0, n * F32)
        rec.copy(net.scalars, 0, self.readback, n * F32, 12)
        rec.submit()
        out = g.download(self.readback, np.float32, n + 3)
        losses = [float(out[i]) / self.N + ent[i] for i in range(self.steps)]
        return losses, out[n:]

    def _head(self, i: int, train: bool) -> Call:
        if (i, train) not in self._loss:
            self._loss[(i, train)] = self.head_loss(i, train)
        return self._loss[(i, train)]

    def greedy(self, aux, ids, depth: int, tmap) -> np.ndarray:
        """`ddl_ref.eagle3.ttt_greedy` on the GPU: step i's tokens are step i − 1's argmax (mapped to target
        ids on the host, one round trip a step) -> (B, depth, T) target ids."""
        self.set_aux(aux)
        g, N = self.gpu, self.N
        ids = _pad(np.asarray(ids, np.int64), self.B)
        g.write(self.tok[0], _ahead(ids, 1).astype(np.uint32).reshape(-1))
        out = []
        for i in range(depth):
            rec = g.recorder()
            self._record(rec, self._fwd[i])
            self._greedy[i].record(rec)
            rec.submit()
            d = g.download(self.g_ids, np.uint32, N).astype(np.int64).reshape(self.B, self.T)
            t = tmap[d]
            out.append(t)
            if i + 1 < depth:
                g.write(self.tok[i + 1], t.astype(np.uint32).reshape(-1))
        return np.stack(out, axis=1)


# ----------------------------------------------------------------------------------------------------------
# the draft


class WgpuEagle3Draft:
    """An EAGLE-3 draft on the GPU (`backend.Eagle3Trainee`; its numpy twin `refnet.RefEagle3Draft`): trained
    by the unrolled TTT loss on a top-k teacher (`Eagle3Work`), Adam (`adam` betas/eps, no weight decay, the
    gradient scaled to a global norm <= `clip`) over `net.Net`'s arenas of the draft's own table; the target's
    embedding read where the teacher keeps it (`target.net`, in the trunk's dtype)."""

    def __init__(self, target: WgpuEagle3Target, params: dict, cfg: e3.Eagle3Config, d2t, t2d, batch: int,
                 k: int, adam=(0.9, 0.999, 1e-8), clip: float = 0.5):  # fmt: skip
        self.gpu, self.cfg, self.B, self.k = target.gpu, cfg, int(batch), int(k)
        self.target = target
        self.d2t, self.t2d = np.asarray(d2t, np.int64), np.asarray(t2d, bool)
        self.tmap = e3.target_ids(self.d2t)
        self.adam, self.clip = tuple(adam), float(clip)
        self.max_seq_len = target.cfg.max_seq_len
        self.vocab = Vocab(target.net)
        if EMBED not in target.net.slots:
            raise GpuError("the target's embedding is not on the GPU")
        self.table = DraftParams(cfg)
        self.net = Net(
            self.gpu, target.cfg, self.table.split(params), trainable=self.table.names, table=self.table.table
        )
        self._own_aux = None
        self._works: dict = {}

    def own_aux(self, N: int) -> list:
        """Aux buffers of the draft's own, for host aux rows (tests)."""
        if self._own_aux is None or self._own_aux[0].size < N * self.cfg.hidden * F32:
            self._own_aux = [
                self.gpu.buffer(N * self.cfg.hidden * F32, label=f"e3_own_aux{j}") for j in range(3)
            ]
        return self._own_aux

    def work(self, T: int, steps: int) -> Eagle3Work:
        if (T, steps) not in self._works:
            self._works[(T, steps)] = Eagle3Work(self, self.B, T, steps)
        return self._works[(T, steps)]

    def _hyper(self, lr: float, step: int) -> AdamW:
        b1, b2, eps = self.adam
        return AdamW(lr=float(lr), step=int(step), beta1=b1, beta2=b2, eps=eps, weight_decay=0.0, grad_clip=self.clip,
                     grad_clip_mode="global")  # fmt: skip

    def _weighted(self, losses: list[float]) -> float:
        return float(sum(self.cfg.step_weight**i * v for i, v in enumerate(losses)))

    def step(self, batch: Eagle3Batch, ids, loss_mask, lr: float, step: int) -> tuple[float, float, bool]:
        """Forward, backward and (when finite) one AdamW update -> (loss, grad_norm, finite)."""
        T = np.shape(ids)[1]
        losses, scalars = self.work(T, self.cfg.ttt).run(batch, ids, loss_mask, self._hyper(lr, step))
        loss, norm = self._weighted(losses), float(scalars[0])
        finite = math.isfinite(loss) and math.isfinite(norm) and scalars[2] != 0
        return loss, norm, bool(finite)

    def losses(self, batch: Eagle3Batch, ids, loss_mask) -> tuple[float, list[float]]:
        T = np.shape(ids)[1]
        losses, _ = self.work(T, self.cfg.ttt).run(batch, ids, loss_mask, None)
        return self._weighted(losses), losses

    def greedy_chain(self, batch: Eagle3Batch, ids, depth: int) -> np.ndarray:
        b, T = np.shape(ids)
        work = self.work(T, max(self.cfg.ttt, int(depth)))
        return work.greedy(batch.aux, ids, int(depth), self.tmap)[:b]

    def grads(self) -> dict:
        """The last step's gradients by Hugging Face name (tests)."""
        return self.table.join(self.net.grads())

    def snapshot(self):
        return self.export()

    def restore(self, snap) -> None:
        self.net.load(self.table.split(snap), clear_state=False)

    def export(self) -> dict:
        return self.table.join(self.net.export())

    def moments(self) -> tuple[dict, dict]:
        m, v = self.net.moments()
        return self.table.join(m), self.table.join(v)

    def load_moments(self, m: dict, v: dict) -> None:
        self.net.load_moments(self.table.split(m), self.table.split(v))
