"""The Gated DeltaNet reference (`ddl_ref.gdn`): every backward against float64 central finite differences, the
recurrence against two forms derived independently of it (a brute-force product of transition matrices and the
chunked matrix form, whose own backward is checked by finite differences and against the recurrence's), state
chaining, and the delta rule against transformers' own torch implementations.

Shapes are small and odd (T 5-9, Dk/Dv 3-6) with Hv = 2·Hk, so a head mix-up or a transposed state shows up.
torch and transformers are required (the `test` extra): those tests fail, not skip, without them.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddl_ref import gdn
from ddl_ref.check import assert_fd_grad, check_grad, random_params
from ddl_ref.config import ModelConfig


def rng(seed=0):
    return np.random.default_rng(seed)


def delta_inputs(B=2, T=7, Hk=2, Hv=4, Dk=5, Dv=3, seed=0, state=True):
    """Normalised-ish q/k, values, log decays g < 0 and betas in (0, 1): the ranges the mixer produces."""
    r = rng(seed)
    q = r.standard_normal((B, T, Hk, Dk)) * 0.5
    k = r.standard_normal((B, T, Hk, Dk))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = r.standard_normal((B, T, Hv, Dv))
    g = -np.abs(r.standard_normal((B, T, Hv))) * 0.5
    beta = 1.0 / (1.0 + np.exp(-r.standard_normal((B, T, Hv))))
    s0 = r.standard_normal((B, Hv, Dk, Dv)) * 0.5 if state else None
    return q, k, v, g, beta, s0


# ----------------------------------------------------------------------------------------------------------
# conv, l2norm, gated norm


def test_causal_conv_forward_is_the_pytorch_tap_convention():
    r = rng(1)
    B, T, Ch, k = 2, 6, 5, 4
    x = r.standard_normal((B, T, Ch))
    w = r.standard_normal((Ch, k))
    out, _ = gdn.causal_conv_forward(x, w)
    pre = np.zeros_like(x)
    for t in range(T):
        for m in range(k):  # tap m multiplies the input at t − (k−1−m); nothing before t = 0
            s = t - (k - 1 - m)
            if s >= 0:
                pre[:, t] += w[:, m] * x[:, s]
    np.testing.assert_allclose(out, pre / (1.0 + np.exp(-pre)), rtol=1e-12)


def test_causal_conv_backward():
    r = rng(2)
    x, w = r.standard_normal((2, 7, 5)), r.standard_normal((5, 3))
    check_grad(
        lambda x, w: gdn.causal_conv_forward(x, w)[0],
        lambda out, dout, x, w: gdn.causal_conv_backward(dout, gdn.causal_conv_forward(x, w)[1]),
        [x, w],
    )
    state = r.standard_normal((2, 2, 5))  # the k−1 inputs before t = 0
    check_grad(
        lambda x, w, s: gdn.causal_conv_forward(x, w, s)[0],
        lambda out, dout, x, w, s: gdn.causal_conv_backward(dout, gdn.causal_conv_forward(x, w, s)[1], True),
        [x, w, state],
    )


def test_causal_conv_state_chains_and_tail_is_the_last_inputs():
    r = rng(3)
    x, w = r.standard_normal((2, 8, 5)), r.standard_normal((5, 4))
    whole, c = gdn.causal_conv_forward(x, w)
    np.testing.assert_array_equal(gdn.conv_tail(c), x[:, -3:])
    for cut in (1, 2, 5):  # a first part shorter than the window too
        a, ca = gdn.causal_conv_forward(x[:, :cut], w)
        b, _ = gdn.causal_conv_forward(x[:, cut:], w, gdn.conv_tail(ca))
        np.testing.assert_allclose(np.concatenate([a, b], axis=1), whole, rtol=1e-12, atol=1e-14)


def test_l2norm():
    x = rng(4).standard_normal((2, 3, 5))
    out, _ = gdn.l2norm_forward(x)
    np.testing.assert_allclose(out, x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6), rtol=1e-12)
    check_grad(
        lambda x: gdn.l2norm_forward(x)[0],
        lambda out, dout, x: gdn.l2norm_backward(dout, gdn.l2norm_forward(x)[1]),
        [x],
    )


def test_gated_rmsnorm():
    r = rng(5)
    x, z = r.standard_normal((2, 3, 2, 5)), r.standard_normal((2, 3, 2, 5)) * 2.0
    w = 1.0 + 0.3 * r.standard_normal(5)
    eps = 1e-6
    out, _ = gdn.gated_rmsnorm_forward(x, z, w, eps)
    expect = w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (z / (1.0 + np.exp(-z)))
    np.testing.assert_allclose(out, expect, rtol=1e-12)
    check_grad(
        lambda x, z, w: gdn.gated_rmsnorm_forward(x, z, w, eps)[0],
        lambda out, dout, x, z, w: gdn.gated_rmsnorm_backward(
            dout, gdn.gated_rmsnorm_forward(x, z, w, eps)[1]
        ),
        [x, z, w],
    )


# ----------------------------------------------------------------------------------------------------------
# the gated delta rule


def brute_force(q, k, v, g, beta, s0):
    """o_t = S_tᵀq_t from S_t = Σ_{s≤t} (M_t ⋯ M_{s+1}) β_s k_s v_sᵀ + (M_t ⋯ M_0) S_init with
    M_r = exp(g_r) (I − β_r k_r k_rᵀ): the recurrence S_t = M_t S_{t−1} + β_t k_t v_tᵀ unrolled, each t on its
    own (no state carried from one output to the next)."""
    B, T, Hk, Dk = q.shape
    Hv = v.shape[2]
    o = np.zeros_like(v)
    for b in range(B):
        for h in range(Hv):
            j = h // (Hv // Hk)
            M = [np.exp(g[b, r, h]) * (np.eye(Dk) - beta[b, r, h] * np.outer(k[b, r, j], k[b, r, j]))
                 for r in range(T)]  # fmt: skip
            for t in range(T):
                P = np.eye(Dk)
                S = np.zeros((Dk, v.shape[3]))
                for s in range(t, -1, -1):  # P = M_t ⋯ M_{s+1}
                    S += P @ (beta[b, s, h] * np.outer(k[b, s, j], v[b, s, h]))
                    P = P @ M[s]
                S += P @ s0[b, h]  # the loop leaves P = M_t ⋯ M_0, which carries the initial state
                o[b, t, h] = S.T @ q[b, t, j]
    return o


def test_recurrence_matches_the_unrolled_product_form():
    q, k, v, g, beta, s0 = delta_inputs(T=6, seed=6)
    o, _, _ = gdn.gated_delta_forward(q, k, v, g, beta, s0)
    np.testing.assert_allclose(o, brute_force(q, k, v, g, beta, s0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_form_equals_the_recurrence(chunk, with_state):
    q, k, v, g, beta, s0 = delta_inputs(T=9, seed=7, state=with_state)
    g = g * 6.0  # strong decays too: the chunked form must not overflow in exp(γ_t − γ_s)
    o, S, _ = gdn.gated_delta_forward(q, k, v, g, beta, s0)
    oc, Sc, _ = gdn.gated_delta_chunked_forward(q, k, v, g, beta, s0, chunk=chunk)
    np.testing.assert_allclose(oc, o, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(Sc, S, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_chunked_backward_equals_the_recurrence_backward(chunk):
    """The chunked backward (its own derivation: through Tm, P and the chunk states) gives the recurrence
    backward's gradients, the initial state's included; strong decays and a last chunk shorter than the rest."""
    q, k, v, g, beta, s0 = delta_inputs(T=9, seed=19)
    g = g * 6.0
    r = rng(20)
    o, S, cache = gdn.gated_delta_forward(q, k, v, g, beta, s0)
    do, dS = r.standard_normal(o.shape), r.standard_normal(S.shape)
    want = gdn.gated_delta_backward(do, cache, dS)
    _, _, cc = gdn.gated_delta_chunked_forward(q, k, v, g, beta, s0, chunk=chunk)
    got = gdn.gated_delta_chunked_backward(do, cc, dS)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dstate0"), got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("chunk, T", [(3, 8), (4, 4), (64, 5)])
def test_gated_delta_chunked_backward(chunk, T):
    q, k, v, g, beta, s0 = delta_inputs(T=T, Dk=4, Dv=3, seed=21)

    def fwd(q, k, v, g, beta, s0):
        o, S, _ = gdn.gated_delta_chunked_forward(q, k, v, g, beta, s0, chunk=chunk)
        return o, S

    def bwd(out, dout, q, k, v, g, beta, s0):
        _, _, cache = gdn.gated_delta_chunked_forward(q, k, v, g, beta, s0, chunk=chunk)
        return gdn.gated_delta_chunked_backward(dout[0], cache, dstate=dout[1])

    check_grad(fwd, bwd, [q, k, v, g, beta, s0])


@pytest.mark.parametrize("checkpoint", [1, 3, 64])
@pytest.mark.parametrize("T, Dk, Dv", [(5, 3, 6), (8, 6, 4)])
def test_gated_delta_backward(checkpoint, T, Dk, Dv):
    q, k, v, g, beta, s0 = delta_inputs(T=T, Dk=Dk, Dv=Dv, seed=8)

    def fwd(q, k, v, g, beta, s0):
        o, S, _ = gdn.gated_delta_forward(q, k, v, g, beta, s0, checkpoint=checkpoint)
        return o, S  # the final state is an output too: dstate is checked with the rest

    def bwd(out, dout, q, k, v, g, beta, s0):
        _, _, cache = gdn.gated_delta_forward(q, k, v, g, beta, s0, checkpoint=checkpoint)
        return gdn.gated_delta_backward(dout[0], cache, dstate=dout[1])

    check_grad(fwd, bwd, [q, k, v, g, beta, s0])


def test_gated_delta_state_chains():
    q, k, v, g, beta, s0 = delta_inputs(T=9, seed=9)
    o, S, _ = gdn.gated_delta_forward(q, k, v, g, beta, s0)
    a, Sa, _ = gdn.gated_delta_forward(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], s0)
    b, Sb, _ = gdn.gated_delta_forward(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:], beta[:, 4:], Sa)
    np.testing.assert_allclose(np.concatenate([a, b], axis=1), o, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(Sb, S, rtol=1e-12, atol=1e-14)
    # and the gradients chain: the second half's dstate0 is the first half's dstate
    r = rng(10)
    do, dS = r.standard_normal(o.shape), r.standard_normal(S.shape)
    _, _, cw = gdn.gated_delta_forward(q, k, v, g, beta, s0)
    whole = gdn.gated_delta_backward(do, cw, dS)
    _, _, ca = gdn.gated_delta_forward(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4], s0)
    _, _, cb = gdn.gated_delta_forward(q[:, 4:], k[:, 4:], v[:, 4:], g[:, 4:], beta[:, 4:], Sa)
    gb = gdn.gated_delta_backward(do[:, 4:], cb, dS)
    ga = gdn.gated_delta_backward(do[:, :4], ca, gb[5])
    for i in range(5):
        np.testing.assert_allclose(np.concatenate([ga[i], gb[i]], axis=1), whole[i], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ga[5], whole[5], rtol=1e-10, atol=1e-12)


def test_gated_delta_rejects_bad_heads():
    q, k, v, g, beta, _ = delta_inputs(Hk=2, Hv=3)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn.gated_delta_forward(q, k, v, g, beta)


# ----------------------------------------------------------------------------------------------------------
# the whole mixer


def gdn_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=11, d_model=7, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=4, ffn_hidden=6,
                max_seq_len=16, layer_types=("linear_attention",), linear_k_heads=1, linear_v_heads=2,
                linear_k_dim=3, linear_v_dim=5, linear_conv_kernel=3)  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def test_gdn_mixer_gradients_match_finite_differences():
    cfg = gdn_cfg()
    p = "model.layers.0."
    params = {n: a for n, a in random_params(cfg, seed=11).items() if "linear_attn" in n}
    h = rng(12).standard_normal((2, 6, cfg.d_model))
    out, cache = gdn.gdn_forward(params, cfg, p, h, checkpoint=4)
    dout = rng(13).standard_normal(out.shape)
    grads: dict = {}
    dh = gdn.gdn_backward(params, cfg, p, dout, cache, grads)
    assert sorted(grads) == sorted(params)

    def loss():
        return float(np.sum(gdn.gdn_forward(params, cfg, p, h)[0] * dout))

    magnitude = float(np.sum(np.abs(out * dout)))  # the sum's terms cancel: it rounds at their size
    assert_fd_grad("dh", dh, loss, h, magnitude=magnitude)
    for name, a in params.items():
        assert_fd_grad(name, grads[name], loss, a, magnitude=magnitude)
        assert np.any(grads[name] != 0.0), name


def test_gdn_mixer_state_chains_and_is_causal():
    cfg = gdn_cfg()
    p = "model.layers.0."
    params = random_params(cfg, seed=14)
    h = rng(15).standard_normal((2, 9, cfg.d_model))
    whole, cw = gdn.gdn_forward(params, cfg, p, h)
    a, ca = gdn.gdn_forward(params, cfg, p, h[:, :5])
    b, cb = gdn.gdn_forward(params, cfg, p, h[:, 5:], state=ca["state"])
    np.testing.assert_allclose(np.concatenate([a, b], axis=1), whole, rtol=1e-11, atol=1e-13)
    for x, y in zip(cb["state"], cw["state"], strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-11, atol=1e-13)
    h2 = h.copy()
    h2[:, 6] += 1.0
    changed, _ = gdn.gdn_forward(params, cfg, p, h2)
    np.testing.assert_array_equal(changed[:, :6], whole[:, :6])
    assert not np.allclose(changed[:, 6:], whole[:, 6:])


def test_gdn_float32_stays_float32():
    cfg = gdn_cfg()
    params = {n: a.astype(np.float32) for n, a in random_params(cfg, seed=16).items()}
    h = rng(17).standard_normal((1, 5, cfg.d_model)).astype(np.float32)
    out, cache = gdn.gdn_forward(params, cfg, "model.layers.0.", h)
    assert out.dtype == np.float32 and cache["state"].delta.dtype == np.float32
    grads: dict = {}
    dh = gdn.gdn_backward(params, cfg, "model.layers.0.", np.ones_like(out), cache, grads)
    assert dh.dtype == np.float32 and all(g.dtype == np.float32 for g in grads.values())


# ----------------------------------------------------------------------------------------------------------
# against transformers' delta rule (its recurrent and chunked torch code)


def _qwen35_module():
    """transformers' Qwen3.5 modelling module; a failure (not a skip) without torch/transformers."""
    try:
        import torch
        from transformers.models.qwen3_5 import modeling_qwen3_5 as hf
    except ImportError as e:  # pragma: no cover - the test extra installs them
        pytest.fail(f"torch and transformers are needed for the parity tests (the `test` extra): {e}")
    return torch, hf


@pytest.mark.parametrize("form", ["torch_recurrent_gated_delta_rule", "torch_chunk_gated_delta_rule"])
def test_delta_rule_matches_transformers(form):
    torch, hf = _qwen35_module()
    q, k, v, g, beta, s0 = delta_inputs(T=9, Dk=6, Dv=4, seed=18)
    fn = getattr(hf, form)
    kw = {"chunk_size": 4} if "chunk" in form else {}
    # transformers normalises q and k itself (use_qk_l2norm_in_kernel) and scales q by 1/√Dk; feed it the raw
    # q/k and ours the normalised and scaled ones, as `gdn_forward` does
    t = {n: torch.tensor(a) for n, a in dict(q=q, k=k, v=v, g=g, beta=beta, s0=s0).items()}
    o_hf, s_hf = fn(t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], initial_state=t["s0"],
                    output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)  # fmt: skip
    qn = gdn.l2norm_forward(q)[0] / np.sqrt(q.shape[-1])
    o, S, _ = gdn.gated_delta_forward(qn, gdn.l2norm_forward(k)[0], v, g, beta, s0)
    # transformers computes the rule in float32
    np.testing.assert_allclose(o, o_hf.double().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(S, s_hf.double().numpy(), rtol=1e-4, atol=1e-5)
