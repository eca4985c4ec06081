"""heal's draft on the GPU, trained alone: `DraftWork`.

The MTP draft's block and final norm are healed as a one-layer model (`ddl_ref.mtp.draft_config`) whose
first block reads uploaded input rows (the draft's block input eh_proj·[enorm(e); hnorm(h)], built on the
GPU by `heal_gpu.DraftInput`) instead of an embedding, and whose loss is the top-k KL to a teacher's top-k (`ops.topk_kl`, in row
chunks of logits like the cross-entropy). Nothing flows into the embedding; the shared head is frozen unless
trainable.

Chain attention (`chain=j`): the seq rows are the stacked rows of chain steps 1..j of each window (row
(σ−1)·W + p, seq = j·W); attention uses the runtime's diagonal mask (`ops.attention.attention_masked_*`,
`ddl_ref.ops.chain_mask`) and RoPE the positions p + σ − 1. Only step j's rows (the last W of each window)
carry the loss, so the head (the largest product at a wide vocabulary) runs on those alone: they are copied
into rows of their own, one window after another (whole tiles for the head's product), the teacher's top-k
and weights of those rows alone go up, and the head's gradient is copied back into them, the rows of steps < j
getting 0 (what their weight of 0 gave them when the head ran on every row, at j times the cost). A frozen
head only: a trained one keeps every row.

The block's tail (`tail`, the default with such a head): the rows of steps < j feed only the attention (as
keys and values of step j's rows); nothing reads their outputs. So the attention sublayer runs on every row,
then step j's rows of its output are copied into rows of their own and the MLP sublayer and the final norm run
on those alone (`ddl_ref.blocks.block_forward`'s tail). In the backward their gradient is copied back into
the rows of every step, the others' 0, and the attention sublayer's backward runs on every row. At chain 3
this is 2/3 fewer rows through the MLP, most of the block's products. `out_rows` says where a forward's rows
of step j lie; `tail=False` keeps every row's output (`WgpuDraft.greedy`, `hidden_out`).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ddl_ref import mtp as ref_mtp
from ddl_ref import ops as ref_ops
from ddl_wgpu.engine.blocks import Blocks
from ddl_wgpu.engine.layout import F32
from ddl_wgpu.engine.step import AdamW, StepResult
from ddl_wgpu.ops import attention as k_attn
from ddl_wgpu.ops import elementwise as k_elt
from ddl_wgpu.ops import reduce as k_red
from ddl_wgpu.ops import topk_kl as k_topk
from ddl_wgpu.runtime.gpu import Call, GpuError


class DraftWork(Blocks):
    """A one-layer baseline model on input rows (B, T, C), its loss the top-k KL (width `kl_k`, form
    `kl_form`: "full" or "topk", `ops.topk_kl`) to a teacher's top-k; `chain` = j >= 1 stacks chain steps
    1..j (module docstring)."""

    def __init__(self, net, batch: int, seq: int, kl_k: int, chain: int = 0, chunk_rows: int | None = None,
                 kl_form: str = "full", tail: bool = True):  # fmt: skip
        cfg = net.cfg
        if kl_form not in k_topk.FORMS:
            raise GpuError(f"kl form must be one of {list(k_topk.FORMS)}, got {kl_form!r}")
        if chain and (chain < 1 or seq % chain):
            raise GpuError(f"chain={chain} needs {seq} rows of whole chain windows")
        if net.inference:
            raise GpuError("a draft work trains: it needs a Net with gradients (not inference-only)")
        if cfg.residual != "add" or kl_k < 1 or cfg.mtp is not None:
            raise GpuError("a draft work needs a baseline model without a draft and a top-k width kl_k >= 1")
        self.chain, self.kl_k, self.kl_form = int(chain), int(kl_k), kl_form
        # the rows the head runs on per window: step j's alone in a stacked chain (a frozen head); with `tail`
        # the MLP sublayer and the final norm too (`mlp_rows`, read while the blocks' buffers are built)
        head_trained = net.head_name in net.trainable
        self.last = seq // chain if chain > 1 and not head_trained else 0
        self.tail = bool(tail and self.last)
        super().__init__(net, batch, seq, chunk_rows, span=seq // chain if chain else seq)
        N = self.N
        self.init_backward_scratch()
        self.weights = self.act(N, "weights")
        self.scale = self.act(4, "loss_scale")
        self.t_ids = self.act(N * self.kl_k, "teacher_ids")  # u32, as wide as f32
        self.t_probs = self.act(N * self.kl_k, "teacher_probs")
        xf, dxf, rows = self.xf, self.dxf, None
        # the head's own rows (`_record_head`): each window's step-j rows, (offset in xf, offset there) in bytes
        self._runs, self._run_bytes = [], self.last * self.C * F32
        if self.last:
            rows = self.B * self.last
            xf, dxf = self.act(rows * self.C, "xf_last"), self.act(rows * self.C, "dxf_last")
            self._runs = [((b * self.T + self.T - self.last) * self.C * F32, b * self._run_bytes)
                          for b in range(self.B)]  # fmt: skip
            self._zero_dxf = k_elt.fill(self.gpu, self.dxf, N * self.C)  # shared with the other works
            if self.tail:
                self._build_tail(rows, xf, dxf)
            # accept's greedy chain: the top-1 of those rows (built now: heal's plan counts it)
            ids, probs = self.act(rows, "top1_last"), self.act(rows, "top1_last_probs")

            def top1(logits, n: int, r0: int) -> Call:
                return self._select(ids, probs, logits, n, 1, r0)

            self._top1_last = (self.head_calls(xf, top1, rows=rows), ids)
        self._xf_rows, self._dxf_rows = xf, dxf
        self._head_eval = self.head_calls(xf, functools.partial(self._topk_kl, grad=False), rows=rows)
        self._head_train = self.head_calls(xf, self._topk_kl, dxf, head_trained, rows=rows)
        self._sum = k_red.sum_rows(self.gpu, self.loss_acc, self.row_loss, rows or N)
        # the copies around the head: none with the tail, whose final norm writes the head's rows itself
        self._head_runs = [] if self.tail else self._runs
        if not self.tail:
            self._fwd = self.blocks_forward() + self.final_norm_forward()
            self._bwd = self.backward_calls()

    def mlp_rows(self) -> int:
        return self.B * self.last if self.tail else self.N

    def _build_tail(self, rows: int, xf, dxf) -> None:
        """The forward and backward of a stacked chain step with the tail (module docstring): `_fwd` the attention
        sublayer on every row, `_fwd_tail` the MLP sublayer and the final norm on the `rows` rows of step j
        (into xf, the head's rows), `_bwd_tail` their backward (from dxf, the head's gradient, into `dx`'s first
        rows), `_bwd` the attention sublayer's (from `dxf`, every row)."""
        a, p, C = self.L[0], "model.layers.0.", self.C
        # the MLP's buffers in `a` have `rows` rows (`mlp_rows`); its input state is step j's rows of a["xm"]
        self._t = dict(a, xm=self.act(rows * C, "xm_last"))
        self.x_tail, self.rf_tail = self.act(rows * C, "x_final_last"), self.act(rows, "rstd_final_last")
        norm = "model.norm.weight"
        self._fwd = self._add_sublayer("attn", a, p, a["xm"])
        self._fwd_tail = self._add_sublayer("mlp", self._t, p, self.x_tail, rows)
        self._fwd_tail += self._norm(xf, self.rf_tail, self.x_tail, norm, rows)
        self._bwd_tail = self._norm_backward(self.dx, dxf, self.x_tail, norm, self.rf_tail, rows)
        self._bwd_tail += self._add_sublayer_backward("mlp", self._t, p, self.dx, rows)
        self._bwd = self._add_sublayer_backward("attn", a, p, self.dxf)

    def _rope_tables(self):
        """Stacked chain steps: row (σ−1)·W + p sits at position p + σ − 1. The tables have the rotated width
        (`cfg.rope_dim`, as the causal tables of `Blocks`): a partial-RoPE draft (Qwen3.5's) rotates only its
        first rope_dim dims, with the frequencies of a head of that width."""
        if not self.chain:
            return super()._rope_tables()
        positions = ref_ops.chain_positions(self.chain, self.T // self.chain)
        cfg = self.cfg
        return ref_ops.rope_tables_at(positions, cfg.head_dim, cfg.rope_theta, np.float64, cfg.rope_dim)

    def attend(self, a: dict) -> Call:
        """Causal attention, or with `chain` the runtime's diagonal mask over windows of T / chain rows."""
        if not self.chain:
            return super().attend(a)
        q, k = self._qk_final(a, "q"), self._qk_final(a, "k")
        W = self.T // self.chain
        return k_attn.attention_masked_forward(self.gpu, a["a"], a["lse"], q, k, a["v"], *self.heads, W)

    def attend_backward(self, a: dict) -> Call:
        if not self.chain:
            return super().attend_backward(a)
        q, k = self._qk_final(a, "q"), self._qk_final(a, "k")
        W = self.T // self.chain
        grads = (self.dq[0], self.dk[0], self.dv_)
        return k_attn.attention_masked_backward(self.gpu, *grads, self.da, a["a"], a["lse"], q, k, a["v"],
                                                *self.heads, W)  # fmt: skip

    def _topk_kl(self, logits, n: int, r0: int, grad: bool = True) -> Call:
        """The top-k KL of one chunk of logits to the teacher's top-k, with `grad` its gradient in place (an
        evaluation reads the chunk once and writes nothing into it)."""
        return k_topk.topk_kl(self.gpu, self.row_loss, logits, self.t_ids, self.t_probs, self.weights, n,
                              self.cfg.vocab_size, self.kl_k, self.scale, row_offset=r0, form=self.kl_form,
                              grad=grad)  # fmt: skip

    def backward_calls(self) -> Call:
        """final norm -> blocks; the rows came from outside: nothing flows into the embedding."""
        call = self.final_norm_backward(self.dx)
        c, _ = self.blocks_backward(self.dx)
        return call + c

    # -- per-step host data -----------------------------------------------------------------------------

    def upload_rows(self, x, teacher_ids=None, teacher_probs=None, weights=None) -> float:
        """x (B, T, C) into the first block's input; with a teacher, its top-k and the row weights (the loss
        scale is 1 / their sum), of the rows the head runs on (`last`: the last rows of each window; the
        others' weights must be 0). -> the sum of the weights."""
        x = np.asarray(x, np.float32)
        if x.shape != (self.B, self.T, self.C):
            raise GpuError(
                f"input rows of shape {x.shape}, this Work was built for {(self.B, self.T, self.C)}"
            )
        self.gpu.write(self.L[0]["x"], x.reshape(-1), via_host=True)  # 10-31 MB a step at the 27B
        if teacher_ids is None:
            return 0.0
        return self.upload_teacher(teacher_ids, teacher_probs, weights)

    def upload_teacher(self, teacher_ids, teacher_probs, weights) -> float:
        """The teacher's top-k and the row weights alone (`upload_rows`; input rows already on the GPU, as in
        `heal_gpu.WgpuDraft.loss_chain`) -> the sum of the weights."""
        g, N, k = self.gpu, self.N, self.kl_k
        tid = np.asarray(teacher_ids).reshape(N, -1)
        if tid.shape[1] != k:
            raise GpuError(f"teacher top-k of width {tid.shape[1]}, this Work was built for {k}")
        w = np.asarray(weights, np.float32).reshape(N)
        count = float(w.sum())
        if self.last:  # step j's rows of each window, one window after another
            keep = np.arange(N).reshape(self.B, self.T)[:, self.T - self.last :].reshape(-1)
            if float(w[keep].sum()) != count:
                raise GpuError("a stacked chain step's rows before its last step must be weighted 0")
            tid, teacher_probs, w = tid[keep], np.asarray(teacher_probs).reshape(N, -1)[keep], w[keep]
        g.write(self.t_ids, np.clip(tid, 0, self.cfg.vocab_size - 1).astype(np.uint32).reshape(-1))
        g.write(self.t_probs, np.asarray(teacher_probs, np.float32).reshape(-1))
        g.write(self.weights, w)
        g.write(self.scale, np.array([1.0 / max(count, 1.0)], np.float32))
        return count

    # -- steps and evaluation ---------------------------------------------------------------------------

    def record_forward(self, rec):
        """The forward of the uploaded rows into `rec` (with `tail`: the attention on every row, step j's rows of
        its output gathered, the MLP and the final norm on those) -> rec."""
        self._fwd.record(rec)
        if self.tail:
            for at, to in self._runs:
                rec.copy(self.L[0]["xm"], at, self._t["xm"], to, self._run_bytes)
            self._fwd_tail.record(rec)
        return rec

    def _record_backward(self, rec) -> None:
        """The backward after the head's (with `tail`: the MLP's and the final norm's on step j's rows, their
        gradient copied into those rows of a zeroed gradient of every row, then the attention's)."""
        if self.tail:
            self._bwd_tail.record(rec)
            self._zero_dxf.record(rec)
            for at, to in self._runs:
                rec.copy(self.dx, to, self.dxf, at, self._run_bytes)
        self._bwd.record(rec)

    def out_rows(self, which: str) -> tuple:
        """Where the last forward left its output rows `which` ("pre_norm" or "post_norm") of each window's last
        chain step: (buffer, rows per window there, the first of those rows): every row's (xL or xf), or with
        `tail` step j's alone (the tail's output or the head's rows)."""
        if self.tail:
            return ref_mtp.pick_hidden(self.x_tail, self._xf_rows, which), self.last, 0
        step = self.T // self.chain if self.chain else self.T
        return ref_mtp.pick_hidden(self.xL, self.xf, which), self.T, self.T - step

    def _gather(self, rec) -> None:
        """Step j's rows of each window into the head's rows (`last` without `tail`; nothing else)."""
        for at, to in self._head_runs:
            rec.copy(self.xf, at, self._xf_rows, to, self._run_bytes)

    def _record_head(self, rec, train: bool) -> None:
        """The head and its loss (and with `train` its backward into dxf), on step j's rows alone where `last`:
        copied into the head's rows first, its gradient copied back after (dxf zeroed, so the rows of steps
        < j get 0)."""
        self._gather(rec)
        (self._head_train if train else self._head_eval).record(rec)
        if self._head_runs and train:
            self._zero_dxf.record(rec)
            for at, to in self._head_runs:
                rec.copy(self._dxf_rows, to, self.dxf, at, self._run_bytes)

    def record_top1_last(self, rec):
        """After a forward: each window's step-j rows' argmax over the vocabulary (the head on those rows alone,
        `last`) -> the ids buffer, (B, last) u32 one window after another."""
        call, ids = self._top1_last
        self._gather(rec)
        call.record(rec)
        return ids

    def record_step(self, rec, update: AdamW | None = None) -> None:
        """One training step's work into `rec` (the inputs uploaded): zeroed gradients, forward, head and
        top-k KL, the loss sum, backward, and with `update` the clip and AdamW."""
        self.net.zero_grads_call().record(rec)
        self.record_forward(rec)
        self._record_head(rec, True)
        self._sum.record(rec)
        self._record_backward(rec)
        if update is not None:
            self.net.optimizer_call(update).record(rec)

    def step_rows(self, x, teacher_ids, teacher_probs, weights, update: AdamW | None = None) -> StepResult:
        """x (B, T, C) block input rows; teacher top-k ids/probs (B, T, k); weights (B, T) 0/1. Forward,
        top-k KL (mean over weighted rows), backward, and with `update` the clip and AdamW; one submit."""
        count = self.upload_rows(x, teacher_ids, teacher_probs, weights)
        rec = self.gpu.recorder()
        self.record_step(rec, update)
        out = self.finish(rec, update is not None)
        loss = float(out[0]) / max(count, 1.0)
        finite = bool(np.isfinite(loss)) and (update is None or out[3] != 0)
        norm = float(out[1]) if update is not None else math.nan
        return StepResult(loss=loss, count=int(count), grad_norm=norm, finite=finite)

    def loss_sum_rows(self, x, teacher_ids, teacher_probs, weights) -> float:
        """Sum over rows of weight · top-k KL (evaluation; no gradients)."""
        self.upload_rows(x, teacher_ids, teacher_probs, weights)
        rec = self.record_forward(self.gpu.recorder())
        self._record_head(rec, False)
        self._sum.record(rec)
        return float(self.finish(rec, False)[0])

    def forward(self, x) -> None:
        """Forward of input rows x (B, T, C); its output rows stay on the GPU (`out_rows`)."""
        self.upload_rows(x)
        self.record_forward(self.gpu.recorder()).submit()

    def _every_row(self) -> None:
        if self.tail:
            raise GpuError(
                "this draft work runs its MLP on a chain's last step's rows alone: build it with tail=False"
            )

    def forward_rows(self, x) -> tuple[np.ndarray, np.ndarray]:
        """Forward of input rows x (B, T, C) -> the block's (output, final-normed output), each (B, T, C)."""
        self._every_row()
        self.upload_rows(x)
        self.record_forward(self.gpu.recorder()).submit()
        return self.hidden()

    def topk(self, x, k: int) -> tuple[np.ndarray, np.ndarray]:
        """One forward of input rows x (B, T, C), then per row the top-k next tokens (`Blocks.run_topk`)."""
        self._every_row()
        self.upload_rows(x)
        return self.run_topk(self._fwd, min(int(k), self.cfg.vocab_size))
