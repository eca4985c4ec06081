"""The elementwise utilities (`shaders/elementwise.wgsl`, `ddl_wgpu/ops/elementwise.py`: add, axpy, copy,
fill, scale) against numpy.
"""

import numpy as np
import pytest

from ddl_ref.check import check, f64
from ddl_wgpu.ops import elementwise

f32 = np.float32


@pytest.mark.parametrize("n", [1000, 1001])  # the vec4 and the f32 path
def test_elementwise(gpu, rng, n):
    a = rng.standard_normal(n).astype(f32)
    b = rng.standard_normal(n).astype(f32)
    ba, bb = gpu.upload(a), gpu.upload(b)

    out = gpu.buffer(4 * n)
    elementwise.add_forward(gpu, out, ba, bb, n).run(gpu)
    check("add", gpu.read(out, (n,)), f64(a) + f64(b))

    y = gpu.upload(b)
    elementwise.add_inplace(gpu, y, ba, n).run(gpu)
    check("add_inplace", gpu.read(y, (n,)), f64(a) + f64(b))

    y = gpu.upload(b)
    elementwise.axpy(gpu, y, ba, n, -0.75).run(gpu)
    check("axpy", gpu.read(y, (n,)), f64(b) - 0.75 * f64(a))

    y = gpu.upload(b)
    elementwise.scale_inplace(gpu, y, n, 3.0).run(gpu)
    check("scale_inplace", gpu.read(y, (n,)), 3.0 * f64(b))

    # copy into, and fill, a view of an arena; items past n stay untouched
    m = 256 // 4 + n + 7
    arena = gpu.upload(np.full(m, 9.0, f32))
    view = (arena, 256, 4 * n)
    elementwise.copy(gpu, view, ba, n).run(gpu)
    got = gpu.download(arena, f32, m)
    assert np.array_equal(got[64 : 64 + n], a)
    assert np.all(got[:64] == 9.0) and np.all(got[64 + n :] == 9.0)
    call = elementwise.fill(gpu, view, n - 3, 0.0)
    call.run(gpu)
    got = gpu.download(arena, f32, m)
    assert np.all(got[64 : 64 + n - 3] == 0.0) and np.array_equal(got[64 + n - 3 : 64 + n], a[-3:])
    elementwise.set_alpha(gpu, call, 2.5)  # a per-step value, same Call
    call.run(gpu)
    assert np.all(gpu.download(arena, f32, m)[64 : 64 + n - 3] == 2.5)

    with pytest.raises(ValueError):
        elementwise.copy(gpu, gpu.buffer(16), ba, n)


def test_elementwise_grid_spread(gpu):
    """More than 65535 workgroups: the launch spreads over x and y and the shader's linear index and
    bounds guard must cover exactly n items."""
    n = 256 * 65535 + 300
    buf = gpu.buffer(4 * (n + 4))
    elementwise.fill(gpu, buf, n, 1.5).run(gpu)
    got = gpu.download(buf, f32, n + 4)
    assert np.all(got[:n] == 1.5) and np.all(got[n:] == 0.0)


@pytest.mark.parametrize("n", [4096, 4093])  # the vec4 and the u32 path
def test_round_f16_is_numpys(gpu, rng, n):
    """`round_f16` gives numpy's float32 -> float16 -> float32 bits: ties to even at both ends of the normal
    range and among the subnormals, the subnormal range, overflow to inf from 65520 on, signs, zeros, inf."""
    half = np.arange(2**16, dtype=np.uint16).view(np.float16)
    half = half[np.isfinite(half)].astype(f32)
    nxt = np.nextafter(half, f32(np.inf))
    ties = (half[:-1] + half[1:]) / 2  # exactly half way between neighbours (sorted within each sign)
    special = np.array([0.0, -0.0, 65504, 65519.99, 65520, -65520, 1e6, np.inf, -np.inf, 2**-14, 2**-24,
                        2**-25, 3 * 2**-26, 2**-26, -(2**-25), 6.1e-5, 1e-30], f32)  # fmt: skip
    spread = rng.standard_normal(n) * 10.0 ** rng.integers(-9, 5, n)
    pool = np.concatenate([half, nxt, ties, special, spread.astype(f32)])
    x = pool[rng.permutation(pool.size)[:n]]
    x[: special.size] = special
    y = gpu.upload(x)
    elementwise.round_f16(gpu, y, n).run(gpu)
    got = gpu.read(y, (n,))
    with np.errstate(over="ignore"):  # 65520 and up: inf, as meant
        want = x.astype(np.float16).astype(f32)
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{bad.size} differ, e.g. {x[bad[:5]]} -> {got[bad[:5]]}, numpy {want[bad[:5]]}"
