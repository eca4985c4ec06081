"""generate's GPU engine speculating with an EAGLE-3 draft (docs/eagle3.md#generate-on-the-gpu): the twin of
`refnet.RefEagle3Engine` on the decoder's pieces.

The trunk is `decode.WgpuEngine`'s (its cache, its one-token steps run ahead, its verify pass), with one
addition: every trunk pass stores the residual stream at the input of each aux layer into an aux cache by
position (`AuxTrunkRows`: a `store_rows` at the cache's start before the layer's block), so the draft's step-1
rows never leave the GPU, and rows fed past a roll-back are simply written again.

The draft runs as its training runs (`eagle3.Eagle3Work`, one window of the cache's capacity, `depth` unrolled
steps): `ddl_ref.eagle3.propose` is row n − 1 of the TTT unroll (docs/eagle3.md#training-the-ttt-unroll), so a
round writes the tokens x_1..x_n (x_n the next, not yet fed token) into step 0's token row, and step i's row
n − 1 gives the draft of x_{n+i+1}: its post-norm row is copied to a one-row head (the draft vocabulary's
logits, read back), the host takes the argmax (or the sampler's pick) and maps it to a target id, and writes it
into step i + 1's token at row n − 1. The rows after n − 1 hold what earlier rounds left; no row at or before
n − 1 reads them (the unroll's mask: step 0 is causal, step i reads steps 1..i at its own row only).

What this costs: every draft step recomputes the draft over the whole window (the capacity's rows, not the
catch-up rows and one chain row that a cached draft pass would: `refnet.RefEagle3Engine` keeps the draft's
keys and values; a GPU twin needs a cached pass of the draft layer, 2H-wide q/k/v and fc, which is not written),
and each step is a submit with a read-back of Vd logits. The text is the trunk's: greedy output equals plain
greedy decoding whatever the draft proposes.
"""

from __future__ import annotations

import types

import numpy as np

from ddl_ref import eagle3 as e3
from ddl_wgpu.engine.decode import TrunkRows, WgpuEngine
from ddl_wgpu.engine.eagle3 import GpuAux, WgpuEagle3Draft
from ddl_wgpu.engine.layout import F32
from ddl_wgpu.ops import decode as k_dec
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError


class AuxTrunkRows(TrunkRows):
    """`TrunkRows` that store the stream at each aux layer's input into `aux[j]` at the cache's start."""

    def __init__(self, net, cache, n: int, prefill: bool, aux_layers, aux):
        self.aux_layers, self.aux = tuple(aux_layers), aux  # read by block_forward, which the init builds
        super().__init__(net, cache, n, prefill)

    def block_forward(self, a: dict, out, p: str, ddl: bool) -> Call:
        call = Call()
        for j, layer in enumerate(self.aux_layers):
            if p == f"model.layers.{layer}.":  # a["x"] is the stream entering this block
                call += k_dec.store_rows(self.gpu, self.aux[j], a["x"], self.cache.meta, self.N, self.C)
        return call + super().block_forward(a, out, p, ddl)


class WgpuEagle3Engine(WgpuEngine):
    """`backend.Engine` on the GPU with an EAGLE-3 draft (`files.eagle3file.Eagle3Draft`, its aux ids those it
    reads on this model), drafting `depth` deep (module docstring)."""

    def __init__(self, gpu: Gpu, model, draft, depth: int, dtype: str = "f32", capacity: int | None = None):
        cfg = model.cfg
        if cfg.residual == "delta" and cfg.ddl_dv > 1:
            raise GpuError(
                f"a d_v = {cfg.ddl_dv} Deep Delta trunk has no residual stream of vectors to draft from"
            )
        if draft.cfg.hidden != cfg.d_model or draft.cfg.vocab != cfg.vocab_size:
            raise GpuError("the EAGLE-3 draft's width or vocabulary is not the model's")
        if not all(1 <= j < cfg.n_layers for j in draft.cfg.aux_layers):
            raise GpuError(f"aux layers {list(draft.cfg.aux_layers)} are not layer inputs of a {cfg.n_layers}-layer "
                           "model")  # fmt: skip
        cap = cfg.max_seq_len if capacity is None else int(capacity)
        self.aux = [gpu.buffer(cap * cfg.d_model * F32, label=f"eagle3_aux_cache{j}") for j in range(3)]
        self.aux_layers = tuple(draft.cfg.aux_layers)
        # no MTP draft; a verify pass of depth + 1 rows keeps every row's recurrent state (hybrid trunks)
        super().__init__(gpu, model, 0, dtype, cap, keep=int(depth) + 1)  # builds the one-token pass (`_get`)
        self.depth, self.cap = int(depth), cap
        self.dcfg = draft.cfg
        self.tmap = e3.target_ids(draft.d2t)
        # a target id's draft id (what a sampled draft token was)
        self.draft_id = np.full(cfg.vocab_size, -1, np.int64)
        self.draft_id[self.tmap] = np.arange(self.tmap.size)
        # the draft reads the embedding where the trunk keeps it (the draft's `target` is only asked for that)
        host = types.SimpleNamespace(gpu=gpu, net=self.net, cfg=self.cfg)
        self.drafter = WgpuEagle3Draft(host, draft.params, draft.cfg, draft.d2t, draft.t2d, batch=1, k=1)
        self.work = self.drafter.work(cap, max(self.depth, 1))
        self.work.set_aux(GpuAux(self.aux, 1, cap))
        C, Vd = draft.cfg.hidden, draft.cfg.draft_vocab
        self.post1 = gpu.buffer(C * F32, label="eagle3_post_row")
        self.logits1 = gpu.buffer(Vd * F32, label="eagle3_logits_row")
        self._head1 = k_mm.matmul(gpu, self.logits1, self.post1, self.drafter.net.view(e3.HEAD), 1, Vd, C,
                                  trans_b=True, split_k=1)  # fmt: skip
        self._tokens = np.zeros(cap, np.uint32)  # step 0's token row as last written

    def _get(self, kind: str, n: int, prefill: bool = False):
        key = (kind, n, prefill)
        if kind == "trunk" and key not in self._rows:
            self._rows[key] = AuxTrunkRows(self.net, self.trunk, n, prefill, self.aux_layers, self.aux)
        return super()._get(kind, n, prefill)

    def _propose(self, token: int, depth: int, pick) -> tuple[list[int], list[np.ndarray]]:
        """`depth` drafts after `token` (the next, not yet fed token) from row n − 1 of the unrolled draft ->
        (target ids, each step's draft-vocabulary logits). `pick(logits)` -> a draft id (None: the argmax)."""
        n, g, w = self.trunk.length, self.gpu, self.work
        if n < 1:
            raise GpuError("an EAGLE-3 draft drafts after a fed prompt")
        if depth > w.steps or n > self.cap:
            raise GpuError(f"a round of {depth} drafts at position {n} exceeds the draft's window "
                           f"({w.steps} steps of {self.cap} rows)")  # fmt: skip
        self.ids[n] = token
        row = self.ids[1 : n + 1].astype(np.uint32)  # step 0's row p reads the token x_{p+1}
        first = int(np.argmax(row != self._tokens[:n])) if np.any(row != self._tokens[:n]) else n
        if first < n:  # only what changed since the last round (the accepted tokens, the next one)
            g.write(w.tok[0], row[first:], first * 4)
            self._tokens[first:n] = row[first:]
        C, Vd = self.dcfg.hidden, self.dcfg.draft_vocab
        tokens, rows = [], []
        for i in range(depth):
            rec = g.recorder()
            w._record(rec, w._fwd[i])
            rec.copy(w.a[i]["post"], (n - 1) * C * F32, self.post1, 0, C * F32)
            self._head1.record(rec)
            rec.submit()
            logits = g.download(self.logits1, np.float32, Vd)
            d = int(np.argmax(logits)) if pick is None else int(pick(logits))
            tokens.append(int(self.tmap[d]))
            rows.append(logits)
            if i + 1 < depth:
                g.write(w.tok[i + 1], np.array([tokens[-1]], np.uint32), (n - 1) * 4)
        return tokens, rows

    def draft(self, token: int, depth: int, head: str, pick):
        """`depth` draft tokens after `token` -> (tokens, rows): each row the draft's logits scattered into the
        target vocabulary, −inf elsewhere (vLLM's scatter; `generate`'s sampler reads it as the draft's Q)."""
        self._settle()
        V = self.cfg.vocab_size

        def full(logits):
            out = np.full(V, -np.inf, np.float32)
            out[self.tmap] = logits
            return out

        choose = None if head == "argmax" else (lambda lg: int(self.draft_id[pick(full(lg))]))
        tokens, rows = self._propose(token, depth, choose)
        return tokens, [full(r) for r in rows]

    def round(self, token: int, depth: int) -> tuple[list[int], np.ndarray]:
        """A greedy round: the drafts, then the trunk over [token, d_1..d_K] -> (drafts, argmax per verify row)."""
        self._settle()
        drafts, _ = self._propose(token, depth, None)
        return drafts, self.feed([token, *drafts], "argmax")
