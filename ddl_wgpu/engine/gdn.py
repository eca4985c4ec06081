"""The Gated DeltaNet mixer on the GPU (Qwen3.5's linear attention, docs/model.md#gated-deltanet): the
activations of one layer and the Calls of its forward and backward, for `blocks.Blocks`, mirrored op for op
like `ddl_ref.gdn.gdn_forward` / `gdn_backward`.

    X = h Wqkvᵀ;  z = h Wzᵀ;  a = h Waᵀ;  b = h Wbᵀ                     four GEMMs (ops.matmul)
    c = silu(causal_conv(X))                       planar q | k | v     ops.gdn_inputs.conv_forward
    q̂, k̂ = L2-normalised q (/√Dk), k               an RMSNorm            ops.gdn_inputs.l2norm_forward
    g, β = −exp(A_log)·softplus(a + dt_bias), σ(b)                        ops.gdn_inputs.gates_forward
    o = the gated delta rule over t (state Dk × Dv per value head)       ops.gated_delta (chunked)
    y = silu(z) ⊙ RMSNorm(o) per value head (w·x̂)                         ops.rmsnorm + ops.swiglu
    out = y Woutᵀ                                                        ops.matmul (into the residual)

The rule runs in its chunked form (`ops.gated_delta.chunk_forward` / `chunk_backward`,
docs/kernels.md#the-chunked-form) through one scratch buffer every Gated DeltaNet layer shares (`gdn_scr`),
except in an inference net's forward where the per-token kernel measured faster (short rows, or a model of many
value heads: `ops.gated_delta.per_token`, `gdn_per_token`);
the backward runs the same ops in reverse, through one set of scratch buffers the layers share
(`gdn_scratch`). What each layer keeps for its backward: the GEMM outputs (X, z, a, b), the conv output,
q̂/k̂ and the gates, the rule's Δ (its per-token corrections) and the state before each chunk (training nets
only), o and its normalised form, y.

Decoding with a cache (`ddl_wgpu.engine.decode.TrunkRows`) runs the same forward, overriding two steps: the conv
(`_gdn_conv`: it reads the cache's window of the k−1 inputs before the pass) and the rule (`_gdn_rule`: it
starts from the cache's state and writes the state after every row into the cache, which the per-token
kernel does: `ops.gated_delta.gated_delta_forward`).
"""

from __future__ import annotations

import numpy as np

from ddl_ref.params import linear_conv_channels
from ddl_wgpu.ops import gated_delta as k_gd
from ddl_wgpu.ops import gdn_inputs as k_gi
from ddl_wgpu.ops import rmsnorm as k_norm
from ddl_wgpu.ops import sub
from ddl_wgpu.ops import swiglu as k_swiglu
from ddl_wgpu.runtime.gpu import Call


class GatedDeltaNet:
    """Mixin of `blocks.Blocks`: a linear_attention block's activations (`gdn_acts`), forward
    (`gdn_forward`) and backward (`gdn_backward`). Needs the Blocks' `_linear`, `_linear_backward`,
    `_linears`, `_project_out`, `act`, `net`, `gpu`, `cfg`, `B`, `T`, `N`, `C`."""

    def _gdn_sizes(self):
        cfg = self.cfg
        return cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim

    @property
    def gdn_plan(self) -> k_gd.ChunkPlan:
        """The chunked kernels' plan for this shape and adapter (`ops.gated_delta.chunk_plan`)."""
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        return k_gd.chunk_plan(self.gpu, Dk, Dv)

    @property
    def gdn_per_token(self) -> bool:
        """Whether this net's forward runs the rule per token: an inference net's short rows, or any rows of a
        model with many value heads (`ops.gated_delta.per_token`, docs/kernels.md#the-per-token-forward)."""
        return self.net.inference and k_gd.per_token(self.T, self.cfg.linear_v_heads)

    def gdn_scr(self):
        """The chunked rule's scratch, one for every layer: the forward's per-chunk matrices, and in a net
        that trains the backward's parts too (`ops.gated_delta.chunk_sizes`); none for a per-token forward."""
        if getattr(self, "_gdn_scr_buf", None) is None:
            Hk, Hv, Dk, Dv = self._gdn_sizes()
            training = not self.net.inference
            n = 4
            if not self.gdn_per_token:
                n = k_gd.chunk_scratch_floats(self.gpu, self.B, self.T, Hv, Dk, Dv, training, self.gdn_plan)
            self._gdn_scr_buf = self.act(n, "gdn_chunk_scratch")
        return self._gdn_scr_buf

    def gdn_acts(self, tag: str, a: dict) -> dict:
        """A Gated DeltaNet layer's saved activations, added to the block's dict `a`."""
        B, T, N, act = self.B, self.T, self.N, self.act
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        ab = k_gi.align_floats(N * Hv)
        a.update(
            X=act(N * linear_conv_channels(self.cfg), f"gdn_X{tag}"),
            z=act(N * Hv * Dv, f"gdn_z{tag}"),
            ab=act(2 * ab, f"gdn_ab{tag}"),  # a, then b at an aligned offset
            cv=act(k_gi.planar_floats(N, Hk, Hv, Dk, Dv), f"gdn_conv{tag}"),
            qkgb=act(k_gd.qkgb_floats(N, Hk, Hv, Dk), f"gdn_qkgb{tag}"),
            qkr=act(k_gi.rstd_floats(N, Hk), f"gdn_qk_rstd{tag}"),
            o=act(N * Hv * Dv, f"gdn_o{tag}"),
            delta=act(N * Hv * Dv, f"gdn_delta{tag}"),  # Δ (chunked), or v − u (the per-token rule)
            on=act(N * Hv * Dv, f"gdn_on{tag}"),
            orstd=act(N * Hv, f"gdn_o_rstd{tag}"),
            y=act(N * Hv * Dv, f"gdn_y{tag}"),
        )
        # the state before each chunk for the backward (training nets); an inference net's forward saves none
        n_states = k_gd.states_floats(B, Hv, Dk, Dv, T, self.gdn_plan.chunk) if not self.net.inference else 4
        a["states"] = act(n_states, f"gdn_states{tag}")
        a["scr"] = self.gdn_scr()
        return a

    def gdn_scratch(self) -> dict:
        """Backward scratch shared by every Gated DeltaNet layer."""
        N, act = self.N, self.act
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        Ch = linear_conv_channels(self.cfg)
        return dict(
            dy=act(N * Hv * Dv, "gdn_dy"),
            dz=act(N * Hv * Dv, "gdn_dz"),
            don=act(N * Hv * Dv, "gdn_don"),
            do=act(N * Hv * Dv, "gdn_do"),
            dqk=act(k_gi.qk_floats(N, Hv, Dk), "gdn_dqk"),
            dqk_sum=act(k_gi.qk_floats(N, Hk, Dk), "gdn_dqk_per_key_head"),
            dgg=act(N * Hv, "gdn_dgg"),
            dab=act(2 * k_gi.align_floats(N * Hv), "gdn_dab"),
            dcv=act(k_gi.planar_floats(N, Hk, Hv, Dk, Dv), "gdn_dconv"),
            dpre=act(N * Ch, "gdn_dpre"),
            dX=act(N * Ch, "gdn_dX"),
            ones=self.gpu.upload(np.ones(N, np.float32), "gdn_ones"),  # the gates' row sums are a GEMM
        )

    def _ab(self, buf) -> tuple[tuple, tuple]:
        n = self.N * self._gdn_sizes()[1]
        return sub(buf, 0, n), sub(buf, k_gi.align_floats(n), n)

    def gdn_forward(self, a: dict, p: str, out, accumulate: bool) -> Call:
        """The mixer of block `p` from a["h"] into `out` (+= with `accumulate`)."""
        g, cfg, P, N, C = self.gpu, self.cfg, self.net.view, self.N, self.C
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        q = p + "linear_attn."
        Ch = linear_conv_channels(cfg)
        ga, gb_ = self._ab(a["ab"])
        k_off, gb_off = k_gd.qkgb_offsets(N, Hk, Dk)
        call = self._linears(a["h"], C, [(a["X"], q + "in_proj_qkv.weight", Ch), (a["z"], q + "in_proj_z.weight", Hv * Dv),
                                         (ga, q + "in_proj_a.weight", Hv), (gb_, q + "in_proj_b.weight", Hv)])  # fmt: skip
        call += self._gdn_conv(a, q)
        call += k_gi.l2norm_forward(g, sub(a["qkgb"], 0, gb_off), a["qkr"], a["cv"], N, Hk, Dk)
        call += k_gi.gates_forward(g, sub(a["qkgb"], gb_off, 2 * N * Hv), ga, gb_, P(q + "A_log"),
                                   P(q + "dt_bias"), N, Hv)  # fmt: skip
        call += self._gdn_rule(a, q)
        call += k_norm.rmsnorm_forward(g, a["on"], a["orstd"], a["o"], P(q + "norm.weight"), N * Hv, Dv,
                                       cfg.rms_eps, "standard")  # fmt: skip
        call += k_swiglu.swiglu_forward(g, a["y"], a["z"], a["on"], N * Hv * Dv)
        return call + self._project_out(out, a["y"], q + "out_proj.weight", Hv * Dv, accumulate)

    def _gdn_conv(self, a: dict, q: str, hist=None) -> Call:
        """a["cv"] = silu(causal conv of a["X"]); before t = 0 the inputs are `hist` (B, k−1, Ch), else zeros
        (a decoding pass overrides this to read and keep its cache's window: `decode.TrunkRows`)."""
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        w = self.net.view(q + "conv1d.weight")
        return k_gi.conv_forward(self.gpu, a["cv"], a["X"], w, self.B, self.T, Hk, Hv, Dk, Dv,
                                 self.cfg.linear_conv_kernel, hist=hist)  # fmt: skip

    def _gdn_rule(self, a: dict, q: str, states=None, state_in=None, tc: int | None = None,
                  save_final: bool = False) -> Call:  # fmt: skip
        """a["o"] = the gated delta rule from the layer's q, k, gates and v: the chunked kernels, which in a
        training net also save the state before each chunk (and always Δ), or in an inference net's short
        rows (`gdn_per_token`) the per-token kernel. Given `states`, `state_in` and `tc` (a decoding pass:
        `decode.TrunkRows`), the per-token kernel from `state_in`, writing the state before every tc-th row
        and, with `save_final`, the last into `states` (`ops.gated_delta.gated_delta_forward`)."""
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        v_off = k_gi.planar_offsets(self.N, Hk, Dk)[1]
        g, B, T = self.gpu, self.B, self.T
        if states is not None:
            return k_gd.gated_delta_forward(g, a["o"], a["delta"], states, a["qkgb"], a["cv"], B, T, Hk, Hv, Dk, Dv,
                                            tc=tc or T, v_off=v_off, v_stride=Hv * Dv, state_in=state_in,
                                            save_final=save_final)  # fmt: skip
        if self.gdn_per_token:
            return k_gd.gated_delta_forward(g, a["o"], a["delta"], a["states"], a["qkgb"], a["cv"], B, T, Hk, Hv, Dk,
                                            Dv, tc=T, v_off=v_off, v_stride=Hv * Dv, save_ckpt=False)  # fmt: skip
        return k_gd.chunk_forward(g, a["o"], a["delta"], a["states"], a["scr"], a["qkgb"], a["cv"], B, T, Hk, Hv, Dk,
                                  Dv, plan=self.gdn_plan, v_off=v_off, v_stride=Hv * Dv,
                                  save_ckpt=not self.net.inference)  # fmt: skip

    def gdn_backward(self, a: dict, p: str, dout, accumulate_dh: bool) -> Call:
        """Reverse of `gdn_forward`: from d(out) to d(a["h"]) in self.dh (+= with `accumulate_dh`)."""
        g, cfg, P, N, C, s = self.gpu, self.cfg, self.net.view, self.N, self.C, self.gd
        G = lambda n: self.net.view(n, "g")  # noqa: E731
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        q = p + "linear_attn."
        Ch, k = linear_conv_channels(cfg), cfg.linear_conv_kernel
        n = N * Hv * Dv
        ga, gb_ = self._ab(a["ab"])
        da, db = self._ab(s["dab"])
        v_off = k_gi.planar_offsets(N, Hk, Dk)[1]
        call = self._linear_backward(s["dy"], dout, a["y"], q + "out_proj.weight", C, Hv * Dv)
        call += k_swiglu.swiglu_backward(g, s["dz"], s["don"], s["dy"], a["z"], a["on"], n)
        call += k_norm.rmsnorm_backward(g, s["do"], G(q + "norm.weight"), s["don"], a["o"], P(q + "norm.weight"),
                                        a["orstd"], N * Hv, Dv, "standard")  # fmt: skip
        call += k_gd.chunk_backward(g, s["dqk"], s["dcv"], a["scr"], a["states"], a["delta"], a["qkgb"], a["cv"],
                                    s["do"], self.B, self.T, Hk, Hv, Dk, Dv, plan=self.gdn_plan, v_off=v_off,
                                    v_stride=Hv * Dv)  # fmt: skip
        dgb = k_gd.chunk_dg_view(g, a["scr"], self.B, self.T, Hv, Dk, Dv, self.gdn_plan)  # [dg, dbeta]
        call += k_gi.gates_backward(g, da, db, G(q + "A_log"), G(q + "dt_bias"), dgb, ga, gb_, P(q + "A_log"),
                                    P(q + "dt_bias"), s["ones"], N, Hv, 1, dgg=s["dgg"])  # fmt: skip
        call += k_gi.l2norm_backward(g, s["dcv"], s["dqk"], a["qkr"], a["cv"], N, Hk, Dk,
                                     G=Hv // Hk, summed=s["dqk_sum"])  # fmt: skip
        call += k_gi.conv_backward(g, s["dX"], G(q + "conv1d.weight"), s["dcv"], a["X"], P(q + "conv1d.weight"),
                                   self.B, self.T, Hk, Hv, Dk, Dv, k, dpre=s["dpre"])  # fmt: skip
        dh, h = self.dh, a["h"]
        call += self._linear_backward(dh, s["dX"], h, q + "in_proj_qkv.weight", Ch, C, accumulate_dh)
        call += self._linear_backward(dh, s["dz"], h, q + "in_proj_z.weight", Hv * Dv, C, True)
        call += self._linear_backward(dh, da, h, q + "in_proj_a.weight", Hv, C, True)
        return call + self._linear_backward(dh, db, h, q + "in_proj_b.weight", Hv, C, True)
