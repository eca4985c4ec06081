"""The small kernel families against `ddl_ref.ops` (float64 reference of the float32 inputs):
RMSNorm (both styles, per-head use, accumulation, deterministic dw), RoPE (in and out of place), SwiGLU
(large |gate|), the embedding gather and its bucketed backward, and the elementwise utilities.

Shapes are small and deliberately not multiples of the workgroup size, so every bounds guard runs.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check
from ddl_wgpu.ops import elementwise, embedding, rmsnorm, rope, swiglu

f32 = np.float32


def up(gpu, a):
    return gpu.upload(np.ascontiguousarray(a, dtype=np.asarray(a).dtype))


def down(gpu, buf, shape, dtype=f32):
    return gpu.download(buf, dtype, int(np.prod(shape))).reshape(shape)


def f64(a):
    return np.asarray(a, np.float64)


# ---------------------------------------------------------------------------------------------------------
# RMSNorm

# (rows, C): rows/C off the workgroup grid; C=6/16 the per-head shapes (many rows per workgroup); C=300/1100
# several items per thread (1100: a whole workgroup per row, a two-stage row sum); C=12/10 the vec4 and f32
# items of a short row; rows 150/300 (many row slots: a two-stage slot sum) and 100 x 768 several dw row
# blocks of several passes each, the last one partial.
RMS_SHAPES = [
    (37, 50),
    (2 * 7 * 5, 6),
    (2 * 5 * 3, 16),
    (5, 300),
    (3, 1100),
    (150, 20),
    (300, 6),
    (41, 12),
    (41, 10),
    (100, 768),
]


def _rms_inputs(rng, rows, C, style):
    x = rng.standard_normal((rows, C)).astype(f32) * f32(1.5)
    w = (rng.standard_normal(C) * 0.2 + (1.0 if style == "standard" else 0.0)).astype(f32)
    dout = rng.standard_normal((rows, C)).astype(f32)
    return x, w, dout


@pytest.mark.parametrize("style", ["standard", "offset"])
@pytest.mark.parametrize("rows,C", RMS_SHAPES)
def test_rmsnorm_forward(gpu, rng, rows, C, style):
    eps = 1e-5
    x, w, _ = _rms_inputs(rng, rows, C, style)
    out, rstd = gpu.buffer(4 * rows * C), gpu.buffer(4 * rows)
    rmsnorm.rmsnorm_forward(gpu, out, rstd, up(gpu, x), up(gpu, w), rows, C, eps, style).run(gpu)
    ref_out, cache = ref.rmsnorm_forward(f64(x), f64(w), eps, style)
    check("rmsnorm out", down(gpu, out, (rows, C)), ref_out, "norm")
    check("rmsnorm rstd", down(gpu, rstd, (rows,)), cache[2][:, 0], "norm")


@pytest.mark.parametrize("style", ["standard", "offset"])
@pytest.mark.parametrize("rows,C", RMS_SHAPES)
def test_rmsnorm_backward(gpu, rng, rows, C, style):
    eps = 1e-6
    x, w, dout = _rms_inputs(rng, rows, C, style)
    rstd_ref = 1.0 / np.sqrt(np.mean(f64(x) ** 2, axis=-1) + eps)
    # rstd as the GPU forward would give it, so the backward is tested on its own
    bx, bw, brstd, bdout = up(gpu, x), up(gpu, w), up(gpu, rstd_ref.astype(f32)), up(gpu, dout)
    dx0 = rng.standard_normal((rows, C)).astype(f32)
    dw0 = rng.standard_normal(C).astype(f32)
    _, cache = ref.rmsnorm_forward(f64(x), f64(w), eps, style)
    ref_dx, ref_dw = ref.rmsnorm_backward(f64(dout), cache)

    # overwrite dx, accumulate dw (the defaults)
    dx, dw = gpu.buffer(4 * rows * C), up(gpu, dw0)
    rmsnorm.rmsnorm_backward(gpu, dx, dw, bdout, bx, bw, brstd, rows, C, style).run(gpu)
    check("rmsnorm dx", down(gpu, dx, (rows, C)), ref_dx, "norm")
    check("rmsnorm dw (accumulated)", down(gpu, dw, (C,)), f64(dw0) + ref_dw, "norm")

    # accumulate dx, overwrite dw, with a caller-given partials buffer
    dx, dw = up(gpu, dx0), up(gpu, dw0)
    partials = gpu.buffer(rmsnorm.rmsnorm_partials_size(rows, C))
    rmsnorm.rmsnorm_backward(
        gpu,
        dx,
        dw,
        bdout,
        bx,
        bw,
        brstd,
        rows,
        C,
        style,
        accumulate_dx=True,
        accumulate_dw=False,
        partials=partials,
    ).run(gpu)
    check("rmsnorm dx (accumulated)", down(gpu, dx, (rows, C)), f64(dx0) + ref_dx, "norm")
    check("rmsnorm dw", down(gpu, dw, (C,)), ref_dw, "norm")


def test_rmsnorm_per_head_roundtrip(gpu, rng):
    """q/k norm use: x (B, T, H, D) normed over D, forward then backward from the GPU's own rstd."""
    B, T, H, D = 2, 5, 3, 16
    rows = B * T * H
    x = rng.standard_normal((B, T, H, D)).astype(f32)
    w = (1.0 + 0.1 * rng.standard_normal(D)).astype(f32)
    dout = rng.standard_normal((B, T, H, D)).astype(f32)
    out, rstd, dx, dw = gpu.buffer(x.nbytes), gpu.buffer(4 * rows), gpu.buffer(x.nbytes), gpu.buffer(4 * D)
    bx, bw = up(gpu, x), up(gpu, w)
    call = rmsnorm.rmsnorm_forward(gpu, out, rstd, bx, bw, rows, D, 1e-6, "standard")
    call += rmsnorm.rmsnorm_backward(gpu, dx, dw, up(gpu, dout), bx, bw, rstd, rows, D, "standard")
    call.run(gpu)
    ref_out, cache = ref.rmsnorm_forward(f64(x), f64(w), 1e-6, "standard")
    ref_dx, ref_dw = ref.rmsnorm_backward(f64(dout), cache)
    check("per-head out", down(gpu, out, x.shape), ref_out, "norm")
    check("per-head dx", down(gpu, dx, x.shape), ref_dx, "norm")
    check("per-head dw", down(gpu, dw, (D,)), ref_dw, "norm")


def test_rmsnorm_dw_deterministic(gpu, rng):
    rows, C = 300, 37  # 5 row blocks of 64 (4 passes of 16 row slots)
    x, w, dout = _rms_inputs(rng, rows, C, "standard")
    rstd = (1.0 / np.sqrt(np.mean(f64(x) ** 2, axis=-1) + 1e-6)).astype(f32)
    bx, bw, brstd, bdout = up(gpu, x), up(gpu, w), up(gpu, rstd), up(gpu, dout)
    got = []
    for _ in range(2):
        dx, dw = gpu.buffer(x.nbytes), gpu.buffer(4 * C)
        rmsnorm.rmsnorm_backward(gpu, dx, dw, bdout, bx, bw, brstd, rows, C, accumulate_dw=False).run(gpu)
        got.append((down(gpu, dx, (rows, C)), down(gpu, dw, (C,))))
    assert np.array_equal(got[0][0], got[1][0])
    assert np.array_equal(got[0][1], got[1][1])


def test_rmsnorm_dw_blocks():
    # (TPR, IPT): at most IPT_MAX = 4 items per thread while a row has at most WG threads
    assert [rmsnorm.row_layout(c) for c in (1, 6, 16, 50, 128, 192, 300, 768, 1100)] == [
        (1, 1), (2, 3), (4, 4), (16, 4), (32, 4), (64, 3), (128, 3), (256, 3), (256, 5),
    ]  # fmt: skip
    # blocks of MIN_PASSES passes of the row slots (WG / TPR), at least MIN_BLOCK_ROWS rows
    assert rmsnorm.rmsnorm_dw_blocks(37, 50) == (64, 1)  # 16 slots
    assert rmsnorm.rmsnorm_dw_blocks(300, 37) == (64, 5)
    assert rmsnorm.rmsnorm_dw_blocks(300, 6) == (512, 1)  # 128 slots
    assert rmsnorm.rmsnorm_dw_blocks(16384, 768, 4) == (16, 1024)  # the small preset's norms: 4 slots
    assert rmsnorm.rmsnorm_dw_blocks(98304, 128, 4) == (128, 768)  # its q-norm: 32 slots
    assert rmsnorm.rmsnorm_dw_blocks(16384, 768) == (16, 1024)  # f32 items: one slot, MIN_BLOCK_ROWS rows
    assert rmsnorm.rmsnorm_dw_blocks(262144, 128) == (64, 4096)  # past MAX_BLOCKS blocks grow
    assert rmsnorm.rmsnorm_dw_blocks(300, 16, 4) == (1024, 1)
    assert rmsnorm.rmsnorm_partials_size(300, 16) == 4 * 16 * 2  # the f32 path needs more blocks
    assert rmsnorm.rmsnorm_partials_size(300, 37) == 4 * 37 * 5
    # the reduce pass: about 4 blocks per lane
    assert [rmsnorm.reduce_channels(192, n) for n in (1, 16, 1024, 4096)] == [256, 64, 1, 1]
    with pytest.raises(ValueError):
        rmsnorm._style("layer")


# ---------------------------------------------------------------------------------------------------------
# RoPE


@pytest.mark.parametrize("D", [16, 6, 12])  # vec4 pairs (h = 8), f32 pairs (h = 3, 6)
def test_rope(gpu, rng, D):
    B, T, N = 2, 7, 3
    cos, sin = ref.rope_tables(T + 4, D, 10000.0, f32)  # tables longer than T: row stride D still holds
    bcos, bsin = up(gpu, cos), up(gpu, sin)
    x = rng.standard_normal((B, T, N, D)).astype(f32)
    dout = rng.standard_normal((B, T, N, D)).astype(f32)
    ref_out = ref.rope_forward(f64(x), f64(cos), f64(sin))
    ref_dx = ref.rope_backward(f64(dout), f64(cos), f64(sin))

    out = gpu.buffer(x.nbytes)
    rope.rope_forward(gpu, out, up(gpu, x), bcos, bsin, B, T, N, D).run(gpu)
    check("rope out", down(gpu, out, x.shape), ref_out)
    dx = gpu.buffer(x.nbytes)
    rope.rope_backward(gpu, dx, up(gpu, dout), bcos, bsin, B, T, N, D).run(gpu)
    check("rope dx", down(gpu, dx, x.shape), ref_dx)

    # in place, on a buffer and on a view into an arena
    bx = up(gpu, x)
    rope.rope_forward(gpu, bx, bx, bcos, bsin, B, T, N, D).run(gpu)
    check("rope out (in place)", down(gpu, bx, x.shape), ref_out)
    arena = gpu.buffer(512 + dout.nbytes)
    gpu.write(arena, dout, 512)
    view = (arena, 512, dout.nbytes)
    rope.rope_backward(gpu, view, view, bcos, bsin, B, T, N, D).run(gpu)
    got = gpu.download(arena, f32, dout.size, 512).reshape(x.shape)
    check("rope dx (in place)", got, ref_dx)


def test_rope_rejects():
    class Buf:
        size = 4096

    b = Buf()
    with pytest.raises(ValueError):
        rope._same((b, 0, 256), (b, 256, 256))
    assert rope._same((b, 0, 256), (b, 0, 256))
    assert rope._same(b, b)


# ---------------------------------------------------------------------------------------------------------
# SwiGLU


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


# ---------------------------------------------------------------------------------------------------------
# embedding


def test_embedding_buckets():
    ids = np.array([[3, 1, 3], [0, 3, 1]])
    order, starts = embedding.embedding_buckets(ids, 5)
    assert order.dtype == np.uint32 and starts.dtype == np.uint32
    assert order.tolist() == [3, 1, 5, 0, 2, 4]  # stable: equal ids keep position order
    assert starts.tolist() == [0, 1, 3, 3, 6, 6]
    with pytest.raises(ValueError):
        embedding.embedding_buckets(ids, 3)


@pytest.mark.parametrize("C", [33, 32])  # the f32 and the vec4 path
def test_embedding(gpu, rng, C):
    B, T, V = 3, 11, 29
    ids = rng.integers(0, 12, size=(B, T))  # repeats, and ids 12..27 unseen
    ids[0, :4] = 28
    ids[1, :7] = 5  # a long bucket: the shader's 4-way interleaved sum plus a remainder
    wte = rng.standard_normal((V, C)).astype(f32)
    dout = rng.standard_normal((B, T, C)).astype(f32)
    n = B * T
    bids = up(gpu, ids.astype(np.uint32))
    out = gpu.buffer(4 * n * C)
    embedding.embedding_forward(gpu, out, bids, up(gpu, wte), n, C).run(gpu)
    assert np.array_equal(down(gpu, out, (B, T, C)), ref.embedding_forward(ids, wte))

    order, starts = embedding.embedding_buckets(ids, V)
    bo, bs, bd = up(gpu, order), up(gpu, starts), up(gpu, dout)
    ref_dwte = ref.embedding_backward(f64(dout), ids, V)
    dwte0 = rng.standard_normal((V, C)).astype(f32)
    dwte = up(gpu, dwte0)
    embedding.embedding_backward(gpu, dwte, bd, bo, bs, V, C).run(gpu)  # accumulate is the default
    check("dwte (accumulated)", down(gpu, dwte, (V, C)), f64(dwte0) + ref_dwte)

    got = []
    for _ in range(2):
        dwte = up(gpu, dwte0)
        embedding.embedding_backward(gpu, dwte, bd, bo, bs, V, C, accumulate=False).run(gpu)
        got.append(down(gpu, dwte, (V, C)))
    check("dwte", got[0], ref_dwte)
    assert np.array_equal(got[0], got[1])


# ---------------------------------------------------------------------------------------------------------
# elementwise


@pytest.mark.parametrize("n", [1000, 1001])  # the vec4 and the f32 path
def test_elementwise(gpu, rng, n):
    a = rng.standard_normal(n).astype(f32)
    b = rng.standard_normal(n).astype(f32)
    ba, bb = up(gpu, a), up(gpu, b)

    out = gpu.buffer(4 * n)
    elementwise.add_forward(gpu, out, ba, bb, n).run(gpu)
    check("add", down(gpu, out, (n,)), f64(a) + f64(b))

    y = up(gpu, b)
    elementwise.add_inplace(gpu, y, ba, n).run(gpu)
    check("add_inplace", down(gpu, y, (n,)), f64(a) + f64(b))

    y = up(gpu, b)
    elementwise.axpy(gpu, y, ba, n, -0.75).run(gpu)
    check("axpy", down(gpu, y, (n,)), f64(b) - 0.75 * f64(a))

    y = up(gpu, b)
    elementwise.scale_inplace(gpu, y, n, 3.0).run(gpu)
    check("scale_inplace", down(gpu, y, (n,)), 3.0 * f64(b))

    # copy into, and fill, a view of an arena; items past n stay untouched
    m = 256 // 4 + n + 7
    arena = up(gpu, np.full(m, 9.0, f32))
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
