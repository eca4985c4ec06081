"""RoPE (`shaders/rope.wgsl`, `ddl_wgpu/ops/rope.py`) against `ddl_ref.ops.rope_forward` / `rope_backward`
(float64 reference of the float32 inputs), in and out of place.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import rope

f32 = np.float32


@pytest.mark.parametrize("D", [16, 6, 12])  # vec4 pairs (h = 8), f32 pairs (h = 3, 6)
def test_rope(gpu, rng, D):
    B, T, N = 2, 7, 3
    cos, sin = ref.rope_tables(T + 4, D, 10000.0, f32)  # tables longer than T: row stride D still holds
    bcos, bsin = gpu.upload(cos), gpu.upload(sin)
    x = rng.standard_normal((B, T, N, D)).astype(f32)
    dout = rng.standard_normal((B, T, N, D)).astype(f32)
    ref_out = ref.rope_forward(f64(x), f64(cos), f64(sin))
    ref_dx = ref.rope_backward(f64(dout), f64(cos), f64(sin))

    out = gpu.buffer(x.nbytes)
    rope.rope_forward(gpu, out, gpu.upload(x), bcos, bsin, B, T, N, D).run(gpu)
    check("rope out", gpu.read(out, x.shape), ref_out)
    dx = gpu.buffer(x.nbytes)
    rope.rope_backward(gpu, dx, gpu.upload(dout), bcos, bsin, B, T, N, D).run(gpu)
    check("rope dx", gpu.read(dx, x.shape), ref_dx)

    # in place, on a buffer and on a view into an arena
    bx = gpu.upload(x)
    rope.rope_forward(gpu, bx, bx, bcos, bsin, B, T, N, D).run(gpu)
    check("rope out (in place)", gpu.read(bx, x.shape), ref_out)
    arena = gpu.buffer(512 + dout.nbytes)
    gpu.write(arena, dout, 512)
    view = (arena, 512, dout.nbytes)
    rope.rope_backward(gpu, view, view, bcos, bsin, B, T, N, D).run(gpu)
    got = gpu.download(arena, f32, dout.size, 512).reshape(x.shape)
    check("rope dx (in place)", got, ref_dx)


# partial rotary (Qwen3.5: a quarter of the head): vec4 items (R = 8 of 32) and f32 items (R = 4 of 12, 2 of 6)
@pytest.mark.parametrize("D, R", [(32, 8), (12, 4), (6, 2)])
def test_partial_rope(gpu, rng, D, R):
    B, T, N = 2, 5, 3
    cos, sin = ref.rope_tables(T, D, 1e6, f32, rotary_dim=R)
    assert cos.shape == (T, R)
    bcos, bsin = gpu.upload(cos), gpu.upload(sin)
    x = rng.standard_normal((B, T, N, D)).astype(f32)
    out = gpu.buffer(x.nbytes)
    rope.rope_forward(gpu, out, gpu.upload(x), bcos, bsin, B, T, N, D, rotary=R).run(gpu)
    ref_out = ref.rope_forward(f64(x), f64(cos), f64(sin))
    check("partial rope out", gpu.read(out, x.shape), ref_out)
    assert np.array_equal(gpu.read(out, x.shape)[..., R:], x[..., R:]), "pass-through channels changed"
    dx = gpu.buffer(x.nbytes)
    rope.rope_backward(gpu, dx, gpu.upload(x), bcos, bsin, B, T, N, D, rotary=R).run(gpu)
    check("partial rope dx", gpu.read(dx, x.shape), ref.rope_backward(f64(x), f64(cos), f64(sin)))
    bx = gpu.upload(x)
    rope.rope_forward(gpu, bx, bx, bcos, bsin, B, T, N, D, rotary=R).run(gpu)
    check("partial rope (in place)", gpu.read(bx, x.shape), ref_out)


def test_rope_rejects():
    class Buf:
        size = 4096

    b = Buf()
    with pytest.raises(ValueError):
        rope._same((b, 0, 256), (b, 256, 256))
    assert rope._same((b, 0, 256), (b, 0, 256))
    assert rope._same(b, b)
