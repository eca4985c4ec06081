"""Launchers for `shaders/rope.wgsl`: rotary position embedding (rotate-half) on x (B, T, N, D).

Kernel path: `shaders/rope.wgsl` -> `ddl_wgpu/ops/rope.py` -> reference `ddl_ref.ops.rope_forward`,
`ddl_ref.ops.rope_backward` -> test `tests/test_kernel_rope.py`.

The tables cos/sin are (T_max, R) f32 with T_max >= T, from `ddl_ref.ops.rope_tables`, uploaded once; row t
is position t, and positions run 0..T-1 within each sequence of the batch. R = `rotary` (default D) is the
rotated width: partial rotary (Qwen3.5, R = D/4) rotates the first R channels of each head and passes the
others through.

In place: when `out is x` (or `dx is dout`; or both are the same view of the same buffer) the launcher
picks the `*_inplace` entry point, which binds that buffer once as read_write (binding one buffer twice
with one binding writable is a wgpu usage conflict). Two different views of one buffer are refused for the
same reason.

Items move as vec4<f32> when head_dim / 2 and R / 2 are multiples of 4 (`elementwise.vec_width`).

What it does not do: interleaved pairs, or position offsets (KV-cache decoding: `decode.rope_at`).
"""

from __future__ import annotations

from ddl_wgpu.ops.elementwise import need, templates, vec_width, view
from ddl_wgpu.runtime.gpu import Call, Gpu, Uniform

FILE = "rope.wgsl"
WG = 256  # threads per workgroup, as in the shader
# counted in items of the shader's type (f32 or vec4)
PARAMS = Uniform(
    "Params",
    ("pairs", "u32", "B * T * N * h / LANES"),
    ("T", "u32"),
    ("N", "u32"),
    ("D", "u32", "head_dim / LANES: a row of x, in items of F"),
    ("R", "u32", "rotated items of a row (<= D): a row of a table"),
    ("_pad0", "pad"),
    ("_pad1", "pad"),
    ("_pad2", "pad"),
)


def _same(a, b) -> bool:
    """True when a and b are the same buffer range; raises when they are different ranges of one buffer."""
    if a is b:
        return True
    va, vb = view(a), view(b)
    if va[0] is not vb[0]:
        return False
    if va[1:] == vb[1:]:
        return True
    raise ValueError("rope: input and output are different views of one buffer; wgpu cannot bind that")


def _launch(gpu: Gpu, entry: str, out, x, cos, sin, B: int, T: int, N: int, D: int, rotary=None) -> Call:
    B, T, N, D = int(B), int(T), int(N), int(D)
    R = D if rotary is None else int(rotary)
    if D % 2 or R % 2 or not 0 < R <= D:
        raise ValueError(f"rope needs an even head_dim and an even rotated width <= it, got {D} and {R}")
    n = B * T * N * D
    for name, r, count in (("x", x, n), ("out", out, n), ("cos", cos, T * R), ("sin", sin, T * R)):
        need(entry, name, r, count)
    # pairs of items move as vec4 when h % 4 == 0 (and the pass-through pairs too)
    width = vec_width(D // 2, x, out, cos, sin) if R // 2 % 4 == 0 else 1
    pairs = n // 2 // width
    u = gpu.uniform(PARAMS, pairs=pairs, T=T, N=N, D=D // width, R=R // width, label=entry)
    tm = templates(width)
    if _same(out, x):
        k = gpu.kernel(
            FILE, entry + "_inplace", "rrwu", templates=tm, workgroup=(WG, 1, 1), uniforms=(PARAMS,)
        )
        bg = gpu.bind(k, cos, sin, x, u)
    else:
        k = gpu.kernel(FILE, entry, "rrrwu", templates=tm, workgroup=(WG, 1, 1), uniforms=(PARAMS,))
        bg = gpu.bind(k, x, cos, sin, out, u)
    return Call([(k, bg, max(1, -(-pairs // WG)))], [u])


def rope_forward(gpu: Gpu, out, x, cos, sin, B: int, T: int, N: int, D: int, rotary=None) -> Call:
    """out (B, T, N, D) = x * cos + rotate_half(x) * sin on the first `rotary` (default D) channels, the rest
    copied; `out` may be `x` (in place)."""
    return _launch(gpu, "rope_forward", out, x, cos, sin, B, T, N, D, rotary)


def rope_backward(gpu: Gpu, dx, dout, cos, sin, B: int, T: int, N: int, D: int, rotary=None) -> Call:
    """dx (B, T, N, D) = R^T dout (overwritten, not accumulated); `dx` may be `dout` (in place)."""
    return _launch(gpu, "rope_backward", dx, dout, cos, sin, B, T, N, D, rotary)
