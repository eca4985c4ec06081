"""Launchers for `shaders/gdn_inputs.wgsl`: what turns a Gated DeltaNet layer's projections into the gated
delta rule's inputs (the causal conv with SiLU, the L2 norm of q and k, the gates), forward and backward
(docs/model.md#gated-deltanet).

Kernel path: `shaders/gdn_inputs.wgsl` -> `ddl_wgpu/ops/gdn_inputs.py` -> reference
`ddl_ref.gdn.causal_conv_forward`, `causal_conv_backward`, `l2norm_forward`, `l2norm_backward` and the gates of
`ddl_ref.gdn.gdn_forward` / `gdn_backward` -> test `tests/test_kernel_gdn_inputs.py`.

Rows n = b*T + t. The projection x is (rows, Ch), Ch = 2*Hk*Dk + Hv*Dv ([q; k; v]); the conv writes its output
planar (`planar_offsets`): q (rows, Hk*Dk), then k, then v (rows, Hv*Dv), which is what the L2 norm and the
rule read.

The L2 norm is an RMSNorm (`ops.rmsnorm`) with a constant weight: x·rsqrt(Σx² + ε) = x·w·rsqrt(mean(x²) + ε/D)
with w = 1/√D, and q's extra 1/√Dk scale folds into w = 1/D. So q and k reuse the RMSNorm kernels (forward,
backward and the saved rstd) instead of a kernel of their own; the backward's unused weight gradient goes to a
scratch buffer.

Parameter gradients (the conv weight, A_log, dt_bias) are deterministic two-pass sums: per row block then a
fixed-order sum (conv), or a GEMM with a ones vector (the gates' per-row terms).
"""

from __future__ import annotations

import math

import numpy as np

from ddl_wgpu.ops import need_all as _need
from ddl_wgpu.ops import sub
from ddl_wgpu.ops.matmul import matmul
from ddl_wgpu.ops.rmsnorm import rmsnorm_backward, rmsnorm_forward
from ddl_wgpu.runtime.gpu import Call, Gpu, Uniform

FILE = "gdn_inputs.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = Uniform(
    "Params",
    ("rows", "u32", "B * T"),
    ("T", "u32"),
    ("Ch", "u32", "channels of the projection: 2 * qk_cols + v_cols"),
    ("k", "u32", "conv taps"),
    ("qk_cols", "u32", "Hk * Dk"),
    ("v_cols", "u32", "Hv * Dv"),
    ("Hk", "u32"),
    ("Hv", "u32"),
    ("Dk", "u32"),
    ("Dv", "u32"),
    ("G", "u32", "value heads per key head"),
    ("has_hist", "u32", "conv: 1 reads the history before t = 0, 0 zeros"),
    ("accumulate", "u32", "conv dx / dw: 1 adds into the output"),
    ("rows_per_block", "u32", "conv dw pass 1"),
    ("n_blocks", "u32"),
    ("k_off", "u32", "floats: k's start in the planar conv output"),
    ("v_off", "u32", "floats: v's start"),
    ("src_off", "u32", "head_group_sum: floats, dk's start in src"),
    ("dst_off", "u32", "head_group_sum: dk's start in dst"),
    ("_pad", "pad"),
)


def align_floats(n: int) -> int:
    """n floats rounded up to 256 bytes: where a part of a shared buffer starts, so it can be bound alone."""
    return -(-int(n) // 64) * 64


def planar_offsets(rows: int, Hk: int, Dk: int) -> tuple[int, int]:
    """Float offsets of k and of v in the planar conv output (q starts at 0); also k's offset in the qk
    buffer the L2 norm writes and the gated delta rule reads."""
    k_off = align_floats(int(rows) * int(Hk) * int(Dk))
    return k_off, 2 * k_off


def planar_floats(rows: int, Hk: int, Hv: int, Dk: int, Dv: int) -> int:
    """Floats of the planar conv output (and of its gradient)."""
    return planar_offsets(rows, Hk, Dk)[1] + int(rows) * int(Hv) * int(Dv)


def conv_blocks(rows: int) -> tuple[int, int]:
    """(rows_per_block, n_blocks) of the conv weight gradient: blocks of about sqrt(rows) rows (>= 16)."""
    rpb = max(16, math.isqrt(max(0, int(rows) - 1)) + 1)
    return rpb, -(-max(1, int(rows)) // rpb)


def _uniform(gpu, label, rows, T, Hk, Hv, Dk, Dv, k=4, has_hist=0, accumulate=0, rpb=0, n_blocks=0,
             src_off=0, dst_off=0):  # fmt: skip
    qk, vc = Hk * Dk, Hv * Dv
    k_off, v_off = planar_offsets(rows, Hk, Dk)
    return gpu.uniform(PARAMS, rows=rows, T=T, Ch=2 * qk + vc, k=k, qk_cols=qk, v_cols=vc, Hk=Hk, Hv=Hv, Dk=Dk,
                       Dv=Dv, G=Hv // Hk, has_hist=int(bool(has_hist)), accumulate=int(bool(accumulate)),
                       rows_per_block=rpb, n_blocks=n_blocks, k_off=k_off, v_off=v_off, src_off=src_off,
                       dst_off=dst_off, label=label)  # fmt: skip


def _k(gpu: Gpu, entry: str, sig: str):
    return gpu.kernel(FILE, entry, sig, workgroup=(WG, 1, 1), uniforms=(PARAMS,))


def _groups(n: int) -> int:
    return max(1, -(-int(n) // WG))


# ---------------------------------------------------------------------------------------------------------
# the causal conv


def conv_forward(gpu: Gpu, out, x, w, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, k: int,
                 hist=None) -> Call:  # fmt: skip
    """out (planar, rows x Ch) = silu(causal depthwise conv over time of x (rows, Ch) with w (Ch, k)); before
    t = 0 the input is `hist` (B, k-1, Ch) when given (decoding), else zeros."""
    rows, Ch = B * T, 2 * Hk * Dk + Hv * Dv
    _need("conv_forward", out=(out, planar_floats(rows, Hk, Hv, Dk, Dv)), x=(x, rows * Ch), w=(w, Ch * k))
    if hist is not None:
        _need("conv_forward", hist=(hist, B * (k - 1) * Ch))
    p = _uniform(gpu, "conv_forward", rows, T, Hk, Hv, Dk, Dv, k, has_hist=hist is not None)
    kf = _k(gpu, "conv_forward", "rrrwu")
    return Call([(kf, gpu.bind(kf, x, w, hist if hist is not None else w, out, p), _groups(rows * Ch))], [p])


def conv_backward(gpu: Gpu, dx, dw, dout, x, w, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, k: int,
                  dpre=None, accumulate_dx: bool = False) -> Call:  # fmt: skip
    """From dout (planar): dx (rows, Ch) (+)= the input gradient, dw (Ch, k) += the weight gradient. `dpre`:
    a (rows, Ch) scratch for dout * silu'(pre) (allocated when None)."""
    rows, Ch = B * T, 2 * Hk * Dk + Hv * Dv
    rpb, n_blocks = conv_blocks(rows)
    if dpre is None:
        dpre = gpu.buffer(4 * rows * Ch, label="conv dpre")
    partials = gpu.buffer(4 * n_blocks * Ch * k, label="conv dw partials")
    _need("conv_backward", dx=(dx, rows * Ch), dw=(dw, Ch * k), dout=(dout, planar_floats(rows, Hk, Hv, Dk, Dv)),
          x=(x, rows * Ch),
          w=(w, Ch * k), dpre=(dpre, rows * Ch))  # fmt: skip
    sizes = (rows, T, Hk, Hv, Dk, Dv, k)
    pp = _uniform(gpu, "conv_backward_pre", *sizes)
    px = _uniform(gpu, "conv_backward_dx", *sizes, accumulate=accumulate_dx)
    pg = _uniform(gpu, "conv_grad", *sizes, accumulate=1, rpb=rpb, n_blocks=n_blocks)
    k1, k2 = _k(gpu, "conv_backward_pre", "rrrrwu"), _k(gpu, "conv_backward_dx", "rrwu")
    k3, k4 = _k(gpu, "conv_grad_partial", "rrrwu"), _k(gpu, "conv_grad_reduce", "rwu")
    call = Call(
        [
            (k1, gpu.bind(k1, dout, x, w, w, dpre, pp), _groups(rows * Ch)),
            (k2, gpu.bind(k2, dpre, w, dx, px), _groups(rows * Ch)),
            (k3, gpu.bind(k3, dpre, x, w, partials, pg), n_blocks * -(-Ch // WG)),
            (k4, gpu.bind(k4, partials, dw, pg), _groups(Ch * k)),
        ],
        [pp, px, pg],
    )
    call.scratch = (dpre, partials)  # kept alive with the call (the bind groups refer to them)
    return call


# ---------------------------------------------------------------------------------------------------------
# the L2 norm of q and k: an RMSNorm with a constant weight


def l2norm_weights(gpu: Gpu, Dk: int):
    """The constant RMSNorm weights that make the L2 norm: 1/Dk for q (with its 1/√Dk scale), 1/√Dk for k."""
    w = np.concatenate([np.full(Dk, 1.0 / Dk), np.full(Dk, 1.0 / math.sqrt(Dk))]).astype(np.float32)
    buf, _ = gpu.upload_ranges([w[:Dk], w[Dk:]])
    return buf, (buf, 0, 4 * Dk), (buf, -(-4 * Dk // 256) * 256, 4 * Dk)


def qk_floats(rows: int, H: int, Dk: int) -> int:
    """Floats of a [q; k] buffer of H heads per row (k at `align_floats(rows*H*Dk)`)."""
    return 2 * align_floats(int(rows) * int(H) * int(Dk))


def rstd_floats(rows: int, Hk: int) -> int:
    """Floats of the L2 norm's saved rstd: q's rows, then k's at an aligned offset."""
    return 2 * align_floats(int(rows) * int(Hk))


def l2norm_forward(gpu: Gpu, qk, rstd, conv_out, rows: int, Hk: int, Dk: int, eps: float = 1e-6) -> Call:
    """qk = [q̂ / √Dk; k̂] (each (rows, Hk, Dk), k at `planar_offsets`' k offset) from the planar conv output's
    q and k; rstd (`rstd_floats`)."""
    n = rows * Hk
    ko, ro = align_floats(n * Dk), align_floats(n)
    _need("l2norm_forward", qk=(qk, 2 * ko), rstd=(rstd, 2 * ro), conv_out=(conv_out, 2 * ko))
    arena, wq, wk = l2norm_weights(gpu, Dk)
    call = Call()
    for s, w in enumerate((wq, wk)):
        call += rmsnorm_forward(gpu, sub(qk, s * ko, n * Dk), sub(rstd, s * ro, n),
                                sub(conv_out, s * ko, n * Dk), w, n, Dk, eps / Dk, "standard")  # fmt: skip
    call.scratch = arena  # kept alive with the call (`gpu.Call.scratch`)
    return call


def l2norm_backward(gpu: Gpu, dconv_out, dqk, rstd, conv_out, rows: int, Hk: int, Dk: int, G: int = 1,
                    summed=None) -> Call:  # fmt: skip
    """The q and k parts of d(conv out) (planar) from dqk = [dq; dk] per VALUE head (`qk_floats(rows, Hk*G,
    Dk)`: the rule's gradients); the G value heads of a key head are summed first, into `summed`
    (`qk_floats(rows, Hk, Dk)`, allocated when None)."""
    n = rows * Hk
    ko, ro = align_floats(n * Dk), align_floats(n)
    _need("l2norm_backward", dconv_out=(dconv_out, 2 * ko), dqk=(dqk, qk_floats(rows, Hk * G, Dk)),
          rstd=(rstd, 2 * ro), conv_out=(conv_out, 2 * ko))  # fmt: skip
    call = Call()
    if G > 1:
        if summed is None:
            summed = gpu.buffer(4 * 2 * ko, label="dqk per key head")
        p = _uniform(gpu, "head_group_sum", rows, 1, Hk, Hk * G, Dk, 1, src_off=align_floats(n * G * Dk),
                     dst_off=ko)  # fmt: skip
        kh = _k(gpu, "head_group_sum", "rwu")
        call += Call([(kh, gpu.bind(kh, dqk, summed, p), _groups(2 * n * Dk))], [p])
        dqk = summed
    arena, wq, wk = l2norm_weights(gpu, Dk)
    dw_scratch = gpu.buffer(4 * Dk, label="l2norm dw (unused)")
    for s, w in enumerate((wq, wk)):
        call += rmsnorm_backward(gpu, sub(dconv_out, s * ko, n * Dk), dw_scratch, sub(dqk, s * ko, n * Dk),
                                 sub(conv_out, s * ko, n * Dk), w, sub(rstd, s * ro, n), n, Dk,
                                 "standard")  # fmt: skip
    call.scratch = (arena, dw_scratch, summed)
    return call


# ---------------------------------------------------------------------------------------------------------
# the gates


def gates_forward(gpu: Gpu, gb, a, b, A_log, dt_bias, rows: int, Hv: int) -> Call:
    """gb (rows, Hv, 2) = [g, beta]: g = -exp(A_log)·softplus(a + dt_bias), beta = sigmoid(b); a, b (rows, Hv)."""
    _need("gates_forward", gb=(gb, 2 * rows * Hv), a=(a, rows * Hv), b=(b, rows * Hv), A_log=(A_log, Hv),
          dt_bias=(dt_bias, Hv))  # fmt: skip
    p = _uniform(gpu, "gates_forward", rows, 1, 1, Hv, 1, 1)
    kf = _k(gpu, "gates_forward", "rrrrwu")
    return Call([(kf, gpu.bind(kf, a, b, A_log, dt_bias, gb, p), _groups(rows * Hv))], [p])


def gates_backward(gpu: Gpu, da, db, dA_log, ddt_bias, dgb, a, b, A_log, dt_bias, ones, rows: int, Hv: int,
                   Dv: int, dgg=None) -> Call:  # fmt: skip
    """da, db (rows, Hv) (overwritten) and dA_log, ddt_bias (Hv,) (accumulated) from the rule's per-column terms
    dgb (rows, Hv, 2, Dv). `ones`: rows ones (the row sums are a GEMM); `dgg`: (rows, Hv) scratch."""
    _need("gates_backward", da=(da, rows * Hv), db=(db, rows * Hv), dA_log=(dA_log, Hv), ddt_bias=(ddt_bias, Hv),
          dgb=(dgb, 2 * rows * Hv * Dv), a=(a, rows * Hv), b=(b, rows * Hv), ones=(ones, rows))  # fmt: skip
    if dgg is None:
        dgg = gpu.buffer(4 * rows * Hv, label="dg * g")
    p = _uniform(gpu, "gates_backward", rows, 1, 1, Hv, 1, Dv)
    kb = _k(gpu, "gates_backward", "rrrrrwwwu")
    call = Call([(kb, gpu.bind(kb, dgb, a, b, A_log, dt_bias, da, db, dgg, p), _groups(rows * Hv))], [p])
    # (1, rows) @ (rows, Hv): the sums over rows, each output one thread's fixed-order loop
    call += matmul(gpu, dA_log, ones, dgg, 1, Hv, rows, accumulate=True)
    call += matmul(gpu, ddt_bias, ones, da, 1, Hv, rows, accumulate=True)
    call.scratch = dgg
    return call
