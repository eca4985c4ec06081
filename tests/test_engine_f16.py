"""Inference-only nets and f16 weights (the heal teacher's `--trunk-dtype f16`).

- the matmul's f16-B variant against numpy: tight against the weights rounded to f16 (only the f32
  accumulation order differs), loose against the f32 weights (f16 keeps 11 significant bits: relative
  rounding <= 2^-11 ≈ 4.9e-4 per weight), and bit-equal to the f32 kernel run on the pre-rounded weights;
- the f16 embedding gather (exact: f16 -> f32 is exact);
- `Net(inference=True, dtype="f16")`: logits / loss / top-k equal (tight) to an f32 net on the same weights
  pre-rounded to f16, and close (rel 1e-2 on logits) to the f32 net; also in row chunks (lowered binding
  limit); memory ≈ 2 bytes per parameter of the big matrices; no training; the clear error when the
  adapter lacks shader-f16."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_cfg

from ddl_ref.params import init_params
from ddl_wgpu.engine.inference import InferenceWork
from ddl_wgpu.engine.layout import ALIGN, F16_SUFFIXES, is_f16_matrix
from ddl_wgpu.engine.net import Net
from ddl_wgpu.engine.step import AdamW
from ddl_wgpu.engine.trunk import TrunkWork
from ddl_wgpu.ops import embedding as k_emb
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.runtime.gpu import Gpu, GpuError

B, T = 2, 8
V, C = 300, 32


def rounded(params: dict) -> dict:
    """The parameters an f16 inference Net actually holds: the big matrices rounded to f16."""
    return {
        n: (
            a.astype(np.float16).astype(np.float32)
            if is_f16_matrix(n, a.shape)
            else np.asarray(a, np.float32)
        )
        for n, a in params.items()
    }


def ids(seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, T))


def f16_buffer(gpu, w: np.ndarray, lead: int = 0):
    """An f16 copy of w in a buffer, starting `lead` bytes in (a 256-aligned view like the arenas')."""
    h = np.asarray(w, np.float16).reshape(-1)
    buf = gpu.buffer(lead + h.nbytes + 4)
    gpu.write(buf, h, lead)
    return (buf, lead, -(-h.nbytes // 4) * 4)


# -- kernels ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("M,N,K", [(37, 45, 23), (64, 72, 40), (5, 3, 7)])
def test_matmul_f16_weights_forward(gpu, rng, M, N, K):
    x = rng.standard_normal((M, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    w16 = w.astype(np.float16).astype(np.float32)
    wv = f16_buffer(gpu, w, lead=ALIGN)
    out = gpu.buffer(M * N * 4)
    k_mm.matmul(gpu, out, gpu.upload(x), wv, M, N, K, trans_b=True, b_dtype="f16").run(gpu)
    got = gpu.download(out, np.float32, M * N).reshape(M, N)
    want16 = x.astype(np.float64) @ w16.astype(np.float64).T
    np.testing.assert_allclose(got, want16, rtol=1e-5, atol=1e-5 * np.sqrt(K))
    # against the f32 weights: each weight moved by <= 2^-11 relative, so |err| <= 2^-11 sum|x||w|
    bound = 2.0**-11 * (np.abs(x) @ np.abs(w).T) + 1e-5
    assert (np.abs(got - x @ w.T) <= bound).all()
    assert np.abs(got - x @ w.T).max() > 0  # the rounding is really there
    # the f32 kernel on the pre-rounded weights: the same k order, the same bits
    out32 = gpu.buffer(M * N * 4)
    k_mm.matmul(gpu, out32, gpu.upload(x), gpu.upload(w16), M, N, K, trans_b=True).run(gpu)
    np.testing.assert_array_equal(got, gpu.download(out32, np.float32, M * N).reshape(M, N))


def test_matmul_f16_weights_untransposed_and_checks(gpu, rng):
    M, N, K = 9, 20, 13
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    out = gpu.buffer(M * N * 4)
    bv = f16_buffer(gpu, b)
    k_mm.matmul(gpu, out, gpu.upload(a), bv, M, N, K, b_dtype="f16").run(gpu)
    want = a.astype(np.float64) @ b.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(gpu.download(out, np.float32, M * N).reshape(M, N), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(GpuError, match="B needs"):  # bounds checked in f16 bytes
        k_mm.matmul(gpu, out, gpu.upload(a), (bv[0], 0, 2 * K * N - 4), M, N, K, b_dtype="f16")
    with pytest.raises(GpuError, match="b_dtype"):
        k_mm.matmul(gpu, out, gpu.upload(a), bv, M, N, K, b_dtype="bf16")


@pytest.mark.parametrize("width_c", [32, 6])  # vec4<f16> and scalar f16 items
def test_embedding_gather_f16(gpu, rng, width_c):
    Vt, n = 50, 11
    table = rng.standard_normal((Vt, width_c)).astype(np.float32)
    tok = rng.integers(0, Vt, n).astype(np.uint32)
    out = gpu.buffer(n * width_c * 4)
    k_emb.embedding_forward(gpu, out, gpu.upload(tok), f16_buffer(gpu, table), n, width_c, w_dtype="f16").run(
        gpu
    )
    got = gpu.download(out, np.float32, n * width_c).reshape(n, width_c)
    np.testing.assert_array_equal(got, table.astype(np.float16).astype(np.float32)[tok])


# -- the inference Net --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(tie_embeddings=False),
        dict(tie_embeddings=True, qk_norm="pre_rope"),
        dict(residual="delta", ddl_dv=4, ddl_compressor="cc", ddl_expand_embed=True),
    ],
    ids=["untied", "tied", "ddl"],
)
def test_f16_net_matches_prerounded_f32_and_is_close_to_f32(gpu, kw):
    cfg = tiny_cfg("chunked", **kw)
    p = init_params(cfg, 0)
    x = ids()
    full = Net(gpu, cfg, p, work_class=TrunkWork)  # the training engine, f32
    n16 = Net(gpu, cfg, p, inference=True, dtype="f16", work_class=InferenceWork)
    nr = Net(
        gpu, cfg, rounded(p), inference=True, work_class=InferenceWork
    )  # f32 inference net on the rounded weights
    l32, l16, lr = (n.work(B, T).logits(x) for n in (full, n16, nr))
    # same kernels, same k order, the f16 -> f32 conversion exact: equal up to accumulation-order noise
    np.testing.assert_allclose(l16, lr, rtol=0, atol=1e-6 * np.abs(lr).max())
    # f16 rounding of the weights (2^-11 relative each) moves the logits by well under 1% of their range
    assert np.abs(l16 - l32).max() <= 1e-2 * np.abs(l32).max()
    (s16, c16), (sr, cr), (s32, c32) = (n.work(B, T).loss_sum(x) for n in (n16, nr, full))
    assert c16 == cr == c32
    assert s16 == pytest.approx(sr, rel=1e-6) and s16 == pytest.approx(s32, rel=1e-2)
    t16, tr = n16.work(B, T).topk(x, 5), nr.work(B, T).topk(x, 5)
    np.testing.assert_array_equal(t16[0], tr[0])
    np.testing.assert_allclose(t16[1], tr[1], rtol=1e-5, atol=1e-7)
    for h16, hr in zip(n16.work(B, T).hidden(), nr.work(B, T).hidden(), strict=True):
        np.testing.assert_allclose(h16, hr, rtol=1e-5, atol=1e-6)
    exp = n16.export()  # export decodes the f16 slots
    for name, a in rounded(p).items():
        np.testing.assert_array_equal(exp[name], a, err_msg=name)


def test_f16_net_in_row_chunks():
    """A lowered binding limit: the f16 embedding (19 KB) and untied head are bound in 64-row chunks."""
    small = Gpu(max_binding=8192, max_buffer=64 << 10)
    if "shader-f16" not in small.features:
        pytest.skip("adapter without shader-f16")
    cfg = tiny_cfg("chunked", tie_embeddings=False)
    p = init_params(cfg, 1)
    n16 = Net(small, cfg, p, inference=True, dtype="f16", work_class=InferenceWork)
    nr = Net(small, cfg, rounded(p), inference=True, work_class=InferenceWork)
    assert len(n16.row_views("model.embed_tokens.weight")) > 1 and len(n16.row_views("lm_head.weight")) > 1
    x = ids(1)
    l16, lr = n16.work(B, T).logits(x), nr.work(B, T).logits(x)
    np.testing.assert_allclose(l16, lr, rtol=0, atol=1e-6 * np.abs(lr).max())
    t16, tr = n16.work(B, T).topk(x, 4), nr.work(B, T).topk(x, 4)
    np.testing.assert_array_equal(t16[0], tr[0])
    assert n16.work(B, T).loss_sum(x)[0] == pytest.approx(nr.work(B, T).loss_sum(x)[0], rel=1e-6)


def test_inference_net_memory(gpu):
    cfg = tiny_cfg("chunked", tie_embeddings=False)
    p = init_params(cfg, 0)
    big = sum(a.size for n, a in p.items() if is_f16_matrix(n, a.shape))
    rest = sum(a.size for n, a in p.items() if not is_f16_matrix(n, a.shape))
    assert big > 0.9 * (big + rest)  # the rule covers nearly every parameter of a transformer
    sizes = {}
    for key, kw in {
        "train": {},
        "f32": dict(inference=True),
        "f16": dict(inference=True, dtype="f16"),
    }.items():
        before = gpu.allocated
        net = Net(gpu, cfg, p, **kw)
        sizes[key] = gpu.allocated - before
        if key == "f16":
            assert all(
                net.slots[n].dtype == ("f16" if is_f16_matrix(n, a.shape) else "f32") for n, a in p.items()
            )
    slack = ALIGN * len(p) + 1024  # per-tensor 256-byte alignment and the scalars buffer
    assert 16 * (big + rest) <= sizes["train"] <= 16 * (big + rest) + 4 * slack
    assert 4 * (big + rest) <= sizes["f32"] <= 4 * (big + rest) + slack
    assert 2 * big + 4 * rest <= sizes["f16"] <= 2 * big + 4 * rest + slack


def test_inference_net_refuses_training(gpu):
    cfg = tiny_cfg("chunked")
    net = Net(gpu, cfg, init_params(cfg, 0), inference=True, dtype="f16", work_class=InferenceWork)
    work = net.work(B, T)
    # the forward-only work: no backward Calls, no training head, no backward scratch
    assert isinstance(work, InferenceWork) and not hasattr(work, "_bwd") and not hasattr(work, "_head_train")
    assert not hasattr(work, "dxf")
    with pytest.raises(GpuError, match="inference-only"):
        TrunkWork(net, B, T)
    with pytest.raises(GpuError, match="inference-only"):
        work.step(ids())
    with pytest.raises(GpuError, match="inference-only"):
        net.optimizer_call(AdamW(lr=1e-3, step=1))
    with pytest.raises(GpuError, match="inference-only"):
        net.grads()
    with pytest.raises(GpuError, match="inference-only"):
        net.view("model.norm.weight", "g")
    with pytest.raises(GpuError, match="inference=True"):
        Net(gpu, cfg, init_params(cfg, 0), dtype="f16")
    with pytest.raises(GpuError, match="dtype"):
        Net(gpu, cfg, init_params(cfg, 0), inference=True, dtype="bf16")


def test_f16_net_loads_float16_arrays_as_their_float32_values(gpu):
    """Given float16 arrays (a folder's own f16 tensors, the 27B bench's weights) an f16 net holds the same
    bits as given their float32 values; a float32 weight past f16's range is refused in one line."""
    cfg = tiny_cfg("chunked")
    p = rounded(init_params(cfg, 0))
    half = {n: a.astype(np.float16) if is_f16_matrix(n, a.shape) else a for n, a in p.items()}
    a = Net(gpu, cfg, p, inference=True, dtype="f16", work_class=InferenceWork)
    b = Net(gpu, cfg, half, inference=True, dtype="f16", work_class=InferenceWork)
    for x, y in zip(a.p, b.p, strict=True):
        assert np.array_equal(gpu.download(x, np.uint32), gpu.download(y, np.uint32))
    big = dict(p)
    name = next(n for n in p if is_f16_matrix(n, p[n].shape))
    big[name] = p[name] * 1e6
    with pytest.raises(GpuError, match=f"{name} overflows float16") as e:
        Net(gpu, cfg, big, inference=True, dtype="f16", work_class=InferenceWork)
    assert "\n" not in str(e.value)


def test_write_pads_to_whole_words(gpu):
    buf = gpu.buffer(16)
    gpu.write(buf, np.full(4, 7, np.uint32))
    gpu.write(buf, np.arange(1, 4, dtype=np.uint8), 4)  # 3 bytes: written as one word, its last byte 0
    assert gpu.download(buf, np.uint8, 12).tolist() == [7, 0, 0, 0, 1, 2, 3, 0, 7, 0, 0, 0]


def test_f16_without_shader_f16_is_one_clear_error(gpu, monkeypatch):
    cfg = tiny_cfg("chunked")
    monkeypatch.setattr(gpu, "features", set())
    with pytest.raises(GpuError, match="shader-f16") as e:
        Net(gpu, cfg, init_params(cfg, 0), inference=True, dtype="f16")
    assert "\n" not in str(e.value)
    Net(gpu, cfg, init_params(cfg, 0), inference=True)  # f32 still works
    assert "lm_head.weight" in F16_SUFFIXES


# 256: two even slices; 200, 150: a short last slice (256 bytes into the f16 rows); 100: slices of 64
# elements put the last slice 128 bytes in, not bindable, so the f16 product falls back to one pass
@pytest.mark.parametrize("K", [256, 200, 150, 100])
def test_matmul_f16_weights_split_k(gpu, rng, K):
    """The split-K path GPUs take for long K (forced here): f16 slice offsets are in elements (2 bytes)."""
    M, N = 12, 20
    x = rng.standard_normal((M, K)).astype(np.float32)
    w16 = rng.standard_normal((N, K)).astype(np.float16).astype(np.float32)
    out, out32 = gpu.buffer(M * N * 4), gpu.buffer(M * N * 4)
    k_mm.matmul(
        gpu, out, gpu.upload(x), f16_buffer(gpu, w16), M, N, K, trans_b=True, split_k=2, b_dtype="f16"
    ).run(gpu)
    k_mm.matmul(gpu, out32, gpu.upload(x), gpu.upload(w16), M, N, K, trans_b=True, split_k=2).run(gpu)
    got = gpu.download(out, np.float32, M * N).reshape(M, N)
    np.testing.assert_allclose(got, x.astype(np.float64) @ w16.astype(np.float64).T, rtol=1e-5, atol=1e-4)
    if K != 100:  # the same slices in both: the same bits
        np.testing.assert_array_equal(got, gpu.download(out32, np.float32, M * N).reshape(M, N))
