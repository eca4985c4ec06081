"""Tests of the reference model, its config, parameter table and optimizer.

The whole-model gradient check perturbs every parameter of a tiny model (float64, central differences) for
each qk_norm mode, tied and untied heads and both norm styles.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import hybrid_cfg, tiny_cfg

from ddl_ref import model, ops
from ddl_ref.check import assert_fd_grad, random_params
from ddl_ref.config import PRESETS, ConfigError, ModelConfig, ModelVariant, MtpConfig, parse_variants, preset
from ddl_ref.optim import CosineWarmupSchedule, adamw_step, clip_multiplier, global_grad_norm
from ddl_ref.params import init_params, num_params, param_table

# ----------------------------------------------------------------------------------------------------------
# model


@pytest.mark.parametrize("norm_style", ["standard", "offset"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("qk_norm", ["none", "pre_rope", "post_rope"])
def test_model_gradients_match_finite_differences(qk_norm, tied, norm_style):
    cfg = tiny_cfg("numpy", qk_norm=qk_norm, tie_embeddings=tied, norm_style=norm_style)
    params = random_params(cfg)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, size=(2, 5))
    lengths = np.array([5, 3])  # the second row is padded
    _, loss, cache = model.forward(params, cfg, ids, lengths)
    grads = model.backward(params, cfg, cache)
    assert list(grads) == [s.name for s in param_table(cfg)]
    for name, p in params.items():
        assert_fd_grad(name, grads[name], lambda: model.forward(params, cfg, ids, lengths)[1], p)
        assert np.any(grads[name] != 0.0), f"{name}: gradient is identically zero"


def test_forward_shapes_loss_and_hidden_states():
    cfg = tiny_cfg("numpy")
    params = random_params(cfg)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(3, 7))
    logits, loss, _ = model.forward(params, cfg, ids)
    assert logits.shape == (3, 7, cfg.vocab_size)
    assert loss == ops.lm_loss_forward(logits, ids, np.full(3, 7))[0]
    pre, post = model.hidden_states(params, cfg, ids)
    assert pre.shape == post.shape == (3, 7, cfg.d_model)
    np.testing.assert_allclose(post @ params["model.embed_tokens.weight"].T, logits, rtol=1e-12)
    np.testing.assert_allclose(post, ops.rmsnorm_forward(pre, params["model.norm.weight"], cfg.rms_eps)[0])


def test_model_is_causal():
    cfg = tiny_cfg("numpy")
    params = random_params(cfg)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(1, 6))
    logits, _, _ = model.forward(params, cfg, ids)
    ids2 = ids.copy()
    ids2[0, 4] = (ids2[0, 4] + 1) % cfg.vocab_size
    logits2, _, _ = model.forward(params, cfg, ids2)
    np.testing.assert_array_equal(logits[:, :4], logits2[:, :4])
    assert not np.allclose(logits[:, 4:], logits2[:, 4:])


def test_init_loss_near_log_vocab_and_float32_matches_float64():
    cfg = PRESETS["tiny"]
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, size=(2, 16))
    p32 = init_params(cfg, seed=0, dtype=np.float32)
    p64 = init_params(cfg, seed=0, dtype=np.float64)
    l32, loss32, _ = model.forward(p32, cfg, ids)
    l64, loss64, c64 = model.forward(p64, cfg, ids)
    assert l32.dtype == np.float32
    # Small init: near-uniform predictions.
    assert abs(loss64 - math.log(cfg.vocab_size)) < 0.1
    np.testing.assert_allclose(l32, l64, rtol=1e-4, atol=1e-5)
    assert abs(loss32 - loss64) < 1e-5
    # backward(dlogits=...) is the same path as the loss gradient.
    g1 = model.backward(p64, cfg, c64)
    g2 = model.backward(p64, cfg, c64, dlogits=ops.lm_loss_backward(c64["loss"]))
    for name in g1:
        np.testing.assert_array_equal(g1[name], g2[name])


def test_delta_residual_runs():
    # The Deep Delta residual is implemented now; its own tests are in tests/test_ref_ddl.py.
    cfg = tiny_cfg("numpy", residual="delta")
    _, loss, cache = model.forward(random_params(cfg), cfg, np.zeros((1, 3), dtype=int))
    assert np.isfinite(loss) and len(cache["blocks"]) == cfg.n_layers


def test_sequence_longer_than_max_seq_len():
    cfg = tiny_cfg("numpy", max_seq_len=4)
    with pytest.raises(ValueError, match="exceeds max_seq_len 4"):
        model.forward(random_params(cfg), cfg, np.zeros((1, 5), dtype=int))


# ----------------------------------------------------------------------------------------------------------
# parameter table


def test_param_table_names_and_shapes():
    cfg = tiny_cfg("numpy", qk_norm="pre_rope", tie_embeddings=False)
    table = {s.name: s.shape for s in param_table(cfg)}
    assert table["model.embed_tokens.weight"] == (11, 8)
    assert table["model.layers.1.self_attn.q_proj.weight"] == (12, 8)  # H*D = 2*6, != d_model
    assert table["model.layers.1.self_attn.k_proj.weight"] == (6, 8)
    assert table["model.layers.1.self_attn.o_proj.weight"] == (8, 12)
    assert table["model.layers.0.self_attn.q_norm.weight"] == (6,)
    assert table["model.layers.0.mlp.down_proj.weight"] == (8, 10)
    assert table["lm_head.weight"] == (11, 8)
    assert len(table) == 1 + 2 * 11 + 1 + 1
    no_qk = {s.name for s in param_table(tiny_cfg("numpy", qk_norm="none"))}
    assert not any("q_norm" in n or "k_norm" in n for n in no_qk)
    assert "lm_head.weight" not in no_qk
    assert all(s.decay for s in param_table(cfg))


def test_param_counts():
    # small preset: 123,590,400 parameters = embed 50304*768 + 12 * (4*768*768 + 3*2048*768 + 2*768 + 2*128)
    # + final norm 768 (tied head).
    assert num_params(PRESETS["small"]) == 123_590_400
    assert (
        num_params(PRESETS["small"])
        == 50304 * 768 + 12 * (4 * 768 * 768 + 3 * 2048 * 768 + 2 * 768 + 256) + 768
    )
    assert num_params(preset("small", tie_embeddings=False)) == 123_590_400 + 50304 * 768
    assert num_params(PRESETS["tiny"]) == sum(p.size for p in init_params(PRESETS["tiny"], 0).values())


def test_init_is_deterministic_and_scaled():
    cfg = preset("small", n_layers=4, vocab_size=512)
    a = init_params(cfg, seed=7)
    b = init_params(cfg, seed=7)
    c = init_params(cfg, seed=8)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert abs(a["model.embed_tokens.weight"].std() - 0.02) < 0.002
    assert abs(a["model.layers.0.mlp.gate_proj.weight"].std() - 0.5 / math.sqrt(768)) < 0.001
    assert abs(a["model.layers.0.mlp.down_proj.weight"].std() - 0.5 / math.sqrt(768) / 2) < 0.0005
    np.testing.assert_array_equal(a["model.norm.weight"], 1.0)
    off = init_params(preset("tiny", norm_style="offset"), seed=0)
    np.testing.assert_array_equal(off["model.layers.0.self_attn.q_norm.weight"], 0.0)


# ----------------------------------------------------------------------------------------------------------
# config


def test_config_validation_messages():
    with pytest.raises(ConfigError, match=r"n_heads \(6\) must be a multiple of n_kv_heads \(4\)"):
        ModelConfig(n_kv_heads=4)
    with pytest.raises(ConfigError, match="head_dim must be even"):
        ModelConfig(head_dim=7)
    with pytest.raises(ConfigError, match="d_model must be positive"):
        ModelConfig(d_model=0)
    with pytest.raises(ConfigError, match=r"qk_norm must be one of \['none', 'pre_rope', 'post_rope'\]"):
        ModelConfig(qk_norm="pre")
    with pytest.raises(ConfigError, match="ddl_dv must be one of"):
        ModelConfig(ddl_dv=2)
    with pytest.raises(ConfigError, match="n_layers must be int, got float"):
        ModelConfig(n_layers=2.0)
    with pytest.raises(ConfigError, match="tie_embeddings must be bool"):
        ModelConfig(tie_embeddings=1)
    with pytest.raises(ConfigError, match="concat must be one of"):
        MtpConfig(concat="middle")
    assert ModelConfig(rope_theta=10000).rope_theta == 10000  # an int is fine for a float field


def test_config_dict_roundtrip_and_unknown_keys():
    cfg = preset("tiny", mtp=MtpConfig(concat="hidden_first"), qk_norm="pre_rope")
    d = cfg.to_dict()
    assert d["mtp"] == {"concat": "hidden_first", "trunk_hidden": "pre_norm", "chain_hidden": "pre_norm"}
    assert ModelConfig.from_dict(d) == cfg
    with pytest.raises(ConfigError, match=r"unknown ModelConfig keys: \['d_modle', 'layers'\]"):
        ModelConfig.from_dict({"d_modle": 4, "layers": 2})
    with pytest.raises(ConfigError, match=r"unknown mtp keys: \['x'\]"):
        ModelConfig.from_dict({"mtp": {"x": 1}})
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ConfigError, match="unknown ModelConfig keys"):
        preset("tiny", n_layer=3)


def test_presets():
    small, medium, tiny = PRESETS["small"], PRESETS["medium"], PRESETS["tiny"]
    assert (small.d_model, small.n_layers, small.n_heads, small.head_dim, small.ffn_hidden) == (
        768,
        12,
        6,
        128,
        2048,
    )
    assert small.ffn_hidden == 8 * 768 // 3
    assert (medium.d_model, medium.n_layers, medium.n_heads, medium.ffn_hidden) == (
        1024,
        24,
        8,
        8 * 1024 // 3,
    )
    assert (tiny.vocab_size, tiny.n_kv_heads) == (256, 2)
    assert preset("tiny", n_layers=3).n_layers == 3


def test_variants():
    assert parse_variants("all")[0] == ModelVariant.BASELINE and len(parse_variants("all")) == 6
    assert parse_variants(" baseline, baseline ") == [ModelVariant.BASELINE]
    v = ModelVariant.BASELINE
    assert v.slug == "baseline" and v == "baseline" and not v.uses_ddl
    assert v.resolve_config(preset("tiny", residual="delta", ddl_dv=4, ddl_compressor="cc")).residual == "add"
    with pytest.raises(ConfigError, match=r"unknown variant 'ddl-xx'; valid variants: \['baseline', 'ddl',"):
        parse_variants("baseline,ddl-xx")
    with pytest.raises(ConfigError, match="no variants given"):
        parse_variants(" , ")


# ----------------------------------------------------------------------------------------------------------
# optimizer


def test_adamw_matches_hand_computation():
    p = {"w": np.array([1.0, -2.0]), "frozen": np.array([3.0])}
    g = {"w": np.array([0.5, 0.25]), "frozen": np.array([1.0])}
    state: dict = {}
    lr, b1, b2, eps, wd, mult = 0.1, 0.9, 0.95, 1e-8, 0.01, 0.5
    adamw_step(p, g, state, lr, 1, b1, b2, eps, wd, grad_multiplier=mult, trainable={"w"})
    # Step 1 by hand for w[0]: decay 1 - 0.1*0.01 = 0.999; g = 0.25; m = 0.025, v = 0.003125;
    # mhat = 0.25, vhat = 0.0625, update = 0.1 * 0.25 / (0.25 + 1e-8).
    w0 = 1.0 * 0.999 - 0.1 * 0.25 / (0.25 + 1e-8)
    assert p["w"][0] == pytest.approx(w0, rel=1e-14)
    assert p["frozen"][0] == 3.0 and "frozen" not in state["m"]
    # Step 2 for w[1] with a new gradient.
    g2 = {"w": np.array([0.0, -1.0])}
    w1 = -2.0 * 0.999 - 0.1 * 0.125 / (0.125 + 1e-8)
    m = 0.9 * (0.1 * 0.125) + 0.1 * (-0.5)
    v = 0.95 * (0.05 * 0.125**2) + 0.05 * 0.25
    w1 = w1 * 0.999 - 0.1 * (m / (1 - 0.9**2)) / (math.sqrt(v / (1 - 0.95**2)) + 1e-8)
    adamw_step(p, g2, state, lr, 2, b1, b2, eps, wd, grad_multiplier=mult)
    assert p["w"][1] == pytest.approx(w1, rel=1e-14)
    # decay=set() turns weight decay off.
    q = {"w": np.array([1.0])}
    adamw_step(q, {"w": np.array([0.0])}, {}, lr, 1, b1, b2, eps, wd, decay=set())
    assert q["w"][0] == 1.0


def test_grad_norm_and_clip():
    grads = {"a": np.array([3.0]), "b": np.array([[4.0]], dtype=np.float32)}
    assert global_grad_norm(grads) == 5.0
    assert clip_multiplier(5.0, 1.0) == 0.2
    assert clip_multiplier(0.5, 1.0) == 1.0
    assert clip_multiplier(0.0, 1.0) == 1.0


def test_cosine_warmup_schedule():
    s = CosineWarmupSchedule(1.0, 0.1, 2, 6)
    lrs = [s.learning_rate(i) for i in range(8)]
    assert lrs[0] == 0.5 and lrs[1] == 1.0
    assert lrs[2] <= 1.0 and lrs[3] < lrs[2] and lrs[4] < lrs[3]
    assert lrs[5] == 0.1 and lrs[6] == 0.1 and lrs[7] == 0.1  # clamped past the end
    assert CosineWarmupSchedule(1.0, 0.1, 2, 3).learning_rate(2) == 1.0  # one cosine step: stays at base
    with pytest.raises(ValueError, match="total_steps must be greater than zero"):
        CosineWarmupSchedule(1.0, 0.1, 0, 0)
    with pytest.raises(ValueError, match="warmup_steps cannot exceed total_steps"):
        CosineWarmupSchedule(1.0, 0.1, 7, 6)
    with pytest.raises(ValueError, match="min_learning_rate cannot exceed base_learning_rate"):
        CosineWarmupSchedule(0.1, 1.0, 2, 6)


# ----------------------------------------------------------------------------------------------------------
# hybrid trunks (Qwen3.5): Gated DeltaNet and gated full attention with partial RoPE


TWO_BLOCKS = dict(n_layers=2, layer_types=("linear_attention", "full_attention"))  # the cheaper checks


FD_ENTRIES = 48  # per tensor, in the hybrid checks: a Gated DeltaNet forward is a loop over tokens in Python


def fd_entries(g: np.ndarray, rng) -> np.ndarray | None:
    """Every entry of a small tensor (None); of a larger one, the half of FD_ENTRIES where the analytic
    gradient is largest and as many drawn at random (an analytic zero is checked too: unused embedding rows)."""
    if g.size <= FD_ENTRIES:
        return None
    top = np.argsort(np.abs(g).reshape(-1))[-FD_ENTRIES // 2 :]
    return np.union1d(top, rng.choice(g.size, FD_ENTRIES // 2, replace=False))


def assert_model_grads(cfg, mtp_weight=None, seed=0):
    params = random_params(cfg, seed=seed)
    ids = np.random.default_rng(seed + 1).integers(0, cfg.vocab_size, size=(2, 6))
    lengths = np.array([6, 4])  # the second row is padded
    _, _, cache = model.forward(params, cfg, ids, lengths, mtp_weight=mtp_weight)
    grads = model.backward(params, cfg, cache)
    assert list(grads) == [s.name for s in param_table(cfg)]
    rng = np.random.default_rng(seed + 2)
    for name, p in params.items():
        at = fd_entries(grads[name], rng)
        f = lambda: model.forward(params, cfg, ids, lengths, mtp_weight=mtp_weight)[1]  # noqa: E731
        assert_fd_grad(name, grads[name], f, p, at=at)
        assert np.any(grads[name] != 0.0), f"{name}: gradient is identically zero"


@pytest.mark.parametrize(
    "tied, overrides",
    [
        (True, {}),
        (False, {}),
        # rms_eps 1e-3: here a Gated DeltaNet output of RMS ~3e-3 meets the gated norm's sqrt(mean(o²) + eps),
        # whose curvature at 1e-5 put the central differences' truncation error (1e-6 · eps_step² scaled) at
        # 9e-7 of the gradient, within 10 % of the tolerance; at 1e-3 it is 2e-9
        (False, {"qk_norm": "post_rope", "norm_style": "standard", "rotary_dim": None, "rms_eps": 1e-3}),
    ],
)
def test_hybrid_model_gradients_match_finite_differences(tied, overrides):
    assert_model_grads(hybrid_cfg(tie_embeddings=tied, **overrides))


@pytest.mark.parametrize("variant", ["ddl", "ddl-tc", "ddl-cc-noec"])
def test_ddl_on_a_hybrid_trunk_gradients(variant):
    # The mixer's output is the Deep Delta sublayer output u, whichever mixer it is. rms_eps 1e-3: a Gated
    # DeltaNet output of RMS ~3e-3 meets the gated norm's sqrt(mean(o²) + eps), which at 1e-5 bends too
    # sharply for central differences at 1e-6 once DDL's u/|u| sits behind it (the error then shrinks as
    # eps², as a correct gradient's does); the function and its backward are the same at any eps.
    assert_model_grads(hybrid_cfg(variant=variant, rms_eps=1e-3, **TWO_BLOCKS))


def test_spectral_diagnostics_on_a_hybrid_ddl_trunk():
    # DDL's diagnostics read the delta updates only: one entry per sublayer, whichever mixer fed it
    cfg = hybrid_cfg(variant="ddl-tc")
    _, _, cache = model.forward(random_params(cfg), cfg, np.zeros((1, 4), dtype=int), spectral=True)
    assert len(cache["spectral"]["beta_per_layer"]) == 2 * cfg.n_layers
    base = hybrid_cfg()
    _, _, cache = model.forward(random_params(base), base, np.zeros((1, 4), dtype=int), spectral=True)
    assert cache["spectral"] is None  # a baseline hybrid has none


def test_hybrid_with_mtp_draft_gradients():
    # trunk block 0 is linear; the draft block is full attention with the trunk's gate and partial RoPE
    cfg = hybrid_cfg(mtp=MtpConfig(), tie_embeddings=False, **TWO_BLOCKS)
    names = {s.name for s in param_table(cfg)}
    assert (
        "model.mtp.layers.0.self_attn.q_proj.weight" in names
        and "model.layers.0.self_attn.o_proj.weight" not in names
    )
    assert_model_grads(cfg, mtp_weight=0.3, seed=3)


def test_hybrid_forward_is_causal_and_float32_matches_float64():
    cfg = hybrid_cfg()
    p64 = random_params(cfg, seed=4)
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size, size=(2, 7))
    logits, _, _ = model.forward(p64, cfg, ids)
    ids2 = ids.copy()
    ids2[:, 4] = (ids2[:, 4] + 1) % cfg.vocab_size
    logits2, _, _ = model.forward(p64, cfg, ids2)
    np.testing.assert_array_equal(logits[:, :4], logits2[:, :4])
    assert not np.allclose(logits[:, 4:], logits2[:, 4:])
    l32, _, _ = model.forward({k: v.astype(np.float32) for k, v in p64.items()}, cfg, ids)
    assert l32.dtype == np.float32
    np.testing.assert_allclose(l32, logits, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------------
# against transformers' Qwen3_5ForCausalLM: loss and the gradient of every parameter


def _torch_transformers():
    """torch and transformers; a failure (not a skip) without them: the reference must be compared with HF."""
    try:
        import torch
        import transformers
    except ImportError as e:
        pytest.fail(f"{e}: the parity tests need the `test` extra (pip install -e '.[test]')")
    return torch, transformers


# rms_norm_eps 1e-4, not Qwen3.5's 1e-6: transformers computes its norms and the delta rule in float32 even in a
# float64 model, and a head whose output is near zero has that rounding amplified by its gated norm to ~1e-4 of
# a gradient at eps 1e-6 (with transformers' float32 casts patched to float64 the gap is ~3e-6); at 1e-4 its
# float32 noise stays under 2e-5, so the 1e-4 bound below keeps a margin and a real mismatch (> 1e-2) shows.
QWEN35 = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6,
              linear_value_head_dim=5, linear_conv_kernel_dim=4, rms_norm_eps=1e-3, max_position_embeddings=32)  # fmt: skip
QWEN35_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]


def _our_qwen35_config(prf: float, tied: bool) -> ModelConfig:
    """What `import-hf` will make of the config above: head_dim 16 != 32 / 4, GQA, Hv = 2·Hk, Dk != Dv."""
    q = QWEN35
    return ModelConfig(vocab_size=q["vocab_size"], d_model=q["hidden_size"], n_layers=len(QWEN35_LAYERS),
                       n_heads=q["num_attention_heads"], n_kv_heads=q["num_key_value_heads"], head_dim=q["head_dim"],
                       ffn_hidden=q["intermediate_size"], max_seq_len=q["max_position_embeddings"],
                       rope_theta=10000.0, rms_eps=q["rms_norm_eps"], tie_embeddings=tied, norm_style="offset",
                       qk_norm="pre_rope", layer_types=tuple(QWEN35_LAYERS), attn_output_gate=True,
                       rotary_dim=int(q["head_dim"] * prf), linear_k_heads=q["linear_num_key_heads"],
                       linear_v_heads=q["linear_num_value_heads"], linear_k_dim=q["linear_key_head_dim"],
                       linear_v_dim=q["linear_value_head_dim"], linear_conv_kernel=q["linear_conv_kernel_dim"])  # fmt: skip


def _hf_qwen35(torch, transformers, prf: float, tied: bool, dtype, seed: int = 0):
    config = transformers.Qwen3_5TextConfig(
        **QWEN35, num_hidden_layers=len(QWEN35_LAYERS), layer_types=QWEN35_LAYERS, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": prf},
    )  # fmt: skip
    torch.manual_seed(seed)
    hf = transformers.Qwen3_5ForCausalLM(config).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    # random values everywhere (the zero-centred norms off 0, the gated norm off 1, A_log, dt_bias, the conv),
    # at scales that keep every path active, so a misplaced weight shows up in the loss or a gradient
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if name.endswith("linear_attn.norm.weight"):
                v = 1.0 + 0.3 * r
            elif p.ndim == 1:  # (1+w) norms, A_log, dt_bias
                v = 0.3 * r
            elif name.endswith("conv1d.weight"):
                v = 0.5 * r
            else:
                v = r / math.sqrt(p.shape[1])
            p.copy_(v.to(dtype))
    return hf


@pytest.mark.parametrize("prf, tied, dtype", [(0.25, True, "float64"), (0.25, False, "float64"),
                                              (0.5, True, "float64"), (0.5, False, "float32")])  # fmt: skip
def test_hybrid_matches_transformers_loss_and_gradients(prf, tied, dtype):
    torch, transformers = _torch_transformers()
    hf = _hf_qwen35(torch, transformers, prf, tied, getattr(torch, dtype))
    cfg = _our_qwen35_config(prf, tied)
    sd = hf.state_dict()
    params = {}
    for s in param_table(cfg):  # identical names; the conv drops PyTorch's in-channel axis
        t = sd[s.name].double().numpy()
        params[s.name] = t[:, 0, :] if s.name.endswith("conv1d.weight") else t
        assert params[s.name].shape == s.shape, s.name
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, size=(3, 11))
    lengths = np.array([11, 7, 2])  # right padding; torch gets the mask and -100 labels there
    real = np.arange(11)[None, :] < lengths[:, None]
    out = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(real.astype(np.int64)),
             labels=torch.tensor(np.where(real, ids, -100)))  # fmt: skip
    out.loss.backward()
    logits, loss, cache = model.forward(params, cfg, ids, lengths)
    grads = model.backward(params, cfg, cache)
    assert abs(loss - out.loss.item()) <= 1e-4 * abs(loss), (loss, out.loss.item())
    hf_logits = out.logits.detach().double().numpy()
    assert np.max(np.abs(logits - hf_logits)[real]) <= 1e-4 * np.max(np.abs(hf_logits[real]))
    hf_params = dict(hf.named_parameters())
    assert set(grads) == set(hf_params)  # a tied lm_head is the embedding in both
    for name, g in grads.items():
        want = hf_params[name].grad.double().numpy()
        want = want[:, 0, :] if name.endswith("conv1d.weight") else want
        rel = np.max(np.abs(g - want)) / np.max(np.abs(want))
        assert rel <= 1e-4, f"{name}: gradient off by {rel:.2e} of its max"
