"""The matmul's f16 products (`compute="f16"`, mixed-precision training) against float64 numpy.

Every result must lie within `ops.matmul.f16_error_bound`, the worst case derived from the chunk length (f16
rounding of both operands, `chunk` f16 roundings per partial, f32 across partials); and it must really be the
f16 path: its error is far above the f32 kernel's on the same data. Shapes are not multiples of the tiles.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddl_wgpu.gpu import GpuError
from ddl_wgpu.ops.matmul import LARGE_TILE, SMALL_TILE, Batch, Strides, f16_error_bound, matmul


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _op(x, trans):
    return (x.T if trans else x).astype(np.float64)


def _run(gpu, A, B, M, N, K, n_out=None, **kw):
    a, b = gpu.upload(A), gpu.upload(B)
    c = gpu.buffer(4 * (n_out or M * N))
    matmul(gpu, c, a, b, M, N, K, **kw).run(gpu)
    return gpu.download(c, np.float32, n_out or M * N)


def _within(what, got, ref, bound):
    err = np.abs(got.astype(np.float64) - ref)
    worst = float((err / bound).max())
    assert worst <= 1.0, f"{what}: error {err.max():.3g} exceeds the f16 bound (max ratio {worst:.3g})"
    return float(err.max())


@pytest.mark.parametrize("chunk", [1, 4, 8, 16])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
def test_f16_products_within_the_chunk_bound(gpu, rng, chunk, trans_a, trans_b):
    M, N, K = 37, 21, 150
    A = _rand(rng, *((K, M) if trans_a else (M, K)))
    B = _rand(rng, *((N, K) if trans_b else (K, N)))
    a64, b64 = _op(A, trans_a), _op(B, trans_b)
    ref = a64 @ b64
    bound = f16_error_bound(np.abs(a64) @ np.abs(b64), K, chunk, np.abs(A).max(), np.abs(B).max())
    kw = dict(trans_a=trans_a, trans_b=trans_b, split_k=1)
    got = _run(gpu, A, B, M, N, K, compute="f16", chunk=chunk, **kw).reshape(M, N)
    err16 = _within(f"f16 chunk {chunk} ta={trans_a} tb={trans_b}", got, ref, bound)
    err32 = np.abs(_run(gpu, A, B, M, N, K, **kw).reshape(M, N) - ref).max()
    assert err16 > 20 * err32, f"f16 path error {err16:.3g} vs f32 {err32:.3g}: were f16 products used?"


@pytest.mark.parametrize("tile", [SMALL_TILE, LARGE_TILE], ids=["small", "large"])
def test_f16_tiles_split_k_and_the_bound_is_tight_enough(gpu, rng, tile):
    # split-K (f32 partials, f32 reduction) over a long K, both tiles; the measured error is a sizeable
    # fraction of the bound, so the bound is not vacuous
    M, N, K = 20, 70, 1000
    A, B = _rand(rng, K, M), _rand(rng, K, N)
    ref = A.T.astype(np.float64) @ B
    bound = f16_error_bound(
        np.abs(A.T.astype(np.float64)) @ np.abs(B), K, 8, np.abs(A).max(), np.abs(B).max()
    )
    for parts in (1, 3):
        got = _run(gpu, A, B, M, N, K, trans_a=True, compute="f16", chunk=8, split_k=parts, tile=tile)
        _within(f"f16 split_k={parts}", got.reshape(M, N), ref, bound)
    assert np.abs(got.reshape(M, N) - ref).max() > 1e-3 * bound.max()


def test_f16_batched_causal_accumulate_alpha(gpu, rng):
    # the attention layout: two-level batch, GQA divisor, causal k range, alpha, accumulate into C
    T, D, nb, H, G = 19, 12, 2, 4, 2
    q, k = _rand(rng, nb, T, H, D), _rand(rng, nb, T, H // G, D)
    c0 = _rand(rng, nb * H, T, T)
    batch = Batch(
        nb * H, H, Strides(T * H * D, D), Strides(T * (H // G) * D, D, div=G), Strides(H * T * T, T * T)
    )
    a, b, c = gpu.upload(q), gpu.upload(k), gpu.upload(c0)
    matmul(gpu, c, a, b, T, T, D, trans_b=True, lda=H * D, ldb=(H // G) * D, batch=batch, alpha=0.5,
           accumulate=True, compute="f16", chunk=4).run(gpu)  # fmt: skip
    got = gpu.download(c, np.float32, c0.size).reshape(nb, H, T, T)
    q64 = q.astype(np.float64).transpose(0, 2, 1, 3)
    k64 = np.repeat(k.astype(np.float64).transpose(0, 2, 1, 3), G, axis=1)
    prod = q64 @ k64.transpose(0, 1, 3, 2)
    ref = 0.5 * prod + c0.reshape(nb, H, T, T)
    # alpha and accumulate: the product's bound halved, plus one f32 rounding of the result
    bound = 0.5 * f16_error_bound(np.abs(q64) @ np.abs(k64).transpose(0, 1, 3, 2), D, 4, np.abs(q).max(),
                                  np.abs(k).max()) + 2 * 2.0**-23 * (np.abs(ref) + 1.0)  # fmt: skip
    _within("f16 batched", got, ref, bound)


def test_f16_products_with_f16_weights(gpu, rng):
    # f16 B storage (the inference Net) combined with f16 products: B is exact in f16 already
    M, N, K = 9, 33, 40
    A, W = _rand(rng, M, K), _rand(rng, N, K).astype(np.float16)
    b = gpu.buffer(W.nbytes + 4)
    gpu.write(b, W.reshape(-1))
    a, c = gpu.upload(A), gpu.buffer(4 * M * N)
    matmul(gpu, c, a, b, M, N, K, trans_b=True, b_dtype="f16", compute="f16", chunk=8).run(gpu)
    w64 = W.astype(np.float64)
    ref = A.astype(np.float64) @ w64.T
    bound = f16_error_bound(
        np.abs(A.astype(np.float64)) @ np.abs(w64).T, K, 8, np.abs(A).max(), np.abs(W).max()
    )
    _within("f16 products, f16 B", gpu.download(c, np.float32, M * N).reshape(M, N), ref, bound)


def test_f16_chunk_must_divide_the_k_step(gpu, rng):
    a, b, c = gpu.upload(_rand(rng, 8, 8)), gpu.upload(_rand(rng, 8, 8)), gpu.buffer(256)
    with pytest.raises(GpuError, match="chunk"):
        matmul(gpu, c, a, b, 8, 8, 8, compute="f16", chunk=3)
    with pytest.raises(GpuError, match="compute"):
        matmul(gpu, c, a, b, 8, 8, 8, compute="bf16")


def test_pick_tile_uses_the_f16_tile_for_f16_products(gpu):
    from ddl_wgpu.ops import matmul as k_mm

    big = k_mm.pick_tile(gpu, 8192, 8192, compute="f16")
    fits = k_mm.F16_LARGE_TILE.shared_bytes <= gpu.limits.get("max-compute-workgroup-storage-size", 16384)
    assert big == (k_mm.F16_LARGE_TILE if fits else SMALL_TILE)
    assert k_mm.pick_tile(gpu, 8192, 8192) == (LARGE_TILE if LARGE_TILE.shared_bytes <= gpu.limits.get(
        "max-compute-workgroup-storage-size", 16384) else SMALL_TILE)  # fmt: skip
