"""Launcher for `shaders/gemv.wgsl`: matrix-vector products for the few rows of a decoding pass.

Kernel path: `shaders/gemv.wgsl` -> `ddl_wgpu/ops/gemv.py` -> reference `ddl_ref.ops.linear_forward` -> test
`tests/test_kernel_gemv.py`.

`gemv(y, x, w, n, OUT, IN)`: y[r, col0 + o] (+)= Σ_i x[r, i] · w[o, i] for r < n, with w (OUT, IN) the
Hugging Face linear layout in f32 or f16 (read as u32 pairs and widened, so no shader-f16 is needed). One
workgroup per output, a fixed-order tree over its threads: deterministic. `ddl_wgpu.decode` uses it for the
linear layers and the LM head of passes of at most `GEMV_MAX_ROWS` rows, where the tiled GEMM would leave
most of each tile idle.

The test checks f32 rows as vec4 and as scalars, f16 weights (against the f16-rounded weights), accumulation
and an output column offset.
"""

from __future__ import annotations

from ddl_wgpu.gpu import Call, Gpu, Uniform, grid
from ddl_wgpu.ops import need, view

FILE = "gemv.wgsl"
GW = 64  # threads per output, as in the shader
GEMV_MAX_ROWS = 8  # rows up to which a decoding pass uses gemv instead of the tiled GEMM
PARAMS = Uniform(
    "GemvParams",
    ("n", "u32", "rows of x and y"),
    ("out_", "u32", "OUT"),
    ("items", "u32", "IN in items of X"),
    ("ldy", "u32", "floats per row of y"),
    ("col0", "u32", "first column of y written"),
    ("acc", "u32", "1: y += ..., 0: y = ..."),
)


def gemv(gpu: Gpu, y, x, w, n: int, out_features: int, in_features: int, w_dtype: str = "f32", ldy: int | None = None,
         col0: int = 0, accumulate: bool = False) -> Call:  # fmt: skip
    """y[r, col0 + o] (+)= Σ_i x[r, i] · w[o, i] for r < n; w (OUT, IN) f32 or f16 (read as u32 pairs)."""
    ldy = out_features if ldy is None else int(ldy)
    if w_dtype == "f16" and (in_features % 4 or view(x)[1] % 16):
        raise ValueError(
            f"gemv: f16 weights need in_features % 4 == 0 and x 16-byte aligned, got {in_features}"
        )
    vec = in_features % 4 == 0 and all(view(r)[1] % 16 == 0 for r in (x, w))
    need("gemv", "x", x, n * in_features)
    need("gemv", "y", y, (n - 1) * ldy + col0 + out_features)
    if w_dtype == "f16":
        tm = {"X": "vec4<f32>", "WT": "vec2<u32>", "HSUM": "(v.x + v.y) + (v.z + v.w)",
              "LOADW": "vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y))"}  # fmt: skip
    elif vec:
        tm = {"X": "vec4<f32>", "WT": "vec4<f32>", "HSUM": "(v.x + v.y) + (v.z + v.w)", "LOADW": "w"}
    else:
        tm = {"X": "f32", "WT": "f32", "HSUM": "v", "LOADW": "w"}
    items = in_features // 4 if tm["X"] != "f32" else in_features
    k = gpu.kernel(FILE, "gemv", "rrwu", templates=tm, workgroup=(GW, 1, 1), uniforms=(PARAMS,))
    u = gpu.uniform(PARAMS, label="gemv", n=n, out_=out_features, items=items, ldy=ldy, col0=col0,
                    acc=int(accumulate))  # fmt: skip
    return Call([(k, gpu.bind(k, x, w, y, u), grid(out_features))], [u])
