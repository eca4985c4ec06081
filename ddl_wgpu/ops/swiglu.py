"""Launchers for `shaders/swiglu.wgsl`: out = silu(gate) * up over n items, and its backward.

Kernel path: `shaders/swiglu.wgsl` -> `ddl_wgpu/ops/swiglu.py` -> reference `ddl_ref.ops.swiglu_forward`,
`ddl_ref.ops.swiglu_backward` -> test `tests/test_kernel_swiglu.py`.

The sigmoid in the shader is the stable form (exp of -|g| only), so |gate| of any size gives no NaN. Items
move as vec4<f32> when n % 4 == 0 (`elementwise.vec_width`).

What it does not do: the gate/up projections (matmul) or a fused split of one (.., 2F) tensor; gate and up
are two buffers (or two views of one arena).
"""

from __future__ import annotations

from ddl_wgpu.ops.elementwise import need, templates, vec_width
from ddl_wgpu.runtime.gpu import Call, Gpu, Uniform

FILE = "swiglu.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = Uniform("Params", ("n", "u32", "number of items of F (n / 4 on the vec4 path)"))


def _launch(gpu: Gpu, entry: str, sig: str, resources: list, n: int) -> Call:
    n = int(n)
    for r in resources:
        need(entry, "a buffer", r, n)
    width = vec_width(n, *resources)
    k = gpu.kernel(FILE, entry, sig, templates=templates(width), workgroup=(WG, 1, 1), uniforms=(PARAMS,))
    u = gpu.uniform(PARAMS, n=n // width, label=entry)
    return Call([(k, gpu.bind(k, *resources, u), max(1, -(-(n // width) // WG)))], [u])


def swiglu_forward(gpu: Gpu, out, gate, up, n: int) -> Call:
    """out (n,) = silu(gate) * up."""
    return _launch(gpu, "swiglu_forward", "rrwu", [gate, up, out], n)


def swiglu_backward(gpu: Gpu, dgate, dup, dout, gate, up, n: int) -> Call:
    """dgate (n,) = dout * up * silu'(gate); dup (n,) = dout * silu(gate). Both overwritten."""
    return _launch(gpu, "swiglu_backward", "rrrwwu", [dout, gate, up, dgate, dup], n)
