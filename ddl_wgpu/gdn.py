"""The Gated DeltaNet mixer on the GPU (Qwen3.5's linear attention, docs/model.md#gated-deltanet): the
activations of one layer and the Calls of its forward and backward, for `blocks.Blocks`, mirrored op for op
like `ddl_ref.gdn.gdn_forward` / `gdn_backward`.

    X = h Wqkvᵀ;  z = h Wzᵀ;  a = h Waᵀ;  b = h Wbᵀ                     four GEMMs (ops.matmul)
    c = silu(causal_conv(X))                       planar q | k | v     ops.gdn_inputs.conv_forward
    q̂, k̂ = L2-normalised q (/√Dk), k               an RMSNorm            ops.gdn_inputs.l2norm_forward
    g, β = −exp(A_log)·softplus(a + dt_bias), σ(b)                        ops.gdn_inputs.gates_forward
    o = the gated delta rule over t (state Dk × Dv per value head)       ops.gated_delta
    y = silu(z) ⊙ RMSNorm(o) per value head (w·x̂)                         ops.rmsnorm + ops.swiglu
    out = y Woutᵀ                                                        ops.matmul (into the residual)

The backward runs the same ops in reverse, through one set of scratch buffers every Gated DeltaNet layer
shares (`gdn_scratch`), the delta rule's state scratch included. What each layer keeps for its backward: the
GEMM outputs (X, z, a, b), the conv output, q̂/k̂ and the gates, the rule's r = v − u and chunk checkpoints
(training nets only), o and its normalised form, y.

Decoding with a cache (`ddl_wgpu.decode.TrunkRows`) runs the same forward, overriding two steps: the conv
(`_gdn_conv`: it reads the cache's window of the k−1 inputs before the pass) and the rule (`_gdn_rule`: it
starts from the cache's state and writes the state after every row into the cache).
"""

from __future__ import annotations

import numpy as np

from ddl_ref.params import linear_conv_channels
from ddl_wgpu.gpu import Call
from ddl_wgpu.ops import gated_delta as k_gd
from ddl_wgpu.ops import gdn_inputs as k_gi
from ddl_wgpu.ops import rmsnorm as k_norm
from ddl_wgpu.ops import sub
from ddl_wgpu.ops import swiglu as k_swiglu

CHUNK = 64  # tokens per checkpointed chunk of the delta rule (memory: docs/kernels.md#the-gated-delta-rule)


class GatedDeltaNet:
    """Mixin of `blocks.Blocks`: a linear_attention block's activations (`gdn_acts`), forward
    (`gdn_forward`) and backward (`gdn_backward`). Needs the Blocks' `_linear`, `_linear_backward`,
    `_linears`, `_project_out`, `act`, `net`, `gpu`, `cfg`, `B`, `T`, `N`, `C`."""

    def _gdn_sizes(self):
        cfg = self.cfg
        return cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim

    @property
    def gdn_chunk(self) -> int:
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        return k_gd.chunk_tokens(self.gpu, self.B, Hv, Dk, Dv, self.T, CHUNK)

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
            r=act(N * Hv * Dv, f"gdn_r{tag}"),
            on=act(N * Hv * Dv, f"gdn_on{tag}"),
            orstd=act(N * Hv, f"gdn_o_rstd{tag}"),
            y=act(N * Hv * Dv, f"gdn_y{tag}"),
        )
        # checkpoints for the backward (training nets); an inference net's forward saves none
        n_states = k_gd.states_floats(B, Hv, Dk, Dv, T, self.gdn_chunk) if not self.net.inference else 4
        a["states"] = act(n_states, f"gdn_states{tag}")
        return a

    def gdn_scratch(self) -> dict:
        """Backward scratch shared by every Gated DeltaNet layer."""
        B, N, act = self.B, self.N, self.act
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        Ch = linear_conv_channels(self.cfg)
        return dict(
            dy=act(N * Hv * Dv, "gdn_dy"),
            dz=act(N * Hv * Dv, "gdn_dz"),
            don=act(N * Hv * Dv, "gdn_don"),
            do=act(N * Hv * Dv, "gdn_do"),
            dqk=act(k_gi.qk_floats(N, Hv, Dk), "gdn_dqk"),
            dqk_sum=act(k_gi.qk_floats(N, Hk, Dk), "gdn_dqk_per_key_head"),
            dgb=act(2 * N * Hv * Dv, "gdn_dgb"),
            dgg=act(N * Hv, "gdn_dgg"),
            dab=act(2 * k_gi.align_floats(N * Hv), "gdn_dab"),
            dcv=act(k_gi.planar_floats(N, Hk, Hv, Dk, Dv), "gdn_dconv"),
            dpre=act(N * Ch, "gdn_dpre"),
            dX=act(N * Ch, "gdn_dX"),
            scratch=act(k_gd.scratch_floats(B, Hv, Dk, Dv, self.gdn_chunk), "gdn_state_scratch"),
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
        """a["o"], a["r"] = the gated delta rule from the layer's q, k, gates and v; `states` (default the
        layer's checkpoints, written by training nets only) and `state_in` as `ops.gated_delta`'s (a
        decoding pass passes its cache's: `decode.TrunkRows`)."""
        Hk, Hv, Dk, Dv = self._gdn_sizes()
        v_off = k_gi.planar_offsets(self.N, Hk, Dk)[1]
        ckpt = states is not None or not self.net.inference
        states = a["states"] if states is None else states
        tc = self.gdn_chunk if tc is None else tc
        return k_gd.gated_delta_forward(self.gpu, a["o"], a["r"], states, a["qkgb"], a["cv"], self.B, self.T,
                                        Hk, Hv, Dk, Dv, tc=tc, v_off=v_off, v_stride=Hv * Dv, state_in=state_in,
                                        save_ckpt=ckpt, save_final=save_final)  # fmt: skip

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
        call += k_gd.gated_delta_backward(g, s["dqk"], s["dcv"], s["dgb"], s["scratch"], a["states"], a["qkgb"],
                                          a["r"], s["do"], self.B, self.T, Hk, Hv, Dk, Dv, tc=self.gdn_chunk,
                                          v_off=v_off, v_stride=Hv * Dv)  # fmt: skip
        call += k_gi.gates_backward(g, da, db, G(q + "A_log"), G(q + "dt_bias"), s["dgb"], ga, gb_, P(q + "A_log"),
                                    P(q + "dt_bias"), s["ones"], N, Hv, Dv, dgg=s["dgg"])  # fmt: skip
        call += k_gi.l2norm_backward(g, s["dcv"], s["dqk"], a["qkr"], a["cv"], N, Hk, Dk,
                                     G=Hv // Hk, summed=s["dqk_sum"])  # fmt: skip
        call += k_gi.conv_backward(g, s["dX"], G(q + "conv1d.weight"), s["dcv"], a["X"], P(q + "conv1d.weight"),
                                   self.B, self.T, Hk, Hv, Dk, Dv, k, dpre=s["dpre"])  # fmt: skip
        dh, h = self.dh, a["h"]
        call += self._linear_backward(dh, s["dX"], h, q + "in_proj_qkv.weight", Ch, C, accumulate_dh)
        call += self._linear_backward(dh, s["dz"], h, q + "in_proj_z.weight", Hv * Dv, C, True)
        call += self._linear_backward(dh, da, h, q + "in_proj_a.weight", Hv, C, True)
        return call + self._linear_backward(dh, db, h, q + "in_proj_b.weight", Hv, C, True)
