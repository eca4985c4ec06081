"""generate's GPU engine speculating with an EAGLE-3 draft (docs/eagle3.md#generate-on-the-gpu): the twin of
`refnet.RefEagle3Engine` on the decoder's pieces.

The trunk is `decode.WgpuEngine`'s (its cache, its one-token steps run ahead, its verify pass), with one
addition: every trunk pass stores the residual stream at the input of each aux layer into an aux cache by
position (`AuxTrunkRows`: a `store_rows` at the cache's start before the layer's block), so the draft's step-1
rows never leave the GPU, and rows fed past a roll-back are simply written again.

The draft runs as a decoder does, with a cache of its own keys and values by slot (`Eagle3Cache`;
`Eagle3Rows`, the draft layer over n rows at slots start .. start + n − 1, `start` in the draft's `meta`). A
round at trunk length n (x_n the next, not yet fed token) first catches up the step-1 rows of the anchors a ..
n − 1 the draft has not seen (a = the draft's length, at most n − 1): row p reads the token x_{p+1}, fc of the
aux rows at p (copied out of the aux caches), RoPE position p, and attends to every cached slot < p and to
itself. Row n − 1's logits give d_1. Chain step j = 1 .. depth − 1 is one row at slot n + j − 1 (its RoPE
position), reading d_j and the previous step's `pre` at its last row, attending to slots 0 .. n + j − 1: the
prefix's step-1 keys, the chain's earlier rows and itself. This is `ddl_ref.eagle3.propose` and
`RefEagle3Engine` (and the TTT unroll's mask at row n − 1: step 0 causal, step i reading steps 1..i at that
row), with the prefix's keys kept instead of recomputed. No row reads a slot after its own, so a round's chain
rows (slots n .. n + depth − 2) need no roll-back: the draft's length is n after the round, and the next
round's catch-up rows write over them; a trunk roll-back to L takes the draft's length to min(length, L).

Per pass (`Eagle3Rows`): the embedding gather (the trunk's table), input_layernorm and hidden_norm, q/k/v as
the sum of their embedding half over en and their hidden half over hn (`eagle3.DraftParams`' split, so
x = [en; hn] is never built), `rope_store` (RoPE of q and k, k and v into the cache), `attend_cache`, o_proj
added into a copy of the residual, the MLP added into it in place (that is `pre`). Passes of at most
`ops.gemv.GEMV_MAX_ROWS` rows run the products as matrix-vector products (each half of q/k/v one stacked
dispatch, gate and up with SwiGLU one); longer ones (a prompt's catch-up) the tiled GEMM. The last row's `pre`
is copied to one row that the final norm and the draft-vocabulary head read; its Vd logits are read back, and
the host takes the argmax (or the sampler's pick) and maps it to a target id, the next chain step's token.
The draft's tensors live in a parameters-only `Net` (f32, no gradients or moments); its embedding is the
trunk's.

What a round costs: the draft layer over the catch-up rows (after a prompt the whole prompt; after that the
tokens kept last round and the new one) and over one row per further step; only their attention grows with
the position (it reads every cached slot). Each draft step is a submit and a read-back of Vd logits, so the
host waits for the GPU `depth` times a round before the verify pass. The text is the trunk's: greedy output
equals plain greedy decoding whatever the draft proposes.

Verified (lavapipe, tests/test_generate_eagle3_gpu.py): every step's draft-vocabulary logits equal
`RefEagle3Engine`'s within f32 rounding over a long prompt's catch-up (the GEMM path) and rounds that kept
all, some and none of their drafts, a roll-back behind the draft's cached rows, argmax and picked chains, with
and without norm_before_residual; greedy text with the draft equal to plain greedy text.
"""

from __future__ import annotations

import numpy as np

from ddl_ref import eagle3 as e3
from ddl_ref import ops as ref_ops
from ddl_wgpu.engine.decode import TrunkRows, WgpuEngine
from ddl_wgpu.engine.eagle3 import DraftParams
from ddl_wgpu.engine.layout import F32
from ddl_wgpu.engine.net import Net
from ddl_wgpu.engine.vocab import Vocab
from ddl_wgpu.ops import decode as k_dec
from ddl_wgpu.ops import elementwise as k_ew
from ddl_wgpu.ops import gemv as k_gemv
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.ops import rmsnorm as k_norm
from ddl_wgpu.ops import swiglu as k_swiglu
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


class Eagle3Cache:
    """The draft's keys and values by slot (`slots`, K, D), RoPE tables of as many positions, and the `meta`
    its passes read their first slot from (set in the command stream from `positions`)."""

    def __init__(self, gpu: Gpu, cfg: e3.Eagle3Config, slots: int):
        K, D = cfg.n_kv_heads, cfg.head_dim
        self.k = gpu.buffer(slots * K * D * F32, label="eagle3_key_cache")
        self.v = gpu.buffer(slots * K * D * F32, label="eagle3_value_cache")
        cos, sin = ref_ops.rope_tables(slots, D, cfg.rope_theta, np.float64)
        self.rope = gpu.upload(np.stack([cos, sin]).astype(np.float32), "eagle3_rope_tables")
        self.meta = gpu.buffer(16, label="eagle3_meta")
        self.positions = gpu.upload(np.arange(slots, dtype=np.uint32), "eagle3_positions")
        self.slots = slots
        self.length = 0  # slots holding step-1 rows of anchors 0 .. length − 1

    def at(self, rec, start: int) -> None:
        rec.copy(self.positions, 4 * start, self.meta, 0, 4)


class Eagle3Rows:
    """The draft layer over n rows at slots start .. start + n − 1 of `cache` (module docstring): `ids` the
    rows' tokens, `hid` their hidden input, or with `fc` the three aux rows `aux[j]` (n, H) that fc turns into
    it; `pre` the rows' pre-norm output (the residual stream after the MLP)."""

    def __init__(self, gpu: Gpu, net: Net, vocab: Vocab, cfg: e3.Eagle3Config, cache: Eagle3Cache, n: int,
                 fc: bool):  # fmt: skip
        C, H, K, D, F = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.intermediate
        self.gpu, self.net, self.N, self.C = gpu, net, n, C
        self.gemv = n <= k_gemv.GEMV_MAX_ROWS

        def act(floats: int, label: str):
            return gpu.buffer(floats * F32, label=f"eagle3_{label}")

        self.ids = gpu.buffer(n * 4, label="eagle3_ids")
        self.aux = [act(n * C, f"aux_rows{j}") for j in range(3)] if fc else None
        self.hid = act(n * C, "hidden_in")
        e, en, hn, r, n2 = (act(n * C, name) for name in ("emb", "enorm", "hnorm", "pre", "n2"))
        rs = act(n, "rstd")  # every norm's rstd: nothing reads it afterwards
        q, qr, att = (act(n * H * D, name) for name in ("q", "q_rope", "att"))
        k, v = act(n * K * D, "k"), act(n * K * D, "v")
        s = act(n * F, "swiglu")
        self.pre = r

        call = Call()
        if fc:
            for j in range(3):
                call += self._products(self.aux[j], [(self.hid, f"{e3.FC}.{j}", C)], C, accumulate=j > 0)
        call += vocab.embed_forward(e, self.ids, n)
        call += self._norm(en, rs, e, e3.IN_NORM, cfg)
        call += self._norm(hn, rs, self.hid, e3.HID_NORM, cfg)
        for x, half in ((en, "e"), (hn, "h")):  # q/k/v = en·W_eᵀ + hn·W_hᵀ
            segs = [(q, f"{e3.Q_PROJ}.{half}", H * D), (k, f"{e3.K_PROJ}.{half}", K * D),
                    (v, f"{e3.V_PROJ}.{half}", K * D)]  # fmt: skip
            call += self._products(x, segs, C, accumulate=half == "h")
        call += k_dec.rope_store(gpu, qr, cache.k, cache.v, q, k, v, cache.rope, cache.meta, n, H, K, D)
        scratch = k_dec.attend_scratch(gpu, n, H, D)
        call += k_dec.attend_cache(gpu, att, qr, cache.k, cache.v, cache.meta, n, H, K, D, scratch)
        call += k_ew.copy(gpu, r, hn if cfg.norm_before_residual else self.hid, n * C)
        call += self._products(att, [(r, e3.O_PROJ, C)], H * D, accumulate=True)
        call += self._norm(n2, rs, r, e3.POST_NORM, cfg)
        P = net.view
        if self.gemv:
            call += k_gemv.gemv_swiglu(gpu, s, n2, P(e3.GATE), P(e3.UP), n, F, C)
        else:
            gate, up = act(n * F, "gate"), act(n * F, "up")
            call += self._products(n2, [(gate, e3.GATE, F)], C) + self._products(n2, [(up, e3.UP, F)], C)
            call += k_swiglu.swiglu_forward(gpu, s, gate, up, n * F)
        call += self._products(s, [(r, e3.DOWN, C)], F, accumulate=True)
        self.fwd = call

    def _norm(self, out, rstd, x, name: str, cfg: e3.Eagle3Config) -> Call:
        return k_norm.rmsnorm_forward(
            self.gpu, out, rstd, x, self.net.view(name), self.N, self.C, cfg.rms_eps
        )

    def _products(self, x, outs: list[tuple], n_in: int, accumulate: bool = False) -> Call:
        """out (n, rows) (+)= x (n, n_in) · W[name]ᵀ for each (out, name, rows): one stacked matrix-vector
        dispatch for a few rows, else a GEMM each (K never sliced)."""
        if self.gemv:
            segs = [k_gemv.Segment(out, self.net.view(name), rows) for out, name, rows in outs]
            return k_gemv.gemv_stacked(self.gpu, x, segs, self.N, n_in, accumulate=accumulate)
        call = Call()
        for out, name, rows in outs:
            call += k_mm.matmul(self.gpu, out, x, self.net.view(name), self.N, rows, n_in, trans_b=True,
                                accumulate=accumulate, split_k=1)  # fmt: skip
        return call


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
        self.dcfg = dcfg = draft.cfg
        self.tmap = e3.target_ids(draft.d2t)
        # a target id's draft id (what a sampled draft token was)
        self.draft_id = np.full(cfg.vocab_size, -1, np.int64)
        self.draft_id[self.tmap] = np.arange(self.tmap.size)
        # the draft's own tensors (fc and q/k/v split as `eagle3.DraftParams` lays them out), parameters only;
        # its embedding is the trunk's, read where the trunk keeps it
        table = DraftParams(dcfg)
        self.dnet = Net(gpu, self.cfg, table.split(draft.params), inference=True, table=table.table)
        self.vocab = Vocab(self.net)
        # slots: the anchors 0 .. cap − 1, then a round's chain rows up to n + depth − 2
        self.e3cache = Eagle3Cache(gpu, dcfg, cap + max(self.depth, 1))
        self._dpasses: dict = {}
        C, Vd = dcfg.hidden, dcfg.draft_vocab
        self.pre1 = gpu.buffer(C * F32, label="eagle3_pre_row")
        self.post1 = gpu.buffer(C * F32, label="eagle3_post_row")
        rstd1 = gpu.buffer(4 * F32, label="eagle3_rstd_row")
        self.logits1 = gpu.buffer(Vd * F32, label="eagle3_logits_row")
        norm = k_norm.rmsnorm_forward(
            gpu, self.post1, rstd1, self.pre1, self.dnet.view(e3.NORM), 1, C, dcfg.rms_eps
        )
        self._head1 = norm + k_gemv.gemv(gpu, self.logits1, self.post1, self.dnet.view(e3.HEAD), 1, Vd, C)
        if self.depth:
            self._draft_pass(1, False)  # the chain step's pass, built with the engine

    def _get(self, kind: str, n: int, prefill: bool = False):
        key = (kind, n, prefill)
        if kind == "trunk" and key not in self._rows:
            self._rows[key] = AuxTrunkRows(self.net, self.trunk, n, prefill, self.aux_layers, self.aux)
        return super()._get(kind, n, prefill)

    def _draft_pass(self, n: int, fc: bool) -> Eagle3Rows:
        if (n, fc) not in self._dpasses:
            self._dpasses[(n, fc)] = Eagle3Rows(
                self.gpu, self.dnet, self.vocab, self.dcfg, self.e3cache, n, fc
            )
        return self._dpasses[(n, fc)]

    def rollback(self, length: int) -> None:
        super().rollback(length)
        self.e3cache.length = min(self.e3cache.length, length)

    def _propose(self, token: int, depth: int, pick) -> tuple[list[int], list[np.ndarray]]:
        """`depth` drafts after `token` (the next, not yet fed token): the catch-up rows, then one row per
        further step (module docstring) -> (target ids, each step's draft-vocabulary logits). `pick(logits)`
        -> a draft id (None: the argmax)."""
        n, g, dc = self.trunk.length, self.gpu, self.e3cache
        if n < 1:
            raise GpuError("an EAGLE-3 draft drafts after a fed prompt")
        if n + depth - 1 > dc.slots:
            raise GpuError(
                f"a round of {depth} drafts at position {n} exceeds the draft's cache ({dc.slots} slots)"
            )
        C, Vd = self.dcfg.hidden, self.dcfg.draft_vocab
        a = min(dc.length, n - 1)  # the catch-up rows: anchors a .. n − 1 (at least the last, token x_n)
        self.ids[n] = token
        run = self._draft_pass(n - a, True)
        g.write(run.ids, self.ids[a + 1 : n + 1].astype(np.uint32))
        rec = g.recorder()
        for j in range(3):
            rec.copy(self.aux[j], a * C * F32, run.aux[j], 0, (n - a) * C * F32)
        start, tokens, rows = a, [], []
        for i in range(depth):
            if i:  # chain step i at slot n + i − 1: the previous step's token and last `pre` row
                prev, run = run, self._draft_pass(1, False)
                g.write(run.ids, np.array([tokens[-1]], np.uint32))
                rec = g.recorder()
                rec.copy(prev.pre, (prev.N - 1) * C * F32, run.hid, 0, C * F32)
                start = n + i - 1
            dc.at(rec, start)
            run.fwd.record(rec)
            rec.copy(run.pre, (run.N - 1) * C * F32, self.pre1, 0, C * F32)
            self._head1.record(rec)
            rec.submit()
            logits = g.download(self.logits1, np.float32, Vd)
            d = int(np.argmax(logits)) if pick is None else int(pick(logits))
            tokens.append(int(self.tmap[d]))
            rows.append(logits)
        dc.length = n  # the step-1 rows of anchors 0 .. n − 1 stay; the chain rows are written over
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
