"""Launchers for `shaders/rmsnorm.wgsl`: RMSNorm over the last axis of a (rows, C) tensor.

style "standard": out = w * xhat (Llama/Qwen3); "offset": out = (1 + w) * xhat (Gemma/Qwen3.5); xhat = x * rstd,
rstd = 1 / sqrt(mean(x^2) + eps). The forward saves rstd (rows,) for the backward. The same launchers serve
the per-head q/k norm (rows = B * T * heads, C = head_dim).

The backward is three dispatches: dx per row (optionally accumulated: the engine sums the residual-stream
gradient this way), then dw by a deterministic two-pass reduction — per-row-block partial sums into a scratch
buffer (n_blocks, C), then a fixed-order sum of the blocks added into dw (accumulated by default: a weight's
gradient sums over the micro-batches of a step). The block size depends only on `rows`
(`rmsnorm_dw_blocks`), so results are bit-identical run to run.

What it does not do: a bias, a mean-subtracting LayerNorm, or fusing the residual add.
"""

from __future__ import annotations

import math

from ddl_wgpu.gpu import Call, Gpu

FILE = "rmsnorm.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = "uufuuuuu"  # Params {rows, C, eps, style, accumulate_dx, accumulate_dw, rows_per_block, n_blocks}
STYLES = {"standard": 0, "offset": 1}


def _nbytes(res) -> int:
    return res[2] if isinstance(res, tuple) else res.size


def _need(entry: str, name: str, res, n: int):
    if _nbytes(res) < 4 * n:
        raise ValueError(f"{entry}: {name} has {_nbytes(res)} bytes, needs {4 * n}")


def _style(style: str) -> int:
    if style not in STYLES:
        raise ValueError(f"rmsnorm style must be 'standard' or 'offset', got {style!r}")
    return STYLES[style]


def threads_per_row(C: int) -> int:
    """Threads that share one row: the next power of two >= C, at most one workgroup (WG)."""
    return min(WG, 1 << max(0, int(C) - 1).bit_length())


def rmsnorm_dw_blocks(rows: int) -> tuple[int, int]:
    """(rows_per_block, n_blocks) of the dw reduction. Blocks of about sqrt(rows) rows (at least 64)
    balance the serial sums of the two passes: pass 1 sums rows_per_block rows, pass 2 n_blocks blocks."""
    rows = max(1, int(rows))
    rpb = max(64, math.isqrt(rows - 1) + 1)
    return rpb, -(-rows // rpb)


def rmsnorm_partials_size(rows: int, C: int) -> int:
    """Bytes of the scratch buffer `rmsnorm_backward` needs for its dw partials."""
    return 4 * rmsnorm_dw_blocks(rows)[1] * int(C)


def _row_kernel(gpu: Gpu, entry: str, sig: str, C: int):
    tpr = threads_per_row(C)
    k = gpu.kernel(FILE, entry, sig, constants={"TPR": tpr}, workgroup=(WG, 1, 1))
    return k, WG // tpr  # kernel, rows per workgroup


def rmsnorm_forward(
    gpu: Gpu, out, rstd, x, w, rows: int, C: int, eps: float, style: str = "standard"
) -> Call:
    """out (rows, C) = weff * x * rstd, rstd (rows,) saved for the backward; x (rows, C), w (C,)."""
    rows, C = int(rows), int(C)
    for name, r, n in (("out", out, rows * C), ("rstd", rstd, rows), ("x", x, rows * C), ("w", w, C)):
        _need("rmsnorm_forward", name, r, n)
    k, rpw = _row_kernel(gpu, "rmsnorm_forward", "rrwwu", C)
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
        _need("rmsnorm_backward", name, r, n)
    _need("rmsnorm_backward", "w", w, C)
    _need("rmsnorm_backward", "rstd", rstd, rows)
    rpb, n_blocks = rmsnorm_dw_blocks(rows)
    if partials is None:
        partials = gpu.buffer(rmsnorm_partials_size(rows, C), label="rmsnorm dw partials")
    _need("rmsnorm_backward", "partials", partials, n_blocks * C)
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
    kdx, rpw = _row_kernel(gpu, "rmsnorm_backward", "rrrrwu", C)
    k1 = gpu.kernel(FILE, "rmsnorm_backward_dw_partial", "rrrwu", workgroup=(WG, 1, 1))
    k2 = gpu.kernel(FILE, "rmsnorm_backward_dw_reduce", "rwu", workgroup=(WG, 1, 1))
    call = Call(
        [
            (kdx, gpu.bind(kdx, dout, x, w, rstd, dx, u), -(-rows // rpw)),
            (k1, gpu.bind(k1, dout, x, rstd, partials, u), -(-n_blocks * C // WG)),
            (k2, gpu.bind(k2, partials, dw, u), -(-C // WG)),
        ],
        [u],
    )
    call.scratch = partials  # kept alive with the call (the bind groups refer to it)
    return call
