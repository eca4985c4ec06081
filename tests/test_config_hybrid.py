"""The hybrid (Qwen3.5) fields of ModelConfig and their parameter table: validation, round trip, names."""

import dataclasses

import numpy as np
import pytest

from ddl_ref.config import ConfigError, ModelConfig, MtpConfig, apply_arch, preset, qwen35_layer_types
from ddl_ref.params import init_params, linear_conv_channels, mtp_specs, param_table


def test_qwen35_pattern_every_fourth_layer_is_full_attention():
    assert qwen35_layer_types(8) == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",
    ) * 3 + ("full_attention",)
    # transformers' reading: a trunk shorter than the interval has no full-attention layer; the hybrid built
    # here (apply_arch) makes its last layer the full-attention one
    assert qwen35_layer_types(2) == ("linear_attention", "linear_attention")
    assert apply_arch(preset("tiny", n_layers=2), "qwen3_5").layer_types == (
        "linear_attention",
        "full_attention",
    )


def test_apply_arch_keeps_sizes_and_builds_the_hybrid():
    base = preset("tiny")
    cfg = apply_arch(base, "qwen3_5")
    assert (cfg.d_model, cfg.n_layers, cfg.vocab_size) == (base.d_model, base.n_layers, base.vocab_size)
    assert cfg.norm_style == "offset" and cfg.qk_norm == "pre_rope" and cfg.attn_output_gate
    assert cfg.rope_dim == 4 and cfg.has_linear
    assert apply_arch(base, "transformer") is base
    with pytest.raises(ConfigError, match="unknown architecture"):
        apply_arch(base, "mamba")


@pytest.mark.parametrize(
    "overrides, message",
    [
        # wrong length (tiny has 2 layers)
        ({"layer_types": ("full_attention",)}, "1 entries for n_layers 2"),
        ({"layer_types": ("full_attention", "sliding")}, "layer_types"),
        ({"layer_types": ("linear_attention", "full_attention")}, "positive when a layer is linear"),
        ({"rotary_dim": 3}, "rotary_dim must be even"),
        ({"rotary_dim": 18}, "rotary_dim must be even"),
        ({"linear_k_heads": -1}, ">= 0"),
    ],
)
def test_hybrid_validation_messages(overrides, message):
    with pytest.raises(ConfigError, match=message):
        preset("tiny", **overrides)


def test_value_heads_must_be_a_multiple_of_key_heads():
    cfg = apply_arch(preset("tiny"), "qwen3_5")
    with pytest.raises(ConfigError, match="multiple of linear_k_heads"):
        dataclasses.replace(cfg, linear_k_heads=3)


def test_hybrid_config_round_trips_and_old_dicts_load_unchanged():
    cfg = apply_arch(preset("tiny", mtp=MtpConfig()), "qwen3_5")
    d = cfg.to_dict()
    assert d["layer_types"] == list(cfg.layer_types)  # a list in JSON/msgpack
    assert ModelConfig.from_dict(d) == cfg
    old = preset("tiny").to_dict()
    for key in ("layer_types", "attn_output_gate", "rotary_dim", "linear_k_heads", "linear_v_heads",
                "linear_k_dim", "linear_v_dim", "linear_conv_kernel"):  # fmt: skip
        del old[key]
    assert ModelConfig.from_dict(old) == preset("tiny")
    assert [s.name for s in param_table(preset("tiny"))] == [
        s.name for s in param_table(ModelConfig.from_dict(old))
    ]


def test_hybrid_param_table_follows_the_layer_types():
    cfg = apply_arch(preset("tiny", mtp=MtpConfig()), "qwen3_5")
    shapes = {s.name: s.shape for s in param_table(cfg)}
    C, H, D = cfg.d_model, cfg.n_heads, cfg.head_dim
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"] == (linear_conv_channels(cfg), C)
    assert shapes["model.layers.0.linear_attn.conv1d.weight"] == (linear_conv_channels(cfg), 4)
    assert shapes["model.layers.0.linear_attn.norm.weight"] == (cfg.linear_v_dim,)
    assert "model.layers.0.self_attn.q_proj.weight" not in shapes
    assert shapes["model.layers.1.self_attn.q_proj.weight"] == (2 * H * D, C)  # query and gate per head
    assert "model.layers.1.linear_attn.A_log" not in shapes
    # the draft is a full-attention block on a hybrid trunk too
    assert "model.mtp.layers.0.self_attn.q_proj.weight" in {s.name for s in mtp_specs(cfg)}
    p = init_params(cfg, 0)
    a = p["model.layers.0.linear_attn.A_log"]
    assert (a >= np.log(0.01)).all() and (a <= np.log(16.0)).all() and len(set(a.tolist())) == a.size
    assert (p["model.layers.0.linear_attn.norm.weight"] == 1).all()  # the gated norm is w·x̂: starts at 1
    assert (p["model.layers.0.input_layernorm.weight"] == 0).all()  # zero-centred (1+w) norms start at 0


def test_select_layers_and_param_count_follow_the_layer_types():
    from ddl_ref.config import select_layers
    from ddl_ref.params import num_params
    from ddl_wgpu.files.modelfile import param_count

    cfg = apply_arch(preset("tiny", n_layers=6, mtp=MtpConfig()), "qwen3_5")
    assert cfg.layer_types.count("full_attention") == 1  # the two kinds differ in size
    sub = select_layers(cfg, [3, 0, 0])
    assert sub.n_layers == 3 and sub.layer_types == ("full_attention", "linear_attention", "linear_attention")
    for c in (cfg, sub, select_layers(cfg, [3]), select_layers(cfg, [1]), preset("tiny"), preset("small")):
        assert param_count(c) == num_params(c)
    assert select_layers(preset("tiny"), [1, 0, 1]) == preset("tiny", n_layers=3)


def test_drop_layers_keeps_a_hybrid_blocks_types_and_tensors():
    from ddl_wgpu.files.modelfile import Model
    from ddl_wgpu.jobs.compress import drop_layers

    cfg = apply_arch(preset("tiny", n_layers=4), "qwen3_5")
    model = Model(cfg=cfg, params=init_params(cfg, 0))
    out = drop_layers(model, [1])
    assert out.cfg.layer_types == ("linear_attention", "linear_attention", "full_attention")
    np.testing.assert_array_equal(
        out.params["model.layers.2.self_attn.q_proj.weight"],
        model.params["model.layers.3.self_attn.q_proj.weight"],
    )
    np.testing.assert_array_equal(
        out.params["model.layers.1.linear_attn.A_log"], model.params["model.layers.2.linear_attn.A_log"]
    )
