"""Launchers for `shaders/rmsnorm.wgsl`: RMSNorm over the last axis of a (rows, C) tensor.

Kernel path: `shaders/rmsnorm.wgsl` -> `ddl_wgpu/ops/rmsnorm.py` -> reference `ddl_ref.ops.rmsnorm_forward`,
`ddl_ref.ops.rmsnorm_backward` -> test `tests/test_kernel_rmsnorm.py`.

style "standard": out = w * xhat (Llama/Qwen3); "offset": out = (1 + w) * xhat (Gemma/Qwen3.5); xhat = x * rstd,
rstd = 1 / sqrt(mean(x^2) + eps). The forward saves rstd (rows,) for the backward. The same launchers serve
the per-head q/k norm (rows = B * T * heads, C = head_dim).

Row kernels (`row_layout`): TPR threads share a row and each holds IPT items of it in registers (generated
straight-line code, `unroll`), so the forward reads x once and the backward reads x and dout once. Rows move
as vec4<f32> when C % 4 == 0 (`elementwise.vec_width`).

The backward is two dispatches: one pass over the rows that writes dx (optionally accumulated: the engine sums
the residual-stream gradient this way) and, per block of rows, the partial sums of dw into a scratch buffer
(n_blocks, C); then a fixed-order sum of the blocks added into dw (accumulated by default: a weight's
gradient sums over the micro-batches of a step). The blocking depends only on the shape
(`rmsnorm_dw_blocks`), so results are bit-identical run to run. Memory traffic: x, dout read once, dx written
once (plus dx read when accumulating), and the partials (n_blocks / rows of the row traffic) written and
read once.

What it does not do: a bias, a mean-subtracting LayerNorm, or fusing the residual add.
"""

from __future__ import annotations

from ddl_wgpu.ops import pow2_at_least
from ddl_wgpu.ops.elementwise import need, templates, vec_width
from ddl_wgpu.runtime.gpu import Call, Gpu, Uniform

FILE = "rmsnorm.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = Uniform(
    "Params",
    ("rows", "u32"),
    ("C", "u32", "channels (not items of F)"),
    ("eps", "f32"),
    ("style", "u32", "0 standard (w), 1 offset (1 + w)"),
    ("accumulate_dx", "u32", "backward: 1 adds into dx, 0 overwrites it"),
    ("accumulate_dw", "u32", "dw reduce: 1 adds into dw, 0 overwrites it"),
    ("rows_per_block", "u32", "backward: rows of one dw partial (a multiple of WG / TPR)"),
    ("n_blocks", "u32", "backward: ceil(rows / rows_per_block)"),
)
STYLES = {"standard": 0, "offset": 1}
# Items (f32 or vec4) of a row one thread holds at most, while the row has WG threads or fewer: more items
# per thread means fewer threads per row (a shorter row sum) but more registers. Measured on the H200
# (16384 x 768 and 98304 x 128, vec4): 4 beats 8 for the forward, both backwards and the Delta kernels
# (which hold up to six items' worth of operands per item and use this too).
IPT_MAX = 4
# dw blocks: a workgroup walks its block in passes of its WG / TPR row slots, at least MIN_PASSES of them
# (and at least MIN_BLOCK_ROWS rows, for rows of one slot per workgroup), so the partial row it writes (and
# the reduce pass reads) stays small beside the rows it reads: 1/16 of a stream at 768 channels. Past
# MAX_BLOCKS blocks they grow instead (the reduce pass's serial sums stay short). Measured on the H200
# (16384 x 768): 4 passes (1024 blocks) beat 8 (512) and 2 (2048).
MIN_PASSES = 4
MIN_BLOCK_ROWS = 16
MAX_BLOCKS = 4096


def _style(style: str) -> int:
    if style not in STYLES:
        raise ValueError(f"rmsnorm style must be 'standard' or 'offset', got {style!r}")
    return STYLES[style]


def row_layout(items: int, ipt_max: int | None = None) -> tuple[int, int]:
    """(TPR, IPT) for a row of `items` (C, or C / 4 on the vec4 path): TPR threads per row, a power of two
    (at most WG) with at most `ipt_max` (default IPT_MAX) items each where that fits, and IPT =
    ceil(items / TPR) items per thread (more than `ipt_max` only for rows longer than WG * ipt_max). Shared
    with ops/delta.py."""
    items = max(1, int(items))
    tpr = min(WG, pow2_at_least(-(-items // int(IPT_MAX if ipt_max is None else ipt_max))))
    return tpr, -(-items // tpr)


def unroll(ipt: int, text: str, sep: str = "\n    ") -> str:
    """`text` once per item k < ipt with every '#' replaced by k: the straight-line per-item code of the row
    kernels (named variables x0, x1, ... rather than a private array; shared with ops/delta.py)."""
    return sep.join(text.replace("#", str(k)) for k in range(int(ipt)))


def _templates(width: int, ipt: int) -> dict:
    """Template values of rmsnorm.wgsl: the item type, and the per-item code for IPT items per thread."""
    t = templates(width)
    t["FW_LOAD"] = unroll(
        ipt, "let c# = lane + #u * TPR; var x# = F(0.0); if (ok && c# < CI) { x# = fw_x[base + c#]; }"
    )
    t["FW_SS"] = unroll(ipt, "x# * x#", " + ")
    t["FW_STORE"] = unroll(ipt, "if (c# < CI) { fw_out[base + c#] = weff(fw_w[c#], fw_p.style) * (x# * r); }")
    t["BW_INIT"] = unroll(
        ipt,
        "let c# = lane + #u * TPR; let in# = c# < CI; var we# = F(0.0); "
        "if (in#) { we# = weff(bw_w[c#], bw_p.style); } var dw# = F(0.0);",
    )
    t["BW_LOAD"] = unroll(
        ipt,
        "var x# = F(0.0); var g# = F(0.0); if (ok && in#) { x# = bw_x[base + c#]; g# = bw_dout[base + c#]; }",
        "\n        ",
    )
    t["BW_DOT"] = unroll(ipt, "g# * we# * x#", " + ")
    t["BW_STORE"] = unroll(
        ipt,
        "if (ok && in#) { var d = rs * (g# * we# - x# * m); if (acc) { d += bw_dx[base + c#]; } "
        "bw_dx[base + c#] = d; } dw# += g# * (x# * rs);",
        "\n        ",
    )
    t["BW_PARTIAL"] = unroll(
        ipt, "let s# = slot_sum(lid.x, dw#); if (slot == 0u && in#) { bw_partials[b * CI + c#] = s#; }"
    )
    return t


def rmsnorm_dw_blocks(rows: int, C: int, width: int = 1) -> tuple[int, int]:
    """(rows_per_block, n_blocks) of the backward's dw partials (`width` 4 on the vec4 path); a function of
    the shape only, so the order of the additions (and the bits of dw) never changes between runs.

    A block is MIN_PASSES passes of the workgroup's WG / TPR row slots (and at least MIN_BLOCK_ROWS rows),
    more when that would give more than MAX_BLOCKS blocks."""
    rows = max(1, int(rows))
    slots = WG // row_layout(int(C) // width)[0]
    rpb = slots * max(MIN_PASSES, -(-MIN_BLOCK_ROWS // slots), -(-rows // (slots * MAX_BLOCKS)))
    return rpb, -(-rows // rpb)


def reduce_channels(items: int, n_blocks: int) -> int:
    """Items per workgroup (the `CW` override) of the dw reduce pass: WG / CW block lanes with about 4
    blocks each, so the pass has many workgroups and short serial sums."""
    lanes = min(WG, pow2_at_least(-(-int(n_blocks) // 4)))
    return min(WG // lanes, pow2_at_least(items))


def rmsnorm_partials_size(rows: int, C: int) -> int:
    """Bytes of the scratch buffer `rmsnorm_backward` needs for its dw partials (n_blocks, C): enough for
    either path (f32 or vec4)."""
    widths = (1, 4) if int(C) % 4 == 0 else (1,)
    return 4 * int(C) * max(rmsnorm_dw_blocks(rows, C, w)[1] for w in widths)


def _row_kernel(gpu: Gpu, entry: str, sig: str, C: int, width: int):
    tpr, ipt = row_layout(C // width)
    k = gpu.kernel(FILE, entry, sig, {"TPR": tpr}, _templates(width, ipt), (WG, 1, 1), uniforms=(PARAMS,))
    return k, WG // tpr  # kernel, rows per workgroup (row slots)


def rmsnorm_forward(
    gpu: Gpu, out, rstd, x, w, rows: int, C: int, eps: float, style: str = "standard"
) -> Call:
    """out (rows, C) = weff * x * rstd, rstd (rows,) saved for the backward; x (rows, C), w (C,)."""
    rows, C = int(rows), int(C)
    for name, r, n in (("out", out, rows * C), ("rstd", rstd, rows), ("x", x, rows * C), ("w", w, C)):
        need("rmsnorm_forward", name, r, n)
    k, rpw = _row_kernel(gpu, "rmsnorm_forward", "rrwwu", C, vec_width(C, out, x, w))
    fields = dict(accumulate_dx=0, accumulate_dw=0, rows_per_block=0, n_blocks=0)
    u = gpu.uniform(PARAMS, rows=rows, C=C, eps=eps, style=_style(style), **fields, label="rmsnorm_forward")
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
    if partials is None:
        partials = gpu.buffer(rmsnorm_partials_size(rows, C), label="rmsnorm dw partials")
    need("rmsnorm_backward", "partials", partials, n_blocks * C)
    u = gpu.uniform(
        PARAMS,
        rows=rows,
        C=C,
        eps=0.0,
        style=_style(style),
        accumulate_dx=int(bool(accumulate_dx)),
        accumulate_dw=int(bool(accumulate_dw)),
        rows_per_block=rpb,
        n_blocks=n_blocks,
        label="rmsnorm_backward",
    )
    tpr, ipt = row_layout(C // width)
    tm = _templates(width, ipt)  # both entry points from one module
    kb = gpu.kernel(FILE, "rmsnorm_backward", "rrrrwwu", {"TPR": tpr}, tm, (WG, 1, 1), uniforms=(PARAMS,))
    cw = reduce_channels(C // width, n_blocks)
    k2 = gpu.kernel(FILE, "rmsnorm_backward_dw_reduce", "rwu", {"CW": cw}, tm, (WG, 1, 1), uniforms=(PARAMS,))
    call = Call(
        [
            (kb, gpu.bind(kb, dout, x, w, rstd, dx, partials, u), n_blocks),
            (k2, gpu.bind(k2, partials, dw, u), -(-(C // width) // cw)),
        ],
        [u],
    )
    call.scratch = partials  # kept alive with the call (the bind groups refer to it)
    return call
