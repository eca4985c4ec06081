"""The decoding matrix-vector product (`shaders/gemv.wgsl`, `ddl_wgpu/ops/gemv.py`) against numpy: f32 rows as
vec4 and as scalars, f16 weights (against the f16-rounded weights), accumulation into y, a column offset
and row stride of y."""

import numpy as np
import pytest

from ddl_ref.check import check
from ddl_wgpu.ops import gemv as k_gemv

f32 = np.float32


@pytest.mark.parametrize("IN,w_dtype", [(36, "f32"), (37, "f32"), (300, "f16")])
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemv(gpu, rng, IN, w_dtype, accumulate):
    n, OUT, ldy, col0 = 3, 70, 75, 5
    x = rng.standard_normal((n, IN)).astype(f32)
    w = rng.standard_normal((OUT, IN)).astype(f32)
    y0 = rng.standard_normal((n, ldy)).astype(f32)
    y = gpu.upload(y0)
    wb = gpu.upload(w.astype(np.float16)) if w_dtype == "f16" else gpu.upload(w)
    w_used = w.astype(np.float16).astype(np.float64) if w_dtype == "f16" else w.astype(np.float64)
    k_gemv.gemv(gpu, y, gpu.upload(x), wb, n, OUT, IN, w_dtype, ldy, col0, accumulate).run(gpu)
    want = y0.astype(np.float64).copy()
    prod = x.astype(np.float64) @ w_used.T
    want[:, col0 : col0 + OUT] = (want[:, col0 : col0 + OUT] if accumulate else 0.0) + prod
    check("gemv", gpu.download(y, f32, n * ldy).reshape(n, ldy), want, "matmul")
