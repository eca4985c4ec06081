"""Launchers for `shaders/elementwise.wgsl`: the small utilities a step needs between the real kernels.

Kernel path: `shaders/elementwise.wgsl` -> `ddl_wgpu/ops/elementwise.py` -> reference numpy itself (no
`ddl_ref` function) -> test `tests/test_kernel_elementwise.py`.

- `add_forward(out, a, b)`: out = a + b;
- `add_inplace(y, x)`: y += x (the residual stream, summing gradients);
- `axpy(y, x, alpha)`: y += alpha * x;
- `copy(dst, src)`; `fill(buf, value)` (zeroing gradients); `scale_inplace(y, alpha)`;
- `round_f16(y)`: y = f32(f16(y)) rounded to nearest even, numpy's `astype(float16)` bit for bit (heal's draft
  rows kept on the GPU between chain steps, with the bits its float16 host cache gives them).

Each returns a `Call` whose only uniform is `Params {n: u32, alpha: f32}` (n counts items of the shader's
type: n / 4 on the vec4 path); a per-step scalar (a fill value, a scale) is changed with
`set_alpha(gpu, call, alpha)`, which rewrites alpha alone.

The shaders are written over a type F, filled in as f32 or vec4<f32> (`templates`): the vec4 variant is used
when n % 4 == 0 and every binding offset is a multiple of 16 (always true for the 256-aligned arenas), and moves
about twice the bytes per second on the H200. The helpers `view`, `need`, `vec_width` and `templates` are
shared with the other small families (rmsnorm, rope, swiglu, embedding).

What it does not do: broadcasting or strides; every operand is a flat run of n f32 values.
"""

from __future__ import annotations

from ddl_wgpu.ops import need, view  # re-exported: the other launchers import them from here
from ddl_wgpu.runtime.gpu import Call, Gpu, Uniform

FILE = "elementwise.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = Uniform(
    "Params",
    ("n", "u32", "number of items of F"),
    ("alpha", "f32", "the scalar of axpy, fill and scale_inplace (unused elsewhere)"),
)


def vec_width(n: int, *resources) -> int:
    """4 when items can be moved as vec4<f32> (n divisible by 4 and every binding offset by 16), else 1."""
    return 4 if int(n) % 4 == 0 and all(view(r)[1] % 16 == 0 for r in resources) else 1


def templates(width: int) -> dict:
    """Template values of the shaders that are written over `F` (f32 or vec4<f32>)."""
    if width == 4:
        return {"F": "vec4<f32>", "U": "vec4<u32>", "LANES": 4, "HSUM": "(v.x + v.y) + (v.z + v.w)"}
    return {"F": "f32", "U": "u32", "LANES": 1, "HSUM": "v"}


def _launch(gpu: Gpu, entry: str, sig: str, resources: list, n: int, alpha: float = 0.0) -> Call:
    n = int(n)
    width = vec_width(n, *resources)
    k = gpu.kernel(FILE, entry, sig, templates=templates(width), workgroup=(WG, 1, 1), uniforms=(PARAMS,))
    u = gpu.uniform(PARAMS, n=n // width, alpha=alpha, label=entry)
    groups = max(1, -(-(n // width) // WG))
    return Call([(k, gpu.bind(k, *resources, u), groups)], [u])


def set_alpha(gpu: Gpu, call: Call, alpha: float):
    """Rewrite the scalar of an `axpy`, `fill` or `scale_inplace` Call (Params.alpha) for the next submit,
    leaving n as it was."""
    gpu.write_fields(call.uniforms[0], PARAMS, alpha=alpha)


def add_forward(gpu: Gpu, out, a, b, n: int) -> Call:
    """out = a + b over n items."""
    for name, r in (("out", out), ("a", a), ("b", b)):
        need("add_forward", name, r, n)
    return _launch(gpu, "add_forward", "rrwu", [a, b, out], n)


def add_inplace(gpu: Gpu, y, x, n: int) -> Call:
    """y += x over n items (y and x must be different buffers)."""
    need("add_inplace", "y", y, n)
    need("add_inplace", "x", x, n)
    return _launch(gpu, "add_inplace", "rwu", [x, y], n)


def axpy(gpu: Gpu, y, x, n: int, alpha: float) -> Call:
    """y += alpha * x over n items."""
    need("axpy", "y", y, n)
    need("axpy", "x", x, n)
    return _launch(gpu, "axpy", "rwu", [x, y], n, alpha)


def copy(gpu: Gpu, dst, src, n: int) -> Call:
    """dst = src over n items. (Between whole buffers `Recorder.copy` also works, but it ends the compute
    pass; this one stays inside it.)"""
    need("copy", "dst", dst, n)
    need("copy", "src", src, n)
    return _launch(gpu, "copy", "rwu", [src, dst], n)


def fill(gpu: Gpu, buf, n: int, value: float = 0.0) -> Call:
    """buf = value over n items (zeroing gradients before a step)."""
    need("fill", "buf", buf, n)
    return _launch(gpu, "fill", "wu", [buf], n, value)


def scale_inplace(gpu: Gpu, y, n: int, alpha: float) -> Call:
    """y *= alpha over n items."""
    need("scale_inplace", "y", y, n)
    return _launch(gpu, "scale_inplace", "wu", [y], n, alpha)


def round_f16(gpu: Gpu, y, n: int) -> Call:
    """y = f32(f16(y)) over n items, to nearest with ties to even (numpy's `astype(float16)`, subnormals, inf
    from 65520 on and NaN included)."""
    need("round_f16", "y", y, n)
    return _launch(gpu, "round_f16", "wu", [y], n)
