"""Launchers for `shaders/elementwise.wgsl`: the small utilities a step needs between the real kernels.

- `add_forward(out, a, b)`: out = a + b;
- `add_inplace(y, x)`: y += x (the residual stream, summing gradients);
- `axpy(y, x, alpha)`: y += alpha * x;
- `copy(dst, src)`; `fill(buf, value)` (zeroing gradients); `scale_inplace(y, alpha)`.

Each returns a `Call` whose only uniform is `Params {n: u32, alpha: f32}` (format `PARAMS`), so a per-step
scalar (a fill value, a scale) is changed with `gpu.write_uniform(call.uniforms[0], PARAMS, n, alpha)`.

What it does not do: broadcasting or strides; every operand is a flat run of n f32 values.
"""

from __future__ import annotations

from ddl_wgpu.gpu import Call, Gpu

FILE = "elementwise.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = "uf"  # Params {n: u32, alpha: f32}


def _nbytes(res) -> int:
    return res[2] if isinstance(res, tuple) else res.size


def _need(name: str, res, n: int):
    if _nbytes(res) < 4 * n:
        raise ValueError(f"{name}: buffer of {_nbytes(res)} bytes is too small for {n} f32 values")


def _launch(gpu: Gpu, entry: str, sig: str, resources: list, n: int, alpha: float = 0.0) -> Call:
    n = int(n)
    k = gpu.kernel(FILE, entry, sig, workgroup=(WG, 1, 1))
    u = gpu.uniform(PARAMS, n, float(alpha), label=entry)
    groups = max(1, -(-n // WG))
    return Call([(k, gpu.bind(k, *resources, u), groups)], [u])


def add_forward(gpu: Gpu, out, a, b, n: int) -> Call:
    """out = a + b over n items."""
    for name, r in (("out", out), ("a", a), ("b", b)):
        _need(name, r, n)
    return _launch(gpu, "add_forward", "rrwu", [a, b, out], n)


def add_inplace(gpu: Gpu, y, x, n: int) -> Call:
    """y += x over n items (y and x must be different buffers)."""
    _need("y", y, n)
    _need("x", x, n)
    return _launch(gpu, "add_inplace", "rwu", [x, y], n)


def axpy(gpu: Gpu, y, x, n: int, alpha: float) -> Call:
    """y += alpha * x over n items."""
    _need("y", y, n)
    _need("x", x, n)
    return _launch(gpu, "axpy", "rwu", [x, y], n, alpha)


def copy(gpu: Gpu, dst, src, n: int) -> Call:
    """dst = src over n items. (Between whole buffers `Recorder.copy` also works, but it ends the compute
    pass; this one stays inside it.)"""
    _need("dst", dst, n)
    _need("src", src, n)
    return _launch(gpu, "copy", "rwu", [src, dst], n)


def fill(gpu: Gpu, buf, n: int, value: float = 0.0) -> Call:
    """buf = value over n items (zeroing gradients before a step)."""
    _need("buf", buf, n)
    return _launch(gpu, "fill", "wu", [buf], n, value)


def scale_inplace(gpu: Gpu, y, n: int, alpha: float) -> Call:
    """y *= alpha over n items."""
    _need("y", y, n)
    return _launch(gpu, "scale_inplace", "wu", [y], n, alpha)
