"""Tests of the Deep Delta Learning reference: ops (finite differences), the five DDL variants end to end,
properties from the paper, parameter table/counts, spectral diagnostics and variant parsing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import tiny_cfg

from ddl_ref import delta, model, shortconv
from ddl_ref.check import assert_fd_grad, check_grad, random_params
from ddl_ref.config import PRESETS, ConfigError, ModelConfig, ModelVariant, parse_variants, preset
from ddl_ref.params import init_params, num_params, param_table
from ddl_ref.spectral import DeltaRegime, SpectralAccumulator, beta_histogram, spectral_snapshot

DDL_VARIANTS = [v for v in ModelVariant if v.uses_ddl]


def delta_inputs(rng, lead, C, dv):
    X = rng.standard_normal(lead + (C, dv))
    u = rng.standard_normal(lead + (C,))
    c = rng.standard_normal(lead + (C,))
    x_v = rng.standard_normal(lead + (C,))
    w_beta = rng.standard_normal(C) * 0.5
    b_beta = rng.standard_normal(1) * 0.5
    W_v = rng.standard_normal((dv, C)) * 0.5
    b_v = rng.standard_normal(dv) * 0.5
    return [X, u, c, x_v, w_beta, b_beta, W_v, b_v]


# ----------------------------------------------------------------------------------------------------------
# ops


@pytest.mark.parametrize("dv", [1, 4])
def test_delta_gradients(dv):
    rng = np.random.default_rng(dv)
    inputs = delta_inputs(rng, (2, 3), 5, dv)

    def fwd(*a):
        return delta.delta_forward(*a, 1e-5, 4.0)[0]

    def bwd(out, dout, *a):
        return delta.delta_backward(dout, delta.delta_forward(*a, 1e-5, 4.0)[1])

    check_grad(fwd, bwd, inputs)


def test_tc_cc_ec_gradients():
    rng = np.random.default_rng(7)
    B, T, C, dv, k = 2, 5, 3, 4, 3
    X = rng.standard_normal((B, T, C, dv))
    read = rng.standard_normal(dv)
    tc_w = rng.standard_normal((C * dv, k))
    check_grad(lambda *a: shortconv.tc_forward(*a)[0], lambda o, d, *a: shortconv.tc_backward(d, shortconv.tc_forward(*a)[1]),
               [X, tc_w, read])  # fmt: skip
    cc_w = rng.standard_normal((C, dv))
    check_grad(lambda *a: shortconv.cc_forward(*a)[0], lambda o, d, *a: shortconv.cc_backward(d, shortconv.cc_forward(*a)[1]),
               [X, cc_w, read])  # fmt: skip
    e = rng.standard_normal((B, T, C))
    ec_w = rng.standard_normal((C * dv, 4))
    check_grad(lambda *a: shortconv.ec_forward(*a)[0], lambda o, d, *a: shortconv.ec_backward(d, shortconv.ec_forward(*a)[1]),
               [e, ec_w])  # fmt: skip
    check_grad(lambda a: shortconv.repeat_forward(a, dv), lambda o, d, a: shortconv.repeat_backward(d), [e])


def test_conv_conventions_against_direct_formulas():
    rng = np.random.default_rng(8)
    B, T, C, dv, k = 1, 6, 2, 4, 4
    X = rng.standard_normal((B, T, C, dv))
    read = rng.standard_normal(dv)
    w = rng.standard_normal((C * dv, k))
    x_in = shortconv.tc_forward(X, w, read)[0]
    for t in range(T):
        for i in range(C):
            ref = sum(read[j] * w[i * dv + j, m] * X[0, t - (k - 1 - m), i, j]
                      for j in range(dv) for m in range(k) if t - (k - 1 - m) >= 0)  # fmt: skip
            assert x_in[0, t, i] == pytest.approx(ref, rel=1e-12, abs=1e-12)
    wc = rng.standard_normal((C, dv))
    pl = (dv - 1) // 2
    y = shortconv.cc_forward(X, wc, read)[0]
    for i in range(C):
        ref = sum(read[j] * wc[i, m] * X[0, 3, i, j + m - pl]
                  for j in range(dv) for m in range(dv) if 0 <= j + m - pl < dv)  # fmt: skip
        assert y[0, 3, i] == pytest.approx(ref, rel=1e-12)
    # Causality of TC and EC: changing X at t = 3 leaves t < 3 untouched.
    X2 = X.copy()
    X2[:, 3] += 1.0
    np.testing.assert_array_equal(shortconv.tc_forward(X2, w, read)[0][:, :3], x_in[:, :3])


def test_identity_inits():
    rng = np.random.default_rng(9)
    B, T, C, dv = 2, 5, 3, 4
    e = rng.standard_normal((B, T, C))
    for variant in (ModelVariant.DDL_TC, ModelVariant.DDL_CC):
        cfg = tiny_cfg("numpy", variant, d_model=C)
        p = init_params(cfg, 0, np.float64)
        # EC at init repeats the embedding d_v times.
        X0 = shortconv.ec_forward(e, p["model.embed_expand.conv.weight"])[0]
        np.testing.assert_array_equal(X0, shortconv.repeat_forward(e, dv))
        # An identity compressor with read 1/dv is the mean over d_v.
        X = rng.standard_normal((B, T, C, dv))
        fwd = shortconv.tc_forward if cfg.ddl_compressor == "tc" else shortconv.cc_forward
        x_in = fwd(X, p["model.layers.0.compress.conv.weight"], p["model.layers.0.compress.read.weight"])[0]
        np.testing.assert_allclose(x_in, X.mean(axis=-1), rtol=1e-14, atol=1e-15)


# ----------------------------------------------------------------------------------------------------------
# properties from the paper


@pytest.mark.parametrize("dv", [1, 4])
def test_beta_zero_is_identity_and_beta_two_is_householder(dv):
    rng = np.random.default_rng(10 + dv)
    X, u, c, x_v, w_beta, _, W_v, b_v = delta_inputs(rng, (3,), 6, dv)
    # β forced to 0: the update is the identity on the stream.
    X_new, _ = delta.delta_forward(X, u, c, x_v, w_beta, np.array([-40.0]), W_v, b_v, 1e-5, 4.0)
    np.testing.assert_allclose(X_new, X, rtol=0, atol=1e-15)
    # β = 2: X_new = (I − 2kkᵀ) X + 2 k vᵀ, the shortcut is a Householder reflection.
    X_new, cache = delta.delta_forward(X, u, c, x_v, np.zeros(6), np.array([40.0]), W_v, b_v, 1e-5, 4.0)
    k, beta, v = cache["k"], cache["beta"], cache["v"]
    np.testing.assert_allclose(beta, 2.0, rtol=1e-15)
    shortcut = X_new - beta[:, None, None] * k[:, :, None] * v[:, None, :]
    np.testing.assert_allclose(
        np.linalg.norm(shortcut, axis=(1, 2)), np.linalg.norm(X, axis=(1, 2)), rtol=1e-9
    )
    np.testing.assert_allclose(
        np.einsum("tcj,tc->tj", shortcut, k), -np.einsum("tcj,tc->tj", X, k), atol=1e-9
    )
    # The component orthogonal to k is untouched.
    perp = X - k[:, :, None] * np.einsum("tcj,tc->tj", X, k)[:, None, :]
    perp_new = shortcut - k[:, :, None] * np.einsum("tcj,tc->tj", shortcut, k)[:, None, :]
    np.testing.assert_allclose(perp_new, perp, atol=1e-9)


def test_lifted_determinant():
    rng = np.random.default_rng(12)
    d, dv, beta = 5, 3, 1.3
    k = rng.standard_normal(d)
    k /= np.linalg.norm(k)
    A = np.eye(d) - beta * np.outer(k, k)
    assert np.linalg.det(A) == pytest.approx(1 - beta, rel=1e-12)
    assert np.linalg.det(np.kron(np.eye(dv), A)) == pytest.approx((1 - beta) ** dv, rel=1e-12)
    # The delta op applies exactly I_dv ⊗ A (on vec X, column-major over d_v) plus β k vᵀ.
    X = rng.standard_normal((d, dv))
    Xn, cache = delta.delta_forward(X, k * 3.0, np.zeros(d), np.zeros(d), np.zeros(d),
                                    np.array([math.log(beta / (2 - beta))]), np.zeros((dv, d)), np.zeros(dv),
                                    0.0, 4.0)  # fmt: skip
    lifted = (np.kron(np.eye(dv), A) @ X.T.reshape(-1)).reshape(dv, d).T
    np.testing.assert_allclose(Xn, lifted + cache["beta"] * np.outer(k, cache["v"]), atol=1e-12)


def test_error_contraction():
    # e_post = (1 − β) e_pre with e = kᵀX − vᵀ ([P3] Eq 2.4).
    rng = np.random.default_rng(13)
    X, u, c, x_v, w_beta, b_beta, W_v, b_v = delta_inputs(rng, (4,), 6, 4)
    Xn, cache = delta.delta_forward(X, u, c, x_v, w_beta, b_beta, W_v, b_v, 1e-5, 4.0)
    k, beta, v = cache["k"], cache["beta"], cache["v"]
    e_pre = np.einsum("tcj,tc->tj", X, k) - v
    e_post = np.einsum("tcj,tc->tj", Xn, k) - v
    # ‖k‖ = 1 − O(ε²/‖u‖²), so the identity holds to ~1e-10.
    np.testing.assert_allclose(e_post, (1 - beta)[:, None] * e_pre, atol=1e-9)


# ----------------------------------------------------------------------------------------------------------
# the model


@pytest.mark.parametrize("variant", DDL_VARIANTS, ids=lambda v: v.slug)
def test_model_gradients_match_finite_differences(variant):
    cfg = tiny_cfg("numpy", variant)
    params = random_params(cfg)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 5))
    lengths = np.array([5, 3])
    _, loss, cache = model.forward(params, cfg, ids, lengths)
    grads = model.backward(params, cfg, cache)
    assert list(grads) == [s.name for s in param_table(cfg)]
    for name, p in params.items():
        # eps 1e-5, not 1e-6: a DDL sublayer keeps only the direction of its output, so some attention
        # gradients are ~1e-4 and the rounding floor of the loss (fd_floor) would be 1e-5 of them at 1e-6.
        f = lambda: model.forward(params, cfg, ids, lengths)[1]  # noqa: E731
        assert_fd_grad(name, grads[name], f, p, eps=1e-5)
        assert np.any(grads[name] != 0.0), f"{name}: gradient is identically zero"


@pytest.mark.parametrize("variant", list(ModelVariant), ids=lambda v: v.slug)
def test_model_init_and_hidden_states(variant):
    cfg = variant.resolve_config(PRESETS["tiny"])
    p64 = init_params(cfg, 0, np.float64)
    p32 = init_params(cfg, 0, np.float32)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 12))
    l64, loss64, _ = model.forward(p64, cfg, ids)
    l32, loss32, _ = model.forward(p32, cfg, ids)
    assert l32.dtype == np.float32
    assert abs(loss64 - math.log(cfg.vocab_size)) < 0.15
    np.testing.assert_allclose(l32, l64, rtol=1e-4, atol=1e-5)
    pre, post = model.hidden_states(p64, cfg, ids)
    assert pre.shape == post.shape == (2, 12, cfg.d_model)
    # Causal.
    ids2 = ids.copy()
    ids2[0, 7] = (ids2[0, 7] + 1) % cfg.vocab_size
    np.testing.assert_array_equal(model.forward(p64, cfg, ids2)[0][:, :7], l64[:, :7])


def test_d_v4_variants_agree_at_init():
    # Identity compressors and identity EC: every d_v = 4 variant computes the same function at init.
    ids = np.random.default_rng(5).integers(0, 256, size=(2, 9))
    logits = []
    for v in (ModelVariant.DDL_TC_NOEC, ModelVariant.DDL_CC_NOEC, ModelVariant.DDL_TC, ModelVariant.DDL_CC):
        cfg = v.resolve_config(PRESETS["tiny"])
        logits.append(model.forward(init_params(cfg, 3, np.float64), cfg, ids)[0])
    for other in logits[1:]:
        np.testing.assert_allclose(other, logits[0], rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------------------
# parameter table


def test_param_table_per_variant():
    C, dv, k = 8, 4, 4
    base = {s.name for s in param_table(tiny_cfg("numpy", ModelVariant.BASELINE))}
    for v in ModelVariant:
        cfg = tiny_cfg("numpy", v)
        table = {s.name: s for s in param_table(cfg)}
        assert base <= set(table)
        extra = {n: s.shape for n, s in table.items() if n not in base}
        d = 1 if v in (ModelVariant.BASELINE, ModelVariant.DDL) else dv
        expect = {}
        if v.uses_ddl:
            for i in range(2):
                for s in ("attn", "mlp"):
                    q = f"model.layers.{i}.ddl_{s}."
                    expect.update({q + "beta_proj.weight": (C,), q + "beta_proj.bias": (1,),
                                   q + "v_proj.weight": (d, C), q + "v_proj.bias": (d,)})  # fmt: skip
        if d > 1:
            conv = (C * dv, k) if cfg.ddl_compressor == "tc" else (C, dv)
            for pre in ("model.layers.0.compress.", "model.layers.1.compress.", "model.readout."):
                expect.update({pre + "conv.weight": conv, pre + "read.weight": (dv,)})
        if cfg.ddl_expand_embed:
            expect["model.embed_expand.conv.weight"] = (C * dv, 4)
        assert extra == expect, v
        assert all(s.decay for s in table.values())


def test_ddl_init_values():
    cfg = ModelVariant.DDL_CC.resolve_config(preset("small", n_layers=2, vocab_size=128))
    p = init_params(cfg, seed=1)
    C = 768
    np.testing.assert_array_equal(p["model.layers.0.ddl_attn.beta_proj.bias"], 0.0)  # logit(1/2)
    assert abs(p["model.layers.0.ddl_attn.beta_proj.weight"].std() - 0.5 / math.sqrt(C)) < 0.003
    assert abs(p["model.layers.1.ddl_mlp.v_proj.weight"].std() - 0.5 / math.sqrt(C)) < 0.002
    b_v = p["model.layers.0.ddl_mlp.v_proj.bias"]
    assert np.all(np.abs(b_v) <= 1 / math.sqrt(C)) and np.any(b_v != 0)
    np.testing.assert_array_equal(p["model.readout.read.weight"], 0.25)
    np.testing.assert_array_equal(p["model.layers.1.compress.conv.weight"][:, 1], 1.0)  # centre tap
    np.testing.assert_array_equal(p["model.layers.1.compress.conv.weight"].sum(), C)
    ec = p["model.embed_expand.conv.weight"]
    assert ec.shape == (C * 4, 4) and np.all(ec[:, 3] == 1.0) and ec.sum() == C * 4
    # β₀ -> bias = logit(β₀/2), clipped.
    for beta0, bias in ((1.0, 0.0), (1.5, math.log(3.0)), (2.0, math.log((1 - 1e-6) / 1e-6)),
                        (0.0, math.log(1e-6 / (1 - 1e-6)))):  # fmt: skip
        pb = init_params(ModelVariant.DDL.resolve_config(preset("tiny", ddl_beta_init=beta0)), 0)
        assert float(pb["model.layers.0.ddl_attn.beta_proj.bias"][0]) == pytest.approx(bias, rel=1e-6)


def test_param_counts():
    small = PRESETS["small"]
    # d_v = 1: per sublayer β head (C + 1) and v head (C + 1), 2 sublayers x 12 blocks (≈ +37K).
    assert (
        num_params(ModelVariant.DDL.resolve_config(small)) - num_params(small)
        == 2 * 12 * (769 + 769)
        == 36_912
    )
    C, dv, k, L = 768, 4, 4, 12
    heads = 2 * L * (C + 1 + dv * C + dv)
    tc = (L + 1) * (C * dv * k + dv)
    cc = (L + 1) * (C * dv + dv)
    ec = C * dv * 4
    n0 = num_params(small)
    assert num_params(ModelVariant.DDL_TC_NOEC.resolve_config(small)) - n0 == heads + tc
    assert num_params(ModelVariant.DDL_CC_NOEC.resolve_config(small)) - n0 == heads + cc
    assert num_params(ModelVariant.DDL_TC.resolve_config(small)) - n0 == heads + tc + ec
    assert num_params(ModelVariant.DDL_CC.resolve_config(small)) - n0 == heads + cc + ec


# ----------------------------------------------------------------------------------------------------------
# spectral diagnostics


def _const_beta_cfg_params(variant, beta):
    cfg = tiny_cfg("numpy", variant)
    params = random_params(cfg)
    for n in params:
        if "beta_proj.weight" in n:
            params[n][:] = 0.0
        elif "beta_proj.bias" in n:
            params[n][:] = math.log(beta / (2.0 - beta))
    return cfg, params


@pytest.mark.parametrize("variant", [ModelVariant.DDL, ModelVariant.DDL_CC], ids=lambda v: v.slug)
def test_spectral_snapshot_constant_beta(variant):
    cfg, params = _const_beta_cfg_params(variant, 1.6)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 5))
    lengths = np.array([5, 3])
    _, _, cache = model.forward(params, cfg, ids, lengths, spectral=True)
    snap = cache["spectral"]
    assert snap == spectral_snapshot(cache, cfg, lengths)
    json.dumps(snap)  # JSON-able
    n_layers = 2 * cfg.n_layers
    dv = cfg.ddl_dv
    np.testing.assert_allclose(snap["beta_per_layer"], [1.6] * n_layers, rtol=1e-12)
    np.testing.assert_allclose(snap["k_eigenvalue_per_layer"], [-0.6] * n_layers, rtol=1e-12)
    np.testing.assert_allclose(snap["spatial_determinant_per_layer"], [-0.6] * n_layers, rtol=1e-12)
    np.testing.assert_allclose(snap["lifted_determinant_per_layer"], [(-0.6) ** dv] * n_layers, rtol=1e-12)
    assert snap["regime_per_layer"] == ["reflection"] * n_layers
    hist = snap["beta_histogram"]
    assert len(hist["edges"]) == 21 and hist["edges"][0] == 0.0 and hist["edges"][-1] == 2.0
    assert hist["counts"][16] == n_layers and sum(hist["counts"]) == n_layers
    assert hist["regimes"] == {"identity": 0, "projection": 0, "reflection": n_layers}
    # k_coherence and correction_norm by hand over the real tokens only.
    mask = np.arange(5)[None, :] < lengths[:, None]
    dc = cache["blocks"][1]["ddl_mlp"]
    k = dc["k"][mask]
    assert snap["k_coherence_per_layer"][3] == pytest.approx(np.linalg.norm(k.mean(axis=0)), rel=1e-12)
    X = dc["X"][mask]
    corr = 1.6 * np.linalg.norm(dc["v"][mask] - np.einsum("ncj,nc->nj", X, k), axis=-1)
    assert snap["correction_norm_per_layer"][3] == pytest.approx(corr.mean(), rel=1e-10)
    assert all(0.0 <= c <= 1.0 + 1e-9 for c in snap["k_coherence_per_layer"])
    # Padding is ignored: changing a padded token changes nothing.
    ids2 = ids.copy()
    ids2[1, 4] = (ids2[1, 4] + 1) % cfg.vocab_size
    assert model.forward(params, cfg, ids2, lengths, spectral=True)[2]["spectral"] == snap


def test_spectral_none_for_baseline_and_k_coherence_extremes():
    cfg = tiny_cfg("numpy", ModelVariant.BASELINE)
    _, _, cache = model.forward(random_params(cfg), cfg, np.zeros((1, 3), dtype=int), spectral=True)
    assert cache["spectral"] is None
    # Hand-built caches: one direction for every token -> coherence 1; opposite directions -> 0.
    cfg = tiny_cfg("numpy", ModelVariant.DDL, d_model=4, n_layers=1)
    k_same = np.tile(np.array([0.0, 1.0, 0.0, 0.0]), (1, 2, 1))
    k_opp = np.array([[[1.0, 0, 0, 0], [-1.0, 0, 0, 0]]])
    beta = np.full((1, 2), 0.3)
    delta_ = np.full((1, 2, 1), 2.0)
    blocks = [{"ddl_attn": {"k": k_same, "beta": beta, "delta": delta_},
               "ddl_mlp": {"k": k_opp, "beta": beta, "delta": delta_}}]  # fmt: skip
    snap = spectral_snapshot({"ids": np.zeros((1, 2)), "blocks": blocks}, cfg)
    assert snap["k_coherence_per_layer"] == [1.0, 0.0]
    assert snap["correction_norm_per_layer"] == pytest.approx([0.6, 0.6])
    assert snap["regime_per_layer"] == ["identity", "identity"]
    assert spectral_snapshot({"ids": np.zeros((1, 2)), "blocks": blocks}, cfg, [0]) is None


def test_regimes_histogram_and_accumulator():
    assert [DeltaRegime.from_beta(b) for b in (0.0, 0.49, 0.5, 1.49, 1.5, 2.0)] == [
        "identity", "identity", "projection", "projection", "reflection", "reflection"]  # fmt: skip
    h = beta_histogram([0.05, 0.15, 1.0, 1.99, 2.0])
    assert h["counts"][0] == 1 and h["counts"][1] == 1 and h["counts"][10] == 1 and h["counts"][19] == 2
    assert h["regimes"] == {"identity": 2, "projection": 1, "reflection": 2}

    def snap(beta, extra):
        vals = {k: [extra, extra + 1] for k in ("k_eigenvalue_per_layer", "spatial_determinant_per_layer",
                                                "lifted_determinant_per_layer", "k_coherence_per_layer",
                                                "correction_norm_per_layer")}  # fmt: skip
        return {"beta_per_layer": beta, **vals, "regime_per_layer": [], "beta_histogram": {}}

    acc = SpectralAccumulator()
    assert acc.finish() is None
    acc.observe(snap([0.2, 1.4], 1.0), 3.0)
    acc.observe(None, 100.0)  # baseline batches are ignored
    acc.observe(snap([1.0, 2.0], 5.0), 1.0)
    out = acc.finish()
    # Weighted by prediction count 3:1: betas 0.4 and 1.55; regimes from the averaged betas.
    assert out["beta_per_layer"] == pytest.approx([0.4, 1.55])
    assert out["correction_norm_per_layer"] == pytest.approx([2.0, 3.0])
    assert out["regime_per_layer"] == ["identity", "reflection"]
    assert out["beta_histogram"]["counts"][4] == 1 and out["beta_histogram"]["counts"][15] == 1
    with pytest.raises(ValueError, match="length must remain stable"):
        acc.observe({k: [0.0] for k in snap([1.0, 1.0], 0.0) if k.endswith("_layer")}, 1.0)


# ----------------------------------------------------------------------------------------------------------
# config and variants


def test_variants_and_parsing():
    assert [v.slug for v in parse_variants("all")] == [
        "baseline", "ddl", "ddl-tc-noec", "ddl-cc-noec", "ddl-tc", "ddl-cc"]  # fmt: skip
    assert parse_variants("ddl, ddl-cc,ddl") == [ModelVariant.DDL, ModelVariant.DDL_CC]
    assert not ModelVariant.BASELINE.uses_ddl and all(v.uses_ddl for v in DDL_VARIANTS)
    base = PRESETS["tiny"]
    rows = {v.slug: (c.residual, c.ddl_dv, c.ddl_compressor, c.ddl_expand_embed)
            for v in ModelVariant for c in [v.resolve_config(base)]}  # fmt: skip
    assert rows == {
        "baseline": ("add", 1, "none", False),
        "ddl": ("delta", 1, "none", False),
        "ddl-tc-noec": ("delta", 4, "tc", False),
        "ddl-cc-noec": ("delta", 4, "cc", False),
        "ddl-tc": ("delta", 4, "tc", True),
        "ddl-cc": ("delta", 4, "cc", True),
    }
    # Resolving keeps the trunk and DDL hyper-parameters; resolving back to baseline works from any variant.
    cc = ModelVariant.DDL_CC.resolve_config(base)
    assert cc.d_model == base.d_model and cc.uses_ddl
    assert ModelVariant.BASELINE.resolve_config(cc) == base
    with pytest.raises(ConfigError, match=r"unknown variant 'ddl-xx'; valid variants: \['baseline', 'ddl', "):
        parse_variants("ddl,ddl-xx")
    with pytest.raises(ConfigError, match="ddl-cc'\\] or 'all'"):
        parse_variants("DDL")


def test_config_residual_validation():
    with pytest.raises(ConfigError, match="ddl_dv=4 needs ddl_compressor 'tc' or 'cc'"):
        ModelConfig(residual="delta", ddl_dv=4)
    with pytest.raises(ConfigError, match="ddl_dv=1 has no expanded state"):
        ModelConfig(residual="delta", ddl_dv=1, ddl_compressor="tc")
    with pytest.raises(ConfigError, match="ddl_dv=1 has no expanded state"):
        ModelConfig(residual="delta", ddl_expand_embed=True)
    with pytest.raises(ConfigError, match="residual='add' needs ddl_dv=1"):
        ModelConfig(ddl_dv=4, ddl_compressor="cc")
    with pytest.raises(ConfigError, match="residual='add' needs"):
        ModelConfig(ddl_expand_embed=True)
    cfg = ModelConfig(residual="delta", ddl_dv=4, ddl_compressor="cc", ddl_expand_embed=True)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
