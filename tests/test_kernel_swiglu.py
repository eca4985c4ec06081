"""SwiGLU (`shaders/swiglu.wgsl`, `ddl_wgpu/ops/swiglu.py`) against `ddl_ref.ops.swiglu_forward` /
`swiglu_backward` (float64 reference of the float32 inputs), including large |gate|.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import swiglu

f32 = np.float32


@pytest.mark.parametrize("n", [1000, 999])  # the vec4 and the f32 path
def test_swiglu(gpu, rng, n):
    gate = (rng.standard_normal(n) * 4).astype(f32)
    gate[:8] = [60, -60, 100, -100, 88.8, -88.8, 0, -0.0]
    upv = rng.standard_normal(n).astype(f32)
    dout = rng.standard_normal(n).astype(f32)
    bg, bu = gpu.upload(gate), gpu.upload(upv)
    out, dgate, dup = gpu.buffer(4 * n), gpu.buffer(4 * n), gpu.buffer(4 * n)
    call = swiglu.swiglu_forward(gpu, out, bg, bu, n)
    call += swiglu.swiglu_backward(gpu, dgate, dup, gpu.upload(dout), bg, bu, n)
    call.run(gpu)
    ref_dgate, ref_dup = ref.swiglu_backward(f64(dout), f64(gate), f64(upv))
    check("swiglu out", gpu.read(out, (n,)), ref.swiglu_forward(f64(gate), f64(upv)))
    check("swiglu dgate", gpu.read(dgate, (n,)), ref_dgate)
    check("swiglu dup", gpu.read(dup, (n,)), ref_dup)
