"""heal's and accept's GPU backend objects (`backend.Teacher`, `backend.Draft`; their numpy twins are
`refnet.RefTeacher` and `refnet.RefDraft`): the frozen trunk, resident or streamed layer by layer (`WgpuTeacher`,
over `stream.Trunk`), the draft trained alone (`WgpuDraft`, over `draft.DraftWork`), the draft's block input
rows built on the GPU (`DraftInput`), and the GPU memory plan of their jobs (`plan_trunk_job`, counted on a
`gpumem.DryGpu`).

The draft's input x = eh_proj·[enorm(E[t]); hnorm(h)] (`ddl_ref.mtp.step_input`) is built where its inputs
already are: h is the teacher's hidden rows after its forward (step 1) or the draft's own output rows after
its forward (steps 2..chain, heal's refresh), E the embedding the trunk holds; only the token ids and the row
mask go up and only x comes down, never the hidden rows (`WgpuTeacher.topk_rows`, `WgpuDraft.next_rows`).
accept's greedy chain keeps even x there (`WgpuTeacher.greedy_hidden`, `WgpuDraft.greedy_chain`): the rows
are copied into the draft's input on the GPU, each step's argmax ids into the next step's token buffer, and
only those ids come down.
Given the teacher, the draft's Net reads the trunk's embedding/head (`Net(shared=...)`, in the trunk's dtype)
instead of holding a second copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np

from ddl_ref import mtp as ref_mtp
from ddl_ref.blocks import head_name
from ddl_ref.config import ModelConfig
from ddl_wgpu.engine.draft import DraftWork
from ddl_wgpu.engine.layout import EMBED, F32
from ddl_wgpu.engine.net import Net
from ddl_wgpu.engine.step import draft_adamw
from ddl_wgpu.engine.stream import Trunk, WeightSource
from ddl_wgpu.engine.vocab import Vocab
from ddl_wgpu.ops import elementwise as k_elt
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.ops import mtp_input as k_mtp
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError

CHAIN_FLUSH = 16  # `WgpuDraft.loss_chains`: batches whose loss sums come down together


def pad_rows(a, B: int):
    """a (b, ...) -> (B, ...) with zero rows appended (a Work has a fixed batch)."""
    a = np.asarray(a)
    if a.shape[0] == B:
        return a
    if a.shape[0] > B:
        raise GpuError(f"a batch of {a.shape[0]} windows, this GPU work was built for {B}")
    return np.concatenate([a, np.zeros((B - a.shape[0], *a.shape[1:]), a.dtype)])


class DraftInput:
    """The draft's block input rows x = eh_proj·[enorm(E[t]); hnorm(h)] of B·T rows on the GPU: the gather of
    the tokens from `embed_net`'s embedding (f32 or f16, row chunks: `vocab.Vocab`), `ops.mtp_input` (both
    norms, the concatenation, the row mask), the projection on `matmul`. enorm, hnorm and eh_proj are uploaded
    once as float32 (frozen). The result is `ddl_ref.mtp.step_input`'s within float rounding (f64 sums aside,
    the same operations), on the table as `embed_net` stores it. After `gather_on_host` the rows E[t] are
    gathered on the host from the table's source instead (the same values: heal's draft phase, once the trunk's
    untied embedding is released)."""

    def __init__(self, gpu: Gpu, params: dict, cfg: ModelConfig, embed_net: Net):
        self.gpu, self.cfg, self.C = gpu, cfg, cfg.d_model
        norms = [np.asarray(params[n], np.float32).reshape(-1) for n in (ref_mtp.ENORM, ref_mtp.HNORM)]
        self.wn = gpu.upload(np.concatenate(norms), "mtp_norms")
        self.eh = gpu.upload(np.asarray(params[ref_mtp.EH_PROJ], np.float32), "mtp_eh_proj")
        self.vocab = Vocab(embed_net)
        self.table = None  # (WeightSource, dtype) of the embedding once it is gathered on the host
        self._bufs: dict = {}  # rows -> (tokens, valid, e, cat, x)
        self._calls: dict = {}  # (rows, T, hidden buffer, h_stride, h_offset, concat) -> (Call, hidden buffer)

    def gather_on_host(self, source, dtype: str) -> None:
        """From now on E[t] comes from `source` (a `stream.WeightSource`), converted to `dtype` as the GPU's
        table held it (`WeightSource.rows`), written into the rows' buffer by `upload`/`upload_tokens`: the
        table on the GPU can go."""
        self.table = (source, dtype)
        self._calls = {}  # they gather from the GPU's table

    def buffers(self, N: int):
        """(tokens u32, valid f32, e, cat, x) of N rows, allocated once per N."""
        if N not in self._bufs:
            g, C = self.gpu, self.C
            self._bufs[N] = (g.buffer(N * 4, label="mtp_tokens"), g.buffer(N * F32, label="mtp_valid"),
                             g.buffer(N * C * F32, label="mtp_e"), g.buffer(2 * N * C * F32, label="mtp_cat"),
                             g.buffer(N * C * F32, label="mtp_x"))  # fmt: skip
        return self._bufs[N]

    def call(self, N: int, T: int, hidden, h_stride: int | None = None, h_offset: int = 0,
             concat: str | None = None, split_k: int | None = None) -> Call:  # fmt: skip
        """The Call building N rows (windows of T) into `x` from the token and mask buffers (`buffers(N)`)
        and the hidden rows in `hidden` (windows of `h_stride` rows from `h_offset`); built once per key.
        `concat` overrides the model's MtpConfig.concat; `split_k` the projection's K slices (`ops.matmul`:
        1 for rows that must not depend on the number built at once)."""
        concat = concat or self.cfg.mtp.concat
        key = (N, T, id(hidden), h_stride, h_offset, concat, split_k)
        if key not in self._calls:
            g, C, cfg = self.gpu, self.C, self.cfg
            tok, val, e, cat, x = self.buffers(N)
            call = self.vocab.embed_forward(e, tok, N) if self.table is None else Call()
            call += k_mtp.mtp_input_rows(g, cat, e, hidden, self.wn, val, N, C, T, cfg.rms_eps, cfg.norm_style,
                                         concat, h_stride, h_offset)  # fmt: skip
            call += k_mm.matmul(g, x, cat, self.eh, N, C, 2 * C, trans_b=True, split_k=split_k)
            self._calls[key] = (call, hidden)  # the buffer kept alive while its id is a key
        return self._calls[key][0]

    def forget(self, hidden) -> None:
        """Drop the Calls built on a hidden-rows buffer (so it can be freed: the trunk's pass is over)."""
        self._calls = {k: v for k, v in self._calls.items() if v[1] is not hidden}

    def upload(self, tokens, valid) -> None:
        """tokens (B, T) int and valid (B, T) bool into the token and mask buffers of B·T rows."""
        self.upload_tokens(tokens)
        self.gpu.write(self.buffers(np.size(tokens))[1], np.asarray(valid, np.float32).reshape(-1))

    def upload_tokens(self, tokens) -> None:
        """tokens (B, T) int into the token buffer of B·T rows (and, gathered on the host, their rows E[t])."""
        tokens = np.clip(np.asarray(tokens), 0, self.cfg.vocab_size - 1).reshape(-1)
        tok, _val, e, _cat, _x = self.buffers(tokens.size)
        self.gpu.write(tok, tokens.astype(np.uint32))
        if self.table is not None:
            source, dtype = self.table
            self.gpu.write(e, source.rows(EMBED, tokens, dtype, self.C), via_host=True)

    def rows(self, tokens, valid, hidden, h_stride: int | None = None, h_offset: int = 0) -> np.ndarray:
        """tokens (B, T) int (row p's token), valid (B, T) bool, `hidden` a GPU buffer of windows of
        `h_stride` rows (default T) whose rows h_offset.. are the hidden rows -> x (B, T, C) float32."""
        B, T = np.shape(tokens)
        self.upload(tokens, valid)
        self.call(B * T, T, hidden, h_stride, h_offset).run(self.gpu)
        return self.gpu.read(self.buffers(B * T)[4], (B, T, self.C))


class WgpuTeacher:
    """The trunk on the GPU (`stream.Trunk`: its blocks' weights resident, or streamed layer by layer under a
    `gpumem.TrunkPlan`), run over blocks of `block` windows (the plan's, else `batch`): one forward per block,
    the next-token top-k from chunked logits, the draft's step-1 rows built from the hidden rows where they are
    (`topk_rows`), the hidden rows downloaded when asked (`topk_hidden`, `hidden_rows`). Frozen and
    forward-only; `dtype` "f16" stores its big matrices in f16 (`layout.F16_SUFFIXES`: about 2 bytes per
    parameter), which needs the adapter feature shader-f16. `net` answers as the trunk's Net (`TrunkWeights`):
    a draft given this teacher reads its resident embedding/head. `release()` frees the blocks' weights and the
    works once the trunk has run (heal's draft trains within the budget after it)."""

    def __init__(self, gpu: Gpu, params, cfg: ModelConfig, batch: int, dtype: str = "f32", plan=None,
                 source: WeightSource | None = None):  # fmt: skip
        self.trunk = Trunk(gpu, cfg, source or WeightSource(params), dtype,
                           streamed=plan is not None and plan.streamed)  # fmt: skip
        self.net, self.gpu = self.trunk.weights, gpu
        self.dtype, self.mtp, self.batch = dtype, cfg.mtp, batch
        self.block = self.B = plan.block if plan is not None else batch  # windows per pass over the layers
        self.input = DraftInput(gpu, params, cfg, self.net) if cfg.mtp is not None else None
        self._hid: dict = {}  # T -> a batch's hidden rows, copied out of a block for `DraftInput`

    def work(self, T: int):
        return self.trunk.work(self.block, T)

    def topk_hidden(self, ids_batch, k: int):
        ids = np.asarray(ids_batch)
        b, T = ids.shape
        work = self.work(T)
        top_ids, top_probs = work.topk(pad_rows(ids, self.block), k)
        pre, post = work.hidden()
        return top_ids[:b], top_probs[:b], pre[:b], post[:b]

    def topk_rows(self, ids_batch, lengths, k: int, mtp=None):
        """One forward of up to `block` windows -> (top_ids, top_probs, the draft's step-1 block input rows (b,
        T, C) float32). The rows are built on the GPU from the forward's hidden rows (`DraftInput`, `batch`
        windows at a time, the projection unsliced: rows independent of the block), which stay there. `mtp`
        overrides the model's MtpConfig (trunk_hidden, concat: accept's conventions)."""
        ids = np.asarray(ids_batch)
        b, T = ids.shape
        mtp = mtp or self.mtp
        work = self.work(T)
        top_ids, top_probs = work.topk(pad_rows(ids, self.block), k)
        hid = ref_mtp.pick_hidden(work.xL, work.xf, mtp.trunk_hidden)
        tok, valid = ref_mtp.shifted(ids, 1), ref_mtp.step_valid(lengths, T, 1)
        return top_ids[:b], top_probs[:b], self._rows(hid, tok, valid, mtp.concat)

    def _rows(self, hid, tok, valid, concat: str) -> np.ndarray:
        """The step-1 rows of the block's first len(tok) windows, `batch` windows at a time: each batch's
        hidden rows copied into a buffer of one batch, then `DraftInput` (its buffers are the draft's)."""
        b, T = tok.shape
        B, C, g = self.batch, self.input.C, self.gpu
        row = T * C * F32
        if T not in self._hid:
            self._hid[T] = g.buffer(B * row, label="batch_hidden")
        h = self._hid[T]
        out = np.empty((b, T, C), np.float32)
        for s in range(0, b, B):
            n = min(B, b - s)
            self.input.upload(pad_rows(tok[s : s + n], B), pad_rows(valid[s : s + n], B))
            rec = g.recorder()
            rec.copy(hid, s * row, h, 0, n * row)
            self.input.call(B * T, T, h, concat=concat, split_k=1).record(rec)
            rec.submit()
            out[s : s + n] = g.read(self.input.buffers(B * T)[4], (B, T, C))[:n]
        return out

    def greedy_hidden(self, ids_batch, which: str):
        """One forward of ids (b, T) -> (the trunk's greedy next token (b, T) int32, the GPU buffer of the
        hidden rows `which` ("pre_norm" or "post_norm") of all `block` windows (padded ones zero ids)). Only
        the argmax ids come down; the buffer holds the rows until this teacher's next forward of that T.
        `hidden_rows` downloads them when a host path needs them."""
        ids = np.asarray(ids_batch)
        b, T = ids.shape
        work = self.work(T)
        work.upload_ids(pad_rows(ids, self.block), None)
        call, ids_out, _probs = work._topk_call(1)
        rec = work.record_forward(self.gpu.recorder())
        call.record(rec)
        rec.submit()
        greedy = self.gpu.download(ids_out, np.uint32, work.N).reshape(self.block, T)[:b].astype(np.int32)
        return greedy, ref_mtp.pick_hidden(work.xL, work.xf, which)

    def hidden_rows(self, b: int, T: int):
        """The last forward's (pre, post) hidden rows of its first b windows of T, downloaded (b, T, C)."""
        pre, post = self.work(T).hidden()
        return pre[:b], post[:b]

    def release(self) -> None:
        """Free the blocks' weights, the works, the batch copies of hidden rows and an untied embedding (the
        trunk has run; the draft's input rows gather E[t] on the host after it); the final norm and head stay for
        the draft."""
        for h in self._hid.values():
            if self.input is not None:
                self.input.forget(h)
            self.gpu.release(h)
        self._hid = {}
        self.gpu.drop_scratch()  # the trunk's block sized them; the draft's works size their own
        self.trunk.release()
        w = self.trunk.weights
        if w.release_embedding() and self.input is not None:  # the draft's rows E[t] gathered on the host
            self.input.gather_on_host(w.source, w.wdtype(EMBED))


class WgpuDraft:
    """The draft block + its final norm on the GPU, as a one-layer model (`ddl_ref.mtp.draft_config`) whose
    first block reads the given input rows; the embedding/head is frozen: read from `teacher`'s Net when
    given (no copy; in the trunk's dtype), else loaded into the draft's own. Adam
    (`step.draft_adamw`) and the top-k KL's form (`kl_form`) as `refnet.RefDraft`; a non-finite step leaves
    weights and moments untouched (the AdamW kernel's skip)."""

    def __init__(self, gpu: Gpu, params: dict, cfg: ModelConfig, init: dict | None = None, batch: int = 4,
                 kl_form: str = "full", teacher: WgpuTeacher | None = None):  # fmt: skip
        self.cfg, self.B, self.kl_form = cfg, batch, kl_form
        src = init if init is not None else params
        n = len(ref_mtp.MTP_LAYER_PREFIX)
        self.names = {}  # one-layer name -> model.mtp.* name
        for name in ref_mtp.trained_names(params):
            local = "model.norm.weight" if name == ref_mtp.NORM else "model.layers.0." + name[n:]
            self.names[local] = name
        dp = {local: np.asarray(src[name], np.float32) for local, name in self.names.items()}
        frozen = (EMBED, head_name(cfg))  # the head is the embedding when tied
        shared = {name: teacher.net for name in frozen} if teacher is not None else {}
        # a teacher's released embedding (heal's draft phase) is left out: the draft's works never read it
        gone = teacher is not None and teacher.input is not None and teacher.input.table is not None
        if gone:
            frozen, shared = frozen[1:], {n: t for n, t in shared.items() if n != EMBED}
        for name in frozen:
            if name not in shared:
                dp[name] = params[name]
        # the frozen embedding/head gets no gradient or moment storage (the draft work never writes it)
        self.net = Net(gpu, ref_mtp.draft_config(cfg), dp, trainable=list(self.names), frozen_state=False,
                       shared=shared, names=(lambda n: n != EMBED) if gone else None)  # fmt: skip
        # each of the draft's works records and submits alone, and what it computes is read (or copied) before
        # another work runs: they share their activations (`Blocks.act`; at the Qwen3.8-27B shape a stacked
        # chain's last step, 3 x 512 rows, holds 1.3 GiB of them and each chunk of logits is 0.47 GiB)
        self.net.shared_acts = {}
        self.input = teacher.input if teacher is not None else DraftInput(gpu, params, cfg, self.net)
        self._works: dict = {}
        self._aside = None  # `using`: the trained weights aside, unless in the gradients (`_aside_arenas`)
        self._steps: dict = {}  # rows -> each chain step's input rows (`greedy_chain`, stacked)
        self._round: dict = {}  # rows -> `loss_chain`'s rounding of DraftInput's rows
        self._sum_buf = None  # `loss_chain`'s loss sums

    def prepare(self, T: int, k: int, chain: int, stacked: bool) -> None:
        """Allocate now all that heal's draft phase on windows of T tokens allocates, so that nothing after it
        does (`plan_trunk_job` counts it on a DryGpu, the same code): the works of its steps and evaluations
        (top-k width k) and of its refresh's and acceptance's forwards (width 1, with their top-1), with
        `stacked` those of chains 2..chain, largest first (their shared activations are sized by the first);
        the acceptance's input rows and, stacked, each chain step's; with chain > 1 where `using` puts the
        weights aside; the read-back staging of its largest download (the weights, `export` and `snapshot`,
        or a batch's rows)."""
        chains = range(2, chain + 1) if stacked else ()
        for S, j in sorted([(T, 0)] + [(j * T, j) for j in chains], reverse=True):
            self._work(S, k, j)
            self._work(S, 1, j)._topk_call(1)
        self.net.zero_grads_call()
        self.net.optimizer_call(draft_adamw(0.0, 1))  # its uniforms are rewritten by every step
        self.input.buffers(self.B * T)
        if stacked:
            self._step_rows(self.B * T, chain)
        if chain > 1:
            self._aside_arenas()
            self._round_call(self.B * T)
            self._sums(CHAIN_FLUSH * chain)
        rows = self.B * T * self.cfg.d_model * F32
        self.net.gpu.reserve_staging(max([b.size for b in self.net.p] + [rows, self.B * chain * T * 4]))

    def _work(self, T: int, k: int = 1, chain: int = 0, tail: bool = True) -> DraftWork:
        """The work of T rows per window (`chain`: stacked steps 1..chain), top-k width k; `tail`: a stacked
        step's MLP on its last step's rows alone (`DraftWork`), unless every row's output is wanted."""
        key = (T, k, chain, tail)
        if key not in self._works:
            self._works[key] = DraftWork(
                self.net, self.B, T, kl_k=k, chain=chain, kl_form=self.kl_form, tail=tail
            )
        return self._works[key]

    def _args(self, x_rows, teacher_ids, teacher_probs, weights, chain: int = 0):
        x, tid, tp, w = (pad_rows(a, self.B) for a in (np.asarray(x_rows, np.float32), teacher_ids,
                                                         np.asarray(teacher_probs, np.float32),
                                                         np.asarray(weights, np.float32)))  # fmt: skip
        return self._work(x.shape[1], tid.shape[-1], chain), (x, tid, tp, w)

    def step(self, x_rows, teacher_ids, teacher_probs, weights, lr, step, grad_scale, chain: int = 0):
        """Forward, backward and (when finite) one Adam update -> (loss, grad_norm, finite). Gradients are
        float32, so `grad_scale` (the reference's loss scale) is never needed here."""
        work, args = self._args(x_rows, teacher_ids, teacher_probs, weights, chain)
        r = work.step_rows(*args, update=draft_adamw(lr, step))
        return float(r.loss), float(r.grad_norm), bool(r.finite and math.isfinite(r.grad_norm))

    def grads(self) -> dict:
        """The last step's gradients of the trained tensors, by their model.mtp.* names (tests; until a `using`,
        which puts the weights aside there)."""
        g = self.net.grads()
        return {name: g[local] for local, name in self.names.items()}

    def loss_sum(self, x_rows, teacher_ids, teacher_probs, weights, chain: int = 0) -> float:
        work, args = self._args(x_rows, teacher_ids, teacher_probs, weights, chain)
        return work.loss_sum_rows(*args)

    def hidden_out(self, x_rows, chain: int = 0):
        x = np.asarray(x_rows, np.float32)
        b = x.shape[0]
        pre, post = self._work(x.shape[1], 1, chain, tail=False).forward_rows(pad_rows(x, self.B))
        return pre[:b], post[:b]

    def loss_sum_next(self, x_rows, teacher_ids, teacher_probs, weights, next_tokens, valid, chain: int = 0):
        """`loss_sum` and `next_rows` from one forward -> (loss sum, the next chain step's rows (b, T, C))."""
        work, args = self._args(x_rows, teacher_ids, teacher_probs, weights, chain)
        loss = work.loss_sum_rows(*args)  # its forward's output rows stay on the GPU
        return loss, self._rows(work, np.shape(x_rows)[0], next_tokens, valid)

    def loss_chain(self, x_rows, steps, stacked: bool) -> list[float]:
        """heal's held-out evaluation of one batch right after a refresh (`refnet.RefDraft.loss_chain`), its
        rows kept on the GPU: step 1 on x_rows (b, T, C); step j + 1's rows built there from step j's forward
        (`DraftInput`), rounded to float16 as heal's host cache would hold them (`ops.elementwise.round_f16`:
        the bits of `loss_sum_next` and the cache), and copied into step j + 1's input (`stacked`: after the
        rows of steps 1..j of each window, as `greedy_chain` lays them). steps[j − 1] = (teacher ids, teacher
        probs, weights, next) of step j, the first three as `loss_sum` takes them, next (tokens, valid) of
        step j + 1 (None at the last). Only the loss sums come down -> [loss sum of step j]."""
        return self.loss_chains([(x_rows, steps)], stacked)[0]

    def loss_chains(self, batches, stacked: bool) -> list[list[float]]:
        """`loss_chain` of each (x_rows, steps) of `batches` (an iterable, consumed as it goes) -> their sums. The
        host never waits between steps or batches: each step's loss sum is copied aside and the next step's or
        batch's uploads queue behind its submission, so the host prepares a batch while the GPU runs the one
        before; the sums come down every CHAIN_FLUSH batches (which bounds how far the host runs ahead) and at
        the end."""
        out, slot, depth, sums = [], 0, 0, None
        for x_rows, steps in batches:
            depth = len(steps)
            sums = self._sums(CHAIN_FLUSH * depth)
            self._record_chain(np.asarray(x_rows, np.float32), steps, stacked, sums, slot * depth)
            slot += 1
            if slot == CHAIN_FLUSH:
                out += self._download_sums(sums, slot, depth)
                slot = 0
        return out + (self._download_sums(sums, slot, depth) if slot else [])

    def _download_sums(self, sums, n: int, depth: int) -> list[list[float]]:
        v = self.net.gpu.download(sums, np.float32, n * depth).reshape(n, depth)
        return [[float(a) for a in r] for r in v]

    def _record_chain(self, x1, steps, stacked: bool, sums, at: int) -> None:
        """One batch's chain steps, each submitted alone (`loss_chains`); step j's loss sum into sums[at + j − 1]."""
        T = x1.shape[1]
        B, g, inp = self.B, self.net.gpu, self.input
        N = B * T
        x = inp.buffers(N)[4]
        held = self._step_rows(N, len(steps)) if stacked else []
        g.write(x, pad_rows(x1, B).reshape(-1), via_host=True)  # step 1's rows; each later step's built there
        for j, (tid, tp, w, nxt) in enumerate(steps, 1):
            sigma = j if stacked and j > 1 else 0
            S = sigma * T if sigma else T
            work = self._work(S, np.shape(tid)[-1], sigma)
            work.upload_teacher(*(pad_rows(a, B) for a in (tid, tp, w)))
            if nxt is not None:
                inp.upload(*(pad_rows(a, B) for a in nxt))
            rec = g.recorder()
            self._record_input(rec, work, j, T, held)
            work.record_forward(rec)
            work._record_head(rec, False)
            work._sum.record(rec)
            rec.copy(work.loss_acc, 0, sums, 4 * (at + j - 1), 4)
            if nxt is not None:  # the next step's rows from this forward's last T rows of each window
                inp.call(N, T, *work.out_rows(self.cfg.mtp.chain_hidden)).record(rec)
                self._round_call(N).record(rec)
            rec.submit()

    def _record_input(self, rec, work: DraftWork, j: int, T: int, held: list) -> None:
        """Step j's input rows into `work` from DraftInput's rows (this step's, windows of T): copied in, or
        with `held` (a stacked chain's rows of each step, `_step_rows`) kept as step j's and laid after the rows
        of steps 1..j − 1 of each window (`greedy_chain`, `loss_chains`)."""
        B, row, x, x_in = self.B, self.cfg.d_model * F32, self.input.buffers(self.B * T)[4], work.L[0]["x"]
        if not held:
            rec.copy(x, 0, x_in, 0, B * T * row)
            return
        S = work.T  # the stacked rows of a window: j·T, or T at step 1
        rec.copy(x, 0, held[j - 1], 0, B * T * row)
        for b in range(B):  # window b's rows of steps 1..j, one after the other
            for s in range(j):
                rec.copy(held[s], b * T * row, x_in, (b * S + s * T) * row, T * row)

    def _round_call(self, N: int) -> Call:
        """`round_f16` of DraftInput's N rows in place (`loss_chain`), built once per N."""
        if N not in self._round:
            self._round[N] = k_elt.round_f16(self.net.gpu, self.input.buffers(N)[4], N * self.cfg.d_model)
        return self._round[N]

    def _sums(self, n: int):
        """`loss_chains`'s buffer of n loss sums (CHAIN_FLUSH batches' chain steps), allocated once."""
        if self._sum_buf is None or self._sum_buf.size < 4 * n:
            self._sum_buf = self.net.gpu.buffer(4 * n, label="chain_loss_sums")
        return self._sum_buf

    def next_rows(self, x_rows, next_tokens, valid, chain: int = 0) -> np.ndarray:
        """The block input rows of the next chain step from this draft's forward of x_rows (with `chain`,
        the stacked output's last step), built on the GPU from the `chain_hidden` output rows (`DraftInput`):
        next_tokens (b, T) row p's token, valid (b, T) -> (b, T, C) float32."""
        x = np.asarray(x_rows, np.float32)
        b, S = x.shape[0], x.shape[1]
        work = self._work(S, 1, chain)
        work.forward(pad_rows(x, self.B))
        return self._rows(work, b, next_tokens, valid)

    def _rows(self, work, b: int, next_tokens, valid) -> np.ndarray:
        """The next chain step's rows from `work`'s last forward (`DraftWork.out_rows`: its last step's rows of
        each window)."""
        hid, stride, first = work.out_rows(self.cfg.mtp.chain_hidden)
        tok, val = pad_rows(next_tokens, self.B), pad_rows(valid, self.B)
        return self.input.rows(tok, val, hid, h_stride=stride, h_offset=first)[:b]

    def greedy(self, x_rows, chain: int = 0):
        """Forward only -> (argmax (b, T) int32, pre, post): one chained draft step (`accept`), any b; `chain`
        as in `hidden_out` (the stacked rows of steps 1..chain, every row's argmax and hiddens returned)."""
        x = np.asarray(x_rows, np.float32)
        work = self._work(x.shape[1], 1, chain, tail=False)
        out = []
        for s in range(0, x.shape[0], self.B):
            part = x[s : s + self.B]
            ids, _p = work.topk(pad_rows(part, self.B), 1)
            pre, post = work.hidden()
            n = part.shape[0]
            out.append((ids[:n, :, 0], pre[:n], post[:n]))
        return tuple(np.concatenate(parts) for parts in zip(*out, strict=True))

    def greedy_chain(self, hidden, tokens, valid, depth: int, stacked: bool = False, mtp=None,
                     rows=None) -> np.ndarray:  # fmt: skip
        """`accept.greedy_chain` with every row on the GPU: step 1's rows from `hidden` (a GPU buffer of
        this draft's batch of windows of T rows, e.g. `WgpuTeacher.greedy_hidden`'s) and `tokens` (b, T),
        masked by `valid` (b, T, the same mask every step); step j + 1's from step j's argmax ids (copied on
        the GPU into the token buffer) and its `chain_hidden` output rows. `stacked`: step σ >= 2 runs the
        stacked rows of steps 1..σ (each step's rows kept on the GPU, copied window by window into the
        chain-σ work's input) and reads its last T rows of each window. `mtp` overrides the model's
        MtpConfig (concat, chain_hidden). `rows` (b, T, C): step 1's rows given (heal's held-out windows, whose
        step-1 rows it holds), uploaded instead of built (`hidden` unused; `tokens` then only sizes the batch).
        Only the argmax ids come down -> preds (b, depth, T) int32."""
        mtp = mtp or self.cfg.mtp
        tokens = np.asarray(tokens)
        b, T = tokens.shape
        B, g, inp = self.B, self.net.gpu, self.input
        N = B * T
        inp.upload(pad_rows(tokens, B), pad_rows(valid, B))
        tok, _val, _e, _cat, x = inp.buffers(N)
        steps = self._step_rows(N, depth) if stacked else []
        preds, h, stride = [], hidden, T
        for j in range(1, depth + 1):
            sigma = j if stacked and j > 1 else 0
            S = sigma * T if sigma else T
            work = self._work(S, 1, sigma)
            rec = g.recorder()
            if j > 1 or rows is None:
                inp.call(N, T, h, stride, stride - T, mtp.concat).record(rec)
            else:
                g.write(x, pad_rows(np.asarray(rows, np.float32), B).reshape(-1), via_host=True)
            self._record_input(rec, work, j, T, steps)
            work.record_forward(rec)
            # the argmax ids, `width` per window: the head on each window's step-j rows alone (T, as tok lays
            # them), or on every row (S, each window's last T wanted)
            if sigma and work.last:
                ids_out, width = work.record_top1_last(rec), T
            else:
                top, ids_out, _probs = work._topk_call(1)
                top.record(rec)
                width = S
            if inp.table is None:  # the next step's tokens, this step's argmax ids, copied there
                if width == T:
                    rec.copy(ids_out, 0, tok, 0, N * 4)
                else:
                    for w in range(B):
                        rec.copy(ids_out, (w * S + S - T) * 4, tok, w * T * 4, T * 4)
            rec.submit()
            ids = g.download(ids_out, np.uint32, B * width).reshape(B, width)[:, width - T :]
            preds.append(ids[:b].astype(np.int32))
            if inp.table is not None and j < depth:  # ... or their rows gathered on the host
                inp.upload_tokens(ids)
            h, stride, _first = work.out_rows(mtp.chain_hidden)  # its last T rows of each window
        return np.stack(preds, axis=1)

    def _step_rows(self, N: int, depth: int) -> list:
        """`depth` buffers of N input rows (stacked chains keep every step's rows), allocated once."""
        have = self._steps.setdefault(N, [])
        while len(have) < depth:
            have.append(self.net.gpu.buffer(N * self.cfg.d_model * F32, label=f"chain_step{len(have) + 1}"))
        return have

    def snapshot(self) -> list:
        """The current weights in host memory (heal's best weights and its refresh's: a download per new best or
        per refresh, and the GPU holds no more copies of the draft): each parameter arena's bytes."""
        return [self.net.gpu.download(b, np.uint8) for b in self.net.p]

    def restore(self, snap) -> None:
        """The weights of a `snapshot` (host) or a `keep` (GPU) back in."""
        if snap and isinstance(snap[0], np.ndarray):
            for buf, data in zip(self.net.p, snap, strict=True):
                self.net.gpu.write(buf, data, via_host=True)
        else:
            self.net.restore(snap)

    def _aside_arenas(self) -> list:
        """Where `using` puts the trained weights aside: the gradient arenas when each is as large as its
        parameter arena (every step zeroes them before it writes them, so between steps they hold nothing;
        `grads` reads the last step's only until then), else a copy of its own, allocated once."""
        p, g = self.net.p, self.net.g
        if len(g) == len(p) and all(a.size >= b.size for a, b in zip(g, p, strict=True)):
            return g
        if self._aside is None:
            self._aside = [self.net.gpu.buffer(b.size, label="snapshot") for b in p]
        return self._aside

    def _copy_weights(self, src: list, dst: list) -> None:
        rec = self.net.gpu.recorder()
        for a, b, p in zip(src, dst, self.net.p, strict=True):
            rec.copy(a, 0, b, 0, p.size)
        rec.submit()

    @contextlib.contextmanager
    def using(self, snap):
        """Within the block the draft's forwards run on the weights `snap` (a `snapshot`; heal's lazy refresh):
        the trained weights are copied aside on the GPU (`_aside_arenas`), `snap` written in, and the trained
        weights copied back after it (the Adam moments are not touched)."""
        aside = self._aside_arenas()
        self._copy_weights(self.net.p, aside)
        self.restore(snap)
        try:
            yield
        finally:
            self._copy_weights(aside, self.net.p)

    def export(self) -> dict:
        p = self.net.export(self.names)  # the trained tensors only: not the shared embedding/head
        return {name: p[local].copy() for local, name in self.names.items()}


# ----------------------------------------------------------------------------------------------------------
# the memory plan of heal's and accept's trunk pass and of heal's draft (`gpumem`), counted on a DryGpu


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What `WgpuTeacher` reads of a plan."""

    streamed: bool
    block: int


def fake_params(cfg: ModelConfig) -> dict:
    """Every tensor of `cfg`'s table as a read-only broadcast of 0.0 (no memory): what a dry build reads."""
    from ddl_ref.params import param_table

    return {s.name: np.broadcast_to(np.float32(0), s.shape) for s in param_table(cfg)}


def plan_trunk_job(gpu: Gpu, job: str, cfg: ModelConfig, dtype: str, windows: int, T: int, batch: int,
                   budget: int | None, k: int = 1, rows: bool = True, draft: dict | None = None):  # fmt: skip
    """The `gpumem.TrunkPlan` of heal's (`draft`: {"k", "chain", "stacked", "kl_form"} of its draft) or accept's
    trunk pass over `windows` windows of T tokens: the teacher, its work for a block, its top-k of width k and
    (`rows`) the step-1 rows built `batch` windows at a time, counted by building them on a `gpumem.DryGpu`."""
    from ddl_wgpu.engine import gpumem

    params = fake_params(cfg)

    def teacher(dry, streamed: bool, block: int) -> WgpuTeacher:
        t = WgpuTeacher(dry, params, cfg, batch, dtype, plan=_Shape(streamed, block))
        t.work(T)._topk_call(k)
        down = block * T * k * F32  # the largest download: the block's top-k, or a batch's rows
        if rows and t.input is not None:
            t.input.buffers(batch * T)
            t._hid[T] = dry.buffer(batch * T * cfg.d_model * F32)
            down = max(down, batch * T * cfg.d_model * F32)
        dry.reserve_staging(down)
        return t

    def trunk_bytes(streamed: bool, block: int) -> int:
        return gpumem.dry_bytes(gpu, lambda dry: teacher(dry, streamed, block))

    def weight_bytes(streamed: bool) -> int:
        return gpumem.dry_bytes(gpu, lambda dry: Trunk(dry, cfg, None, dtype, streamed).weights)

    draft_bytes = 0
    if draft is not None:
        dry = gpumem.DryGpu(gpu)
        draft_phase(dry, cfg, dtype, batch, T, draft, params)
        draft_bytes = dry.peak
    return gpumem.plan_trunk(job, windows, T, budget, trunk_bytes, weight_bytes, draft_bytes, dtype=dtype)


def draft_phase(dry, cfg: ModelConfig, dtype: str, batch: int, T: int, draft: dict, params=None) -> WgpuDraft:
    """heal's draft phase built on `dry` (a `gpumem.DryGpu`) as heal builds it: what the trunk leaves after its
    release (the embedding, final norm and head, the draft's input projection), then the draft on it, prepared
    for windows of T tokens (`WgpuDraft.prepare`; `draft` as `plan_trunk_job`'s); `dry.peak` is then the
    phase's peak."""
    params = fake_params(cfg) if params is None else params
    t = WgpuTeacher(dry, params, cfg, batch, dtype, plan=_Shape(True, 1))
    t.input.buffers(batch * T)  # the trunk's pass made the step-1 rows' buffers; the draft's rows reuse them
    t.release()
    dry.peak = dry.live
    d = WgpuDraft(dry, params, cfg, None, batch, draft["kl_form"], t)
    d.prepare(T, draft["k"], draft["chain"], draft["stacked"])
    return d
