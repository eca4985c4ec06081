"""The deterministic reductions (`shaders/reduce.wgsl`, `ddl_wgpu/ops/reduce.py`): gradient norm and clip
multiplier against `ddl_ref.optim.global_grad_norm` / `clip_multiplier`, the non-finite flag, and row sums.
Every reduction also gets a bit-identical determinism check.
"""

import numpy as np
import pytest

from ddl_ref import optim as ref_optim
from ddl_ref.check import check
from ddl_wgpu.ops import reduce as red_ops


def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def grad_norm(gpu, arrays, clip, max_groups=red_ops.MAX_GROUPS, unscale=1.0):
    _, views = gpu.upload_ranges(arrays)
    partials = gpu.buffer(4 * red_ops.total_partials([a.size for a in arrays], max_groups))
    scalars = gpu.buffer(red_ops.SCALARS_BYTES)
    call = red_ops.grad_norm_clip(gpu, scalars, partials, views, clip, max_groups=max_groups, unscale=unscale)
    call.run(gpu)
    return call, scalars, gpu.download(scalars, np.float32, 4)


def test_grad_norm_and_clip(gpu, rng):
    arrays = [rng.normal(size=n) for n in (1001, 37, 5003)]
    norm = ref_optim.global_grad_norm({str(i): a for i, a in enumerate(arrays)})
    for clip in (0.5 * norm, 2.0 * norm):
        _, _, s = grad_norm(gpu, arrays, clip)
        check("norm", s[0], np.float64(norm), "loss")
        check("clip multiplier", s[1], np.float64(ref_optim.clip_multiplier(norm, clip)), "loss")
        assert s[2] == 1.0
        check("sum of squares", s[3], np.float64(norm**2), "loss")
    assert grad_norm(gpu, arrays, 2.0 * norm)[2][1] == 1.0
    assert grad_norm(gpu, arrays, 0.0)[2][1] == 1.0  # clip <= 0: off
    assert grad_norm(gpu, [np.zeros(77)], 1.0)[2][:3].tolist() == [0.0, 1.0, 1.0]  # zero norm: multiplier 1

    # the clip threshold is in the finalize uniform, rewritable per run
    call, scalars, _ = grad_norm(gpu, arrays, 2.0 * norm)
    gpu.write_fields(call.uniforms[-1], red_ops.FINALIZE, clip=0.25 * norm)
    call.run(gpu)
    check("rewritten clip", gpu.download(scalars, np.float32, 4)[1], np.float64(0.25), "loss")


def test_unscale_gives_the_unscaled_gradients_norm_and_multiplier(gpu, rng):
    """Mixed precision's loss scaling: partials of S * g with unscale = 1 / S give the norm of g and the
    multiplier min(1, clip / ||g||) / S, against the reference; for a power-of-two S bit for bit the unscaled
    run's numbers (times 1 / S for the multiplier), whether the clip bites or not; the finite flag of a
    scaled gradient whose sum of squares overflows is 0."""
    arrays = [f32(rng.normal(size=n)) for n in (1001, 37, 5003)]
    norm = ref_optim.global_grad_norm({str(i): a for i, a in enumerate(arrays)})
    for clip in (0.5 * norm, 2.0 * norm):
        plain = grad_norm(gpu, arrays, clip)[2]
        for s in (2.0**16, 2.0**-3, 2.0**40):
            scaled = [f32(a * np.float32(s)) for a in arrays]
            got = grad_norm(gpu, scaled, clip, unscale=1.0 / s)[2]
            check("unscaled norm", got[0], np.float64(norm), "loss")
            check("multiplier / S", got[1] * s, np.float64(ref_optim.clip_multiplier(norm, clip)), "loss")
            assert got[0] == plain[0] and got[1] == np.float32(plain[1] / s) and got[2] == 1.0
            assert got[3] == np.float32(plain[3] * s * s)  # the sum of squares stays the scaled gradient's
    # not a power of two: the formula still holds (to rounding)
    got = grad_norm(gpu, [f32(a * 3.0) for a in arrays], 0.5 * norm, unscale=1.0 / 3.0)[2]
    check("norm, S = 3", got[0], np.float64(norm), "loss")
    check("multiplier, S = 3", got[1] * 3.0, np.float64(0.5), "loss")
    # rewritable per step, like the clip
    call, scalars, _ = grad_norm(gpu, arrays, 2.0 * norm)
    gpu.write_fields(call.uniforms[-1], red_ops.FINALIZE, unscale=0.5)
    call.run(gpu)
    assert gpu.download(scalars, np.float32, 4)[1] == 0.5
    # S * g past sqrt(f32 max) in the sum of squares: not finite, multiplier 0 (the scaler's overflow)
    got = grad_norm(gpu, [f32(a * np.float32(2.0**70)) for a in arrays], 1.0, unscale=2.0**-70)[2]
    assert got[2] == 0.0 and got[1] == 0.0


def test_grad_norm_grid_stride_and_determinism(gpu, rng):
    arrays = [rng.normal(size=n) for n in (9001, 3)]
    norm = ref_optim.global_grad_norm({str(i): a for i, a in enumerate(arrays)})
    _, _, a = grad_norm(gpu, arrays, 1.0, max_groups=2)  # 9001 elements through 2 workgroups
    check("norm (grid stride)", a[0], np.float64(norm), "loss")
    _, _, b = grad_norm(gpu, arrays, 1.0, max_groups=2)
    _, _, c = grad_norm(gpu, arrays, 1.0)
    assert np.array_equal(a, b)
    check("norm (more groups)", c[0], np.float64(norm), "loss")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_grad_norm_flags_non_finite(gpu, rng, bad):
    arrays = [rng.normal(size=n) for n in (301, 37, 515)]
    arrays[2][400] = bad
    _, _, s = grad_norm(gpu, arrays, 1.0)
    assert s[2] == 0.0
    assert s[1] == 0.0


def test_sum_rows(gpu, rng):
    x = rng.normal(size=1234)
    out = gpu.buffer(16)
    call = red_ops.sum_rows(gpu, out, gpu.upload(f32(x)), x.size, index=2)
    call.run(gpu)
    got = gpu.download(out, np.float32, 4)
    check("sum", got[2], np.float64(f32(x).astype(np.float64).sum()), "loss")
    assert got[0] == 0.0 and got[1] == 0.0
    call.run(gpu)
    assert np.array_equal(gpu.download(out, np.float32, 4), got)
