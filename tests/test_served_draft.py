"""A healed Qwen3.5 draft runs in vLLM and SGLang as it ran here (issue 33), on the numpy backend:

- the shapes vLLM and SGLang build from config.json (`served_draft.served_shapes`) are those of transformers' own
  Qwen3.5 decoder layer, and `check_shapes` names every kind of mismatch (wider, narrower, missing, extra, a
  layer count SGLang does not build);
- the width rule: `compress --ffn-keep` narrows a Qwen3.5-layout model's draft with its trunk by the trunk's
  importance rule (a transformer's stays whole); `heal --draft-width model|init` (default by layout) narrows the
  starting draft or keeps it, and refuses to widen one;
- `export-hf` of a hybrid made here, after `compress --drop-layers`, `--ffn-keep` and `heal`, writes a draft that
  passes the check; a draft healed wider than intermediate_size is refused in one line that names the way out;
- the chain attention default follows the draft's layout in `heal` and `accept` (stacked for Qwen3.5's,
  per-step for the reference tool's), is recorded with its reason, printed by the CLI, and the flag overrides.

The imported causal and conditional-generation folders' exports are checked in tests/test_hf_qwen35.py (which
builds them with transformers); the GPU backend's defaults in tests/test_heal_hybrid.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from ddl_ref.config import ARCH_MTP, MtpConfig, apply_arch
from ddl_ref.params import MTP_LAYER_PREFIX
from ddl_wgpu.files.hf import draft_layout, served_draft
from ddl_wgpu.files.hf.convert import HfError, export_hf_from_file
from ddl_wgpu.files.modelfile import load_model
from ddl_wgpu.jobs import accept, compress, heal, heal_files

FFN = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
TEXT = dict(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], vocab_size=97,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})  # fmt: skip
RUN = heal.HealConfig(chain=2, window=24, tokens=1200, batch=2, eval_every=4, patience=0, lr=3e-3, epochs=0.3,
                      refresh=5)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------
# the shapes the runtimes build


def test_the_served_shapes_are_transformers_qwen35_layer():
    """The rules (served_draft's docstring, from vLLM's and SGLang's qwen3_5_mtp.py) give every shape of
    transformers' Qwen3.5 full-attention decoder layer (the gated q_proj, head_dim 16 != 32 / 4, 2 kv heads),
    plus fc (C, 2C) and the three (C,) norms; both runtimes build the same one layer."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    layer = Qwen3_5DecoderLayer(Qwen3_5TextConfig(**TEXT), 1)
    want = {f"mtp.layers.0.{n}": tuple(p.shape) for n, p in layer.state_dict().items()}
    want.update({"mtp.fc.weight": (32, 64), "mtp.pre_fc_norm_embedding.weight": (32,),
                 "mtp.pre_fc_norm_hidden.weight": (32,), "mtp.norm.weight": (32,)})  # fmt: skip
    got = served_draft.served_shapes(TEXT)
    assert got["vLLM"] == want == got["SGLang"] and len(want) == 15
    assert got["vLLM"]["mtp.layers.0.self_attn.q_proj.weight"] == (2 * 4 * 16, 32)  # query and gate
    # a conditional-generation config keeps them in text_config; head_dim null: hidden // heads
    cond = served_draft.served_shapes({"text_config": {**TEXT, "head_dim": None}})
    assert cond["vLLM"]["mtp.layers.0.self_attn.q_norm.weight"] == (8,)
    assert served_draft.served_shapes({**TEXT, "attn_output_gate": False})["SGLang"][
        "mtp.layers.0.self_attn.q_proj.weight"
    ] == (4 * 16, 32)  # no gate rows


def test_check_shapes_names_each_mismatch():
    want = served_draft.served_shapes(TEXT)["vLLM"]
    assert served_draft.check_shapes(TEXT, want).ok
    assert not served_draft.check_shapes(
        TEXT, {"model.norm.weight": (32,)}
    ).draft  # no draft: nothing to check
    wide = {**want, "mtp.layers.0.mlp.down_proj.weight": (32, 96)}
    c = served_draft.check_shapes(TEXT, wide)
    assert c.truncated and c.problems == [
        "mtp.layers.0.mlp.down_proj.weight is (32, 96), vLLM and SGLang build (32, 48) (intermediate_size 48: "
        "their loaders keep the first 48 of its 96 channels)"
    ]
    narrow = served_draft.check_shapes(TEXT, {**want, "mtp.layers.0.mlp.up_proj.weight": (24, 32)})
    assert not narrow.truncated and narrow.problems == [
        "mtp.layers.0.mlp.up_proj.weight is (24, 32), vLLM and SGLang build (48, 32)"
    ]
    missing = {n: s for n, s in want.items() if n != "mtp.norm.weight"}
    assert served_draft.check_shapes(TEXT, missing).problems == [
        "mtp.norm.weight is missing (vLLM and SGLang build (32,))"
    ]
    extra = {**want, "mtp.layers.1.input_layernorm.weight": (32,)}
    assert served_draft.check_shapes(TEXT, extra).problems == [
        "mtp.layers.1.input_layernorm.weight (32,) is not a tensor vLLM and SGLang build"
    ]
    two = served_draft.check_shapes({**TEXT, "mtp_num_hidden_layers": 2}, want)  # SGLang builds one layer
    assert len(two.problems) == 11  # vLLM builds layer 1 too
    assert all(p.startswith("mtp.layers.1.") and "is missing (vLLM build (" in p for p in two.problems)
    with pytest.raises(HfError, match=r"hidden_size must be a positive integer.*'32'"):
        served_draft.check_shapes({**TEXT, "hidden_size": "32"}, want)


# ---------------------------------------------------------------------------------------------------------
# a hybrid made here: the width rule, every export path, the refusal


def hybrid_cfg(heal_kit, mtp=ARCH_MTP["qwen3_5"]):
    """The heal tests' tiny shape as a Qwen3.5 hybrid (a Gated DeltaNet block, then a gated full-attention
    block; FFN 24) with a draft in Qwen3.5's layout (post-norm hiddens) unless `mtp` says otherwise."""
    return apply_arch(heal_kit.tiny_cfg(mtp=mtp), "qwen3_5")


@pytest.fixture
def hybrid(tmp_path, heal_kit):
    """(model file, text file): a tiny hybrid with a perturbed draft in Qwen3.5's layout."""
    return heal_kit.make_model(tmp_path / "m.ddlw", hybrid_cfg(heal_kit)), heal_kit.make_text(
        tmp_path / "t.txt", 300
    )


def _ffn(params, prefix=MTP_LAYER_PREFIX):
    return {n: params[prefix + n] for n in FFN}


def test_compress_narrows_a_qwen35_draft_with_its_trunk(hybrid, tmp_path, heal_kit):
    """--ffn-keep 0.5 on a hybrid: the draft keeps the 12 of its 24 channels the trunk's rule keeps for it
    (compress.narrow_ffn on the draft alone), and the config says it is the trunk's width; a transformer's
    draft stays whole, its width recorded (the reference heal tool's rule)."""
    model, _ = hybrid
    rec = compress.compress_file(model, tmp_path / "c.ddlw", keep=0.5)
    c, m = load_model(tmp_path / "c.ddlw"), load_model(model)
    assert c.cfg.ffn_hidden == 12 and c.cfg.mtp.ffn_hidden is None
    assert rec["draft"]["ffn_hidden_before"] == 24 and rec["draft"]["ffn_hidden_after"] == 12
    assert "intermediate_size" in rec["draft"]["rule"]
    want = dict(m.params)
    compress.narrow_ffn(want, MTP_LAYER_PREFIX, 12)
    for n, a in _ffn(want).items():
        np.testing.assert_array_equal(c.params[MTP_LAYER_PREFIX + n], a)
    assert not np.array_equal(want[MTP_LAYER_PREFIX + FFN[0]], m.params[MTP_LAYER_PREFIX + FFN[0]][:12])
    t = compress.ffn_keep(load_model(heal_kit.make_model(tmp_path / "t.ddlw")), 0.5)
    assert t.cfg.mtp.ffn_hidden == 24 and "reference heal tool" in t.provenance["compress"]["draft"]["rule"]


def test_heal_draft_width_model_narrows_init_keeps_and_neither_widens(hybrid, tmp_path, heal_kit):
    model, text = hybrid
    compress.compress_file(model, tmp_path / "c.ddlw", keep=0.5)
    c = load_model(tmp_path / "c.ddlw")
    assert heal.resolve(c.cfg, heal.HealConfig())[0].draft_width == "model"  # the hybrid's default
    # "model": the init draft (24 wide) narrowed to the model's 12 by the importance rule
    fitted, init, rec = heal_files.fit_draft(c, model, "model")
    want = {n: a for n, a in load_model(model).params.items() if n.startswith(MTP_LAYER_PREFIX)}
    compress.narrow_ffn(want, MTP_LAYER_PREFIX, 12)
    assert rec == {"rule": "model", "ffn_hidden": 12, "source_ffn_hidden": 24,
                   "kept_importance_fraction": rec["kept_importance_fraction"]}  # fmt: skip
    assert fitted.cfg.mtp.ffn_hidden is None and all(np.array_equal(init[n], want[n]) for n in want)
    # "init": the init draft's width, recorded in the config
    r = heal.heal(tmp_path / "c.ddlw", str(text), tmp_path / "i.ddlw", dataclasses.replace(RUN, draft_width="init"),
                  init_path=model)  # fmt: skip
    assert r["draft_width"] == {"rule": "init", "ffn_hidden": 24, "source_ffn_hidden": 24, "why": "as given"}
    assert load_model(tmp_path / "i.ddlw").cfg.mtp.ffn_hidden == 24
    # a draft narrower than the model's width is not widened
    wide = heal_kit.make_model(tmp_path / "w.ddlw", dataclasses.replace(hybrid_cfg(heal_kit), ffn_hidden=48))
    with pytest.raises(heal.HealError, match=r"init model's draft has 24 SwiGLU channels, fewer than the model's "
                                             r"FFN width 48.*--draft-width init heals it at 24"):  # fmt: skip
        heal.heal(wide, str(text), tmp_path / "x.ddlw", RUN, init_path=model)
    assert not (tmp_path / "x.ddlw").exists()


def test_every_export_path_of_a_hybrid_made_here_passes_the_check(hybrid, tmp_path):
    """export-hf of the hybrid, after compress --drop-layers, after --ffn-keep and after heal (from the trained
    draft, the default draft width): vLLM and SGLang build every written mtp.* tensor at its shape."""
    model, text = hybrid
    compress.compress_file(model, tmp_path / "d.ddlw", drop=[0])
    compress.compress_file(model, tmp_path / "f.ddlw", keep=0.5)
    r = heal.heal(tmp_path / "f.ddlw", str(text), tmp_path / "h.ddlw", RUN, init_path=model)
    assert r["draft_width"]["rule"] == "model" and r["draft_width"]["ffn_hidden"] == 12
    for name in ("m", "d", "f", "h"):
        src = model if name == "m" else tmp_path / f"{name}.ddlw"
        s = export_hf_from_file(src, tmp_path / f"hf_{name}")
        check = served_draft.check_folder(tmp_path / f"hf_{name}")
        assert check.ok and check.tensors == 15, (name, check.problems)
        assert s["mtp"]["served"] == "vLLM and SGLang build all 15 mtp.* tensors at the written shapes"
        assert "warning" not in s["mtp"], s["mtp"]  # post-norm hiddens, the runtimes' width: nothing to warn
        conf = json.loads((tmp_path / f"hf_{name}" / "config.json").read_text())
        assert conf["intermediate_size"] == (12 if name in "fh" else 24) and "ddl_mtp" not in conf


def test_export_refuses_a_draft_wider_than_intermediate_size(hybrid, tmp_path, cli, user_error):
    """A hybrid's draft healed at the init's width (--draft-width init: 24 channels on a 12-wide trunk) would be
    served on its first 12 channels: export-hf refuses it in one line naming the way out, writing nothing;
    --raw still writes it under our names."""
    model, text = hybrid
    compress.compress_file(model, tmp_path / "c.ddlw", keep=0.5)
    heal.heal(tmp_path / "c.ddlw", str(text), tmp_path / "h.ddlw", dataclasses.replace(RUN, draft_width="init"),
              init_path=model)  # fmt: skip
    with pytest.raises(HfError, match=r"mtp.layers.0.mlp.down_proj.weight is \(16, 24\), vLLM and SGLang build "
                                      r"\(16, 12\).*truncated draft.*--draft-width model.*--raw") as e:  # fmt: skip
        export_hf_from_file(tmp_path / "h.ddlw", tmp_path / "out")
    assert "\n" not in str(e.value) and not (tmp_path / "out").exists()
    user_error(
        cli("export-hf", tmp_path / "h.ddlw", tmp_path / "out"), "--draft-width model", "keep the first 12"
    )
    assert not (tmp_path / "out").exists()
    export_hf_from_file(tmp_path / "h.ddlw", tmp_path / "raw", raw=True)
    assert not served_draft.check_folder(tmp_path / "raw").draft  # our names: not a draft they read
    # the way out the refusal names: heal at the model's width (its own wide draft narrowed, no --init needed)
    r = heal.heal(
        tmp_path / "h.ddlw", str(text), tmp_path / "n.ddlw", dataclasses.replace(RUN, draft_width="model")
    )
    assert r["draft_width"]["ffn_hidden"] == 12 and r["draft_width"]["source_ffn_hidden"] == 24
    export_hf_from_file(tmp_path / "n.ddlw", tmp_path / "out")
    assert served_draft.check_folder(tmp_path / "out").ok


# ---------------------------------------------------------------------------------------------------------
# chain attention: the draft's layout decides, the flag overrides


def test_chain_attention_follows_the_draft_layout(heal_kit):
    post = hybrid_cfg(heal_kit)
    assert draft_layout.chain_attention_for(post)[0] == "stacked"
    assert draft_layout.chain_attention_for(heal_kit.tiny_cfg())[0] == "per-step"  # ours: pre-norm
    # the conventions decide, not the trunk: a hybrid with a pre-norm draft chains per-step
    assert draft_layout.chain_attention_for(hybrid_cfg(heal_kit, MtpConfig()))[0] == "per-step"
    half = dataclasses.replace(post, mtp=MtpConfig(trunk_hidden="post_norm"))
    assert draft_layout.chain_attention_for(half)[0] == "per-step"
    assert heal.HealConfig().chain_attention is None and heal.HealConfig().draft_width is None
    cfg, why = heal.resolve(post, heal.HealConfig())
    assert (cfg.chain_attention, cfg.draft_width) == ("stacked", "model") and "vLLM and SGLang" in why[
        "chain_attention"
    ]
    cfg, why = heal.resolve(post, heal.HealConfig(chain_attention="per-step"))
    assert cfg.chain_attention == "per-step" and why["chain_attention"] == "as given"
    assert heal.resolve(heal_kit.tiny_cfg(), heal.HealConfig())[0].draft_width == "init"


def test_heal_and_accept_run_the_layout_chain_by_default(hybrid, tmp_path):
    """On a Qwen3.5-layout draft heal trains, and measures its acceptance, stacked by default, the same run as
    --chain-attention stacked; accept measures stacked too; per-step when asked."""
    model, text = hybrid
    d = heal.heal(model, str(text), tmp_path / "d.ddlw", RUN)
    s = heal.heal(model, str(text), tmp_path / "s.ddlw", dataclasses.replace(RUN, chain_attention="stacked"))
    assert d["chain_attention"] == "stacked" and "Qwen3.5's layout" in d["chain_attention_why"]
    assert (
        d["acceptance_after"]["chain_attention"] == "stacked" and d["config"]["chain_attention"] == "stacked"
    )
    assert d["history"] == s["history"] and s["chain_attention_why"] == "as given"
    a = accept.accept_file(model, str(text), depth=2, window=24)
    assert a["chain_attention"] == "stacked" and "Qwen3.5's layout" in a["chain_attention_why"]
    p = accept.accept_file(model, str(text), depth=2, window=24, chain_attention="per-step")
    assert p["chain_attention"] == "per-step" and p["chain_attention_why"] == "as given"
    assert p["prefix_acceptance"][0] == a["prefix_acceptance"][0]  # step 1 is the same in both


def test_the_cli_prints_the_resolved_chain_and_width_with_the_reason(hybrid, tmp_path, cli, ok):
    model, text = hybrid
    args = ["--data", text, "--window", "24", "--tokens", "1200", "--chain", "2", "--batch", "2", "--epochs",
            "0.3", "--backend", "ref"]  # fmt: skip
    r = ok(cli("heal", model, "--out", tmp_path / "h.ddlw", *args))
    assert "  chain attention: stacked (default: the draft is in Qwen3.5's layout" in r.stdout, r.stdout
    assert (
        "  draft width: model (default: a Qwen3.5-layout model: vLLM and SGLang build its draft at intermediate_size"
        in r.stdout
    )
    assert (
        "heal: the draft's SwiGLU 24 channels wide (the model's; --draft-width model), chain attention stacked"
        in r.stderr
    )
    r = ok(cli("heal", model, "--out", tmp_path / "p.ddlw", *args, "--chain-attention", "per-step",
               "--draft-width", "init"))  # fmt: skip
    assert (
        "  chain attention: per-step (--chain-attention)" in r.stdout
        and "  draft width: init (--draft-width)" in r.stdout
    )
    a = ok(
        cli("accept", model, "--data", text, "--depth", "2", "--window", "24", "--backend", "ref", "--json")
    )
    assert "chain attention: stacked (default: the draft is in Qwen3.5's layout" in a.stderr
    assert json.loads(a.stdout)["chain_attention"] == "stacked"
