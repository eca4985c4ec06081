"""Launcher for `shaders/mtp_input.wgsl`: the MTP draft's normed input halves [enorm(e); hnorm(h)] per row.

Kernel path: `shaders/mtp_input.wgsl` -> `ddl_wgpu/ops/mtp_input.py` -> reference
`ddl_ref.mtp.draft_input_forward` (through `ddl_ref.mtp.step_input`, which also masks rows) -> test
`tests/test_kernel_mtp_input.py`.

heal builds the draft's block input x = eh_proj · [enorm(E[t]); hnorm(h)] of every window on the GPU
(`heal_gpu.DraftInput`): the embedding gather (`vocab.Vocab.embed_forward`, f32 or f16 table, row chunks),
this kernel, then the projection on `matmul`. Rows with valid = 0 (past a window's end) come out as zero
rows of `cat`, hence of x. Forward only (heal keeps the input projection frozen).

What it does not do: the projection itself, or a backward.
"""

from __future__ import annotations

from ddl_wgpu.ops.elementwise import need
from ddl_wgpu.runtime.gpu import Call, Gpu, Uniform

FILE = "mtp_input.wgsl"
WG = 256  # threads per workgroup (one row each), as in the shader
PARAMS = Uniform(
    "Params",
    ("rows", "u32", "rows of cat (B·T)"),
    ("C", "u32", "channels of e and h; cat has 2C"),
    ("T", "u32", "rows per window of cat"),
    ("h_stride", "u32", "rows per window of h"),
    ("h_offset", "u32", "row of window b, position 0 within h's window"),
    ("e_col", "u32", "column of cat where enorm(e) starts (0 or C)"),
    ("h_col", "u32", "column of cat where hnorm(h) starts (C or 0)"),
    ("eps", "f32"),
    ("style", "u32", "0 standard (w), 1 offset (1 + w)"),
)
CONCATS = ("emb_first", "hidden_first")
STYLES = {"standard": 0, "offset": 1}


def mtp_input_rows(gpu: Gpu, cat, e, h, wn, valid, rows: int, C: int, T: int, eps: float,
                   style: str = "standard", concat: str = "emb_first", h_stride: int | None = None,
                   h_offset: int = 0) -> Call:  # fmt: skip
    """cat (rows, 2C) = [enorm(e[r]); hnorm(h[hr])] (`concat` "emb_first"; "hidden_first" swaps the halves),
    zero where valid[r] == 0. e (rows, C); wn (2C,) = enorm weight then hnorm weight; valid (rows,) f32;
    h holds windows of `h_stride` rows (default T), row r = b·T + t reading h row b·h_stride + h_offset + t."""
    rows, C, T = int(rows), int(C), int(T)
    h_stride = T if h_stride is None else int(h_stride)
    if concat not in CONCATS:
        raise ValueError(f"concat must be one of {list(CONCATS)}, got {concat!r}")
    if style not in STYLES:
        raise ValueError(f"rmsnorm style must be 'standard' or 'offset', got {style!r}")
    if rows % T or not 0 <= h_offset <= h_stride - T:
        raise ValueError(f"mtp_input_rows: {rows} rows of windows of {T}, h windows of {h_stride} from "
                         f"{h_offset}")  # fmt: skip
    need("mtp_input_rows", "cat", cat, rows * 2 * C)
    need("mtp_input_rows", "e", e, rows * C)
    need("mtp_input_rows", "h", h, rows // T * h_stride * C)
    need("mtp_input_rows", "wn", wn, 2 * C)
    need("mtp_input_rows", "valid", valid, rows)
    k = gpu.kernel(FILE, "mtp_input_rows", "rrrrwu", workgroup=(WG, 1, 1), uniforms=(PARAMS,))
    e_col = 0 if concat == "emb_first" else C
    u = gpu.uniform(PARAMS, rows=rows, C=C, T=T, h_stride=h_stride, h_offset=int(h_offset), e_col=e_col,
                    h_col=C - e_col, eps=float(eps), style=STYLES[style], label="mtp_input_rows")  # fmt: skip
    return Call([(k, gpu.bind(k, e, h, wn, valid, cat, u), max(1, rows))], [u])
