"""Decoding on the GPU with a cache: `WgpuEngine`, the `backend.Engine` of the wgpu backend.

The model lives in one inference-only `Net` (f32, or f16 big matrices), trunk and MTP draft together, so the
draft shares the trunk's embedding and head. `GpuCache` holds what `ddl_ref.decode.TrunkCache` holds, by
position, on the GPU (`decode_cache`): per full-attention layer the keys (after RoPE and q/k norm) and values; TC's compressor
inputs (two sites per block and the readout); EC's embeddings; and, with a draft, the trunk hidden row the
draft reads (`MtpConfig.trunk_hidden`). The draft (a full-attention block, gated with partial RoPE on a
Qwen3.5 trunk) has its own key/value cache, in run order (slot = RoPE position: step-1 rows of anchors 0..p,
then a round's chain rows, which are rolled back).

A Gated DeltaNet layer (hybrid trunks) is cached by its running state, which a speculative verify can roll
back to its last accepted row (`decode_cache`).

A pass of n new rows is a `TrunkRows` (an `inference.InferenceWork` of one sequence of n rows) or a
`DraftRows` (`blocks.Blocks` running the draft block), built once per n and cached. They override the ops that
see other positions: RoPE at positions start + r on the first `rope_dim` dims (`ops.decode.rope_at`),
attention (keys and values stored into the cache, then the rows attend over it: `attend_cache`; a prefill from
position 0 uses the training flash kernel), the TC compressor and the EC expansion (`tc_cache`/`ec_cache` from
their history caches), the Gated DeltaNet's conv and rule (above), and for passes of at most
`ops.gemv.GEMV_MAX_ROWS` rows the linear layers and the head as matrix-vector products (`ops.gemv`, f32 or f16
weights: a layer's projections of one input stacked into one dispatch, the gated q_proj's [query; gate] and
the Gated DeltaNet's four included; gate, up and SwiGLU in one), and a baseline block's sublayers add into one
stream in place. Everything else is the training engine's kernels (GEMMs for longer passes such as a prefill,
norms, the output gate, Delta updates). The start position reaches the kernels through a 4-byte `meta`
buffer, set inside the command stream by a copy from a table of positions, so every Call is built once.

A decoded token (`_step`) is one submit whose command buffer was recorded while the GPU ran the token before;
in plain greedy decoding (`feed(..., ahead=True)`) the next token is submitted before this one's argmax is
read, fed by that argmax on the GPU, and forgotten (`_settle`) when the caller does anything else
(docs/kernels.md#the-decode-path). A greedy speculative round records the next one while the GPU runs it, for
the case that it keeps no draft (`round`).

Read-back, in the submit that computes it (`readback.Readback`, waited for on this thread): with head "argmax" only
the chosen ids (`ops.decode.argmax` over many workgroups, ties to the lower id); a whole greedy draft chain
(catch-up rows, then chain steps whose token and hidden row are copied on the GPU from the step before) is
one submit that reads back the K drafted ids. Sampling with top-k (k <= 64): the k ids and probabilities per
row (head "top<k>"), turned into the same distribution on the host; sampling over the whole vocabulary (head
"logits"): the logits rows.

Verified (lavapipe): tests/test_generate_gpu.py: logits equal `ddl_ref.model.forward`'s at every position for
all six variants fed in pieces (prefill, single tokens, after a roll-back); greedy generation equal to the
numpy engine's with and without speculation; seeded sampling reproducible; the draft's proposals equal the
numpy engine's. tests/test_generate_gpu_hybrid.py, hybrid trunks (Gated DeltaNet + gated attention, partial
RoPE): logits equal a float64 forward's fed in pieces (roll-backs to a pass's start and inside it, a reset),
the refused roll-backs; greedy text with and without speculation (rejections included) equal to the trunk's
argmax chain; the state and window after every acceptance length of a round bit for bit a plain decode's; the
draft's proposals equal `accept`'s stacked chain; a greedy step run ahead, taken or forgotten, leaves what plain
one-token feeds leave.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ddl_ref import mtp as ref_mtp
from ddl_wgpu.engine.blocks import QK_ORDER, Blocks
from ddl_wgpu.engine.decode_cache import GdnCache, GpuCache
from ddl_wgpu.engine.inference import EMBED_EXPAND, InferenceWork
from ddl_wgpu.engine.layout import F32
from ddl_wgpu.ops import decode as k_dec
from ddl_wgpu.ops import gemv as k_gemv
from ddl_wgpu.ops import view
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError

MTP = "model.mtp."


class _CachedRows:
    """What trunk and draft passes share: RoPE at the cache's positions, attention over the cache, and for a
    few rows the linear layers and the head as matrix-vector products. Each pass class says where a layer's
    keys and values live: `_kv(a)`, the cache entry of the layer whose activations are `a`."""

    cache: GpuCache
    prefill: bool
    _attn_scratch = None  # attend_cache's splits: one buffer for the pass's layers, made on first use

    # -- matrix-vector products for the few rows of a decoding pass (the tiled GEMM would idle) ----------

    def _gemv(self, name: str, n_in: int) -> bool:
        return self.N <= k_gemv.GEMV_MAX_ROWS and (self.net.wdtype(name) == "f32" or n_in % 4 == 0)

    _pending_norm = None  # (h, rstd, x, weight name): a sublayer's input norm left to the products reading h

    def _input_norm(self, a: dict, h: str, r: str, x: str, name: str) -> Call:
        """A few rows' sublayer input norm is not launched: the products that read a[h] (q/k/v, a Gated
        DeltaNet's four, gate/up) compute it from a[x] in their input read (`gemv.Norm`, `_fused_norm`)."""
        if self.N > k_gemv.GEMV_MAX_ROWS:
            return super()._input_norm(a, h, r, x, name)
        if self._pending_norm is not None:
            raise GpuError(f"the norm {self._pending_norm[3]} was left to products that never read it")
        self._pending_norm = (a[h], a[r], a[x], name)
        return Call()

    def _fused_norm(self, x, fusable: bool) -> tuple[Call, object, k_gemv.Norm | None]:
        """For products reading x: (what runs first, the input they read, the norm they fuse). x the output
        of a pending input norm: fused (its raw input read, `gemv.Norm`) when the products are matrix-vector
        products, else the norm launched first; any other x: as it is."""
        pending = self._pending_norm
        if pending is None or pending[0] is not x:
            return Call(), x, None
        self._pending_norm = None
        h, rstd, src, name = pending
        if not fusable:
            return self._norm(h, rstd, src, name), x, None
        return Call(), src, k_gemv.Norm(self.net.view(name), self.cfg.rms_eps, self.cfg.norm_style)

    def _linear(self, out, x, name: str, n_out: int, n_in: int, rows: int | None = None) -> Call:
        if rows is not None or not self._gemv(name, n_in):
            return super()._linear(out, x, name, n_out, n_in, rows)
        return k_gemv.gemv(self.gpu, out, x, self.net.view(name), self.N, n_out, n_in, self.net.wdtype(name))

    def _linears(self, x, n_in: int, outs: list[tuple]) -> Call:
        """A layer's projections of one input (q/k/v; a Gated DeltaNet's four) as one stacked product: one
        dispatch where their weights are adjacent in one arena (`gemv_stacked`)."""
        names = [name for _, name, _ in outs]
        dts = {self.net.wdtype(name) for name in names}
        fusable = len(dts) == 1 and all(self._gemv(name, n_in) for name in names)
        first, x_in, norm = self._fused_norm(x, fusable)
        if not fusable:
            return first + super()._linears(x, n_in, outs)
        segs = [k_gemv.Segment(out, self.net.view(name), rows) for out, name, rows in outs]
        return k_gemv.gemv_stacked(self.gpu, x_in, segs, self.N, n_in, dts.pop(), norm=norm)

    def _mlp_hidden(self, a: dict, p: str, rows: int | None = None) -> Call:
        """a["s"] = silu(h2 W_gateᵀ) ⊙ (h2 W_upᵀ) in one dispatch (`gemv_swiglu`, h2's norm fused): gate and up
        are not kept."""
        gate, up = p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"
        dt = self.net.wdtype(gate)
        fusable = (
            rows is None and dt == self.net.wdtype(up) and self._gemv(gate, self.C) and self._gemv(up, self.C)
        )
        first, x_in, norm = self._fused_norm(a["h2"], fusable)
        if not fusable:
            return first + super()._mlp_hidden(a, p, rows)
        P, F = self.net.view, self.cfg.ffn_hidden
        return k_gemv.gemv_swiglu(self.gpu, a["s"], x_in, P(gate), P(up), self.N, F, self.C, dt, norm=norm)

    def _project_out(self, out, x, name: str, n_in: int, accumulate: bool, rows: int | None = None) -> Call:
        if rows is not None or not self._gemv(name, n_in):
            return super()._project_out(out, x, name, n_in, accumulate, rows)
        return k_gemv.gemv(self.gpu, out, x, self.net.view(name), self.N, self.C, n_in, self.net.wdtype(name),
                          accumulate=accumulate)  # fmt: skip

    def head_forward(self, logits, xf, n: int) -> Call:
        """logits (n, V) = xf · Headᵀ: gemv per vocabulary chunk for a few rows, else the Vocab's GEMMs."""
        net = self.net
        if not self._gemv(net.head_name, self.C):
            return self.vocab.head_forward(logits, xf, n)
        call, V, dt = Call(), self.cfg.vocab_size, net.wdtype(net.head_name)
        for v0, rows, w, _dw in self.vocab.head_chunks():
            call += k_gemv.gemv(self.gpu, logits, xf, w, n, rows, self.C, dt, ldy=V, col0=v0)
        return call

    def _select(self, ids_out, probs_out, logits, n: int, k: int, r0: int) -> Call:
        """k = 1 (greedy decoding, a greedy draft): the argmax over many workgroups (`ops.decode.argmax`; the
        top-k kernel runs one workgroup per row over the whole vocabulary)."""
        if k != 1:
            return super()._select(ids_out, probs_out, logits, n, k, r0)
        return k_dec.argmax(self.gpu, ids_out, probs_out, logits, n, self.cfg.vocab_size, r0)

    def head_calls(self, xf, loss, dxf=None, with_dw: bool = False) -> Call:
        if dxf is not None or self.chunk < self.N or not self._gemv(self.net.head_name, self.C):
            return super().head_calls(xf, loss, dxf, with_dw)
        logits = (self.logit_chunk, 0, self.N * self.cfg.vocab_size * F32)
        return self.head_forward(logits, xf, self.N) + loss(logits, self.N, 0)

    def _qk_norms(self, a: dict):
        """(binding, wq, wk): the layer's q and k norm weights as one span and each one's first float in it, or
        None when they are not in one buffer (`qk_finish` binds them once)."""
        p = self._prefix(a)
        qv, kv = (view(self.net.view(p + f"self_attn.{t}_norm.weight")) for t in "qk")
        if qv[0] is not kv[0]:
            return None
        lo, hi = min(qv[1], kv[1]), max(qv[1] + qv[2], kv[1] + kv[2])
        return (qv[0], lo, hi - lo), (qv[1] - lo) // F32, (kv[1] - lo) // F32

    def _fused_qk(self, a: dict) -> bool:
        """A decoding pass (not a prefill: its flash attention reads k itself) runs q's and k's chains and the
        key store in one launch: `rope_store` (RoPE their only op; with the value store) or `qk_finish` (a q/k
        norm too)."""
        return not self.prefill and (self.cfg.qk_norm == "none" or self._qk_norms(a) is not None)

    def _qk_forward(self, a: dict, t: str, nh: int, p: str) -> Call:
        cfg, D, g, c, N = self.cfg, self.cfg.head_dim, self.gpu, self.cache, self.N
        if self._fused_qk(a):  # at k's turn, q's chain with it
            if t == "q":
                return Call()
            H, K = cfg.n_heads, cfg.n_kv_heads
            kc, vc = self._kv(a)
            qf = self._qk_final(a, "q")
            if cfg.qk_norm == "none":
                return k_dec.rope_store(
                    g, qf, kc, vc, a["q"], a["k"], a["v"], c.rope, c.meta, N, H, K, D, cfg.rope_dim
                )
            w, wq, wk = self._qk_norms(a)
            call = k_dec.qk_finish(g, qf, kc, a["q"], a["k"], w, wq, wk, c.rope, c.meta, N, H, K, D, cfg.qk_norm,
                                   cfg.rms_eps, cfg.norm_style, cfg.rope_dim)  # fmt: skip
            return call + k_dec.store_rows(g, vc, a["v"], c.meta, N, K * D)
        call, src = Call(), a[t]
        for j, op in enumerate(QK_ORDER[cfg.qk_norm], start=1):
            dst = a[t + str(j)]
            if op == "rope":
                call += k_dec.rope_at(g, dst, src, c.cos, c.sin, c.meta, N, nh, D, cfg.rope_dim)
            else:
                call += self._norm(dst, a[t + "r"], src, p + f"self_attn.{t}_norm.weight", N * nh, D)
            src = dst
        return call

    def attend(self, a: dict) -> Call:
        """The rows' keys and values into the cache at start (where `_qk_forward` has not: a prefill, or q/k
        norm weights in two buffers), then attention over slots 0 .. start + r."""
        cfg, g, c = self.cfg, self.gpu, self.cache
        H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        kc, vc = self._kv(a)
        qf = self._qk_final(a, "q")
        call = Call()
        if not self._fused_qk(a):
            call += k_dec.store_rows(g, kc, self._qk_final(a, "k"), c.meta, self.N, K * D)
            call += k_dec.store_rows(g, vc, a["v"], c.meta, self.N, K * D)
            if self.prefill:  # from position 0 the cache holds exactly these rows: the training flash kernel
                return call + Blocks.attend(self, a)
        if self._attn_scratch is None:
            self._attn_scratch = k_dec.attend_scratch(g, self.N, H, D)
        return call + k_dec.attend_cache(g, a["a"], qf, kc, vc, c.meta, self.N, H, K, D, self._attn_scratch)


class TrunkRows(_CachedRows, InferenceWork):
    """The trunk over n new rows with the cache (`prefill`: the rows start at position 0)."""

    def __init__(self, net, cache: GpuCache, n: int, prefill: bool):
        self.cache, self.prefill = cache, prefill
        super().__init__(net, 1, n)

    def _shared_layer_acts(self) -> list[dict]:
        """A baseline trunk's layers share one stream: each sublayer's output projection adds into it in place
        (x += attn(norm(x)); x += mlp(norm(x))), so no copy of the stream precedes each residual add (two
        dispatches a layer: 128 of a 27B token's ~1190). Only forward-only baseline nets share activations."""
        layers = super()._shared_layer_acts()
        stream = layers[0]["x"]
        return [dict(a, x=stream, xm=stream) for a in layers]

    def _last_state(self):
        return self.L[0]["x"] if self.shares_acts else super()._last_state()

    def _kv(self, a: dict):
        return self.cache.kv[self._layer(a)]

    def _layer(self, a: dict) -> int:
        return next(j for j, b in enumerate(self.L) if b is a)

    def _prefix(self, a: dict) -> str:
        return f"model.layers.{self._layer(a)}."

    # -- a Gated DeltaNet layer from its cache (`decode_cache`) ------------------------------------------

    def _gdn_cache(self, q: str) -> GdnCache:
        return self.cache.gdn[int(q.split(".")[2])]  # q = "model.layers.{i}.linear_attn."

    def _gdn_conv(self, a: dict, q: str, hist=None) -> Call:
        """The conv from the cache's window; the window before the pass and (a short pass) its rows kept in
        `prev` for a roll-back."""
        c, cache, g, n = self._gdn_cache(q), self.cache, self.gpu, self.N
        if c.win is None:
            return super()._gdn_conv(a, q)
        Ch, k, Hv, E, W = cache.gdn_sizes()
        if n <= cache.keep:
            call = k_dec.concat_rows(g, c.prev, c.win, a["X"], k - 1, n, Ch)
        else:
            call = k_dec.store_rows(g, c.prev, c.win, cache.meta, k - 1, Ch, at_meta=False)
        return call + super()._gdn_conv(a, q, hist=c.win)

    def _gdn_rule(self, a: dict, q: str, **_) -> Call:
        """The rule from the cache's state, writing every row's state (a short pass: tc = 1) or the first and
        the last (tc = n) into the cache's `states`; then the cache's state and window after the last row.
        Everything per layer lives in the cache: a forward-only net's layers share `a` (`shares_acts`)."""
        c, cache, g, n = self._gdn_cache(q), self.cache, self.gpu, self.N
        Ch, k, Hv, E, W = cache.gdn_sizes()
        slots = cache.pass_slots(n)
        call = super()._gdn_rule(a, q, states=c.states, state_in=c.state, tc=1 if n <= cache.keep else n,
                                 save_final=True)  # fmt: skip
        state = (c.state, c.states, Hv, E, slots * E, E, slots - 1)
        if c.win is None:
            return call + k_dec.take_rows(g, *state[:2], cache.meta, *state[2:])
        # and the window: the last k − 1 inputs, of [window; rows] in prev or of the long pass's rows
        src, row = (c.prev, n) if n <= cache.keep else (a["X"], n - (k - 1))
        return call + k_dec.take_rows2(g, state, (c.win, src, 1, W, 0, Ch, row), cache.meta)

    def embed_forward(self, x0) -> Call:
        cfg = self.cfg
        if not (self.dv > 1 and cfg.ddl_expand_embed):
            return super().embed_forward(x0)
        g, c, n, C = self.gpu, self.cache, self.N, self.C
        call = self.vocab.embed_forward(self.emb, self.ids, n)
        call += k_dec.store_rows(g, c.ehist, self.emb, c.meta, n, C)
        conv = self.net.view(EMBED_EXPAND)
        return call + k_dec.ec_cache(g, x0, c.ehist, conv, c.meta, n, C, self.dv, cfg.ddl_conv_kernel)

    def _compress(self, prefix: str, x_in, X) -> Call:
        cfg = self.cfg
        if cfg.ddl_compressor != "tc":
            return super()._compress(prefix, x_in, X)
        if prefix == "model.readout.":
            site = 2 * cfg.n_layers
        else:
            i = int(prefix.split(".")[2])
            site = 2 * i + (X is self.L[i]["xm"])
        g, c, n, C, dv = self.gpu, self.cache, self.N, self.C, self.dv
        P = self.net.view
        call = k_dec.store_rows(g, c.hist[site], X, c.meta, n, C * dv)
        return call + k_dec.tc_cache(g, x_in, c.hist[site], P(prefix + "conv.weight"), P(prefix + "read.weight"),
                                     c.meta, n, C, dv, cfg.ddl_conv_kernel)  # fmt: skip

    def forward_calls(self) -> Call:
        """The trunk's forward, then (with a draft) its hidden rows into the hidden cache at start."""
        call = super().forward_calls()
        c = self.cache
        if c.hidden is None:
            return call
        rows = self.xf if self.cfg.mtp.trunk_hidden == "post_norm" else self.xL
        return call + k_dec.store_rows(self.gpu, c.hidden, rows, c.meta, self.N, self.C)


class DraftRows(_CachedRows, Blocks):
    """The MTP draft over n rows: inputs eh_proj·[enorm(E[tokens]); hnorm(hidden)], the draft block with its
    cache, the draft's norm; pre = xS, post = xf; the head and top-k of Blocks."""

    def __init__(self, net, cache: GpuCache, n: int):
        self.cache, self.prefill = cache, False
        # the trunk's geometry with the draft block's own SwiGLU width: `compress --ffn-keep` narrows the
        # trunk's FFN and leaves the draft's as it was
        draft_cfg = dataclasses.replace(net.cfg, ffn_hidden=ref_mtp.draft_ffn_hidden(net.cfg))
        super().__init__(net, 1, n, cfg=draft_cfg)
        g, C = self.gpu, self.C
        self.ids = g.buffer(n * 4, label="draft_ids")
        self.hid = self.act(n * C, "draft_hidden_in")
        self.e = self.act(n * C, "draft_emb")
        self.en = self.act(n * C, "draft_enorm")
        self.hn = self.act(n * C, "draft_hnorm")
        self.cat = self.act(n * 2 * C, "draft_cat")
        self.rs = self.act(n, "draft_rstd")  # both input norms' rstd: nothing reads it afterwards
        self._fwd = self._forward_calls()

    def _layer_acts(self, i: int) -> dict:
        """Activations of the draft block only (Blocks would size every trunk layer); its baseline block adds
        into its input stream in place, as the trunk's (`TrunkRows._shared_layer_acts`)."""
        if i:
            return {}
        a = self.block_acts("draft", self.N * self.C)
        return dict(a, xm=a["x"])

    def _last_state(self):
        return self.L[0]["x"]

    def _kv(self, a: dict):
        return self.cache.kv[0]

    def _prefix(self, a: dict) -> str:
        return MTP + "layers.0."

    def _forward_calls(self) -> Call:
        cfg, g, n, C = self.cfg, self.gpu, self.N, self.C
        first = cfg.mtp.concat == "emb_first"
        call = self.vocab.embed_forward(self.e, self.ids, n)
        call += self._norm(self.en, self.rs, self.e, MTP + "enorm.weight")
        call += self._norm(self.hn, self.rs, self.hid, MTP + "hnorm.weight")
        for src, col in ((self.en, 0 if first else C), (self.hn, C if first else 0)):
            call += k_dec.store_rows(g, self.cat, src, self.cache.meta, n, C, 2 * C, col, at_meta=False)
        a = self.L[0]
        call += self._linear(a["x"], self.cat, MTP + "eh_proj.weight", C, 2 * C)
        call += self.block_forward(a, self.xS, MTP + "layers.0.", False)
        return call + self._norm(self.xf, self.rf, self.xS, MTP + "norm.weight")

    def hidden_out(self):
        """(buffer, byte offset) of the last row's hidden the next chain step reads (`chain_hidden`)."""
        buf = self.xf if self.cfg.mtp.chain_hidden == "post_norm" else self.xS
        return buf, (self.N - 1) * self.C * F32


class WgpuEngine:
    """`backend.Engine` on the GPU (module docstring), built by `backend.make_engine`. `depth` > 0 builds the
    draft's cache; `capacity` positions (default the model's max_seq_len); `keep`: the rows of a pass whose
    recurrent state is kept for a roll-back (default depth + 1, a verify pass; another drafter's depth + 1)."""

    backend = "wgpu"

    def __init__(self, gpu: Gpu, model, depth: int = 0, dtype: str = "f32", capacity: int | None = None,
                 keep: int | None = None):  # fmt: skip
        cfg = model.cfg
        if depth and cfg.mtp is None:
            raise GpuError("speculative decoding needs the model's MTP draft")
        if not depth:
            cfg = dataclasses.replace(cfg, mtp=None)
        params = {k: v for k, v in model.params.items() if depth or not k.startswith(MTP)}
        from ddl_wgpu.engine.net import Net

        self.net = Net(gpu, cfg, params, inference=True, dtype=dtype)
        self.gpu, self.cfg, self.depth = gpu, cfg, depth
        cap = cfg.max_seq_len if capacity is None else int(capacity)
        if not 0 < cap <= cfg.max_seq_len:
            raise GpuError(f"cache capacity {cap} must be in 1..max_seq_len {cfg.max_seq_len}")
        tc = cfg.residual == "delta" and cfg.ddl_dv > 1 and cfg.ddl_compressor == "tc"
        ec = cfg.residual == "delta" and cfg.ddl_dv > 1 and cfg.ddl_expand_embed
        types = [cfg.layer_type(i) for i in range(cfg.n_layers)]
        # a verify pass (depth + 1 rows) keeps every row's recurrent state: the roll-back lands inside it
        self.trunk = GpuCache(
            gpu, cfg, cap, types, bool(depth), tc, ec, keep=depth + 1 if keep is None else keep
        )
        self.dcache = (
            GpuCache(gpu, cfg, cap + depth, ["full_attention"], False, False, False) if depth else None
        )
        self.positions = gpu.upload(np.arange(cap + depth + 1, dtype=np.uint32), "positions")
        self.drafted = gpu.buffer(max(depth, 1) * 4, label="drafted")
        self.ids = np.zeros(cap + 1, np.int64)
        self._rows: dict = {}
        self._readback = gpu.readback(max(2 * depth + 1, 2 * 64) * 4, "decode_readback")
        # one-token steps (`_step`): a read-back buffer per parity of the position (two steps can be in
        # flight), the next step's command buffer recorded ahead ((start, head, from_gpu), buffer), and the
        # greedy step run ahead ({"start", "index": its submission, "expect": the token it was fed})
        self._rings = [gpu.readback(8 * 64, f"step_readback{i}") for i in range(2)]
        self._next: tuple | None = None
        self._ahead: dict | None = None
        # a greedy round recorded ahead ((n, a, depth, token), buffer) while the last one ran, and whether
        # that one kept no draft (`round`)
        self._round_next: tuple | None = None
        self._round_zero = True
        self.rounds_ahead = 0  # rounds whose recording was made while the round before ran
        # the decode step's passes and their calls are built with the cache, before the first token
        self._get("trunk", 1)._topk_call(1)
        if depth:
            self._get("trunk", depth + 1)._topk_call(1)
            self._get("draft", 1)._topk_call(1)

    @property
    def length(self) -> int:
        return self.trunk.length

    def _get(self, kind: str, n: int, prefill: bool = False):
        key = (kind, n, prefill)
        if key not in self._rows:
            if kind == "trunk":
                self._rows[key] = TrunkRows(self.net, self.trunk, n, prefill)
            else:
                self._rows[key] = DraftRows(self.net, self.dcache, n)
        return self._rows[key]

    def _at(self, rec, cache: GpuCache, start: int) -> None:
        rec.copy(self.positions, 4 * start, cache.meta, 0, 4)

    def feed(self, ids, head: str, last_only: bool = False, ahead: bool = False) -> np.ndarray:
        """The trunk over new tokens; the head of every row, or with `last_only` of the last row alone (a
        prompt: its last row is copied into the one-row pass's hidden and the head runs there). `ahead`
        (greedy decoding, one token at a time): the caller will feed back the argmax it gets and never roll
        back into this token (`_step`)."""
        ids = np.asarray(ids, np.int64)
        n, start = ids.size, self.trunk.length
        self._round_next = None  # a round recorded ahead assumed nothing fed in between
        if start + n > self.trunk.capacity:
            raise GpuError(f"{start + n} positions exceed the cache capacity {self.trunk.capacity}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size):
            raise GpuError(f"token id out of range for vocab_size {self.cfg.vocab_size}")
        if n == 1 and start > 0 and head != "logits":
            return self._step(int(ids[0]), start, head, ahead and head == "argmax")
        self._settle()
        rows = self._get("trunk", n, prefill=start == 0)
        self.gpu.write(rows.ids, ids.astype(np.uint32))  # the ids alone: no targets or weights to decode
        self.ids[start : start + n] = ids
        rec = self.gpu.recorder()
        self._at(rec, self.trunk, start)
        rows._fwd.record(rec)
        if last_only and n > 1:
            one = self._get("trunk", 1)
            rec.copy(rows.xf, (n - 1) * rows.C * F32, one.xf, 0, rows.C * F32)
            rows = one
        out = self._head(rows, head, rec)
        self.trunk.length, self.trunk.last = start + n, (start, n)
        return out

    # -- one decoded token: recorded ahead, one submit, and (greedy) the next token run ahead -------------

    def _step(self, token: int, start: int, head: str, ahead: bool) -> np.ndarray:
        """One decoded token at `start` > 0 in one submit. Its command buffer was recorded while the GPU ran
        the token before (or is recorded now): the host's recording of ~1500 dispatches (the 27B shape)
        overlaps the GPU instead of preceding it; the token id goes in as a 4-byte write, and the head's ids
        (and probabilities) come back in the same submit, through a read-back buffer per parity of `start`.

        `ahead` (greedy): the step at start + 1 is submitted too, before this one's argmax is read, with that
        argmax copied into its input on the GPU, so the GPU never waits for the host between tokens (its
        submit, the read-back, the caller's loop). When the caller then feeds that argmax, the step is already
        done or running (`_ahead`); anything else first forgets it (`_settle`)."""
        rows, g = self._get("trunk", 1), self.gpu
        run = self._ahead
        if run is not None and run["start"] == start and run["expect"] == token and ahead:
            self._ahead, index = None, run["index"]
        else:
            self._settle()
            self.gpu.write(rows.ids, np.array([token], np.uint32))
            index = g.submit_indexed(self._take_step(rows, start, head, False))
        self.ids[start] = token
        self.trunk.length, self.trunk.last = start + 1, (start, 1)
        if ahead and start + 1 < self.trunk.capacity:
            nxt = g.submit_indexed(self._take_step(rows, start + 1, head, True))
            self._ahead = {"start": start + 1, "index": nxt, "expect": None}
        if start + 1 + ahead < self.trunk.capacity:  # the next step to submit, recorded while the GPU works
            at = start + 1 + ahead
            self._next = ((at, head, ahead), self._record_step(rows, at, head, ahead))
        out = self._read_head(rows, head, self._rings[start % 2], index)
        if self._ahead is not None:
            self._ahead["expect"] = int(out[0])
        return out

    def _take_step(self, rows, start: int, head: str, from_gpu: bool):
        """The recorded step for (start, head, from_gpu), or one recorded now."""
        pending, self._next = self._next, None
        if pending is not None and pending[0] == (start, head, from_gpu):
            return pending[1]
        return self._record_step(rows, start, head, from_gpu)

    def _record_step(self, rows, start: int, head: str, from_gpu: bool = False):
        """The command buffer of a one-row trunk pass at `start` and its head (not submitted); `from_gpu`: its
        token is the argmax the step before left in the top-k output, copied on the GPU."""
        rec = self.gpu.recorder()
        if from_gpu:
            rec.copy(rows._topk_call(1)[1], 0, rows.ids, 0, 4)
        self._at(rec, self.trunk, start)
        rows._fwd.record(rec)
        self._record_head(rows, head, rec, self._rings[start % 2])
        return rec.finish()

    def _settle(self) -> None:
        """Forget a greedy step run ahead that the caller did not take (another token fed, a roll-back, a
        draft): the positions it wrote are overwritten when fed; a Gated DeltaNet layer's state and window go
        back to before it, which leaves no roll-back into the token before (the caller of `ahead` promised
        none)."""
        run, self._ahead = self._ahead, None
        if run is None:
            return
        s = run["start"]
        if self.trunk.has_gdn:
            self.trunk.last = (s, 1)
            self.trunk.rewind(s, self.positions)
        self.trunk.last = (s, 0)

    def _record_head(self, rows, head: str, rec, rb=None) -> None:
        """Record the top-k of `rows` (k = 1 for "argmax") and the copy of its ids and probabilities into a
        read-back buffer (`rb`, default the engine's general one)."""
        n, k = rows.N, 1 if head == "argmax" else int(head[3:])
        call, ids_out, probs_out = rows._topk_call(k)
        call.record(rec)
        if rb is None:
            if self._readback.nbytes < 8 * n * k:
                self._readback = self.gpu.readback(8 * n * k, "decode_readback")
            rb = self._readback
        rec.copy(ids_out, 0, rb.buffer, 0, 4 * n * k)
        if head != "argmax":
            rec.copy(probs_out, 0, rb.buffer, 4 * n * k, 4 * n * k)

    def _read_head(self, rows, head: str, rb=None, after: int | None = None) -> np.ndarray:
        """What `_record_head` copied into `rb`, after submission `after` (None: all submitted work):
        "argmax" (n,) ids; "top<k>" (n, V) pseudo-logits."""
        rb = self._readback if rb is None else rb
        n, k = rows.N, 1 if head == "argmax" else int(head[3:])
        ids = rb.read(np.uint32, n * k, 0, after).reshape(n, k).astype(np.int64)
        if head == "argmax":
            return ids[:, 0]
        out = np.full((n, self.cfg.vocab_size), -np.inf, np.float32)
        probs = rb.read(np.float32, n * k, 4 * n * k).reshape(n, k)
        with np.errstate(divide="ignore"):
            np.put_along_axis(out, ids, np.log(probs), axis=-1)
        return out

    def _head(self, rows, head: str, rec) -> np.ndarray:
        """Record the head of `rows` into `rec`, submit, and read back per `head`: "argmax" (n,) ids;
        "top<k>" (k <= 64) (n, V) pseudo-logits, log p at the k most likely ids and −inf elsewhere (what
        `generate.distribution` with top_k = k turns into the same distribution as the full logits);
        "logits" (n, V)."""
        if head == "logits":
            rec.submit()
            return self._logits(rows)
        self._record_head(rows, head, rec)
        rec.submit()
        return self._read_head(rows, head)

    def _logits(self, rows) -> np.ndarray:
        """(n, V) logits of the rows' final hidden xf, head chunk by chunk (the Calls built once per rows)."""
        g, n, V, C = self.gpu, rows.N, self.cfg.vocab_size, rows.C
        if not hasattr(rows, "decode_logits"):
            rows.decode_logits = []
            for r0 in range(0, n, rows.chunk):
                m = min(rows.chunk, n - r0)
                xf = (rows.xf, r0 * C * F32, m * C * F32)
                rows.decode_logits.append(
                    (r0, m, rows.head_forward((rows.logit_chunk, 0, m * V * F32), xf, m))
                )
        out = np.empty((n, V), np.float32)
        for r0, m, call in rows.decode_logits:
            call.run(g)
            out[r0 : r0 + m] = g.download(rows.logit_chunk, np.float32, m * V).reshape(m, V)
        return out

    def rollback(self, length: int) -> None:
        """Forget positions from `length` on: keys, values and histories are by position (only `length`
        moves); a Gated DeltaNet layer's window and state are rebuilt on the GPU from its last pass
        (`GpuCache.rewind`: to a position inside the last pass, or to 0)."""
        self._settle()
        if not 0 <= length <= self.trunk.length:
            raise GpuError(f"cannot roll back to {length}: the cache holds {self.trunk.length} positions")
        if length < self.trunk.length and self.trunk.has_gdn:
            self.trunk.rewind(length, self.positions)
        self.trunk.length = length
        if self.dcache is not None:
            self.dcache.length = min(self.dcache.length, length)

    def _chain(
        self, rec, token: int | None, depth: int, head: str, pick, n: int | None = None, a: int | None = None
    ):
        """Record the draft's rows into `rec` (module docstring): catch-up step-1 rows for the anchors the draft
        has not seen, then the chain rows. Greedy (head "argmax"): every step's argmax is copied on the GPU
        into `drafted` and into the next step's token; nothing is submitted. Sampling: each step is submitted,
        its row read back per `head` and `pick`ed on the host. `n`, `a`: the trunk's and the draft's lengths
        (default the caches'); `token` None: the catch-up rows' ids are already on the GPU (a round recorded
        ahead, `_record_round`). -> (rec, tokens, rows)."""
        g, C, dc = self.gpu, self.cfg.d_model, self.dcache
        n = self.trunk.length if n is None else n
        a = dc.length if a is None else a
        first = self._get("draft", n - a)
        if token is not None:
            self.ids[n] = token
            g.write(first.ids, self.ids[a + 1 : n + 1].astype(np.uint32))
        rec.copy(self.trunk.hidden, a * C * F32, first.hid, 0, (n - a) * C * F32)
        self._at(rec, dc, a)
        first._fwd.record(rec)
        tokens, rows, prev = [], [], first
        chain = self._get("draft", 1) if depth > 1 else None
        for sigma in range(1, depth + 1):
            if sigma > 1:  # the chain row at position n + σ − 2 reads step σ−1's token and hidden
                buf, off = prev.hidden_out()
                rec.copy(buf, off, chain.hid, 0, C * F32)
                if head == "argmax":
                    rec.copy(self.drafted, (sigma - 2) * 4, chain.ids, 0, 4)
                else:
                    g.write(chain.ids, np.array([tokens[-1]], np.uint32))
                self._at(rec, dc, n + sigma - 2)
                chain._fwd.record(rec)
                prev = chain
            if head == "argmax":
                call, ids_out, _ = prev._topk_call(1)
                call.record(rec)
                rec.copy(ids_out, (prev.N - 1) * 4, self.drafted, (sigma - 1) * 4, 4)
            else:
                row = self._head(prev, head, rec)[-1]
                rows.append(row)
                tokens.append(pick(row))
                rec = g.recorder()
        return rec, tokens, rows

    def draft(self, token: int, depth: int, head: str, pick):
        """`depth` draft tokens after `token` (the next, not yet fed token) -> (tokens, rows read back); the
        chain rows are rolled back at the end."""
        self._settle()
        self._round_next = None
        rec, tokens, rows = self._chain(self.gpu.recorder(), token, depth, head, pick)
        if head == "argmax":
            rec.copy(self.drafted, 0, self._readback.buffer, 0, 4 * depth)
            rec.submit()
            tokens = [int(t) for t in self._readback.read(np.uint32, depth)]
        self.dcache.length = self.trunk.length  # the chain rows go; the step-1 rows of anchors 0..n−1 stay
        return tokens, rows

    def round(self, token: int, depth: int) -> tuple[list[int], np.ndarray]:
        """A greedy speculative round in one submit: the draft chain, then the trunk over [token, d_1..d_K]
        with the drafted ids copied on the GPU into its input; reads back the K drafted ids and the K + 1
        verify argmaxes alone. -> (drafts, argmax per verify row); the trunk cache then holds all K + 1.

        The next round is recorded while the GPU runs this one, as if none of this round's drafts is kept
        (its token the verify's first argmax, copied on the GPU): after a round that kept none, so what a
        draft that is rarely right costs is not also the host's recording (`_round_next`); used when the
        caller's next round is that one (the trunk rolled back to n + 1, the token that argmax)."""
        self._settle()
        g, n, a = self.gpu, self.trunk.length, self.dcache.length
        if n + depth + 1 > self.trunk.capacity:
            raise GpuError(f"{n + depth + 1} positions exceed the cache capacity {self.trunk.capacity}")
        pending, self._round_next = self._round_next, None
        if pending is not None and pending[0] == (n, a, depth, token):
            cb = pending[1]
            self.ids[n] = token
            self.rounds_ahead += 1
        else:
            cb = self._record_round(n, a, token, depth)
        g.queue.submit([cb])
        ahead = None
        if self._round_zero and n + 1 + depth + 1 <= self.trunk.capacity:
            ahead = self._record_round(n + 1, n, None, depth)
        out = self._readback.read(np.uint32, 2 * depth + 1).astype(np.int64)
        drafts = [int(t) for t in out[depth + 1 :]]
        self._round_zero = drafts[0] != int(out[0])  # this round keeps no draft
        if ahead is not None and self._round_zero:
            self._round_next = ((n + 1, n, depth, int(out[0])), ahead)
        self.ids[n : n + depth + 1] = [token, *drafts]
        self.trunk.length, self.trunk.last = n + depth + 1, (n, depth + 1)
        self.dcache.length = n
        return drafts, out[: depth + 1]

    def _record_round(self, n: int, a: int, token: int | None, depth: int):
        """The command buffer of a greedy round at trunk length n and draft length a (`round`). `token` None:
        the round after one that kept no draft, recorded before that one is read: its token is that round's
        verify argmax of row 0, copied on the GPU into the draft's one catch-up row and the verify's first."""
        g = self.gpu
        verify = self._get("trunk", depth + 1)
        call, ids_out, _ = verify._topk_call(1)
        rec = g.recorder()
        if token is None:
            rec.copy(ids_out, 0, self._get("draft", n - a).ids, 0, 4)
            rec.copy(ids_out, 0, verify.ids, 0, 4)
        else:
            g.write(verify.ids, np.array([token], np.uint32))
        rec, _, _ = self._chain(rec, token, depth, "argmax", None, n, a)
        rec.copy(self.drafted, 0, verify.ids, 4, 4 * depth)
        self._at(rec, self.trunk, n)
        verify._fwd.record(rec)
        call.record(rec)
        rec.copy(ids_out, 0, self._readback.buffer, 0, 4 * (depth + 1))
        rec.copy(self.drafted, 0, self._readback.buffer, 4 * (depth + 1), 4 * depth)
        return rec.finish()
