"""Finite-difference checks of every `ddl_ref.ops` backward, plus forward sanity checks against direct formulas.

Everything runs in float64 on small odd shapes; the dtype tests check that float32 stays float32.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddl_ref import ops
from ddl_ref.check import assert_fd_grad, check_grad


def rng(seed=0):
    return np.random.default_rng(seed)


def test_gradcheck_can_fail():
    # A deliberately wrong backward (factor 2) must be caught, or the checker proves nothing.
    x = rng().standard_normal((3, 4))
    with pytest.raises(AssertionError, match="relative error"):
        check_grad(lambda x: x * x, lambda out, dout, x: 4.0 * x * dout, [x])


def test_embedding_backward_repeated_ids():
    r = rng(1)
    V, C = 7, 5
    ids = np.array([[1, 3, 1, 0], [6, 1, 3, 3]])
    wte = r.standard_normal((V, C))
    out = ops.embedding_forward(ids, wte)
    assert out.shape == (2, 4, C)
    np.testing.assert_array_equal(out[0, 2], wte[1])
    dout = r.standard_normal(out.shape)
    dwte = ops.embedding_backward(dout, ids, V)
    f = lambda: float(np.sum(ops.embedding_forward(ids, wte) * dout))  # noqa: E731
    assert_fd_grad("dwte", dwte, f, wte, magnitude=float(np.sum(np.abs(out * dout))))
    np.testing.assert_array_equal(dwte[2], 0.0)


@pytest.mark.parametrize("style", ["standard", "offset"])
def test_rmsnorm(style):
    r = rng(2)
    x = r.standard_normal((2, 3, 7))
    w = r.standard_normal(7) * 0.5 + (1.0 if style == "standard" else 0.0)
    eps = 1e-5
    out, _ = ops.rmsnorm_forward(x, w, eps, style)
    weff = w if style == "standard" else 1.0 + w
    expect = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps) * weff
    np.testing.assert_allclose(out, expect, rtol=1e-12)
    check_grad(
        lambda x, w: ops.rmsnorm_forward(x, w, eps, style)[0],
        lambda out, dout, x, w: ops.rmsnorm_backward(dout, ops.rmsnorm_forward(x, w, eps, style)[1]),
        [x, w],
    )


def test_linear():
    r = rng(3)
    x = r.standard_normal((2, 3, 5))
    w = r.standard_normal((4, 5))
    np.testing.assert_allclose(ops.linear_forward(x, w), np.einsum("btc,oc->bto", x, w), rtol=1e-12)
    check_grad(ops.linear_forward, lambda out, dout, x, w: ops.linear_backward(dout, x, w), [x, w])


def test_rope_tables_and_forward():
    T, D, theta = 5, 6, 10000.0
    cos, sin = ops.rope_tables(T, D, theta, np.float64)
    assert cos.shape == sin.shape == (T, D)
    np.testing.assert_array_equal(cos[0], 1.0)
    # Position 2, frequency index 1: angle 2 / theta^(2/6), duplicated in both halves.
    ang = 2.0 / theta ** (2.0 / 6.0)
    np.testing.assert_allclose([cos[2, 1], cos[2, 4], sin[2, 1]], [np.cos(ang), np.cos(ang), np.sin(ang)])
    x = rng(4).standard_normal((2, T, 3, D))
    out = ops.rope_forward(x, cos, sin)
    # Rotation by pairs (i, i + D/2) preserves the norm of every pair.
    np.testing.assert_allclose(
        x[..., :3] ** 2 + x[..., 3:] ** 2, out[..., :3] ** 2 + out[..., 3:] ** 2, rtol=1e-12
    )
    check_grad(
        lambda x: ops.rope_forward(x, cos, sin), lambda out, dout, x: ops.rope_backward(dout, cos, sin), [x]
    )


def test_rope_full_width_is_unchanged_bit_for_bit():
    # rotary_dim = D (or None) must give exactly today's tables and rotation: old checkpoints, same numbers.
    T, D, theta = 7, 8, 1e6
    inv = 1.0 / (theta ** (np.arange(0, D, 2, dtype=np.float64) / D))
    emb = np.concatenate([np.outer(np.arange(T, dtype=np.float64), inv)] * 2, axis=-1)
    for rd in (None, D):
        cos, sin = ops.rope_tables(T, D, theta, np.float32, rotary_dim=rd)
        np.testing.assert_array_equal(cos, np.cos(emb).astype(np.float32))
        np.testing.assert_array_equal(sin, np.sin(emb).astype(np.float32))
    x = rng(40).standard_normal((2, T, 3, D)).astype(np.float32)
    c, s = ops.rope_tables(T, D, theta, np.float32)
    h = D // 2
    expect = x * c[None, :, None] + np.concatenate([-x[..., h:], x[..., :h]], axis=-1) * s[None, :, None]
    np.testing.assert_array_equal(ops.rope_forward(x, c, s), expect)


@pytest.mark.parametrize("R", [2, 4])
def test_partial_rope(R):
    T, D, theta = 6, 8, 10000.0
    cos, sin = ops.rope_tables(T, D, theta, np.float64, rotary_dim=R)
    assert cos.shape == sin.shape == (T, R)
    # the frequencies are an R-wide head's: position 3, frequency 1 (R = 4) turns by 3 / theta^(2/R)
    ang = 3.0 / theta ** (2.0 * (R // 2 - 1) / R)
    np.testing.assert_allclose(cos[3, R // 2 - 1], np.cos(ang), rtol=1e-14)
    x = rng(41).standard_normal((2, T, 3, D))
    out = ops.rope_forward(x, cos, sin)
    np.testing.assert_array_equal(out[..., R:], x[..., R:])  # the other dims pass through
    full_r = ops.rope_forward(x[..., :R], cos, sin)  # the rotated dims: rotate-half RoPE of an R-wide head
    np.testing.assert_allclose(out[..., :R], full_r, rtol=1e-14)
    assert not np.allclose(out[:, 1:, :, :R], x[:, 1:, :, :R])
    check_grad(
        lambda x: ops.rope_forward(x, cos, sin), lambda out, dout, x: ops.rope_backward(dout, cos, sin), [x]
    )
    pos = np.array([5, 0, 3, 3])
    ca, sa = ops.rope_tables_at(pos, D, theta, np.float64, rotary_dim=R)
    np.testing.assert_array_equal(ca, cos[pos])
    np.testing.assert_array_equal(sa, sin[pos])
    with pytest.raises(ValueError, match="even rotary width"):
        ops.rope_tables(T, D, theta, np.float64, rotary_dim=3)


def test_sigmoid_gate():
    r = rng(42)
    a, gate = r.standard_normal((2, 3, 7)), r.standard_normal((2, 3, 7)) * 3.0
    np.testing.assert_allclose(ops.sigmoid_gate_forward(a, gate), a / (1.0 + np.exp(-gate)), rtol=1e-12)
    check_grad(
        ops.sigmoid_gate_forward, lambda out, dout, a, g: ops.sigmoid_gate_backward(dout, a, g), [a, gate]
    )


def _attention_naive(q, k, v):
    B, T, H, D = q.shape
    K = k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            j = h // (H // K)
            for t in range(T):
                s = np.array([q[b, t, h] @ k[b, u, j] for u in range(t + 1)]) / np.sqrt(D)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, t, h] = p @ v[b, : t + 1, j]
    return out


@pytest.mark.parametrize("H,K,T", [(4, 2, 5), (3, 3, 4), (4, 1, 3)])
def test_attention_gqa(H, K, T):
    r = rng(5)
    B, D = 2, 6
    q = r.standard_normal((B, T, H, D))
    k = r.standard_normal((B, T, K, D))
    v = r.standard_normal((B, T, K, D))
    out, cache = ops.attention_forward(q, k, v)
    np.testing.assert_allclose(out, _attention_naive(q, k, v), rtol=1e-10, atol=1e-12)
    probs, lse = cache[3], cache[4]
    assert probs.shape == (B, H, T, T) and lse.shape == (B, H, T)
    np.testing.assert_array_equal(np.triu(probs, 1), 0.0)
    check_grad(
        lambda q, k, v: ops.attention_forward(q, k, v)[0],
        lambda out, dout, q, k, v: ops.attention_backward(dout, ops.attention_forward(q, k, v)[1]),
        [q, k, v],
    )


def test_attention_rejects_bad_gqa():
    q = np.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        ops.attention_forward(q, np.zeros((1, 2, 2, 4)), np.zeros((1, 2, 2, 4)))


def test_swiglu():
    r = rng(6)
    gate = r.standard_normal((2, 3, 7)) * 3.0
    up = r.standard_normal((2, 3, 7))
    np.testing.assert_allclose(ops.swiglu_forward(gate, up), gate / (1 + np.exp(-gate)) * up, rtol=1e-12)
    check_grad(ops.swiglu_forward, lambda out, dout, g, u: ops.swiglu_backward(dout, g, u), [gate, up])


def test_cross_entropy_rows():
    r = rng(7)
    logits = r.standard_normal((5, 9))
    targets = np.array([0, 8, 3, 3, 99])  # the last target is out of range but weight 0
    weights = np.array([1.0, 1.0, 0.0, 1.0, 0.0])
    loss, dlogits = ops.cross_entropy_rows(logits, targets, weights)
    expect = sum(-np.log(np.exp(logits[n, targets[n]]) / np.exp(logits[n]).sum()) for n in (0, 1, 3))
    np.testing.assert_allclose(loss, expect, rtol=1e-12)
    assert_fd_grad("dlogits", dlogits, lambda: ops.cross_entropy_rows(logits, targets, weights)[0], logits)
    np.testing.assert_array_equal(dlogits[[2, 4]], 0.0)


def test_lm_loss_padding():
    r = rng(8)
    B, T, V = 4, 5, 7
    logits = r.standard_normal((B, T, V))
    ids = r.integers(0, V, size=(B, T))
    lengths = np.array([5, 3, 1, 0])  # full row, padded row, one token (no prediction), empty row
    loss, cache = ops.lm_loss_forward(logits, ids, lengths)
    assert cache[1] == 4 + 2
    nll = [-np.log(ops.softmax(logits[b, p])[ids[b, p + 1]]) for b, n in ((0, 4), (1, 2)) for p in range(n)]
    np.testing.assert_allclose(loss, np.mean(nll), rtol=1e-12)
    dlogits = ops.lm_loss_backward(cache)
    assert_fd_grad("dlogits", dlogits, lambda: ops.lm_loss_forward(logits, ids, lengths)[0], logits)
    # Padding and the last position of each row never receive gradient.
    np.testing.assert_array_equal(dlogits[1, 2:], 0.0)
    np.testing.assert_array_equal(dlogits[2:], 0.0)
    np.testing.assert_array_equal(dlogits[0, 4], 0.0)
    # Changing tokens past a row's length changes nothing.
    ids2 = ids.copy()
    ids2[1, 3:] = (ids2[1, 3:] + 1) % V
    assert ops.lm_loss_forward(logits, ids2, lengths)[0] == loss


def test_lm_loss_no_predictions():
    logits = np.zeros((2, 3, 4))
    loss, cache = ops.lm_loss_forward(logits, np.zeros((2, 3), dtype=int), np.array([1, 0]))
    assert loss == 0.0
    np.testing.assert_array_equal(ops.lm_loss_backward(cache), 0.0)


@pytest.mark.parametrize("form", ["full", "topk"])
def test_topk_kl(form):
    r = rng(9)
    N, V, k = 5, 10, 3
    logits = r.standard_normal((N, V))
    ids = np.stack([r.choice(V, size=k, replace=False) for _ in range(N)])
    probs = r.random((N, k))
    probs[1, 2] = 0.0  # 0 log 0 must be 0, not nan
    probs[4] = 0.0  # a row without teacher mass (batch padding): contributes nothing, even with weight 1
    weights = np.array([1.0, 1.0, 0.0, 1.0, 1.0])
    kl, cache = ops.topk_kl_forward(logits, ids, probs, weights, form)
    expect = 0.0
    for n in (0, 1, 3):
        p = probs[n] / probs[n].sum()
        z = logits[n, ids[n]]
        # "full": the student's log-softmax over the whole vocabulary; "topk": renormalised over the k ids
        logq = z - np.log(np.exp(logits[n] if form == "full" else z).sum())
        expect += sum(p[i] * (np.log(p[i]) - logq[i]) for i in range(k) if p[i] > 0)
    np.testing.assert_allclose(kl, expect, rtol=1e-12)
    assert kl >= 0.0
    dlogits = ops.topk_kl_backward(cache)
    assert_fd_grad(
        "dlogits", dlogits, lambda: ops.topk_kl_forward(logits, ids, probs, weights, form)[0], logits
    )
    assert not dlogits[4].any() and not dlogits[2].any()
    off = np.ones((N, V), bool)
    off[np.arange(N)[:, None], ids] = False
    if form == "full":  # off the top-k the gradient is the student's softmax (weight 1): never zero
        sm = np.exp(logits - np.log(np.exp(logits).sum(-1, keepdims=True)))
        np.testing.assert_allclose(dlogits[0][off[0]], sm[0][off[0]], rtol=1e-12)
    else:
        assert not dlogits[off].any()


def test_topk_kl_full_is_topk_plus_the_mass_outside():
    """KL_full = KL_topk − log Q(K): the full form adds the log of the student's mass on the teacher's ids."""
    r = rng(11)
    N, V, k = 4, 12, 4
    logits = r.standard_normal((N, V)) * 2
    ids = np.stack([r.choice(V, size=k, replace=False) for _ in range(N)])
    probs = r.random((N, k))
    full, _ = ops.topk_kl_forward(logits, ids, probs, np.ones(N), "full")
    topk, _ = ops.topk_kl_forward(logits, ids, probs, np.ones(N), "topk")
    sm = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    mass = sm[np.arange(N)[:, None], ids].sum(-1)
    np.testing.assert_allclose(full, topk - np.log(mass).sum(), rtol=1e-12)
    with pytest.raises(ValueError, match="kl form"):
        ops.topk_kl_forward(logits, ids, probs, np.ones(N), "renorm")


def test_topk_kl_identical_distributions_give_zero():
    r = rng(12)
    N, V = 3, 8  # k = V: the top-k is the whole vocabulary, so both forms are the full KL
    logits = r.standard_normal((N, V))
    ids = np.tile(np.arange(V), (N, 1))
    same = np.exp(logits)
    for form in ("full", "topk"):
        kl0, cache0 = ops.topk_kl_forward(logits, ids, same, np.ones(N), form)
        assert abs(kl0) < 1e-12
        np.testing.assert_allclose(ops.topk_kl_backward(cache0), 0.0, atol=1e-15)
    # "topk" is also zero when the student agrees on the k ids alone, whatever it does elsewhere
    ids3 = ids[:, :3]
    kl3, cache3 = ops.topk_kl_forward(logits, ids3, same[:, :3], np.ones(N), "topk")
    assert abs(kl3) < 1e-12 and np.abs(ops.topk_kl_backward(cache3)).max() < 1e-15


def test_float32_stays_float32():
    r = rng(10)
    f = np.float32
    x = r.standard_normal((2, 3, 4, 6)).astype(f)
    w = r.standard_normal(6).astype(f)
    assert ops.rmsnorm_forward(x, w, 1e-5)[0].dtype == f
    cos, sin = ops.rope_tables(3, 6, 1e4, f)
    assert ops.rope_forward(x, cos, sin).dtype == f
    out, cache = ops.attention_forward(x, x[:, :, :2], x[:, :, :2])
    assert out.dtype == f and all(g.dtype == f for g in ops.attention_backward(out, cache))
    assert ops.swiglu_forward(x, x).dtype == f
    assert ops.linear_forward(x, r.standard_normal((5, 6)).astype(f)).dtype == f
    logits = r.standard_normal((2, 3, 7)).astype(f)
    _, c = ops.lm_loss_forward(logits, np.zeros((2, 3), dtype=int), np.array([3, 2]))
    assert ops.lm_loss_backward(c).dtype == f
