"""A one-kernel smoke test of the GPU stack (`ddl-wgpu check`): compile, upload, dispatch, read back,
compare with numpy, and time it with GPU timestamps where the adapter has them."""

from __future__ import annotations

import numpy as np

from ddl_wgpu.runtime.gpu import Gpu, Uniform

FILE = "selftest.wgsl"
PARAMS = Uniform("Params", ("n", "u32", "floats in x and y"), ("alpha", "f32"))


def selftest(gpu: Gpu, n: int = 100_003) -> list[str]:
    """Run saxpy on `n` floats; raise AssertionError on a wrong result, return report lines."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    y = rng.standard_normal(n).astype(np.float32)
    k = gpu.kernel(FILE, "saxpy", "rwu", uniforms=(PARAMS,))
    bx, by = gpu.upload(x), gpu.upload(y)
    params = gpu.uniform(PARAMS, n=n, alpha=2.5)
    rec = gpu.recorder(timestamps=True)
    rec.dispatch(k, gpu.bind(k, bx, by, params), -(-n // 64))
    rec.submit()
    got = gpu.download(by, np.float32, n)
    want = 2.5 * x + y
    err = float(np.abs(got - want).max())
    if err > 1e-5:
        raise AssertionError(f"selftest: saxpy max abs error {err:g} (expected < 1e-5)")
    lines = [f"saxpy n={n}: max abs error {err:.2e}"]
    if rec.timed:
        lines.append(f"saxpy GPU time: {rec.elapsed_ms():.3f} ms")
    return lines
