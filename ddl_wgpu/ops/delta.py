"""Launchers for `shaders/delta.wgsl`: the Deep Delta residual update (ddl.md §1.2, §1.5, §5) of one sublayer.

Rows r = b*T + t (N = B*T rows). The state X is (rows, C, dv) row-major (d_v = 1 is X of shape (rows, C, 1)),
u (the sublayer output k̃), c (the normalized context, β input) and x_v (the v input) are (rows, C).
Parameters: w_beta (C,), b_beta (1,), W_v (dv, C), b_v (dv,). Reference: `ddl_ref.delta`.

The forward saves per row `stats` (rows, STATS) with STATS = stats_size(dv) = 2 + 2*dv:

    stats[r, STAT_N]                    n = sqrt(|u|^2 + eps^2)
    stats[r, STAT_BETA]                 beta = 2 sigmoid(w_beta . c + b_beta)
    stats[r, STAT_V : STAT_V + dv]      v = s sigmoid(W_v x_v + b_v)
    stats[r, stat_p(dv) : + dv]         p = X^T k  (p starts at STAT_V + dv)

read by the backward and by the spectral diagnostics (k = u / n, δ = v - p, γ = β δ).

Each launcher is two dispatches (the fused form would bind 10-12 storage buffers, over the portable 8; the
split reads every tensor once all the same, see the shader's header). Parameter gradients are plain GEMMs
through `ops.matmul` (deterministic: each output summed by one thread in a fixed order).

What it does not do: mixed precision, the MLP β head (`ddl_beta_single_linear=False`), or d_v > 4.
"""

from __future__ import annotations

from ddl_wgpu.gpu import Call, Gpu
from ddl_wgpu.ops import need_all as _need
from ddl_wgpu.ops.matmul import matmul

FILE = "delta.wgsl"
PARAMS = "uuffuuuu"  # Params {rows, C, eps2, v_scale, accumulate_dc, accumulate_dx_v, pad, pad}
MAX_DV = 4
KSUM_WG = 256
KSUM_KW = 8  # channels per ksum workgroup, as in the shader

# the per-row stats layout
STAT_N = 0
STAT_BETA = 1
STAT_V = 2


def stats_size(dv: int) -> int:
    """Floats per row of `stats`: [n, beta, v_0..v_{dv-1}, p_0..p_{dv-1}]."""
    return 2 + 2 * int(dv)


def stat_p(dv: int) -> int:
    """Offset of p = X^T k within a row of `stats`."""
    return STAT_V + int(dv)


def _check_dv(entry: str, dv: int):
    if not 1 <= int(dv) <= MAX_DV:
        raise ValueError(f"{entry}: dv={dv} must be in 1..{MAX_DV}")


def row_threads(C: int) -> int:
    """Threads per row (the `WG` override): about 4 channels each, a power of two in [32, 256]."""
    per = -(-int(C) // 4)
    return min(256, max(32, 1 << max(0, per - 1).bit_length()))


def _kernel(gpu: Gpu, entry: str, sig: str, C: int, dv: int, wg: int | None = None):
    wg = row_threads(C) if wg is None else wg
    return gpu.kernel(FILE, entry, sig, constants={"WG": wg, "DV": int(dv)}, workgroup=(wg, 1, 1))


def delta_forward(
    gpu: Gpu, X_new, stats, X, u, c, x_v, w_beta, b_beta, W_v, b_v, rows: int, C: int, dv: int,
    k_eps: float, v_scale: float,
) -> Call:  # fmt: skip
    """X_new (rows, C, dv) = X + k (β (v - Xᵀk))ᵀ; stats (rows, STATS) as in the module docstring.
    X_new must be a different buffer from X."""
    rows, C, dv = int(rows), int(C), int(dv)
    _check_dv("delta_forward", dv)
    S = stats_size(dv)
    _need("delta_forward", X_new=(X_new, rows * C * dv), stats=(stats, rows * S), X=(X, rows * C * dv),
          u=(u, rows * C), c=(c, rows * C), x_v=(x_v, rows * C), w_beta=(w_beta, C), b_beta=(b_beta, 1),
          W_v=(W_v, dv * C), b_v=(b_v, dv))  # fmt: skip
    p = gpu.uniform(PARAMS, rows, C, float(k_eps) ** 2, float(v_scale), 0, 0, 0, 0, label="delta_forward")
    kh = _kernel(gpu, "delta_heads", "rrrrrrwu", C, dv)
    ku = _kernel(gpu, "delta_update", "rrwwu", C, dv)
    return Call(
        [
            (kh, gpu.bind(kh, c, x_v, w_beta, b_beta, W_v, b_v, stats, p), rows),
            (ku, gpu.bind(ku, X, u, X_new, stats, p), rows),
        ],
        [p],
    )


def delta_backward(
    gpu: Gpu, dX, du, da, dz, dc, dx_v, G, X, u, stats, w_beta, W_v, rows: int, C: int, dv: int,
    v_scale: float, accumulate_dc: bool = True, accumulate_dx_v: bool = True,
) -> Call:  # fmt: skip
    """From G = dL/dX_new (rows, C, dv), with q = Gᵀk:

    dX (rows, C, dv) = G - β k qᵀ                     du (rows, C) = (dk - k (k·dk)) / n, dk = β (G δ - X q)
    da (rows,) = (δ·q) β (1 - β/2)  (dL/d beta logit)  dz (rows, dv) = β q ⊙ v (1 - v/s)  (dL/d v logits)
    dc (rows, C) (+)= da w_β                           dx_v (rows, C) (+)= dz W_v

    dX, du, da, dz are overwritten; dc and dx_v accumulate by default. All buffers distinct (G and dX too).
    Feed da and dz to `delta_param_grads`.
    """
    rows, C, dv = int(rows), int(C), int(dv)
    _check_dv("delta_backward", dv)
    _need("delta_backward", dX=(dX, rows * C * dv), du=(du, rows * C), da=(da, rows), dz=(dz, rows * dv),
          dc=(dc, rows * C), dx_v=(dx_v, rows * C), G=(G, rows * C * dv), X=(X, rows * C * dv), u=(u, rows * C),
          stats=(stats, rows * stats_size(dv)), w_beta=(w_beta, C), W_v=(W_v, dv * C))  # fmt: skip
    p = gpu.uniform(PARAMS, rows, C, 0.0, float(v_scale), int(bool(accumulate_dc)), int(bool(accumulate_dx_v)),
                    0, 0, label="delta_backward")  # fmt: skip
    kr = _kernel(gpu, "delta_backward_rows", "rrrrwwwwu", C, dv)
    ki = _kernel(gpu, "delta_backward_inputs", "rrrrwwu", C, dv, wg=256)
    return Call(
        [
            (kr, gpu.bind(kr, G, X, u, stats, dX, du, da, dz, p), rows),
            (ki, gpu.bind(ki, da, dz, w_beta, W_v, dc, dx_v, p), -(-rows * C // 256)),
        ],
        [p],
    )


def delta_param_grads(
    gpu: Gpu, dw_beta, db_beta, dW_v, db_v, da, dz, c, x_v, ones, rows: int, C: int, dv: int
) -> Call:
    """Accumulate (+=) the head parameters' gradients, summed over rows, as GEMMs:
    dw_β (1, C) += daᵀ c,  db_β (1,) += daᵀ 1,  dW_v (dv, C) += dzᵀ x_v,  db_v (dv,) += dzᵀ 1.
    `ones` is a (rows,) buffer of 1.0 the caller provides (shared by every Delta layer)."""
    rows, C, dv = int(rows), int(C), int(dv)
    _need("delta_param_grads", ones=(ones, rows), da=(da, rows), dz=(dz, rows * dv), c=(c, rows * C),
          x_v=(x_v, rows * C))  # fmt: skip
    call = matmul(gpu, dw_beta, da, c, 1, C, rows, trans_a=True, accumulate=True)
    call += matmul(gpu, db_beta, da, ones, 1, 1, rows, trans_a=True, accumulate=True)
    call += matmul(gpu, dW_v, dz, x_v, dv, C, rows, trans_a=True, accumulate=True)
    call += matmul(gpu, db_v, dz, ones, dv, 1, rows, trans_a=True, accumulate=True)
    return call


def ksum(gpu: Gpu, out, u, stats, weights, rows: int, C: int, dv: int) -> Call:
    """out (C,) = sum_r weights[r] u[r, :] / n_r = sum_r weights[r] k_r (the spectral k-coherence numerator;
    weights (rows,) is typically the real-token mask). Deterministic: a fixed row order per lane and a
    fixed tree over the lanes."""
    rows, C, dv = int(rows), int(C), int(dv)
    _check_dv("ksum", dv)
    _need("ksum", out=(out, C), u=(u, rows * C), stats=(stats, rows * stats_size(dv)), weights=(weights, rows))  # fmt: skip
    p = gpu.uniform(PARAMS, rows, C, 0.0, 0.0, 0, 0, 0, 0, label="delta_ksum")
    k = _kernel(gpu, "delta_ksum", "rrrwu", C, dv, wg=KSUM_WG)
    return Call([(k, gpu.bind(k, u, stats, weights, out, p), -(-C // KSUM_KW))], [p])
