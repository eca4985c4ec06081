"""SwiGLU (`shaders/swiglu.wgsl`, `ddl_wgpu/ops/swiglu.py`) against `ddl_ref.ops.swiglu_forward` /
`swiglu_backward` (float64 reference of the float32 inputs), including large |gate|.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check
from ddl_wgpu.ops import swiglu

f32 = np.float32


def up(gpu, a):
    return gpu.upload(np.ascontiguousarray(a, dtype=np.asarray(a).dtype))


def down(gpu, buf, shape, dtype=f32):
    return gpu.download(buf, dtype, int(np.prod(shape))).reshape(shape)


def f64(a):
    return np.asarray(a, np.float64)


@pytest.mark.parametrize("n", [1000, 999])  # the vec4 and the f32 path
def test_swiglu(gpu, rng, n):
    gate = (rng.standard_normal(n) * 4).astype(f32)
    gate[:8] = [60, -60, 100, -100, 88.8, -88.8, 0, -0.0]
    upv = rng.standard_normal(n).astype(f32)
    dout = rng.standard_normal(n).astype(f32)
    bg, bu = up(gpu, gate), up(gpu, upv)
    out, dgate, dup = gpu.buffer(4 * n), gpu.buffer(4 * n), gpu.buffer(4 * n)
    call = swiglu.swiglu_forward(gpu, out, bg, bu, n)
    call += swiglu.swiglu_backward(gpu, dgate, dup, up(gpu, dout), bg, bu, n)
    call.run(gpu)
    ref_dgate, ref_dup = ref.swiglu_backward(f64(dout), f64(gate), f64(upv))
    check("swiglu out", down(gpu, out, (n,)), ref.swiglu_forward(f64(gate), f64(upv)))
    check("swiglu dgate", down(gpu, dgate, (n,)), ref_dgate)
    check("swiglu dup", down(gpu, dup, (n,)), ref_dup)
