"""The decoding kernels (`shaders/decode.wgsl`, `ddl_wgpu/ops/decode.py`) against numpy: rows stored into a
cache at the position in `meta`, RoPE at an offset (whole heads and partial), RoPE with the key and value
stores in one launch, q and k through a q/k norm and RoPE in one launch (`qk_finish`), attention of new rows
over a cache split over workgroups (GQA, one and several key blocks per split, a start of 0; a row's bits
independent of the rows beside it), each row's argmax over the vocabulary in blocks, the TC/EC short
convolutions from a history cache (zeros before position 0), one slot per head out of a strided buffer
(`take_rows`, two at once: `take_rows2`), two row blocks concatenated (`concat_rows`).

Shapes are off the workgroup sizes; every test runs at two starts so a kernel that ignores `meta` fails.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref import shortconv as ref_sc
from ddl_ref.check import check
from ddl_ref.decode import attend_cached
from ddl_ref.mtp import topk_probs
from ddl_wgpu.ops import decode as k_dec

f32 = np.float32


def meta_at(gpu, start):
    meta = gpu.buffer(16, label="meta")
    k_dec.set_start(gpu, meta, start)
    return meta


@pytest.mark.parametrize("start", [0, 7])
def test_store_rows(gpu, rng, start):
    n, W, cap = 3, 37, 12
    src = rng.standard_normal((n, W)).astype(f32)
    dst = gpu.upload(np.full((cap, W), -1.0, f32))
    k_dec.store_rows(gpu, dst, gpu.upload(src), meta_at(gpu, start), n, W).run(gpu)
    want = np.full((cap, W), -1.0, f32)
    want[start : start + n] = src
    check("store_rows", gpu.download(dst, f32, cap * W).reshape(cap, W), want)
    # into columns of a wider buffer at row 0 (the draft's concatenation)
    wide = gpu.buffer(n * 2 * W * 4)
    k_dec.store_rows(gpu, wide, gpu.upload(src), meta_at(gpu, start), n, W, 2 * W, W, at_meta=False).run(gpu)
    got = gpu.download(wide, f32, n * 2 * W).reshape(n, 2 * W)
    check("store_rows cols", got, np.concatenate([np.zeros_like(src), src], axis=1))


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("R", [None, 4, 2])  # the whole head; partial RoPE (Qwen3.5: D/4), the narrowest
def test_rope_at(gpu, rng, start, R):
    n, N, D, cap = 3, 5, 12, 16
    x = rng.standard_normal((1, n, N, D)).astype(f32)
    cos, sin = ref.rope_tables(cap, D, 1e4, np.float64, R)
    out = gpu.upload(np.full(x.shape, np.nan, f32))  # a pass-through dim left unwritten stays NaN
    k_dec.rope_at(gpu, out, gpu.upload(x), gpu.upload(cos.astype(f32)), gpu.upload(sin.astype(f32)), meta_at(gpu, start),
                  n, N, D, R).run(gpu)  # fmt: skip
    want = ref.rope_forward(x.astype(np.float64), cos[start : start + n], sin[start : start + n])
    check("rope_at", gpu.download(out, f32, x.size).reshape(x.shape), want)


@pytest.mark.parametrize("start", [0, 5])
@pytest.mark.parametrize("R", [None, 4])  # the whole head; partial RoPE
def test_rope_store(gpu, rng, start, R):
    """q rotated, k rotated into the key cache and v into the value cache at rows start .. start + n − 1 (the
    other rows untouched), in one launch: as `rope_at` and `store_rows` would."""
    n, H, K, D, cap = 3, 5, 2, 12, 16
    q = rng.standard_normal((1, n, H, D)).astype(f32)
    k = rng.standard_normal((1, n, K, D)).astype(f32)
    v = rng.standard_normal((n, K, D)).astype(f32)
    cos, sin = ref.rope_tables(cap, D, 1e4, np.float64, R)
    rope = gpu.upload(np.stack([cos, sin]).astype(f32))
    qo = gpu.upload(np.full(q.shape, np.nan, f32))  # a dim left unwritten stays NaN
    kc, vc = (gpu.upload(np.full((cap, K, D), -1.0, f32)) for _ in range(2))
    k_dec.rope_store(gpu, qo, kc, vc, gpu.upload(q), gpu.upload(k), gpu.upload(v), rope, meta_at(gpu, start), n,
                     H, K, D, R).run(gpu)  # fmt: skip
    tables = cos[start : start + n], sin[start : start + n]
    check("rope_store q", gpu.read(qo, q.shape), ref.rope_forward(q.astype(np.float64), *tables))
    want_k, want_v = np.full((cap, K, D), -1.0), np.full((cap, K, D), -1.0)
    want_k[start : start + n] = ref.rope_forward(k.astype(np.float64), *tables)[0]
    want_v[start : start + n] = v
    check("rope_store k cache", gpu.read(kc, (cap, K, D)), want_k)
    check("rope_store v cache", gpu.read(vc, (cap, K, D)), want_v)


@pytest.mark.parametrize("order,style,R", [("pre_rope", "offset", 4), ("post_rope", "standard", None)])
@pytest.mark.parametrize("start", [0, 5])
def test_qk_finish(gpu, rng, order, style, R, start):
    """q and k through RMSNorm then RoPE (Qwen3.5: offset norm, partial RoPE) or RoPE then RMSNorm, q into its
    buffer and k into the key cache at rows start .., in one launch: as `ddl_ref.ops`' per-head ops."""
    n, H, K, D, cap, eps = 2, 3, 2, 130, 9, 1e-5
    q = rng.standard_normal((1, n, H, D)).astype(f32)
    k = rng.standard_normal((1, n, K, D)).astype(f32)
    wq, wk = (1.0 + 0.1 * rng.standard_normal(D)).astype(f32), (0.1 * rng.standard_normal(D)).astype(f32)
    w = np.zeros(64 + 2 * D, f32)  # both weights in one binding, k's first, q's at an offset
    w[:D], w[64 + D :] = wk, wq
    cos, sin = ref.rope_tables(cap, D, 1e4, np.float64, R)
    qo = gpu.upload(np.full(q.shape, np.nan, f32))
    kc = gpu.upload(np.full((cap, K, D), -1.0, f32))
    k_dec.qk_finish(gpu, qo, kc, gpu.upload(q), gpu.upload(k), gpu.upload(w), 64 + D, 0,
                    gpu.upload(np.stack([cos, sin]).astype(f32)), meta_at(gpu, start), n, H, K, D, order, eps, style,
                    R).run(gpu)  # fmt: skip
    tables = cos[start : start + n], sin[start : start + n]

    def chain(x, wt):
        x = x.astype(np.float64)
        norm = lambda v: ref.rmsnorm_forward(v, wt.astype(np.float64), eps, style)[0]  # noqa: E731
        if order == "pre_rope":
            return ref.rope_forward(norm(x), *tables)
        return norm(ref.rope_forward(x, *tables))

    check("qk_finish q", gpu.read(qo, q.shape), chain(q, wq), "norm")
    want_k = np.full((cap, K, D), -1.0)
    want_k[start : start + n] = chain(k, wk)[0]
    check("qk_finish k cache", gpu.read(kc, (cap, K, D)), want_k, "norm")


@pytest.mark.parametrize("splits", [k_dec.SPLITS, 3])  # the default; few splits of several blocks each
@pytest.mark.parametrize("start", [0, 70, 133])
@pytest.mark.parametrize(
    "H,K,D", [(4, 2, 16), (3, 3, 130), (6, 1, 256)]
)  # the last: the 27B's head_dim, GQA 6:1
def test_attend_cache(gpu, rng, start, H, K, D, splits):
    """The keys split over workgroups and merged (one block, a block per split, several blocks per split with
    the online softmax across them, splits left empty) give the reference attention; and a row's bits do not
    depend on the rows beside it: the last row of a 3-row pass equals the same row decoded alone."""
    n, cap = 3, 140
    q = rng.standard_normal((n, H, D)).astype(f32)
    kc = (rng.standard_normal((cap, K, D)) * 0.7).astype(f32)
    vc = rng.standard_normal((cap, K, D)).astype(f32)
    kb, vb = gpu.upload(kc), gpu.upload(vc)
    out = gpu.buffer(q.nbytes)
    meta = meta_at(gpu, start)
    k_dec.attend_cache(gpu, out, gpu.upload(q), kb, vb, meta, n, H, K, D, splits=splits).run(gpu)
    S = start + n
    want = attend_cached(q.astype(np.float64), kc[:S].astype(np.float64), vc[:S].astype(np.float64), start)
    got = gpu.download(out, f32, q.size).reshape(q.shape)
    check("attend_cache", got, want, "attention")
    one = gpu.buffer(q[-1].nbytes)
    k_dec.attend_cache(gpu, one, gpu.upload(q[-1]), kb, vb, meta_at(gpu, start + n - 1), 1, H, K, D,
                       splits=splits).run(gpu)  # fmt: skip
    assert np.array_equal(gpu.download(one, f32, H * D).reshape(H, D), got[-1])


@pytest.mark.parametrize("V,block", [(1000, 64), (37, 2048)])  # many blocks with a short last one; one block
def test_argmax(gpu, rng, V, block):
    """Each row's argmax and full-softmax probability over the vocabulary split into blocks: numpy's argmax
    and `topk_probs`' probability, ties to the lower id (a row whose maximum appears in two blocks, another whose every logit is
    equal), written at a row offset."""
    rows, off = 3, 2
    z = rng.standard_normal((rows, V)).astype(f32) * 4.0
    z[1, [V // 3, V - 1]] = 50.0  # a tie across blocks: the lower id
    z[2] = 0.5
    ids, probs = gpu.upload(np.full(off + rows, 7, np.uint32)), gpu.buffer((off + rows) * 4)
    k_dec.argmax(gpu, ids, probs, gpu.upload(z), rows, V, off, block).run(gpu)
    want_p = topk_probs(z, 1)[1]  # its ids can break an exact tie either way (argpartition): numpy's argmax
    assert np.array_equal(gpu.download(ids, np.uint32, off + rows), np.r_[7, 7, np.argmax(z, axis=-1)])
    check("argmax probs", gpu.download(probs, f32, off + rows)[off:], want_p[:, 0].astype(np.float64), "norm")


@pytest.mark.parametrize("start", [0, 1, 6])
def test_tc_and_ec_from_history(gpu, rng, start):
    n, C, dv, k, cap = 3, 37, 4, 3, 12
    hist = rng.standard_normal((cap, C, dv)).astype(f32)
    conv = rng.standard_normal((C * dv, k)).astype(f32)
    read = rng.standard_normal(dv).astype(f32)
    out = gpu.buffer(n * C * 4)
    k_dec.tc_cache(
        gpu, out, gpu.upload(hist), gpu.upload(conv), gpu.upload(read), meta_at(gpu, start), n, C, dv, k
    ).run(gpu)
    full = ref_sc.tc_forward(hist[None, : start + n].astype(np.float64), conv, read)[0][0]
    check("tc_cache", gpu.download(out, f32, n * C).reshape(n, C), full[start:], "norm")
    ehist = rng.standard_normal((cap, C)).astype(f32)
    out = gpu.buffer(n * C * dv * 4)
    k_dec.ec_cache(gpu, out, gpu.upload(ehist), gpu.upload(conv), meta_at(gpu, start), n, C, dv, k).run(gpu)
    full = ref_sc.ec_forward(ehist[None, : start + n].astype(np.float64), conv)[0][0]
    check("ec_cache", gpu.download(out, f32, n * C * dv).reshape(n, C, dv), full[start:], "norm")


@pytest.mark.parametrize("start", [0, 3])
def test_take_rows(gpu, rng, start):
    """One slot per head out of [head][slot][E]: a constant slot, and the slot in meta (a roll-back's)."""
    heads, slots, E = 3, 5, 37
    src = rng.standard_normal((heads, slots, E)).astype(f32)
    dst = gpu.buffer(heads * E * 4)
    for slot in (4, None):
        k_dec.take_rows(gpu, dst, gpu.upload(src), meta_at(gpu, start), heads, E, slots * E, E, slot).run(gpu)
        want = src[:, 4 if slot is not None else start]
        assert np.array_equal(gpu.download(dst, f32, heads * E).reshape(heads, E), want), slot
    # rows s .. s + 2 of a (rows, W) buffer (a conv window out of [window; a pass's rows])
    rows = rng.standard_normal((7, 11)).astype(f32)
    win = gpu.buffer(3 * 11 * 4)
    k_dec.take_rows(gpu, win, gpu.upload(rows), meta_at(gpu, start), 1, 3 * 11, 0, 11).run(gpu)
    assert np.array_equal(gpu.download(win, f32, 33).reshape(3, 11), rows[start : start + 3])
    # take_rows2: a state slot (constant) and window rows (at meta) in one launch
    st, wn = gpu.buffer(heads * E * 4), gpu.buffer(3 * 11 * 4)
    first = (st, gpu.upload(src), heads, E, slots * E, E, 2)
    k_dec.take_rows2(gpu, first, (wn, gpu.upload(rows), 1, 3 * 11, 0, 11, None), meta_at(gpu, start)).run(gpu)
    assert np.array_equal(gpu.read(st, (heads, E)), src[:, 2])
    assert np.array_equal(gpu.read(wn, (3, 11)), rows[start : start + 3])


def test_concat_rows(gpu, rng):
    a, b = rng.standard_normal((3, 13)).astype(f32), rng.standard_normal((2, 13)).astype(f32)
    dst = gpu.upload(np.full((6, 13), -1.0, f32))
    k_dec.concat_rows(gpu, dst, gpu.upload(a), gpu.upload(b), 3, 2, 13).run(gpu)
    want = np.concatenate([a, b, np.full((1, 13), -1.0, f32)])
    assert np.array_equal(gpu.read(dst, (6, 13)), want)
