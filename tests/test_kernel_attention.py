"""Both causal-attention implementations against ddl_ref.ops.attention_forward/backward (float64 reference of
float32 inputs): the flash kernels of attention.wgsl and the GEMMs over materialised scores
(attention_scores.wgsl + matmul). out, lse, dq, dk, dv for GQA shapes with T not a multiple of the tiles;
determinism; causality; a custom scale; every flash tile shape the launcher can pick; large head dims; the
flash tile choice for any D <= 256; the scores path in chunks of batches, of kv heads and of query rows; the
implementation choice."""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import attention_inputs, check
from ddl_wgpu.ops import attention, attention_scores
from ddl_wgpu.ops.attention import MAX_D, attention_backward, attention_forward, choose_impl, tile_config
from ddl_wgpu.runtime.gpu import GpuError

IMPLS = ["flash", "scores"]

SHAPES = [  # (B, T, H, K, D)
    (1, 1, 1, 1, 4),
    (2, 7, 4, 2, 6),
    (1, 33, 2, 1, 16),
    (2, 20, 6, 3, 32),
    (1, 70, 2, 2, 8),
]


def _gpu_attention(gpu, shape, q, k, v, dout, scale=None, impl="flash"):
    """Forward then backward on the GPU (the backward consumes the GPU's out and lse, as in training)."""
    B, T, H, K, D = shape
    bq, bk, bv, bdo = (gpu.upload(a) for a in (q, k, v, dout))
    out, lse = gpu.buffer(q.nbytes), gpu.buffer(B * H * T * 4)
    dq, dk, dv = gpu.buffer(q.nbytes), gpu.buffer(k.nbytes), gpu.buffer(v.nbytes)
    attention_forward(gpu, out, lse, bq, bk, bv, B, T, H, K, D, scale=scale, impl=impl).run(gpu)
    attention_backward(gpu, dq, dk, dv, bdo, out, lse, bq, bk, bv, B, T, H, K, D, scale=scale, impl=impl).run(
        gpu
    )
    return {
        "out": gpu.download(out, count=q.size).reshape(q.shape),
        "lse": gpu.download(lse, count=B * H * T).reshape(B, H, T),
        "dq": gpu.download(dq, count=q.size).reshape(q.shape),
        "dk": gpu.download(dk, count=k.size).reshape(k.shape),
        "dv": gpu.download(dv, count=v.size).reshape(v.shape),
    }


def _reference(q, k, v, dout):
    out, cache = ref.attention_forward(*(a.astype(np.float64) for a in (q, k, v)))
    dq, dk, dv = ref.attention_backward(dout.astype(np.float64), cache)
    return {"out": out, "lse": cache[4], "dq": dq, "dk": dk, "dv": dv}


def _check_all(got, want, label):
    for name in ("out", "lse", "dq", "dk", "dv"):
        check(f"{label} {name}", got[name], want[name], "attention")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}T{}H{}K{}D{}".format(*s))
def test_attention_matches_reference(gpu, shape, impl):
    q, k, v, dout = attention_inputs(shape)
    _check_all(_gpu_attention(gpu, shape, q, k, v, dout, impl=impl), _reference(q, k, v, dout), str(shape))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(1, 19, 2, 1, 128), (1, 9, 4, 2, 256)], ids=["D128", "D256"])
def test_attention_large_head_dim(gpu, shape, impl):
    q, k, v, dout = attention_inputs(shape, seed=1)
    _check_all(_gpu_attention(gpu, shape, q, k, v, dout, impl=impl), _reference(q, k, v, dout), str(shape))


def test_attention_scores_in_chunks(gpu, monkeypatch):
    # A scratch limit of 1.5 batches' scores: three chunks of one batch each (offsets into q, k, v, out, lse,
    # delta and the gradients), GQA with G = 3 (dk, dv summed over g), T past the GEMM's 64-row tile.
    shape = (3, 70, 6, 2, 8)
    B, T, H, K, D = shape
    monkeypatch.setattr(attention_scores, "SCORE_BYTES", 3 * H * T * T * 4 // 2)
    chunks, _ = attention_scores.plan(gpu, B, H, K, T)
    assert [(c.b0, c.nb, c.j0, c.nk) for c in chunks] == [(0, 1, 0, K), (1, 1, 0, K), (2, 1, 0, K)]
    q, k, v, dout = attention_inputs(shape, seed=7)
    _check_all(_gpu_attention(gpu, shape, q, k, v, dout, impl="scores"), _reference(q, k, v, dout), "chunks")


def test_attention_scores_in_chunks_of_heads(gpu, monkeypatch):
    # One batch's scores do not fit, two kv heads' (of 2 query heads each) do: chunks of kv heads 0-1 and 2
    # of each batch (head offsets into every tensor, lse/delta rows of a head subset, dk/dv per kv head).
    shape = (2, 70, 6, 3, 8)
    B, T, H, K, D = shape
    monkeypatch.setattr(attention_scores, "SCORE_BYTES", 5 * T * T * 4)
    chunks, _ = attention_scores.plan(gpu, B, H, K, T)
    assert [(c.b0, c.nb, c.j0, c.nk) for c in chunks] == [
        (0, 1, 0, 2),
        (0, 1, 2, 1),
        (1, 1, 0, 2),
        (1, 1, 2, 1),
    ]
    q, k, v, dout = attention_inputs(shape, seed=8)
    _check_all(_gpu_attention(gpu, shape, q, k, v, dout, impl="scores"), _reference(q, k, v, dout), "heads")


def _row_blocks(monkeypatch, gpu, B, T, H, K, R):
    """Set the scratch limit so that one kv head's scores over all T rows do not fit but R rows' do (R not
    a multiple of ROW_ALIGN); check the plan: blocks of R rows, last block first, per (batch, kv head)."""
    G = H // K
    monkeypatch.setattr(attention_scores, "SCORE_BYTES", G * T * 4 * (R + 1) - 4)
    assert not attention_scores.fits(gpu, H, K, T) and attention_scores.row_block(gpu, H, K, T) == R
    chunks, nbytes = attention_scores.plan(gpu, B, H, K, T)
    starts = list(range((T - 1) // R * R, -1, -R))
    assert T % R and nbytes == G * R * T * 4
    assert [(c.b0, c.j0, c.nk, c.r0, c.nr) for c in chunks] == [
        (b, j, 1, r0, min(R, T - r0)) for b in range(B) for j in range(K) for r0 in starts
    ]


def test_attention_scores_in_row_blocks(gpu, monkeypatch):
    # Not even one kv head's query heads fit over all T rows: blocks of 16 query rows (T = 70: a short last
    # block of 6), GQA G = 2, two batches; each block's scores stop at key r0 + 16, the first block's are a
    # square causal product, dk / dv add up over the blocks. Same bits twice.
    shape = (2, 70, 4, 2, 8)
    B, T, H, K, D = shape
    q, k, v, dout = attention_inputs(shape, seed=9)
    whole = _gpu_attention(gpu, shape, q, k, v, dout, impl="scores")
    _row_blocks(monkeypatch, gpu, B, T, H, K, 16)
    got = _gpu_attention(gpu, shape, q, k, v, dout, impl="scores")
    _check_all(got, _reference(q, k, v, dout), "row blocks")
    _check_all(got, {n: a.astype(np.float64) for n, a in whole.items()}, "row blocks vs whole heads")
    again = _gpu_attention(gpu, shape, q, k, v, dout, impl="scores")
    for name in got:
        assert np.array_equal(got[name], again[name]), f"{name} differs between two identical runs"


def test_attention_impl_choice(gpu, monkeypatch):
    monkeypatch.delenv(attention.ENV_IMPL, raising=False)
    cpu = gpu.info.get("type", "") == "CPU"
    assert choose_impl(gpu, 4, 1, 64) == ("flash" if cpu else "scores")
    assert choose_impl(gpu, 4, 1, 64, masked=True) == "scores"  # the masked loops are slow everywhere
    monkeypatch.setenv(attention.ENV_IMPL, "scores")
    assert choose_impl(gpu, 4, 1, 64) == "scores"
    assert choose_impl(gpu, 4, 1, 64, "flash") == "flash"  # the argument beats the environment
    monkeypatch.setattr(
        attention_scores, "SCORE_BYTES", 4 * 64 * 64 * 4 - 4
    )  # one kv head's 4 query heads no longer fit: the scores path runs in row blocks (of 63 rows)
    assert not attention_scores.fits(gpu, 4, 1, 64) and attention_scores.row_block(gpu, 4, 1, 64) == 63
    assert choose_impl(gpu, 4, 1, 64) == "scores"
    monkeypatch.setenv(attention.ENV_IMPL, "auto")
    assert choose_impl(gpu, 4, 1, 64) == "flash"  # causal: row blocks only on request
    assert choose_impl(gpu, 4, 1, 64, masked=True) == "scores"
    monkeypatch.setattr(attention_scores, "SCORE_BYTES", 4 * 64 * 4 - 4)  # not even one row fits
    assert choose_impl(gpu, 4, 1, 64, masked=True) == "flash"
    with pytest.raises(GpuError, match="scratch limit"):
        choose_impl(gpu, 4, 1, 64, "scores")
    with pytest.raises(GpuError, match="not one of"):
        choose_impl(gpu, 4, 1, 64, "fast")


@pytest.mark.parametrize(
    "tile", [(16, 16), (8, 16), (4, 8), (2, 4), (1, 4)], ids=lambda t: f"R{t[0]}TR{t[1]}"
)
def test_attention_tile_shapes(gpu, monkeypatch, tile):
    # Each kernel's tile (R rows x TR columns) depends on D and the adapter's workgroup storage; force each
    # shape on a D that is a multiple of 4 (vec4 loads) and one that is not (scalar loads, zero padding).
    monkeypatch.setattr(attention, "_TILES", (tile,))
    for shape in [(1, 11, 2, 1, 7), (2, 9, 4, 2, 12)]:
        q, k, v, dout = attention_inputs(shape, seed=2)
        _check_all(_gpu_attention(gpu, shape, q, k, v, dout), _reference(q, k, v, dout), f"{tile} {shape}")


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_deterministic(gpu, impl):
    shape = (2, 20, 6, 3, 32)
    q, k, v, dout = attention_inputs(shape, seed=3)
    a = _gpu_attention(gpu, shape, q, k, v, dout, impl=impl)
    b = _gpu_attention(gpu, shape, q, k, v, dout, impl=impl)
    for name in a:
        assert np.array_equal(a[name], b[name]), f"{name} differs between two identical runs"


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_causal(gpu, impl):
    # Changing k and v at positions > t leaves out[:, :t+1] and lse[..., :t+1] bit-identical.
    shape = (1, 37, 4, 2, 16)
    t = 17
    q, k, v, dout = attention_inputs(shape, seed=4)
    a = _gpu_attention(gpu, shape, q, k, v, dout, impl=impl)
    k2, v2 = k.copy(), v.copy()
    k2[:, t + 1 :] = 10.0 * np.random.default_rng(5).standard_normal(k2[:, t + 1 :].shape)
    v2[:, t + 1 :] = -3.0
    b = _gpu_attention(gpu, shape, q, k2, v2, dout, impl=impl)
    assert np.array_equal(a["out"][:, : t + 1], b["out"][:, : t + 1])
    assert np.array_equal(a["lse"][..., : t + 1], b["lse"][..., : t + 1])
    assert not np.array_equal(a["out"][:, t + 1 :], b["out"][:, t + 1 :])


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_custom_scale(gpu, impl):
    # scale c on q equals the default scale D**-0.5 on q' = q * c * sqrt(D); dq picks up that factor.
    shape = (2, 13, 4, 1, 8)
    B, T, H, K, D = shape
    c = 0.2
    q, k, v, dout = attention_inputs(shape, seed=6)
    got = _gpu_attention(gpu, shape, q, k, v, dout, scale=c, impl=impl)
    f = c * np.sqrt(D)
    want = _reference(q.astype(np.float64) * f, k, v, dout)
    want["dq"] = want["dq"] * f
    _check_all(got, want, "scale")


def test_tile_config_fits():
    # Every head dim up to 256 fits WebGPU's default 16 KiB of workgroup storage; more storage, wider tiles.
    for D in range(1, MAX_D + 1):
        small = tile_config(D, 16384)
        big = tile_config(D, 49152)
        assert all(r * tr <= 256 for r, tr in small.values())
        assert all(big[n][0] * big[n][1] >= small[n][0] * small[n][1] for n in small)


@pytest.mark.parametrize("impl", IMPLS)
def test_attention_rejects_short_bindings(gpu, impl):
    # attention.wgsl runs without naga's index clamps: a buffer shorter than the shapes need is an error
    B, T, H, K, D = 2, 9, 4, 2, 8
    q = gpu.buffer(B * T * H * D * 4)
    kv = gpu.buffer(B * T * K * D * 4)
    lse = gpu.buffer(B * H * T * 4)
    short = (gpu.buffer(B * T * H * D * 4), 0, B * T * H * D * 4 - 4)  # a view one value short
    with pytest.raises(ValueError, match="attention_forward: out"):
        attention_forward(gpu, short, lse, q, kv, kv, B, T, H, K, D, impl=impl)
    with pytest.raises(ValueError, match="attention_backward: k"):
        attention_backward(gpu, q, kv, kv, q, q, lse, q, (kv, 0, 256), kv, B, T, H, K, D, impl=impl)
