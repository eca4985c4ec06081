"""The fused register-tiled attention forward (attention_fused.wgsl) against ddl_ref.ops.attention_forward
(float64 reference of float32 inputs): out and lse for GQA shapes, T = 1 and T not a multiple of the tiles,
head dims 4..256 (including ones not a multiple of 4), a custom scale, every candidate tile this adapter fits,
the tiles chosen under WebGPU's default limits, determinism and causality; and the backward reached through
`attention.attention_backward(impl="fused")`, which consumes the fused forward's out and lse."""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check
from ddl_wgpu.gpu import WEBGPU_LIMITS, GpuError
from ddl_wgpu.ops import attention, attention_fused
from ddl_wgpu.ops.attention_fused import TILES, Tile, attention_fused_forward, choose_tile, fitting_tiles

SHAPES = [  # (B, T, H, K, D)
    (1, 1, 1, 1, 4),
    (2, 7, 4, 2, 6),
    (1, 33, 2, 1, 16),
    (2, 20, 6, 3, 32),
    (1, 70, 2, 2, 64),
    (1, 19, 2, 1, 128),
]


def _inputs(shape, seed=0):
    B, T, H, K, D = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B, T, K, D)).astype(np.float32)
    v = rng.standard_normal((B, T, K, D)).astype(np.float32)
    return q, k, v


def _forward(gpu, shape, q, k, v, scale=None, tile=None):
    B, T, H, K, D = shape
    bq, bk, bv = (gpu.upload(a) for a in (q, k, v))
    out, lse = gpu.buffer(q.nbytes), gpu.buffer(B * H * T * 4)
    attention_fused_forward(gpu, out, lse, bq, bk, bv, B, T, H, K, D, scale=scale, tile=tile).run(gpu)
    return gpu.read(out, q.shape), gpu.read(lse, (B, H, T))


def _check_forward(gpu, shape, seed=0, tile=None):
    q, k, v = _inputs(shape, seed)
    out, lse = _forward(gpu, shape, q, k, v, tile=tile)
    want, cache = ref.attention_forward(*(a.astype(np.float64) for a in (q, k, v)))
    check(f"{shape} out", out, want, "attention")
    check(f"{shape} lse", lse, cache[4], "attention")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}D{}".format(*s))
def test_fused_forward_matches_reference(gpu, shape):
    _check_forward(gpu, shape)


def test_fused_forward_head_dim_256(gpu):
    _check_forward(gpu, (1, 9, 4, 2, 256), seed=1)


def test_every_fitting_tile(gpu):
    """Each candidate tile the adapter fits (lavapipe's 32 KiB: all but the largest), on a sequence spanning
    several query and key tiles."""
    fit = fitting_tiles(gpu, 16)
    assert len(fit) >= len(TILES) - 3, [t.label() for t in fit]
    for tile in fit:
        _check_forward(gpu, (1, 2 * max(tile.bq, tile.bk) + 5, 2, 1, 16), tile=tile)


def test_webgpu_default_limits_pick_small_tiles():
    class Limits:  # what the kernel reads of a Gpu
        limits = WEBGPU_LIMITS

    for D in (16, 64, 128, 256):
        t = choose_tile(Limits, D)
        assert t.shared_bytes(D) <= WEBGPU_LIMITS["max-compute-workgroup-storage-size"]
        assert t.wy * t.wx <= WEBGPU_LIMITS["max-compute-invocations-per-workgroup"]


def test_bad_tiles_and_sizes_are_refused(gpu):
    with pytest.raises(GpuError):
        choose_tile(gpu, 32, Tile(16, 16, 4, 4, 8, 3))  # BJ does not divide BK
    with pytest.raises(GpuError):
        choose_tile(gpu, 32, Tile(12, 16, 4, 4, 8, 4))  # TM = 3 rows
    with pytest.raises(GpuError):
        choose_tile(gpu, 300)
    buf = gpu.buffer(1 << 12)
    with pytest.raises(GpuError):
        attention_fused_forward(gpu, buf, buf, buf, buf, buf, 1, 4, 3, 2, 8)  # H % K != 0


def test_custom_scale_and_determinism(gpu):
    shape = (1, 40, 2, 1, 16)
    q, k, v = _inputs(shape, seed=3)
    out, lse = _forward(gpu, shape, q, k, v, scale=0.37)
    out2, lse2 = _forward(gpu, shape, q, k, v, scale=0.37)
    assert np.array_equal(out, out2) and np.array_equal(lse, lse2)
    s = np.einsum("thd,shd->hts", q.astype(np.float64)[0], k.astype(np.float64)[0]) * 0.37
    s = np.where(np.tril(np.ones((40, 40), bool)), s, -np.inf)
    want_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    p = np.exp(s - want_lse[..., None])
    check("scaled out", out[0], np.einsum("hts,shd->thd", p, v.astype(np.float64)[0]), "attention")
    check("scaled lse", lse[0], want_lse, "attention")


def test_causal(gpu):
    """Changing keys and values after position t leaves out and lse at rows <= t bit-identical."""
    shape, t = (1, 50, 2, 2, 16), 21
    q, k, v = _inputs(shape, seed=4)
    out, lse = _forward(gpu, shape, q, k, v)
    k2, v2 = k.copy(), v.copy()
    k2[:, t + 1 :] += 5.0
    v2[:, t + 1 :] -= 3.0
    out2, lse2 = _forward(gpu, shape, q, k2, v2)
    assert np.array_equal(out[:, : t + 1], out2[:, : t + 1])
    assert np.array_equal(lse[..., : t + 1], lse2[..., : t + 1])
    assert not np.array_equal(out[:, t + 1 :], out2[:, t + 1 :])


@pytest.mark.parametrize("shape", [(2, 20, 6, 3, 32), (1, 37, 2, 1, 64)], ids=["gqa", "D64"])
def test_fused_choice_through_the_attention_launchers(gpu, shape, monkeypatch):
    """impl="fused" (and DDL_WGPU_ATTENTION=fused) runs this kernel forward; the backward consumes its out
    and lse and matches the reference's gradients."""
    B, T, H, K, D = shape
    monkeypatch.setenv(attention.ENV_IMPL, "fused")
    assert attention.choose_impl(gpu, H, K, T) == "fused"
    assert attention.choose_impl(gpu, H, K, T, masked=True) != "fused"
    q, k, v = _inputs(shape, seed=5)
    dout = np.random.default_rng(6).standard_normal(q.shape).astype(np.float32)
    bq, bk, bv, bdo = (gpu.upload(a) for a in (q, k, v, dout))
    out, lse = gpu.buffer(q.nbytes), gpu.buffer(B * H * T * 4)
    dq, dk, dv = gpu.buffer(q.nbytes), gpu.buffer(k.nbytes), gpu.buffer(v.nbytes)
    fwd = attention.attention_forward(gpu, out, lse, bq, bk, bv, B, T, H, K, D)
    assert {kern.name for kern, _, _ in fwd.dispatches} == {f"{attention_fused.FILE}:attention_fused_forward"}
    fwd.run(gpu)
    attention.attention_backward(gpu, dq, dk, dv, bdo, out, lse, bq, bk, bv, B, T, H, K, D).run(gpu)
    want, cache = ref.attention_forward(*(a.astype(np.float64) for a in (q, k, v)))
    wdq, wdk, wdv = ref.attention_backward(dout.astype(np.float64), cache)
    for name, buf, w in (("out", out, want), ("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)):
        check(f"fused {name}", gpu.read(buf, w.shape), w, "attention")
    check("fused lse", gpu.read(lse, cache[4].shape), cache[4], "attention")
