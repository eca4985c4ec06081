"""Launchers for `shaders/rmsnorm.wgsl`: RMSNorm over the last axis of a (rows, C) tensor.

style "standard": out = w * xhat (Llama/Qwen3); "offset": out = (1 + w) * xhat (Gemma/Qwen3.5); xhat = x * rstd,
rstd = 1 / sqrt(mean(x^2) + eps). The forward saves rstd (rows,) for the backward. The same launchers serve
the per-head q/k norm (rows = B * T * heads, C = head_dim).

The backward is three dispatches: dx per row (optionally accumulated: the engine sums the residual-stream
gradient this way), then dw by a deterministic two-pass reduction — per-row-block partial sums into a scratch
buffer (n_blocks, C), then a fixed-order sum of the blocks added into dw (accumulated by default: a weight's
gradient sums over the micro-batches of a step). The blocking depends only on the shape
(`rmsnorm_dw_blocks`), so results are bit-identical run to run.

Rows move as vec4<f32> when C % 4 == 0 (`elementwise.vec_width`); the row kernels give each row a power of
two of threads with about 4 items each (`threads_per_row`), several rows per workgroup when C is small.

What it does not do: a bias, a mean-subtracting LayerNorm, or fusing the residual add.
"""

from __future__ import annotations

import math

from ddl_wgpu.gpu import Call, Gpu
from ddl_wgpu.ops.elementwise import need, templates, vec_width

FILE = "rmsnorm.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = "uufuuuuu"  # Params {rows, C, eps, style, accumulate_dx, accumulate_dw, rows_per_block, n_blocks}
STYLES = {"standard": 0, "offset": 1}


def _style(style: str) -> int:
    if style not in STYLES:
        raise ValueError(f"rmsnorm style must be 'standard' or 'offset', got {style!r}")
    return STYLES[style]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def threads_per_row(items: int) -> int:
    """Threads that share one row of `items` (C, or C / 4 on the vec4 path) in the row kernels: about 4
    items each (a power of two), at most WG."""
    return min(WG, _pow2_at_least(-(-int(items) // 4)))


def dw_channels(items: int) -> tuple[int, int]:
    """Items per workgroup across a row (the `CW` override) of dw pass 1 and pass 2: 32 adjacent items give
    coalesced rows (128 bytes, or 512 with vec4) in pass 1; pass 2 trades width for more row lanes
    (WG / 8 = 32), since it sums the partials of every block. Narrow rows (per-head norms) get fewer items
    and more lanes."""
    return min(32, _pow2_at_least(items)), min(8, _pow2_at_least(items))


def rmsnorm_dw_blocks(rows: int, C: int, width: int = 1) -> tuple[int, int]:
    """(rows_per_block, n_blocks) of the dw reduction (`width` 4 on the vec4 path); a function of the shape
    only, so the order of the additions (and the bits of dw) never changes between runs.

    Pass 1 lane sums take rows_per_block / lanes1 steps and pass 2 lane sums n_blocks / lanes2; the block size
    balances the two (rows_per_block = sqrt(rows * lanes1 / lanes2)), with at least 4 steps in pass 1."""
    rows = max(1, int(rows))
    cw1, cw2 = dw_channels(int(C) // width)
    lanes1, lanes2 = WG // cw1, WG // cw2
    rpb = max(4 * lanes1, math.isqrt(max(0, rows * lanes1 // lanes2 - 1)) + 1)  # ceil(sqrt)
    rpb = -(-rpb // lanes1) * lanes1
    return rpb, -(-rows // rpb)


def rmsnorm_partials_size(rows: int, C: int) -> int:
    """Bytes of the scratch buffer `rmsnorm_backward` needs for its dw partials (n_blocks, C): enough for
    either path (f32 or vec4)."""
    widths = (1, 4) if int(C) % 4 == 0 else (1,)
    return 4 * int(C) * max(rmsnorm_dw_blocks(rows, C, w)[1] for w in widths)


def _row_kernel(gpu: Gpu, entry: str, sig: str, C: int, width: int):
    tpr = threads_per_row(C // width)
    k = gpu.kernel(FILE, entry, sig, constants={"TPR": tpr}, templates=templates(width), workgroup=(WG, 1, 1))
    return k, WG // tpr  # kernel, rows per workgroup


def rmsnorm_forward(
    gpu: Gpu, out, rstd, x, w, rows: int, C: int, eps: float, style: str = "standard"
) -> Call:
    """out (rows, C) = weff * x * rstd, rstd (rows,) saved for the backward; x (rows, C), w (C,)."""
    rows, C = int(rows), int(C)
    for name, r, n in (("out", out, rows * C), ("rstd", rstd, rows), ("x", x, rows * C), ("w", w, C)):
        need("rmsnorm_forward", name, r, n)
    k, rpw = _row_kernel(gpu, "rmsnorm_forward", "rrwwu", C, vec_width(C, out, x, w))
    u = gpu.uniform(PARAMS, rows, C, float(eps), _style(style), 0, 0, 0, 0, label="rmsnorm_forward")
    return Call([(k, gpu.bind(k, x, w, out, rstd, u), -(-rows // rpw))], [u])


def rmsnorm_backward(
    gpu: Gpu,
    dx,
    dw,
    dout,
    x,
    w,
    rstd,
    rows: int,
    C: int,
    style: str = "standard",
    accumulate_dx: bool = False,
    accumulate_dw: bool = True,
    partials=None,
) -> Call:
    """dx (rows, C) (+)= rstd * (g*weff - xhat * mean(g*weff*xhat)); dw (C,) (+)= sum over rows of dout*xhat.

    `partials` is a scratch buffer of at least `rmsnorm_partials_size(rows, C)` bytes (allocated here when
    None; several norms of one shape may share one, since the dispatches of a step run in order).
    """
    rows, C = int(rows), int(C)
    for name, r, n in (("dx", dx, rows * C), ("dw", dw, C), ("dout", dout, rows * C), ("x", x, rows * C)):
        need("rmsnorm_backward", name, r, n)
    need("rmsnorm_backward", "w", w, C)
    need("rmsnorm_backward", "rstd", rstd, rows)
    width = vec_width(C, dx, dw, dout, x, w, *([] if partials is None else [partials]))
    rpb, n_blocks = rmsnorm_dw_blocks(rows, C, width)
    cw1, cw2 = dw_channels(C // width)
    if partials is None:
        partials = gpu.buffer(rmsnorm_partials_size(rows, C), label="rmsnorm dw partials")
    need("rmsnorm_backward", "partials", partials, n_blocks * C)
    u = gpu.uniform(
        PARAMS,
        rows,
        C,
        0.0,
        _style(style),
        int(bool(accumulate_dx)),
        int(bool(accumulate_dw)),
        rpb,
        n_blocks,
        label="rmsnorm_backward",
    )
    tm = templates(width)
    kdx, rpw = _row_kernel(gpu, "rmsnorm_backward", "rrrrwu", C, width)
    k1 = gpu.kernel(FILE, "rmsnorm_backward_dw_partial", "rrrwu", {"CW": cw1}, tm, workgroup=(WG, 1, 1))
    k2 = gpu.kernel(FILE, "rmsnorm_backward_dw_reduce", "rwu", {"CW": cw2}, tm, workgroup=(WG, 1, 1))
    call = Call(
        [
            (kdx, gpu.bind(kdx, dout, x, w, rstd, dx, u), -(-rows // rpw)),
            (k1, gpu.bind(k1, dout, x, rstd, partials, u), n_blocks * -(-(C // width) // cw1)),
            (k2, gpu.bind(k2, partials, dw, u), -(-(C // width) // cw2)),
        ],
        [u],
    )
    call.scratch = partials  # kept alive with the call (the bind groups refer to it)
    return call
