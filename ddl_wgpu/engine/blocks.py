"""The building blocks every GPU engine shares: `Blocks`, the activations of one (batch, seq) shape and the
Calls of the model's transformer blocks, forward and backward, mirrored op for op like `ddl_ref.model`.

A block is two sublayers, attention then the SwiGLU MLP. Baseline residual: x_out = x + sublayer(norm(x)).
Deep Delta residual (`cfg.residual == "delta"`): x_in = compress(X) (d_v > 1) or X; c = norm(x_in);
u = sublayer(c); X_out = delta(X; u, c, x_in) (`ops.delta`). The engines built on this class:
`inference.InferenceWork` (the token model's forward, evaluation, logits, top-k), `trunk.TrunkWork` (its
training step, with the joint MTP draft) and `draft.DraftWork` (heal's draft, trained alone on input rows).

Ops are addressed by parameter name (`_linear`, `_norm`, ...): each reads one line per op, and the backward
lists the same ops in reverse. Shapes are fixed: a different (B, T) is an error, not a silent reallocation.
The residual stream is (N, C) for the baseline and DDL d_v = 1, and the DDL state (N, C, d_v) for the
expanded variants (N = B·T rows). Saved activations follow `ddl_ref.model`'s caches.
"""

from __future__ import annotations

import numpy as np

from ddl_ref import ops as ref_ops
from ddl_wgpu.engine.gdn import GatedDeltaNet
from ddl_wgpu.engine.layout import F32
from ddl_wgpu.engine.vocab import Vocab, head_chunk_rows
from ddl_wgpu.ops import attention as k_attn
from ddl_wgpu.ops import attn_gate as k_gate
from ddl_wgpu.ops import delta as k_delta
from ddl_wgpu.ops import elementwise as k_ew
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.ops import rmsnorm as k_norm
from ddl_wgpu.ops import rope as k_rope
from ddl_wgpu.ops import shortconv as k_sc
from ddl_wgpu.ops import swiglu as k_swiglu
from ddl_wgpu.ops import topk_kl as k_topk
from ddl_wgpu.runtime.gpu import Call, GpuError

# the order of the ops applied to q and k after their projections, per cfg.qk_norm
QK_ORDER = {"none": ["rope"], "pre_rope": ["norm", "rope"], "post_rope": ["rope", "norm"]}
# (sublayer, its norm, the block activations of its input state, normed input, rstd), in forward order
SUBLAYERS = (
    ("attn", "input_layernorm", "x", "h", "r1"),
    ("mlp", "post_attention_layernorm", "xm", "h2", "r2"),
)
SUBLAYER = {s[0]: s for s in SUBLAYERS}


class Blocks(GatedDeltaNet):
    """Activations and Calls of the blocks of `net` (a `net.Net`) for one (batch, seq) shape, plus the final
    norm, the LM head in row chunks, the top-k read-out and the step read-back every engine uses. A block's
    token mixer is full attention (optionally gated, partial RoPE) or, in a hybrid trunk, a Gated DeltaNet
    (`gdn.GatedDeltaNet`, per `cfg.layer_type(i)`)."""

    # K slices of the forward's GEMMs (`ops.matmul`'s split_k; None: chosen by shape). A work whose rows must
    # not depend on how many windows share a pass sets 1 (`stream.TrunkPass`): slicing is chosen by the
    # product's shape, so another row count could sum another way.
    split_k: int | None = None

    def __init__(self, net, batch: int, seq: int, chunk_rows: int | None = None, span: int | None = None,
                 cfg=None):  # fmt: skip
        """`span`: the positions the seq rows cover (default seq), at most the model's max_seq_len. `cfg`: the
        geometry the blocks are sized by, when not the net's (the MTP draft's rows: its own SwiGLU width after
        `compress --ffn-keep`)."""
        cfg = net.cfg if cfg is None else cfg
        if (span or seq) > cfg.max_seq_len:
            raise GpuError(f"sequence length {span or seq} exceeds the model's max_seq_len {cfg.max_seq_len}")
        self.net, self.gpu, self.cfg = net, net.gpu, cfg
        self.B, self.T = batch, seq
        self.N = N = batch * seq  # rows (tokens)
        self.C = C = cfg.d_model
        self.heads = (batch, seq, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)  # attention's (B, T, H, K, D)
        self.ddl = cfg.residual == "delta"
        self.dv = cfg.ddl_dv if self.ddl else 1
        self.S = N * C * self.dv  # floats in one stream/state
        self.vocab = Vocab(net)
        cos, sin = self._rope_tables()
        self.cos = self.gpu.upload(cos.astype(np.float32), "rope_cos")
        self.sin = self.gpu.upload(sin.astype(np.float32), "rope_sin")
        # the block output is the next "x"; a forward-only net's layers share one set of activations
        self.L = (
            self._shared_layer_acts()
            if self.shares_acts
            else [self._layer_acts(i) for i in range(cfg.n_layers)]
        )
        self.xS = self._last_state()  # the last block's output (stream or state)
        self.xL = self.act(N * C, "x_final") if self.dv > 1 else self.xS  # readout, before the final norm
        self.xf = self.act(N * C, "x_normed")
        self.rf = self.act(N, "rstd_final")
        self.row_loss = self.act(N, "row_loss")
        self.loss_acc = self.act(4, "loss_sum")
        self.readback = self.gpu.buffer(32, label="readback")  # loss sum, norm, clip, finite; draft loss
        self.chunk = min(N, chunk_rows or head_chunk_rows(self.gpu, N, C, cfg.vocab_size))
        self.logit_chunk = self.act(self.chunk * cfg.vocab_size, "logits_chunk")
        self._topk: dict = {}

    def _last_state(self):
        """The buffer the last block writes (a decoding pass's is its one stream: `decode._CachedRows`)."""
        return self.act(self.S, "x_last")

    def act(self, n: int, label: str):
        """An activation or scratch buffer of n floats: the work's own, or when the net keeps `shared_acts` (a
        dict; the works of heal's draft, which never run within one submit and whose results are read before
        another work runs) the net's buffer for this label's next use by this work, grown when this work needs
        more: every such work of the net binds the same buffers, sized by the largest work built first
        (`heal_gpu.WgpuDraft.prepare`). A work reads only the rows it wrote, so a larger buffer changes
        nothing; nothing a work writes once at its construction (its RoPE tables, constants) comes from here."""
        pool = getattr(self.net, "shared_acts", None)
        if pool is None:
            return self.gpu.buffer(n * F32, label=label)
        seen = self.__dict__.setdefault("_acts_seen", {})
        key = (label, seen.get(label, 0))  # a label a work uses twice (dq0 and dq0 of another layer) twice
        seen[label] = key[1] + 1
        if key not in pool or pool[key].size < n * F32:
            pool[key] = self.gpu.buffer(n * F32, label=label)
        return pool[key]

    @property
    def shares_acts(self) -> bool:
        """True when every layer of a mixer type uses the same activation buffers: a forward-only net keeps
        nothing for a backward (a 64-layer, 5120-wide trunk at 16 x 1024 tokens needs ~8 GB of activations
        per layer), except a DDL model, whose per-layer Delta stats the spectral diagnostics read."""
        return self.net.inference and not self.ddl and self.cfg is self.net.cfg

    def _shared_layer_acts(self) -> list[dict]:
        """One activation set per mixer type; layer i reads its stream from one of two buffers and writes the
        other (each layer still gets its own dict: code that finds a layer by its dict keeps working)."""
        streams = [self.act(self.S, "x_even"), self.act(self.S, "x_odd")]
        shared: dict[str, dict] = {}
        out = []
        for i in range(self.cfg.n_layers):
            mixer = self.cfg.layer_type(i)
            if mixer not in shared:
                shared[mixer] = self.block_acts(f"_{mixer}", self.S, mixer)  # its own "x" goes unused
            out.append(dict(shared[mixer], x=streams[i % 2]))
        return out

    def _rope_tables(self):
        """cos, sin (T, R) float64 of the rows' positions 0..T−1, R = the rotated dims (`cfg.rope_dim`), as
        `DraftWork`'s chain tables and the decoder's are built."""
        cfg = self.cfg
        return ref_ops.rope_tables(self.T, cfg.head_dim, cfg.rope_theta, np.float64, cfg.rope_dim)

    def block_acts(self, tag: str, S: int, mixer: str = "full_attention", share: dict | None = None) -> dict:
        """Saved activations of one block (`x` is the block input: stream or DDL state of S floats) whose token
        mixer is `mixer` ("full_attention" or "linear_attention"). `share`: buffers to use instead of new ones
        for those of its keys the block has (a forward-only trunk's mixer types share the MLP's)."""
        cfg, N, C, B, T = self.cfg, self.N, self.C, self.B, self.T
        H, K, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        share, act, M = share or {}, self.act, self.mlp_rows()
        # the block's input and both sublayers' norms, and the MLP (key, floats, label)
        common = (("x", S, f"x{tag}"), ("h", N * C, f"h{tag}"), ("r1", N, f"rstd1_{tag}"),
                  ("xm", S, f"xm{tag}"),  # stream/state after the attention sublayer
                  ("h2", M * C, f"h2{tag}"), ("r2", M, f"rstd2_{tag}"), ("gate", M * F, f"gate{tag}"),
                  ("up", M * F, f"up{tag}"), ("s", M * F, f"swiglu{tag}"))  # fmt: skip
        a = {"mixer": mixer, **{k: share[k] if k in share else act(n, label) for k, n, label in common}}
        if mixer == "linear_attention":
            return self.gdn_acts(tag, a)
        a.update(
            q=act(N * H * D, f"q{tag}"),
            k=act(N * K * D, f"k{tag}"),
            v=act(N * K * D, f"v{tag}"),
            a=act(N * H * D, f"att{tag}"),
            lse=act(B * H * T, f"lse{tag}"),
        )
        if cfg.attn_output_gate:  # q_proj's [query; gate] rows, the gate, the gated output o_proj reads
            a.update(qg=act(2 * N * H * D, f"qg{tag}"), og=act(N * H * D, f"ogate{tag}"),
                     ag=act(N * H * D, f"att_gated{tag}"))  # fmt: skip
        for t, n_heads in (("q", H), ("k", K)):  # q/k after each op of their chain
            a[t + "1"] = act(N * n_heads * D, f"{t}1_{tag}")
            if cfg.qk_norm != "none":
                a[t + "2"] = act(N * n_heads * D, f"{t}2_{tag}")
                a[t + "r"] = act(N * n_heads, f"{t}rstd{tag}")
        return a

    def mlp_rows(self) -> int:
        """The rows the MLP sublayer runs on: N (a stacked chain's draft runs it on its last step's rows
        alone, `draft.DraftWork`), which sizes its activations and backward scratch."""
        return self.N

    def _layer_acts(self, i: int) -> dict:
        a = self.block_acts(str(i), self.S, self.cfg.layer_type(i))
        if self.ddl:
            for sub, _norm, x_state, _h, _r in SUBLAYERS:
                a["u_" + sub] = self.act(self.N * self.C, f"u_{sub}{i}")  # only its direction is used
                a["st_" + sub] = self.act(self.N * k_delta.stats_size(self.dv), f"stats_{sub}{i}")
                # x_in: the compressed readout (d_v > 1); d_v = 1 reads the stream itself
                xin = self.act(self.N * self.C, f"xin_{sub}{i}") if self.dv > 1 else a[x_state]
                a["xin_" + sub] = xin
        return a

    def init_backward_scratch(self):
        """Backward scratch shared by every layer (engines that train)."""
        cfg, N, C, act = self.cfg, self.N, self.C, self.act
        H, K, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        self.dx = act(N * C, "dx")
        self.dxf = act(N * C, "dxf")
        self.dh = act(N * C, "dh")
        self.da = act(N * H * D, "da")
        self.dq = [act(N * H * D, "dq0"), act(N * H * D, "dq1")]
        self.dk = [act(N * K * D, "dk0"), act(N * K * D, "dk1")]
        self.dv_ = act(N * K * D, "dv")
        M = self.mlp_rows()
        self.ds = act(M * F, "ds")
        self.dgate = act(M * F, "dgate")
        self.dup = act(M * F, "dup")
        if cfg.attn_output_gate:
            self.dqg = act(2 * N * H * D, "dqg")  # d(q_proj output): [dquery; dgate] per head
            self.dga = act(N * H * D, "d_att_gated")
        if cfg.has_linear:
            self.gd = self.gdn_scratch()
        if self.ddl:
            self.dS = [act(self.S, "dS0"), act(self.S, "dS1")]  # gradient of the stream/state, ping-pong
            self.du = act(N * C, "du")
            self.dxin = act(N * C, "dxin")
            self.dbeta = act(N, "dbeta_logit")
            self.dz = act(N * self.dv, "dv_logit")
            self.ones = self.gpu.upload(np.ones(N, np.float32), "ones")

    # -- ops by parameter name ----------------------------------------------------------------------------

    def _linear(self, out, x, name: str, n_out: int, n_in: int, rows: int | None = None) -> Call:
        """out (N, n_out) = x (N, n_in) · W[name]ᵀ (`rows` rows instead of N: a draft's MLP tail)."""
        return k_mm.linear_forward(self.gpu, out, x, self.net.view(name), rows or self.N, n_out, n_in,
                                   self.net.wdtype(name), self.split_k)  # fmt: skip

    def _linears(self, x, n_in: int, outs: list[tuple]) -> Call:
        """Several linear layers of one input, out (N, n_out) = x · W[name]ᵀ for each (out, name, n_out) of
        `outs` (a decoding pass stacks them into one product: `decode._CachedRows`)."""
        call = Call()
        for out, name, n_out in outs:
            call += self._linear(out, x, name, n_out, n_in)
        return call

    def _linear_backward(self, dx, dout, x, name: str, n_out: int, n_in: int, accumulate_dx=False,
                         rows: int | None = None) -> Call:  # fmt: skip
        """dx (+)= dout · W[name]; dW[name] += doutᵀ · x."""
        w, dw = self.net.view(name), self.net.view(name, "g")
        return k_mm.linear_backward(self.gpu, dx, dw, dout, x, w, rows or self.N, n_out, n_in,
                                    accumulate_dx=accumulate_dx, accumulate_dw=True)  # fmt: skip

    def _project_out(self, out, x, name: str, n_in: int, accumulate: bool, rows: int | None = None) -> Call:
        """out (N, C) (+)= x (N, n_in) · W[name]ᵀ: a sublayer's output projection (into the residual)."""
        return k_mm.matmul(self.gpu, out, x, self.net.view(name), rows or self.N, self.C, n_in, trans_b=True,
                           accumulate=accumulate, b_dtype=self.net.wdtype(name), split_k=self.split_k)  # fmt: skip

    def _norm(self, out, rstd, x, name: str, rows: int | None = None, dim: int | None = None) -> Call:
        cfg = self.cfg
        return k_norm.rmsnorm_forward(self.gpu, out, rstd, x, self.net.view(name), rows or self.N,
                                      dim or self.C, cfg.rms_eps, cfg.norm_style)  # fmt: skip

    def _input_norm(self, a: dict, h: str, r: str, x: str, name: str) -> Call:
        """A baseline sublayer's input norm, a[h] = RMSNorm(a[x]) (a decoding pass leaves it to the products
        that read a[h]: `decode._CachedRows`)."""
        return self._norm(a[h], a[r], a[x], name)

    def _norm_backward(self, dx, dout, x, name: str, rstd, rows: int | None = None, dim: int | None = None,
                       accumulate_dx: bool = False) -> Call:  # fmt: skip
        return k_norm.rmsnorm_backward(self.gpu, dx, self.net.view(name, "g"), dout, x, self.net.view(name),
                                       rstd, rows or self.N, dim or self.C, self.cfg.norm_style,
                                       accumulate_dx=accumulate_dx)  # fmt: skip

    def _compress(self, prefix: str, x_in, X) -> Call:
        """x_in (N, C) = the compressor's readout of the state X (TC or CC)."""
        cfg, P = self.cfg, self.net.view
        conv, read = P(prefix + "conv.weight"), P(prefix + "read.weight")
        if cfg.ddl_compressor == "tc":
            return k_sc.tc_forward(self.gpu, x_in, X, conv, read, self.B, self.T, self.C, self.dv,
                                   cfg.ddl_conv_kernel)  # fmt: skip
        return k_sc.cc_forward(self.gpu, x_in, X, conv, read, self.N, self.C, self.dv)

    def _compress_backward(self, prefix: str, dX, dx_in, X) -> Call:
        """dX += d(compress)/dX · dx_in; the compressor's parameter gradients accumulate."""
        cfg, P, G = self.cfg, self.net.view, lambda n: self.net.view(n, "g")
        conv, read = P(prefix + "conv.weight"), P(prefix + "read.weight")
        dconv, dread = G(prefix + "conv.weight"), G(prefix + "read.weight")
        if cfg.ddl_compressor == "tc":
            return k_sc.tc_backward(self.gpu, dX, dconv, dread, dx_in, X, conv, read, self.B, self.T, self.C,
                                    self.dv, cfg.ddl_conv_kernel, accumulate_dX=True)  # fmt: skip
        return k_sc.cc_backward(self.gpu, dX, dconv, dread, dx_in, X, conv, read, self.N, self.C, self.dv,
                                accumulate_dX=True)  # fmt: skip

    # -- a block: forward ------------------------------------------------------------------------------------

    def blocks_forward(self) -> Call:
        """Every block from L[0]["x"] to xS, then (d_v > 1) the readout of the state into xL."""
        call = Call()
        for i, a in enumerate(self.L):
            out = self.L[i + 1]["x"] if i + 1 < len(self.L) else self.xS
            call += self.block_forward(a, out, f"model.layers.{i}.", self.ddl)
        if self.dv > 1:
            call += self._compress("model.readout.", self.xL, self.xS)
        return call

    def block_forward(self, a: dict, out, p: str, ddl: bool) -> Call:
        """One block (parameters named `p`...), both sublayers; `out` receives the block output."""
        call = Call()
        for sub, norm, x_state, h, r in SUBLAYERS:
            x_out = a["xm"] if sub == "attn" else out
            if not ddl:
                call += self._add_sublayer(sub, a, p, x_out)
                continue
            xin = a["xin_" + sub]
            if self.dv > 1:
                call += self._compress(p + "compress.", xin, a[x_state])
            call += self._norm(a[h], a[r], xin, p + norm + ".weight")
            call += self._sublayer_forward(sub, a, p, a["u_" + sub], accumulate=False)
            call += self._delta_forward(a, sub, p + f"ddl_{sub}.", a[x_state], x_out, a[h])
        return call

    def _add_sublayer(self, sub: str, a: dict, p: str, x_out, rows: int | None = None) -> Call:
        """A baseline sublayer, x_out = x + sublayer(norm(x)) with x its input state (`SUBLAYERS`), over `rows`
        rows of a's buffers instead of N (the MLP sublayer of a stacked chain's last step: `draft.DraftWork`)."""
        _, norm, x_state, h, r = SUBLAYER[sub]
        name = p + norm + ".weight"
        if rows is None:
            call = self._input_norm(a, h, r, x_state, name)
        else:
            call = self._norm(a[h], a[r], a[x_state], name, rows)
        if x_out is not a[x_state]:  # a decoding pass adds into the stream in place (`decode`)
            call += k_ew.copy(self.gpu, x_out, a[x_state], (rows or self.N) * self.C)
        return call + self._sublayer_forward(sub, a, p, x_out, accumulate=True, rows=rows)

    def _delta_forward(self, a: dict, sub: str, q: str, X, X_new, c) -> Call:
        """X_new = X + β·k(v − kᵀX) with k = u/|u|, β and v from (c, x_in) (`ops.delta`)."""
        P, cfg = self.net.view, self.cfg
        beta = (P(q + "beta_proj.weight"), P(q + "beta_proj.bias"))
        v = (P(q + "v_proj.weight"), P(q + "v_proj.bias"))
        shape = (self.N, self.C, self.dv, cfg.ddl_k_eps, cfg.ddl_v_scale)
        return k_delta.delta_forward(self.gpu, X_new, a["st_" + sub], X, a["u_" + sub], c, a["xin_" + sub],
                                     *beta, *v, *shape)  # fmt: skip

    def _sublayer_forward(
        self, sub: str, a: dict, p: str, out, accumulate: bool, rows: int | None = None
    ) -> Call:
        """Attention (from a["h"]) or SwiGLU MLP (from a["h2"]; over `rows` rows instead of N), its output
        projection into `out`."""
        cfg, C = self.cfg, self.C
        H, K, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        if sub == "attn" and a["mixer"] == "linear_attention":
            return self.gdn_forward(a, p, out, accumulate)
        if sub == "attn":
            gated = cfg.attn_output_gate  # q_proj gives [query; gate] per head: split them
            q = (a["qg"] if gated else a["q"], p + "self_attn.q_proj.weight", (2 if gated else 1) * H * D)
            call = self._linears(a["h"], C, [q, (a["k"], p + "self_attn.k_proj.weight", K * D),
                                             (a["v"], p + "self_attn.v_proj.weight", K * D)])  # fmt: skip
            if gated:
                call += k_gate.split_heads(self.gpu, a["q"], a["og"], a["qg"], self.N * H, D)
            call += self._qk_forward(a, "q", H, p)
            call += self._qk_forward(a, "k", K, p)
            call += self.attend(a)
            att = a["a"]
            if cfg.attn_output_gate:
                call += k_gate.gate_forward(self.gpu, a["ag"], a["a"], a["og"], self.N * H * D)
                att = a["ag"]
            return call + self._project_out(out, att, p + "self_attn.o_proj.weight", H * D, accumulate)
        call = self._mlp_hidden(a, p, rows)
        return call + self._project_out(out, a["s"], p + "mlp.down_proj.weight", F, accumulate, rows)

    def _mlp_hidden(self, a: dict, p: str, rows: int | None = None) -> Call:
        """a["s"] = silu(gate) ⊙ up, gate and up = h2 · W_gateᵀ, h2 · W_upᵀ (kept in a["gate"], a["up"] for the
        backward; a decoding pass fuses the three: `decode._CachedRows`)."""
        F, C = self.cfg.ffn_hidden, self.C
        call = self._linear(a["gate"], a["h2"], p + "mlp.gate_proj.weight", F, C, rows)
        call += self._linear(a["up"], a["h2"], p + "mlp.up_proj.weight", F, C, rows)
        return call + k_swiglu.swiglu_forward(self.gpu, a["s"], a["gate"], a["up"], (rows or self.N) * F)

    def attend(self, a: dict) -> Call:
        """a["a"], a["lse"] = causal attention of the final q, k over v."""
        q, k = self._qk_final(a, "q"), self._qk_final(a, "k")
        return k_attn.attention_forward(self.gpu, a["a"], a["lse"], q, k, a["v"], *self.heads)

    def _qk_final(self, a: dict, t: str):
        return a[t + str(len(QK_ORDER[self.cfg.qk_norm]))]

    def _qk_forward(self, a: dict, t: str, nh: int, p: str) -> Call:
        """q or k (nh heads) through RoPE and, per cfg.qk_norm, its RMSNorm: a[t] -> a[t1] (-> a[t2])."""
        D = self.cfg.head_dim
        call, src = Call(), a[t]
        for j, op in enumerate(QK_ORDER[self.cfg.qk_norm], start=1):
            dst = a[t + str(j)]
            if op == "rope":
                call += k_rope.rope_forward(self.gpu, dst, src, self.cos, self.sin, self.B, self.T, nh, D,
                                            rotary=self.cfg.rope_dim)  # fmt: skip
            else:
                call += self._norm(dst, a[t + "r"], src, p + f"self_attn.{t}_norm.weight", self.N * nh, D)
            src = dst
        return call

    # -- a block: backward, the same ops in reverse ---------------------------------------------------------

    def blocks_backward(self, d_last) -> tuple[Call, object]:
        """From d(xL) to d(L[0]["x"]): the readout (d_v > 1), then every block in reverse -> (call, d(x0))."""
        call, dcur = Call(), d_last
        if self.dv > 1:
            call += k_ew.fill(self.gpu, self.dS[0], self.S, 0.0)
            call += self._compress_backward("model.readout.", self.dS[0], self.dxin, self.xS)
            dcur = self.dS[0]
        for i in reversed(range(len(self.L))):
            c, dcur = self.block_backward(self.L[i], dcur, f"model.layers.{i}.", self.ddl)
            call += c
        return call, dcur

    def block_backward(self, a: dict, dout, p: str, ddl: bool) -> tuple[Call, object]:
        """From d(block output) to d(block input); returns (call, buffer holding d(block input))."""
        call = Call()
        for sub, norm, x_state, h, r in reversed(SUBLAYERS):
            if not ddl:
                call += self._add_sublayer_backward(sub, a, p, dout)
                continue
            dnext = self.dS[1] if dout is self.dS[0] else self.dS[0]
            xin = a["xin_" + sub]
            call += self._delta_backward(a, sub, p + f"ddl_{sub}.", a[x_state], dout, dnext, a[h])
            call += self._sublayer_backward(sub, a, p, self.du, accumulate_dh=True)
            call += self._norm_backward(
                self.dxin, self.dh, xin, p + norm + ".weight", a[r], accumulate_dx=True
            )
            if self.dv > 1:  # x_in = compress(X): back through the (shared) block compressor
                call += self._compress_backward(p + "compress.", dnext, self.dxin, a[x_state])
            else:  # d_v = 1: x_in is the stream itself
                call += k_ew.add_inplace(self.gpu, dnext, self.dxin, self.N * self.C)
            dout = dnext
        return call, dout

    def _add_sublayer_backward(self, sub: str, a: dict, p: str, dout, rows: int | None = None) -> Call:
        """Reverse of `_add_sublayer`: dx flows through the residual (dout, in place) and the branch adds its
        gradient to it."""
        _, norm, x_state, _h, r = SUBLAYER[sub]
        call = self._sublayer_backward(sub, a, p, dout, accumulate_dh=False, rows=rows)
        return call + self._norm_backward(dout, self.dh, a[x_state], p + norm + ".weight", a[r], rows,
                                          accumulate_dx=True)  # fmt: skip

    def _delta_backward(self, a: dict, sub: str, q: str, X, dX_new, dX, c) -> Call:
        """The Delta update's backward: dX, du (the sublayer's output), dc (-> dh), dx_v (-> dxin), and its
        parameters' gradients from the β and v logits' gradients."""
        P, G, g, N, C, dv = self.net.view, lambda n: self.net.view(n, "g"), self.gpu, self.N, self.C, self.dv
        call = k_delta.delta_backward(g, dX, self.du, self.dbeta, self.dz, self.dh, self.dxin, dX_new, X,
                                      a["u_" + sub], a["st_" + sub], P(q + "beta_proj.weight"),
                                      P(q + "v_proj.weight"), N, C, dv, self.cfg.ddl_v_scale,
                                      accumulate_dc=False, accumulate_dx_v=False)  # fmt: skip
        return call + k_delta.delta_param_grads(g, G(q + "beta_proj.weight"), G(q + "beta_proj.bias"),
                                                G(q + "v_proj.weight"), G(q + "v_proj.bias"), self.dbeta,
                                                self.dz, c, a["xin_" + sub], self.ones, N, C, dv)  # fmt: skip

    def _sublayer_backward(self, sub: str, a: dict, p: str, dout, accumulate_dh: bool,
                           rows: int | None = None) -> Call:  # fmt: skip
        """Reverse of `_sublayer_forward`: from d(sublayer output) to d(its normalized input) in self.dh."""
        cfg, C, dh = self.cfg, self.C, self.dh
        H, K, D, F = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_hidden
        if sub == "mlp":
            call = self._linear_backward(self.ds, dout, a["s"], p + "mlp.down_proj.weight", C, F, rows=rows)
            call += k_swiglu.swiglu_backward(
                self.gpu, self.dgate, self.dup, self.ds, a["gate"], a["up"], (rows or self.N) * F
            )
            call += self._linear_backward(
                dh, self.dup, a["h2"], p + "mlp.up_proj.weight", F, C, accumulate_dh, rows
            )
            return call + self._linear_backward(
                dh, self.dgate, a["h2"], p + "mlp.gate_proj.weight", F, C, True, rows
            )
        if a["mixer"] == "linear_attention":
            return self.gdn_backward(a, p, dout, accumulate_dh)
        gated = cfg.attn_output_gate
        o_in = a["ag"] if gated else a["a"]
        call = self._linear_backward(self.dga if gated else self.da, dout, o_in, p + "self_attn.o_proj.weight", C,
                                     H * D)  # fmt: skip
        if gated:  # da and the gate half of d(q_proj output)
            call += k_gate.gate_backward(
                self.gpu, self.da, self.dqg, self.dga, a["a"], a["og"], self.N * H, D
            )
        call += self.attend_backward(a)
        c_q, dq = self._qk_backward(a, "q", H, p, self.dq[0], self.dq[1])
        c_k, dk = self._qk_backward(a, "k", K, p, self.dk[0], self.dk[1])
        call += c_q + c_k
        q_rows = H * D
        if gated:  # the query half; q_proj's backward is then one GEMM over [dquery; dgate]
            call += k_gate.join_query(self.gpu, self.dqg, dq, self.N * H, D)
            dq, q_rows = self.dqg, 2 * H * D
        call += self._linear_backward(
            dh, self.dv_, a["h"], p + "self_attn.v_proj.weight", K * D, C, accumulate_dh
        )
        call += self._linear_backward(dh, dk, a["h"], p + "self_attn.k_proj.weight", K * D, C, True)
        return call + self._linear_backward(dh, dq, a["h"], p + "self_attn.q_proj.weight", q_rows, C, True)

    def attend_backward(self, a: dict) -> Call:
        """dq[0], dk[0], dv_ from da: the reverse of `attend`."""
        q, k = self._qk_final(a, "q"), self._qk_final(a, "k")
        grads = (self.dq[0], self.dk[0], self.dv_)
        return k_attn.attention_backward(
            self.gpu, *grads, self.da, a["a"], a["lse"], q, k, a["v"], *self.heads
        )

    def _qk_backward(self, a: dict, t: str, nh: int, p: str, dfinal, scratch) -> tuple[Call, object]:
        """Reverse of `_qk_forward`: from d(final q/k) to d(projection output), ping-ponging two buffers."""
        D, order = self.cfg.head_dim, QK_ORDER[self.cfg.qk_norm]
        call, dcur = Call(), dfinal
        for j in range(len(order), 0, -1):
            src = a[t + str(j - 1)] if j > 1 else a[t]
            dnext = scratch if dcur is dfinal else dfinal
            if order[j - 1] == "rope":
                call += k_rope.rope_backward(self.gpu, dnext, dcur, self.cos, self.sin, self.B, self.T, nh, D,
                                             rotary=self.cfg.rope_dim)  # fmt: skip
            else:
                call += self._norm_backward(dnext, dcur, src, p + f"self_attn.{t}_norm.weight", a[t + "r"],
                                            self.N * nh, D)  # fmt: skip
            dcur = dnext
        return call, dcur

    # -- the final norm, the head in row chunks, read-backs ----------------------------------------------

    def final_norm_forward(self) -> Call:
        return self._norm(self.xf, self.rf, self.xL, "model.norm.weight")

    def final_norm_backward(self, d_last) -> Call:
        return self._norm_backward(d_last, self.dxf, self.xL, "model.norm.weight", self.rf)

    def head_calls(self, xf, loss, dxf=None, with_dw: bool = False, rows: int | None = None) -> Call:
        """The LM head over the rows of `xf` (all N, or its first `rows`) in row chunks of logits: per chunk
        the logits, `loss(logits, n, r0)` (a Call on them), and with `dxf` the head's backward (dW too
        `with_dw`)."""
        C, V, N = self.C, self.cfg.vocab_size, self.N if rows is None else rows
        call = Call()
        for r0 in range(0, N, self.chunk):
            n = min(self.chunk, N - r0)
            x = (xf, r0 * C * F32, n * C * F32)
            logits = (self.logit_chunk, 0, n * V * F32)
            call += self.vocab.head_forward(logits, x, n)
            call += loss(logits, n, r0)
            if dxf is not None:
                call += self.vocab.head_backward((dxf, r0 * C * F32, n * C * F32), logits, x, n, with_dw)
        return call

    def _topk_call(self, k: int):
        """(Call, ids buffer, probs buffer) of the top-k of the last forward's rows, built once per k."""
        if k not in self._topk:
            N = self.N
            ids_out = self.act(N * k, "topk_ids")  # u32, as wide as f32
            probs_out = self.act(N * k, "topk_probs")

            def topk(logits, n: int, r0: int) -> Call:
                return self._select(ids_out, probs_out, logits, n, k, r0)

            self._topk[k] = (self.head_calls(self.xf, topk), ids_out, probs_out)
        return self._topk[k]

    def _select(self, ids_out, probs_out, logits, n: int, k: int, r0: int) -> Call:
        """The top-k of n rows of logits into rows r0.. of ids_out / probs_out (a decoding pass takes its
        argmax over many workgroups: `decode._CachedRows`)."""
        return k_topk.topk(self.gpu, ids_out, probs_out, logits, n, self.cfg.vocab_size, k, row_offset=r0)

    def run_topk(self, forward: Call, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`forward` (inputs already uploaded), then per row the k most likely next tokens and their
        full-softmax probabilities (ties to the lower id, so ids[..., 0] is the argmax) -> (ids (B, T, k)
        int32, probs (B, T, k) f32). The forward's hidden rows stay readable through `hidden()`."""
        rec = self.gpu.recorder()
        forward.record(rec)
        return self.topk_after(rec, k)

    def topk_after(self, rec, k: int) -> tuple[np.ndarray, np.ndarray]:
        """`run_topk` after a forward already recorded into `rec`: the head and top-k, submit, read."""
        g, N = self.gpu, self.N
        call, ids_out, probs_out = self._topk_call(k)
        call.record(rec)
        rec.submit()
        shape = (self.B, self.T, k)
        ids = g.download(ids_out, np.uint32, N * k).reshape(shape).astype(np.int32)
        return ids, g.download(probs_out, np.float32, N * k).reshape(shape)

    def hidden(self) -> tuple[np.ndarray, np.ndarray]:
        """The last forward's (pre-norm, post-norm) final hidden rows, each (B, T, C)."""
        shape = (self.B, self.T, self.C)
        return (
            self.gpu.download(self.xL, np.float32, self.N * self.C).reshape(shape),
            self.gpu.download(self.xf, np.float32, self.N * self.C).reshape(shape),
        )

    def finish(self, rec, with_scalars: bool, with_mtp: bool = False) -> np.ndarray:
        """Copy the loss sum (and the optimizer's norm, clip multiplier, finite flag; the joint draft's loss
        sum) into the read-back buffer, submit `rec`, read it."""
        rec.copy(self.loss_acc, 0, self.readback, 0, 4)
        if with_scalars:
            rec.copy(self.net.scalars, 0, self.readback, 4, 12)
        if with_mtp:
            rec.copy(self.loss_acc, 4, self.readback, 16, 4)
        rec.submit()
        return self.gpu.download(self.readback, np.float32, 5)
