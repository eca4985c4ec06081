"""The fused register-tiled attention kernels (attention_fused.wgsl) against ddl_ref.ops.attention_forward and
attention_backward (float64 reference of float32 inputs): out, lse, dq, dk, dv for GQA shapes, T = 1 and T not
a multiple of the tiles, head dims 4..256 (including ones not a multiple of 4), a custom scale, every candidate
tile this adapter fits (square and not), the tiles chosen under WebGPU's default limits, determinism and
causality; and the whole path through `attention.attention_forward/backward(impl="fused")` (with the delta
pass), as the engine reaches it with DDL_WGPU_ATTENTION=fused."""

import dataclasses

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import attention_inputs, check
from ddl_wgpu.gpu import WEBGPU_LIMITS, GpuError
from ddl_wgpu.ops import attention, attention_fused
from ddl_wgpu.ops.attention_fused import (
    BACKWARD_TILES,
    FORWARD_TILES,
    TILES,
    Tile,
    attention_fused_backward,
    attention_fused_forward,
    choose_tile,
    fitting_tiles,
)

SHAPES = [  # (B, T, H, K, D)
    (1, 1, 1, 1, 4),
    (2, 7, 4, 2, 6),
    (1, 33, 2, 1, 16),
    (2, 20, 6, 3, 32),
    (1, 70, 2, 2, 64),
    (1, 19, 2, 1, 128),
]


def _forward(gpu, shape, q, k, v, scale=None, tile=None):
    B, T, H, K, D = shape
    bq, bk, bv = (gpu.upload(a) for a in (q, k, v))
    out, lse = gpu.buffer(q.nbytes), gpu.buffer(B * H * T * 4)
    attention_fused_forward(gpu, out, lse, bq, bk, bv, B, T, H, K, D, scale=scale, tile=tile).run(gpu)
    return gpu.read(out, q.shape), gpu.read(lse, (B, H, T))


def _backward(gpu, shape, q, k, v, dout, out, lse, scale=None, tile=None):
    """The fused backward from the GPU forward's out and lse; delta = rowsum(dout * out) made here (the delta
    pass is `attention.wgsl`'s, tested with the launchers below and in test_kernel_attention.py)."""
    B, T, H, K, D = shape
    delta = np.einsum("bthd,bthd->bht", dout.astype(np.float64), out.astype(np.float64)).astype(np.float32)
    bufs = [gpu.upload(a) for a in (q, k, v, dout, lse, delta)]
    dq, dk, dv = gpu.buffer(q.nbytes), gpu.buffer(k.nbytes), gpu.buffer(v.nbytes)
    bq, bk, bv, bdo, blse, bdelta = bufs
    attention_fused_backward(gpu, dq, dk, dv, bdo, blse, bdelta, bq, bk, bv, B, T, H, K, D, scale=scale,
                             tile=tile).run(gpu)  # fmt: skip
    return gpu.read(dq, q.shape), gpu.read(dk, k.shape), gpu.read(dv, v.shape)


def _check_both(gpu, shape, seed=0, tile=None):
    """Forward and backward of one shape against the float64 reference."""
    q, k, v, dout = attention_inputs(shape, seed)
    out, lse = _forward(gpu, shape, q, k, v, tile=tile)
    want, cache = ref.attention_forward(*(a.astype(np.float64) for a in (q, k, v)))
    check(f"{shape} out", out, want, "attention")
    check(f"{shape} lse", lse, cache[4], "attention")
    grads = _backward(gpu, shape, q, k, v, dout, out, lse, tile=tile)
    for name, got, w in zip(
        ("dq", "dk", "dv"), grads, ref.attention_backward(dout.astype(np.float64), cache), strict=True
    ):
        check(f"{shape} {name}", got, w, "attention")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}D{}".format(*s))
def test_fused_matches_reference(gpu, shape):
    _check_both(gpu, shape)


def test_fused_head_dim_256(gpu):
    _check_both(gpu, (1, 9, 4, 2, 256), seed=1)


def _storage(gpu) -> int:
    return int(gpu.limits.get("max-compute-workgroup-storage-size", 16384))


def test_every_fitting_tile(gpu):
    """Each candidate tile the adapter fits (lavapipe's 32 KiB: all but the largest; WebGPU's default 16 KiB
    under DDL_WGPU_LIMITS=webgpu: the 32 x 32 and 16 x 16 ones), on a sequence spanning several query and key
    tiles."""
    fit = fitting_tiles(gpu, 16)
    least = len(TILES) - 4 if _storage(gpu) >= 32768 else 4  # all but those with 32-channel chunks
    assert len(fit) >= least, [t.label() for t in fit]
    for tile in fit:
        _check_both(gpu, (1, 2 * max(tile.bq, tile.bk) + 5, 2, 1, 16), tile=tile)


@pytest.mark.parametrize("tile", [Tile(64, 64, 8, 16, 16, 16, 8), Tile(32, 32, 8, 8, 16, 16, 16)], ids=str)
def test_unrolled_inner_steps(gpu, tile):
    """UNROLL = 8 and 16 (the H200 candidates' unrolled copies need more storage than lavapipe has). Within
    WebGPU's default 16 KiB the 64 x 64 tile does not fit: the same unrolling runs on the 32 x 32 tile."""
    if tile.shared_bytes(32) > _storage(gpu):
        tile = dataclasses.replace(tile, bq=32, bk=32, wy=8, wx=8)
        assert tile.shared_bytes(32) <= _storage(gpu)
    _check_both(gpu, (1, 2 * tile.bq + 3, 4, 2, 32), seed=7, tile=tile)


def test_webgpu_default_limits_pick_small_tiles():
    class Limits:  # what the kernel reads of a Gpu
        limits = WEBGPU_LIMITS

    for D in (16, 64, 128, 256):
        for backward in (False, True):
            t = choose_tile(Limits, D, backward=backward)
            assert t.shared_bytes(D) <= WEBGPU_LIMITS["max-compute-workgroup-storage-size"]
            assert t.wy * t.wx <= WEBGPU_LIMITS["max-compute-invocations-per-workgroup"]


def test_runs_under_webgpu_default_limits():
    """On a device created with WebGPU's default limits (16 KiB of workgroup storage) the kernels the launcher
    picks compile and match the reference at the largest head dim."""
    from ddl_wgpu.gpu import Gpu

    _check_both(Gpu(limits_mode="webgpu"), (1, 21, 2, 1, 256), seed=2)


def test_both_orders_hold_every_candidate():
    """The tile test above runs TILES; the backward's order must not hold a tile it did not check."""
    assert sorted(map(str, BACKWARD_TILES)) == sorted(map(str, FORWARD_TILES)) == sorted(map(str, TILES))
    assert all(t.valid() for t in TILES)


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
    shape = (1, 40, 2, 2, 16)  # one kv head per query head: the einsums below need no group sums
    q, k, v, dout = attention_inputs(shape, seed=3)
    out, lse = _forward(gpu, shape, q, k, v, scale=0.37)
    out2, lse2 = _forward(gpu, shape, q, k, v, scale=0.37)
    assert np.array_equal(out, out2) and np.array_equal(lse, lse2)
    grads = _backward(gpu, shape, q, k, v, dout, out, lse, scale=0.37)
    grads2 = _backward(gpu, shape, q, k, v, dout, out, lse, scale=0.37)
    assert all(np.array_equal(a, b) for a, b in zip(grads, grads2, strict=True))
    s = np.einsum("thd,shd->hts", q.astype(np.float64)[0], k.astype(np.float64)[0]) * 0.37
    s = np.where(np.tril(np.ones((40, 40), bool)), s, -np.inf)
    want_lse = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    p = np.exp(s - want_lse[..., None])
    v64, do64 = v.astype(np.float64)[0], dout.astype(np.float64)[0]
    want_out = np.einsum("hts,shd->thd", p, v64)
    check("scaled out", out[0], want_out, "attention")
    check("scaled lse", lse[0], want_lse, "attention")
    dp = np.einsum("thd,shd->hts", do64, v64)
    ds = p * (dp - np.einsum("thd,thd->ht", do64, want_out)[..., None])
    check(
        "scaled dq", grads[0][0], 0.37 * np.einsum("hts,shd->thd", ds, k.astype(np.float64)[0]), "attention"
    )
    check(
        "scaled dk", grads[1][0], 0.37 * np.einsum("hts,thd->shd", ds, q.astype(np.float64)[0]), "attention"
    )
    check("scaled dv", grads[2][0], np.einsum("hts,thd->shd", p, do64), "attention")


def test_causal(gpu):
    """Changing keys and values after position t leaves out and lse at rows <= t bit-identical."""
    shape, t = (1, 50, 2, 2, 16), 21
    q, k, v, _ = attention_inputs(shape, seed=4)
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
    """DDL_WGPU_ATTENTION=fused runs these kernels through the attention launchers (the backward after
    `attention.wgsl`'s delta pass) and the results match the reference."""
    B, T, H, K, D = shape
    monkeypatch.setenv(attention.ENV_IMPL, "fused")
    assert attention.choose_impl(gpu, H, K, T) == "fused"
    assert attention.choose_impl(gpu, H, K, T, masked=True) != "fused"
    q, k, v, dout = attention_inputs(shape, seed=5)
    bq, bk, bv, bdo = (gpu.upload(a) for a in (q, k, v, dout))
    out, lse = gpu.buffer(q.nbytes), gpu.buffer(B * H * T * 4)
    dq, dk, dv = gpu.buffer(q.nbytes), gpu.buffer(k.nbytes), gpu.buffer(v.nbytes)
    fwd = attention.attention_forward(gpu, out, lse, bq, bk, bv, B, T, H, K, D)
    assert {kern.name for kern, _, _ in fwd.dispatches} == {f"{attention_fused.FILE}:attention_fused_forward"}
    fwd.run(gpu)
    bwd = attention.attention_backward(gpu, dq, dk, dv, bdo, out, lse, bq, bk, bv, B, T, H, K, D)
    assert [kern.name.split(":")[1] for kern, _, _ in bwd.dispatches] == [
        "attention_backward_delta", "attention_fused_backward_dq", "attention_fused_backward_dkdv"]  # fmt: skip
    bwd.run(gpu)
    want, cache = ref.attention_forward(*(a.astype(np.float64) for a in (q, k, v)))
    wdq, wdk, wdv = ref.attention_backward(dout.astype(np.float64), cache)
    for name, buf, w in (("out", out, want), ("dq", dq, wdq), ("dk", dk, wdk), ("dv", dv, wdv)):
        check(f"fused {name}", gpu.read(buf, w.shape), w, "attention")
    check("fused lse", gpu.read(lse, cache[4].shape), cache[4], "attention")
