"""The matmul family (`shaders/matmul.wgsl`, `ddl_wgpu/ops/matmul.py`) against numpy and `ddl_ref.ops`.

Shapes are small and deliberately not multiples of the 64 x 64 workgroup tile (nor of 4 or of BK), so the
zero-filled edge copies and the guarded stores are exercised on every side.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check
from ddl_wgpu.ops.matmul import (
    LARGE_TILE,
    SMALL_TILE,
    Batch,
    Strides,
    Tile,
    linear_backward,
    linear_forward,
    matmul,
    pick_tile,
)
from ddl_wgpu.runtime.gpu import GpuError

SHAPES = [(1, 1, 1), (7, 13, 5), (33, 17, 65), (64, 48, 40), (130, 9, 70)]  # (M, N, K)


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _op(x, trans):
    return (x.T if trans else x).astype(np.float64)


def _run_matmul(gpu, A, B, M, N, K, c_init=None, **kw):
    a, b = gpu.upload(A), gpu.upload(B)
    n = kw["batch"].count if "batch" in kw else 1
    c = gpu.upload(c_init) if c_init is not None else gpu.buffer(4 * n * M * N)
    matmul(gpu, c, a, b, M, N, K, **kw).run(gpu)
    return gpu.download(c, np.float32, n * M * N if c_init is None else c_init.size)


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matmul_layouts(gpu, rng, M, N, K, trans_a, trans_b):
    A = _rand(rng, *((K, M) if trans_a else (M, K)))
    B = _rand(rng, *((N, K) if trans_b else (K, N)))
    got = _run_matmul(gpu, A, B, M, N, K, trans_a=trans_a, trans_b=trans_b).reshape(M, N)
    check(f"matmul {M}x{N}x{K} ta={trans_a} tb={trans_b}", got, _op(A, trans_a) @ _op(B, trans_b), "matmul")


@pytest.mark.parametrize("M,N,K", [(7, 13, 5), (33, 17, 65)])
def test_matmul_accumulate_alpha(gpu, rng, M, N, K):
    A, B, C0 = _rand(rng, M, K), _rand(rng, N, K), _rand(rng, M, N)
    want = -0.37 * (_op(A, False) @ _op(B, True)) + C0
    got = _run_matmul(gpu, A, B, M, N, K, c_init=C0, trans_b=True, accumulate=True, alpha=-0.37)
    check("matmul accumulate alpha", got.reshape(M, N), want, "matmul")
    # without accumulate the old C is ignored
    got = _run_matmul(gpu, A, B, M, N, K, c_init=C0, trans_b=True, alpha=2.5)
    check("matmul alpha", got.reshape(M, N), 2.5 * (_op(A, False) @ _op(B, True)), "matmul")


def test_linear_matches_ref(gpu, rng):
    rows, OUT, IN = 37, 19, 45
    x, w, dout = _rand(rng, rows, IN), _rand(rng, OUT, IN), _rand(rng, rows, OUT)
    bx, bw, bdout = gpu.upload(x), gpu.upload(w), gpu.upload(dout)
    out, dx, dw = gpu.buffer(4 * rows * OUT), gpu.buffer(4 * rows * IN), gpu.buffer(4 * OUT * IN)
    (
        linear_forward(gpu, out, bx, bw, rows, OUT, IN)
        + linear_backward(gpu, dx, dw, bdout, bx, bw, rows, OUT, IN)
    ).run(gpu)
    x64, w64, d64 = x.astype(np.float64), w.astype(np.float64), dout.astype(np.float64)
    rdx, rdw = ref.linear_backward(d64, x64, w64)
    check(
        "linear out",
        gpu.download(out, np.float32, rows * OUT).reshape(rows, OUT),
        ref.linear_forward(x64, w64),
        "matmul",
    )
    check("linear dx", gpu.download(dx, np.float32, rows * IN).reshape(rows, IN), rdx, "matmul")
    check("linear dw", gpu.download(dw, np.float32, OUT * IN).reshape(OUT, IN), rdw, "matmul")


def test_linear_backward_accumulate_and_skip_dx(gpu, rng):
    rows, OUT, IN = 21, 11, 26
    x, w, dout = _rand(rng, rows, IN), _rand(rng, OUT, IN), _rand(rng, rows, OUT)
    dx0, dw0 = _rand(rng, rows, IN), _rand(rng, OUT, IN)
    bx, bw, bdout = gpu.upload(x), gpu.upload(w), gpu.upload(dout)
    dx, dw = gpu.upload(dx0), gpu.upload(dw0)
    call = linear_backward(gpu, dx, dw, bdout, bx, bw, rows, OUT, IN, accumulate_dx=True, accumulate_dw=True)
    assert len(call.dispatches) == 2
    call.run(gpu)
    rdx, rdw = ref.linear_backward(dout.astype(np.float64), x.astype(np.float64), w.astype(np.float64))
    check(
        "linear dx accumulated",
        gpu.download(dx, np.float32, rows * IN).reshape(rows, IN),
        dx0 + rdx,
        "matmul",
    )
    check(
        "linear dw accumulated", gpu.download(dw, np.float32, OUT * IN).reshape(OUT, IN), dw0 + rdw, "matmul"
    )
    # dx=None: only dW, overwritten (accumulate_dw=False)
    call = linear_backward(gpu, None, dw, bdout, bx, bw, rows, OUT, IN)
    assert len(call.dispatches) == 1
    call.run(gpu)
    check("linear dw only", gpu.download(dw, np.float32, OUT * IN).reshape(OUT, IN), rdw, "matmul")


def test_matmul_batched_strides(gpu, rng):
    # Per-head style products with gaps between the batch entries (strides larger than one matrix).
    nb, M, N, K = 3, 19, 10, 23
    sa, sb, sc = M * K + 5, 0, M * N + 7  # B shared by every batch entry (stride 0)
    A = _rand(rng, (nb - 1) * sa + M * K)
    B = _rand(rng, K, N)
    C0 = _rand(rng, (nb - 1) * sc + M * N)
    batch = Batch(nb, a=Strides(sa), b=Strides(sb), c=Strides(sc))
    got = _run_matmul(gpu, A, B, M, N, K, c_init=C0, batch=batch)
    want = C0.astype(np.float64).copy()
    for z in range(nb):
        want[z * sc : z * sc + M * N] = (_op(A[z * sa : z * sa + M * K].reshape(M, K), False) @ B).ravel()
    check("matmul batched", got[: want.size], want, "matmul")  # gaps keep C0's values


def test_matmul_batched_transposed_row_strides(gpu, rng):
    # Q K^T per head on (T, H, D) storage: A = q rows of one head (row stride H*D), B = k the same, trans_b.
    T, H, D = 13, 3, 8
    q, k = _rand(rng, T, H, D), _rand(rng, T, H, D)
    s = gpu.buffer(4 * H * T * T)
    call = matmul(
        gpu, s, gpu.upload(q), gpu.upload(k), T, T, D, trans_b=True, alpha=D**-0.5, lda=H * D, ldb=H * D,
        batch=Batch(H, a=Strides(D), b=Strides(D), c=Strides(T * T)),
    )  # fmt: skip
    call.run(gpu)
    want = np.einsum("thd,shd->hts", q.astype(np.float64), k.astype(np.float64)) * D**-0.5
    check("matmul per-head scores", gpu.download(s, np.float32, H * T * T).reshape(H, T, T), want, "matmul")


@pytest.mark.parametrize(
    "tile",
    [SMALL_TILE, Tile(wx=4, wy=4, tm=4, tn=4, bk=4)],
    ids=["64x64", "16x16"],
)
def test_matmul_two_level_batch_gqa_offsets(gpu, rng, tile):
    # Q K^T for every (b, h) of (B, T, H, D) storage with K/V heads shared by G = H / KH query heads, the
    # batch starting b0 batches in (element offsets), into packed (B-b0, H, T, T) scores.
    B, T, H, KH, D, b0 = 3, 21, 4, 2, 12, 1
    q, k = _rand(rng, B, T, H, D), _rand(rng, B, T, KH, D)
    nb = B - b0
    s = gpu.buffer(4 * nb * H * T * T)
    matmul(
        gpu, s, gpu.upload(q), gpu.upload(k), T, T, D, trans_b=True, lda=H * D, ldb=KH * D, tile=tile,
        batch=Batch(nb * H, inner=H,
                    a=Strides(stride=T * H * D, istride=D, off=b0 * T * H * D),
                    b=Strides(stride=T * KH * D, istride=D, off=b0 * T * KH * D, div=H // KH),
                    c=Strides(stride=H * T * T, istride=T * T)),
    ).run(gpu)  # fmt: skip
    kk = np.repeat(k[b0:].astype(np.float64), H // KH, axis=2)
    want = np.einsum("bthd,bshd->bhts", q[b0:].astype(np.float64), kk)
    check(
        "matmul two-level batch",
        gpu.download(s, np.float32, nb * H * T * T).reshape(want.shape),
        want,
        "matmul",
    )


@pytest.mark.parametrize(
    "tile",
    [SMALL_TILE, Tile(wx=4, wy=4, tm=4, tn=4, bk=4)],
    ids=["64x64", "16x16"],
)
def test_matmul_causal_modes(gpu, rng, tile):
    # The three causal modes of attention's products on T x T positions (T not a multiple of the tile).
    T, D, nb = 37, 8, 2
    lower = np.tril(_rand(rng, nb, T, T))  # P: zero right of the diagonal
    x, y = _rand(rng, nb, T, D), _rand(rng, nb, T, D)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    xy = Batch(nb, a=Strides(T * D), b=Strides(T * D), c=Strides(T * T))  # scores of x, y
    py = Batch(nb, a=Strides(T * T), b=Strides(T * D), c=Strides(T * D))  # P times y
    # 1: scores x y^T on and below the diagonal; the tiles wholly above it keep the sentinel
    sentinel = np.full((nb, T, T), 7.0, np.float32)
    got = _run_matmul(
        gpu, x, y, T, T, D, c_init=sentinel, trans_b=True, batch=xy, causal="skip_upper", tile=tile,
    ).reshape(nb, T, T)  # fmt: skip
    want = f64(x) @ f64(y).transpose(0, 2, 1)
    t, s_ = np.tril_indices(T)
    check("causal skip_upper", got[:, t, s_], want[:, t, s_], "matmul")
    bm = tile.bm
    above = np.array([[(c // bm) > (r // bm) for c in range(T)] for r in range(T)])  # whole tiles above
    assert above.any() == (bm < T)
    assert np.all(got[:, above] == 7.0), "a tile above the diagonal was written"
    # 2: P y with the k loop stopped at each row tile's end: equal to the full product
    got = _run_matmul(gpu, lower, y, T, D, T, batch=py, causal="k_to_row", tile=tile)
    check("causal k_to_row", got.reshape(nb, T, D), f64(lower) @ f64(y), "matmul")
    # 3: P^T y (op(A) = P^T is zero left of the diagonal) with the k loop started at each row tile
    got = _run_matmul(
        gpu, lower, y, T, D, T, trans_a=True, batch=py, causal="k_from_row", tile=tile,
    )  # fmt: skip
    check("causal k_from_row", got.reshape(nb, T, D), f64(lower).transpose(0, 2, 1) @ f64(y), "matmul")


def test_matmul_rejects_bad_batch_split(gpu):
    a = gpu.buffer(4 * 64)
    with pytest.raises(GpuError, match="batch split"):
        matmul(gpu, a, a, a, 2, 2, 2, batch=Batch(3, inner=2))
    with pytest.raises(GpuError, match="batch split"):
        matmul(gpu, a, a, a, 2, 2, 2, batch=Batch(2, inner=2, c=Strides(div=2)))
    with pytest.raises(GpuError, match="batch split"):
        matmul(gpu, a, a, a, 2, 2, 2, causal="upper")


def test_matmul_views_into_arena(gpu, rng):
    M, N, K = 9, 14, 11
    A, B = _rand(rng, M, K), _rand(rng, N, K)
    oa, ob, oc = 256, 768, 1280  # byte offsets, 256-aligned
    arena_in = np.full(1024, np.nan, np.float32)  # NaN around the views: any stray read would show
    arena_in[oa // 4 : oa // 4 + A.size] = A.ravel()
    arena_in[ob // 4 : ob // 4 + B.size] = B.ravel()
    src = gpu.upload(arena_in)
    sentinel = np.full(1024, 7.0, np.float32)
    dst = gpu.upload(sentinel)
    call = matmul(
        gpu, (dst, oc, 4 * M * N), (src, oa, 4 * A.size), (src, ob, 4 * B.size), M, N, K, trans_b=True
    )
    call.run(gpu)
    got = gpu.download(dst)
    check("matmul view", got[oc // 4 : oc // 4 + M * N].reshape(M, N), _op(A, False) @ _op(B, True), "matmul")
    outside = np.r_[got[: oc // 4], got[oc // 4 + M * N :]]
    assert np.all(outside == 7.0), "matmul wrote outside its view"


@pytest.mark.parametrize(
    "tile",
    [
        Tile(tm=8, tn=8, bk=16),
        Tile(wx=8, wy=4, tm=4, tn=8, bk=8),
        Tile(wx=4, wy=8, tm=8, tn=4, bk=5),
        Tile(unroll=False, prefetch=False),
        Tile(wx=4, wy=8, tm=8, tn=4, bk=5, unroll=False),
        Tile(tm=8, tn=8, bk=16, prefetch=False),
    ],
    ids=[
        "8x8-bk16",
        "wide",
        "odd-bk",
        "loop-noprefetch",
        "odd-bk-loop",
        "8x8-noprefetch",
    ],
)
def test_matmul_other_tiles(gpu, rng, tile):
    # The generator must be right for any tile shape: the H200 uses 8x8 per thread; the others have copy
    # counts that do not divide the thread count.
    M, N, K = 70, 45, 37
    if tile.shared_bytes > gpu.limits["max-compute-workgroup-storage-size"]:  # e.g. DDL_WGPU_LIMITS=webgpu
        with pytest.raises(GpuError, match="workgroup memory"):
            _run_matmul(gpu, _rand(rng, M, K), _rand(rng, N, K), M, N, K, trans_b=True, tile=tile)
        return
    for trans_a, trans_b in [(False, True), (True, False)]:
        A = _rand(rng, *((K, M) if trans_a else (M, K)))
        B = _rand(rng, *((N, K) if trans_b else (K, N)))
        got = _run_matmul(gpu, A, B, M, N, K, trans_a=trans_a, trans_b=trans_b, tile=tile)
        check(f"matmul {tile}", got.reshape(M, N), _op(A, trans_a) @ _op(B, trans_b), "matmul")


def test_matmul_deterministic(gpu, rng):
    rows, OUT, IN = 300, 24, 33  # the dW reduction runs over the 300 rows
    x, w, dout = _rand(rng, rows, IN), _rand(rng, OUT, IN), _rand(rng, rows, OUT)
    bx, bw, bdout = gpu.upload(x), gpu.upload(w), gpu.upload(dout)
    results = []
    for _ in range(2):
        dx, dw = gpu.buffer(4 * rows * IN), gpu.buffer(4 * OUT * IN)
        linear_backward(gpu, dx, dw, bdout, bx, bw, rows, OUT, IN).run(gpu)
        results.append((gpu.download(dx, np.float32, rows * IN), gpu.download(dw, np.float32, OUT * IN)))
    assert np.array_equal(results[0][0], results[1][0])
    assert np.array_equal(results[0][1], results[1][1])


def test_matmul_rejects_small_buffer_and_skips_empty(gpu):
    a, b, c = gpu.buffer(4 * 6), gpu.buffer(4 * 6), gpu.buffer(4 * 4)
    with pytest.raises(GpuError, match="needs"):
        matmul(gpu, c, a, b, 3, 3, 2)  # C needs 9 floats, has 4
    assert matmul(gpu, c, a, b, 0, 2, 3).dispatches == []
    with pytest.raises(GpuError, match="multiples of 4"):
        matmul(gpu, c, a, b, 2, 2, 3, tile=Tile(tm=3))


def test_pick_tile(gpu):
    # Small products keep the 64x64 tile (more workgroups); large ones take 128x128. Both must be right.
    assert pick_tile(gpu, 33, 17) == SMALL_TILE
    fits = LARGE_TILE.shared_bytes <= gpu.limits["max-compute-workgroup-storage-size"]
    assert pick_tile(gpu, 8192, 8192) == (LARGE_TILE if fits else SMALL_TILE)


@pytest.mark.parametrize(
    "M,N,K,ta,tb,parts",
    [(33, 17, 300, True, False, 4), (40, 24, 1000, False, False, 3), (20, 36, 257, False, True, 5),
     (16, 16, 640, True, False, 8), (9, 70, 129, False, False, 2)],
)  # fmt: skip
def test_split_k_matches_reference_and_is_deterministic(gpu, M, N, K, ta, tb, parts):
    """Split-K (K slices + a fixed-order reduction) gives the product, accumulates, and repeats bit for bit."""
    rng = np.random.default_rng(M * N + K)
    A = rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32)
    B = rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32)
    C0 = rng.standard_normal((M, N)).astype(np.float32)
    want = 0.5 * ((A.T if ta else A).astype(np.float64) @ (B.T if tb else B).astype(np.float64)) + C0
    outs = []
    for _ in range(2):
        a, b, c = gpu.upload(A), gpu.upload(B), gpu.upload(C0)
        matmul(gpu, c, a, b, M, N, K, trans_a=ta, trans_b=tb, accumulate=True, alpha=0.5, split_k=parts).run(
            gpu
        )
        outs.append(gpu.download(c, np.float32, M * N).reshape(M, N))
    check("split-k", outs[0], want, "matmul")
    assert np.array_equal(outs[0], outs[1])


def test_auto_split_k_only_on_gpus():
    from ddl_wgpu.ops.matmul import auto_split_k

    class FakeGpu:
        def __init__(self, kind):
            self.info = {"type": kind}

    assert auto_split_k(FakeGpu("CPU"), 768, 768, 16384, 1) == 1  # lavapipe: never
    gpu = FakeGpu("DiscreteGPU")
    assert auto_split_k(gpu, 768, 768, 16384, 1) > 1  # 36 large tiles: split
    assert auto_split_k(gpu, 16384, 2048, 768, 1) == 1  # plenty of tiles
    assert auto_split_k(gpu, 768, 768, 16384, 4) == 1  # batched: never
    assert auto_split_k(gpu, 768, 768, 1500, 1) == 1  # K too short to slice
    # the slice counts the wave model picks for the small preset's dW products, as measured best on the H200:
    # 36 tiles -> 15 slices (14 x 1152 + 256) over 16 x 1024 (3 waves); 96 tiles -> 8 x 2048 over 5 + 1
    assert auto_split_k(gpu, 768, 768, 16384, 1) == 15
    assert auto_split_k(gpu, 2048, 768, 16384, 1) == 8


def test_split_k_cost_counts_waves_and_the_short_slice():
    from ddl_wgpu.ops.matmul import SPLIT_K_SLOTS, split_k_cost

    assert split_k_cost(10, 4096, 1) == 4096  # one wave over all of K
    assert split_k_cost(10, 4096, 4) == 1024  # 40 workgroups, one wave, slices of 1024
    assert split_k_cost(SPLIT_K_SLOTS, 4096, 2) == 2 * 2048  # two waves of 2048
    assert split_k_cost(10, 4000, 4) == 1024 + 928  # 3 full slices of 1024, then 928 as its own launch
