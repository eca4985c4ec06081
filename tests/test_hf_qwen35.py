"""Qwen3.5-family Hugging Face interop (ddl_wgpu.files.hf.convert, ddl_wgpu.files.hf.qwen35) against tiny random models that
transformers itself builds and saves: import + eval on both backends gives transformers' loss, export loads back
in transformers with the same loss, a bf16 sharded `Qwen3_5ForConditionalGeneration` folder with a vision tower
and an `mtp.*` draft round-trips byte for byte, the refusals name their key, a tampered record of kept
tensors is refused, and every export with a draft (imported causal and conditional-generation folders, after
compress and heal) writes the mtp.* shapes vLLM and SGLang build from its config.json (`served_draft`).

The models: GQA (4 heads over 2), head_dim 16 != hidden 32 / 4 heads, partial_rotary_factor 0.25 (4 of 16 dims),
Gated DeltaNet and gated full-attention layers mixed, tied and untied, every weight random (the zero-centred
norms around 0, the gated norm around 1, A_log and dt_bias spread). They need torch and transformers (the `test`
extra) and fail, not skip, without them, as tests/test_hf.py's parity tests."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from ddl_ref.check import random_params
from ddl_ref.config import MtpConfig, apply_arch, preset
from ddl_wgpu.backend import make_net
from ddl_wgpu.data import eval_windows
from ddl_wgpu.files.container import f32_to_bf16, open_checkpoint
from ddl_wgpu.files.hf.convert import HfError, export_hf, export_hf_from_file, import_hf, import_hf_to_file
from ddl_wgpu.files.hf.folder import Weights
from ddl_wgpu.files.hf.served_draft import check_folder
from ddl_wgpu.files.modelfile import Model, load_model, save_model
from ddl_wgpu.jobs.compress import compress_file, drop_layers, ffn_keep
from ddl_wgpu.jobs.train import evaluate

V, B, T = 97, 2, 12
TEXT = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, max_position_embeddings=64,
            rms_norm_eps=1e-6, layer_types=["linear_attention", "full_attention", "linear_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})  # fmt: skip
VISION = dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4, out_hidden_size=32,
              num_position_embeddings=16, spatial_merge_size=2, temporal_patch_size=2)  # fmt: skip
IDS = np.random.default_rng(5).integers(0, V, (B, T))


def _torch():
    """torch and transformers; a failure (not a skip) without them: `make test` must compare with HF."""
    try:
        import torch
        import transformers
    except ImportError as e:
        pytest.fail(f"{e}: the Qwen3.5 interop tests need the `test` extra (pip install -e '.[test]')")
    return torch, transformers


def _randomise(torch, model, seed):
    """Every weight random and off its init, so a weight read wrongly, or a norm applied the wrong way, shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("linear_attn.norm.weight"):  # the gated norm is w·x̂
                v = 1.0 + 0.2 * r
            elif "visual" not in name and name.endswith("norm.weight"):  # the (1 + w) norms, w around 0
                v = 0.2 * r
            elif name.endswith("A_log"):
                v = torch.log(torch.rand(p.shape, generator=g) * 8 + 0.5)
            elif name.endswith("dt_bias"):
                v = 0.5 * r
            else:
                v = r * (0.02 if "embed" in name or "lm_head" in name else 0.5 / math.sqrt(32))
            p.copy_(v.to(p.dtype))


def causal_lm(tied: bool, seed: int = 0, **text):
    torch, transformers = _torch()
    cfg = transformers.Qwen3_5TextConfig(**{**TEXT, **text}, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    _randomise(torch, model, seed)
    return model


def hf_loss(model, ids=IDS) -> float:
    torch, _ = _torch()
    with torch.no_grad():
        t = torch.as_tensor(ids)
        return float(model(input_ids=t, labels=t).loss.double())


def our_loss(model_or_path, backend: str, tmp_path, ids=IDS) -> float:
    """eval's loss (the library path of `ddl-wgpu eval`) over `ids` as consecutive windows of T tokens."""
    m = load_model(model_or_path) if not hasattr(model_or_path, "cfg") else model_or_path
    np.save(tmp_path / "ids.npy", np.asarray(ids, np.int64).reshape(-1))
    ds = eval_windows(
        tmp_path / "ids.npy", seq_len=ids.shape[1], batch_size=ids.shape[0], vocab_size=m.cfg.vocab_size
    )
    return evaluate(make_net(m.cfg, m.params, backend, None), ds)["metrics"]["loss"]


def assert_close(got: float, want: float, rtol: float = 1e-4):
    assert abs(got - want) <= rtol * abs(want), f"{got} vs {want} (rel {abs(got - want) / abs(want):.2e})"


# ---------------------------------------------------------------------------------------------- CausalLM


@pytest.mark.parametrize("tied", [True, False])
def test_import_causal_lm_gives_transformers_loss(tmp_path, tied):
    hf = causal_lm(tied, seed=1 + tied)
    hf.save_pretrained(tmp_path / "hf")
    m = import_hf(tmp_path / "hf")
    c = m.cfg
    assert (c.n_heads, c.n_kv_heads, c.head_dim, c.rotary_dim, c.tie_embeddings) == (4, 2, 16, 4, tied)
    assert c.layer_types == tuple(TEXT["layer_types"]) and c.norm_style == "offset" and c.attn_output_gate
    assert (c.linear_k_heads, c.linear_v_heads, c.linear_k_dim, c.linear_v_dim) == (2, 4, 8, 6)
    assert c.rope_theta == 1e6 and c.qk_norm == "pre_rope" and c.mtp is None
    assert m.metadata["hf.architecture"] == "Qwen3_5ForCausalLM" and m.variant == "baseline"
    assert set(m.dtypes.values()) == {"f32"} and m.metadata["hf.source"]["layout"] == "causal_lm"
    want = hf_loss(hf)
    for backend in ("ref", "wgpu"):
        assert_close(our_loss(m, backend, tmp_path), want)


def test_cli_import_eval_export(tmp_path, cli, ok):
    """The commands a user runs: import-hf, eval (the numpy backend), export-hf; transformers loads the export."""
    _, transformers = _torch()
    hf = causal_lm(False, seed=3, layer_types=["full_attention", "linear_attention", "linear_attention"])
    hf.save_pretrained(tmp_path / "hf")
    r = ok(cli("import-hf", tmp_path / "hf", tmp_path / "m.ddlw"))
    assert "Qwen3_5ForCausalLM" in r.stdout and "layout: causal_lm" in r.stdout
    np.save(tmp_path / "ids.npy", IDS.reshape(-1))
    r = ok(cli("eval", tmp_path / "m.ddlw", "--data", tmp_path / "ids.npy", "--seq-len", T, "--batch", B,
               "--backend", "ref", "--json"))  # fmt: skip
    assert_close(json.loads(r.stdout)["loss"], hf_loss(hf))
    ok(cli("export-hf", tmp_path / "m.ddlw", tmp_path / "out"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    assert_close(hf_loss(back), hf_loss(hf), 1e-6)


@pytest.mark.parametrize("tied, dtype", [(True, "float32"), (False, "float16")])
def test_export_loads_in_transformers_with_the_same_loss(tmp_path, tied, dtype):
    torch, transformers = _torch()
    hf = causal_lm(tied, seed=4).to(getattr(torch, dtype))
    hf.save_pretrained(tmp_path / "hf")
    s = import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    assert s["dtypes"] == [{"float32": "F32", "float16": "F16"}[dtype]]
    s = export_hf_from_file(tmp_path / "m.ddlw", tmp_path / "out")
    assert s["architecture"] == "Qwen3_5ForCausalLM" and s["layout"] == "causal_lm"
    before = Weights(tmp_path / "hf")
    after = Weights(tmp_path / "out")
    assert sorted(after.names()) == sorted(
        before.names()
    )  # conv1d back as (channels, 1, k), no lm_head when tied
    for n in before.names():
        assert after.shape(n) == before.shape(n) and after.dtype(n) == before.dtype(n), n
        assert np.array_equal(after.read_raw(n), before.read_raw(n)), n
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_close(hf_loss(back), hf_loss(hf), 1e-6)


def test_compressed_export_says_what_changed(tmp_path):
    """A config that gives the layers by full_attention_interval: after ffn_keep and a dropped block that breaks
    the interval's pattern, the export lists layer_types, drops the interval, gives the new SwiGLU width, and
    transformers computes the compressed model's loss."""
    _, transformers = _torch()
    hf = causal_lm(False, seed=6, num_hidden_layers=4, layer_types=None, full_attention_interval=2)
    hf.save_pretrained(tmp_path / "hf")
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    del conf["layer_types"]  # as older configs say it
    conf["full_attention_interval"] = 2
    (tmp_path / "hf" / "config.json").write_text(json.dumps(conf))
    m = import_hf(tmp_path / "hf")
    assert m.cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert_close(our_loss(m, "ref", tmp_path), hf_loss(hf))
    export_hf(m, tmp_path / "same")  # unchanged: the config is the folder's, interval and all
    assert json.loads((tmp_path / "same" / "config.json").read_text()) == conf
    c = drop_layers(ffn_keep(m, 0.5), [1])
    export_hf(c, tmp_path / "out")
    out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "full_attention_interval" not in out and out["intermediate_size"] == 24
    assert out["layer_types"] == ["linear_attention", "linear_attention", "full_attention"]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert_close(hf_loss(back), our_loss(c, "ref", tmp_path))


def test_a_hybrid_made_here_exports_as_causal_lm(tmp_path):
    """A hybrid built here (the tiny preset as `apply_arch(..., "qwen3_5")` builds it, with a draft) has no source
    folder: export writes a Qwen3_5ForCausalLM config of its own, which transformers and import read back."""
    _, transformers = _torch()
    cfg = apply_arch(preset("tiny", n_layers=4, mtp=MtpConfig()), "qwen3_5")
    save_model(
        tmp_path / "h.ddlw",
        Model(cfg=cfg, params={n: a.astype(np.float32) for n, a in random_params(cfg, seed=2).items()}),
    )
    m = load_model(tmp_path / "h.ddlw")
    assert m.cfg.has_linear and "hf.source" not in m.metadata
    export_hf_from_file(tmp_path / "h.ddlw", tmp_path / "out")
    assert check_folder(tmp_path / "out").ok  # a hybrid made here (pre-norm draft: shapes only are checked)
    hfc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hfc["architectures"] == ["Qwen3_5ForCausalLM"] and hfc["layer_types"] == list(m.cfg.layer_types)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = np.random.default_rng(1).integers(0, 256, (B, T))
    assert_close(our_loss(m, "ref", tmp_path, ids), hf_loss(back, ids))
    assert hfc["mtp_num_hidden_layers"] == 1 and hfc["ddl_mtp"] == cfg.mtp.to_dict()  # pre-norm: not vLLM's
    again = import_hf(tmp_path / "out")
    assert again.cfg == m.cfg and all(np.array_equal(again.params[n], a) for n, a in m.params.items())


# ------------------------------------------------------------------------------ ConditionalGeneration


def _draft_tensors(torch, transformers, text_cfg, seed):
    """An `mtp.*` draft shaped as vLLM's Qwen3.5 MTP loader reads it: fc (C, 2C), the three norms and one gated
    full-attention decoder layer (transformers' own layer class gives its names and shapes)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    full = text_cfg.layer_types.index("full_attention")
    layer = Qwen3_5DecoderLayer(text_cfg, full)
    _randomise(torch, layer, seed)
    C = text_cfg.hidden_size
    g = torch.Generator().manual_seed(seed + 1)
    out = {f"mtp.layers.0.{n}": p.detach().clone() for n, p in layer.state_dict().items()}
    out["mtp.fc.weight"] = torch.randn(C, 2 * C, generator=g) * 0.1
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = torch.randn(C, generator=g) * 0.2
    return {n: t.to(torch.bfloat16).contiguous() for n, t in out.items()}


def conditional_generation(folder, seed=7):
    """A bf16 Qwen3_5ForConditionalGeneration folder saved by transformers in several shards, with a vision
    tower, plus an mtp.* draft in a shard of its own (declared by text_config.mtp_num_hidden_layers)."""
    torch, transformers = _torch()
    from safetensors.torch import save_file

    cfg = transformers.Qwen3_5Config(text_config=dict(TEXT, tie_word_embeddings=False), vision_config=VISION)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    _randomise(torch, model, seed)
    model = model.to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="40KB")
    draft = _draft_tensors(torch, transformers, model.config.text_config, seed)
    save_file(draft, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"].update(dict.fromkeys(draft, "mtp.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    conf = json.loads((folder / "config.json").read_text())
    conf["text_config"]["mtp_num_hidden_layers"] = 1
    conf["text_config"]["mtp_use_dedicated_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(conf, indent=2))
    (folder / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    return model


def _raw_tensors(folder) -> dict:
    w = Weights(folder)
    return {n: (w.dtype(n), w.shape(n), w.read_raw(n)) for n in w.names()}


def test_conditional_generation_round_trip(tmp_path):
    _, transformers = _torch()
    hf = conditional_generation(tmp_path / "hf")
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 2
    assert check_folder(tmp_path / "hf").ok  # the draft as Qwen ships it: what vLLM and SGLang build
    s = import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    assert s["layout"] == "conditional_generation" and s["dtypes"] == ["BF16"] and s["kept_tensors"] > 10
    assert "tokenizer_config.json" in s["files"] and "generation_config.json" in s["files"]
    m = load_model(tmp_path / "m.ddlw", extra=True)
    assert m.cfg.mtp == MtpConfig(trunk_hidden="post_norm", chain_hidden="post_norm")
    assert set(m.dtypes.values()) == {"bf16"}  # stored as the folder's dtype: the .ddlw is no bigger
    with open_checkpoint(tmp_path / "m.ddlw") as ck:
        assert ck.info("model.layers.0.linear_attn.conv1d.weight").dtype == "bf16"
    # the trunk computes transformers' loss (the draft is not part of it)
    assert_close(our_loss(m, "ref", tmp_path), hf_loss(hf), 1e-4)
    export_hf_from_file(tmp_path / "m.ddlw", tmp_path / "out")
    out = tmp_path / "out"
    assert check_folder(out).ok and check_folder(out).tensors == 15
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert (out / "generation_config.json").read_bytes() == (
        tmp_path / "hf" / "generation_config.json"
    ).read_bytes()
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (tmp_path / "hf" / "config.json").read_text()
    )
    before, after = _raw_tensors(tmp_path / "hf"), _raw_tensors(out)
    assert sorted(after) == sorted(before)
    assert any(n.startswith("model.visual.") for n in before) and any(
        n.startswith("mtp.layers.0.") for n in before
    )
    for n, (dt, shape, raw) in before.items():  # vision tower, trunk, draft: the same bytes, dtype and shape
        assert after[n][0] == dt and after[n][1] == shape and np.array_equal(after[n][2], raw), n
    back = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(out).eval()  # drops mtp.*
    assert_close(hf_loss(back), hf_loss(hf), 1e-6)


def test_conditional_generation_changes_are_written_back(tmp_path):
    """A compressed and edited model: the config says so, the changed tensor is rounded to nearest even, the
    vision tower and the draft are what they were, and transformers computes the compressed model's loss."""
    torch, transformers = _torch()
    conditional_generation(tmp_path / "hf", seed=8)
    import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    compress_file(
        tmp_path / "m.ddlw", tmp_path / "d.ddlw", drop=[0]
    )  # the command's path: dtypes, kept tensors
    m = load_model(tmp_path / "d.ddlw", extra=True)
    assert set(m.dtypes.values()) == {"bf16"} and len(m.extra) > 10
    m.params["model.norm.weight"] = m.params["model.norm.weight"] + np.float32(1 / 3)
    save_model(tmp_path / "c.ddlw", m, dtype=m.dtypes)
    export_hf_from_file(tmp_path / "c.ddlw", tmp_path / "out")
    assert check_folder(tmp_path / "out").ok  # compress --drop-layers: the draft as it was
    text = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert text["num_hidden_layers"] == 2 and text["layer_types"] == ["full_attention", "linear_attention"]
    before, after = _raw_tensors(tmp_path / "hf"), _raw_tensors(tmp_path / "out")
    want = f32_to_bf16(load_model(tmp_path / "c.ddlw").params["model.norm.weight"]).view(np.uint8)
    assert np.array_equal(after["model.language_model.norm.weight"][2], want)
    # old block 1 is new block 0, byte for byte
    assert np.array_equal(after["model.language_model.layers.0.self_attn.q_proj.weight"][2],
                          before["model.language_model.layers.1.self_attn.q_proj.weight"][2])  # fmt: skip
    for n, v in before.items():
        if n.startswith(("model.visual.", "mtp.")):
            assert after[n][:2] == v[:2] and np.array_equal(after[n][2], v[2]), n
    # computed in f32 (transformers would compute a bf16 folder in bf16); the weights are the export's bf16, so
    # the reference is our loss on the exported folder, imported back
    back = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32)
    import_hf_to_file(tmp_path / "out", tmp_path / "back.ddlw")
    assert_close(hf_loss(back.eval()), our_loss(load_model(tmp_path / "back.ddlw"), "ref", tmp_path), 1e-5)


# ------------------------------------------------------------------------------------------- refusals


def _edit_config(folder, text=None, top=None):
    conf = json.loads((folder / "config.json").read_text())
    conf.update(top or {})
    conf["text_config"].update(text or {})
    (folder / "config.json").write_text(json.dumps(conf))


@pytest.fixture(scope="module")
def cond_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cond") / "hf"
    conditional_generation(folder, seed=9)
    return folder


@pytest.mark.parametrize(
    "text, top, pattern",
    [
        ({"num_experts": 8}, None, r"text_config\): num_experts 8: a mixture-of-experts trunk"),
        ({"moe_intermediate_size": 16}, None, r"moe_intermediate_size 16: a mixture-of-experts"),
        (None, {"architectures": ["Qwen3_5MoeForConditionalGeneration"]}, r"architectures 'Qwen3_5MoeFor.*Qwen3.5-MoE"),
        ({"model_type": "qwen3_5_moe_text"}, None, r"text_config.model_type 'qwen3_5_moe_text'"),
        ({"mtp_num_hidden_layers": 2}, None, r"carries 2 MTP draft layers.*mtp_num_hidden_layers"),
        ({"mtp_use_dedicated_embeddings": True}, None, r"mtp_use_dedicated_embeddings true is not supported"),
        ({"attention_bias": True}, None, "attention_bias true"),
        ({"attn_output_gate": False}, None, "attn_output_gate false"),
        ({"hidden_act": "gelu"}, None, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, None, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.1}}, None, "gives 1 rotary dims"),
        ({"layer_types": ["linear_attention", "sliding_attention", "full_attention"]}, None, "'sliding_attention'"),
    ],
)  # fmt: skip
def test_refusals_name_the_key(tmp_path, cond_folder, text, top, pattern):
    import shutil

    folder = tmp_path / "hf"
    shutil.copytree(cond_folder, folder)
    _edit_config(folder, text, top)
    with pytest.raises(HfError, match=pattern) as e:
        import_hf(folder)
    assert "\n" not in str(e.value)


def test_refuses_several_draft_layers_by_their_tensors(tmp_path, cond_folder):
    import shutil

    from safetensors.numpy import save_file

    shutil.copytree(cond_folder, tmp_path / "hf")
    save_file(
        {"mtp.layers.1.input_layernorm.weight": np.zeros(32, np.float32)},
        str(tmp_path / "hf" / "x.safetensors"),
    )
    idx = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    idx["weight_map"]["mtp.layers.1.input_layernorm.weight"] = "x.safetensors"
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(HfError, match=r"carries 2 MTP draft layers.*mtp_num_hidden_layers"):
        import_hf(tmp_path / "hf")


def test_cli_refusal_is_one_line(tmp_path, cond_folder, cli, user_error):
    import shutil

    shutil.copytree(cond_folder, tmp_path / "hf")
    _edit_config(tmp_path / "hf", {"num_experts": 4})
    user_error(cli("import-hf", tmp_path / "hf", tmp_path / "m.ddlw"), "num_experts 4")
    assert not (tmp_path / "m.ddlw").exists()


def test_a_declared_draft_that_transformers_did_not_save_is_no_draft(tmp_path):
    hf = causal_lm(True, seed=5, mtp_num_hidden_layers=1)  # transformers saves no mtp.* tensors
    hf.save_pretrained(tmp_path / "hf")
    s = import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    assert s["mtp"] is None and "holds no mtp.* tensors" in s["note"]
    export_hf_from_file(tmp_path / "m.ddlw", tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["mtp_num_hidden_layers"] == 1


# ------------------------------------------------------------------------------- hostile kept tensors


def test_kept_tensors_are_checked_before_export(tmp_path, cond_folder):
    """The record of kept tensors is read as untrusted: a shape that disagrees with the bytes, a stray tensor, a
    kept config.json that is not this family's (or not its layout's) and a flipped byte are each refused in one
    line before anything is written."""
    from ddl_wgpu.files.container import CheckpointError

    import_hf_to_file(cond_folder, tmp_path / "m.ddlw")
    m = load_model(tmp_path / "m.ddlw", extra=True)
    name = next(n for n in m.metadata["hf.source"]["keep"] if n.endswith("patch_embed.proj.weight"))
    bad = dataclasses.replace(m, metadata=json.loads(json.dumps(m.metadata)))
    bad.metadata["hf.source"]["keep"][name]["shape"][0] += 1
    save_model(tmp_path / "bad.ddlw", bad, dtype=m.dtypes)
    with pytest.raises(HfError, match=rf"tensor hf.keep.{name} must be raw u8 bytes \(\d+ bytes\)"):
        export_hf_from_file(tmp_path / "bad.ddlw", tmp_path / "out")
    stray = dataclasses.replace(m, extra={**m.extra, "hf.keep.model.visual.extra": np.zeros(4, np.uint8)})
    save_model(tmp_path / "stray.ddlw", stray, dtype=m.dtypes)
    with pytest.raises(HfError, match=r"hf.keep.model.visual.extra.*not in the folder's hf.source record"):
        export_hf_from_file(tmp_path / "stray.ddlw", tmp_path / "out")
    for conf, pattern in ((b'{"model_type": "llama"}', "model_type 'llama' is not a Qwen3.5 model type"),
                          (b"[" * 100, "nests deeper"),
                          (json.dumps({**json.loads(m.extra["hf.file.config.json"].tobytes())["text_config"],
                                       "model_type": "qwen3_5_text"}).encode(), "causal_lm config, its record says")):  # fmt: skip
        edited = dataclasses.replace(
            m, extra={**m.extra, "hf.file.config.json": np.frombuffer(conf, np.uint8)}
        )
        save_model(tmp_path / "conf.ddlw", edited, dtype=m.dtypes)
        with pytest.raises(HfError, match=pattern):
            export_hf_from_file(tmp_path / "conf.ddlw", tmp_path / "out")
    with open_checkpoint(tmp_path / "m.ddlw") as ck:
        info = ck.info("hf.keep." + name)
        start = ck._file_of[info.name].data_start
    blob = bytearray((tmp_path / "m.ddlw").read_bytes())
    blob[start + info.offset] ^= 1
    (tmp_path / "flip.ddlw").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="hash mismatch"):
        export_hf_from_file(tmp_path / "flip.ddlw", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_import_compress_heal_export(tmp_path):
    """Issue 24's path on a Qwen3.5 conditional-generation folder with an `mtp.*` draft: import, compress (a
    Gated DeltaNet block dropped), heal the draft on the compressed trunk, export. transformers loads the exported
    trunk with the loss we compute on it; the draft comes back under the names, shapes and dtype it came with,
    holding the healed values (rounded to bf16); the vision tower is the folder's, byte for byte."""
    from ddl_wgpu.jobs.heal import HealConfig, heal

    torch, transformers = _torch()
    conditional_generation(tmp_path / "hf", seed=11)
    import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    compress_file(tmp_path / "m.ddlw", tmp_path / "c.ddlw", drop=[2])  # the last linear_attention block
    tokens = np.random.default_rng(3).integers(0, V, 2400).astype(np.uint16)
    np.save(tmp_path / "tokens.npy", tokens)
    run = HealConfig(chain=2, refresh=0, tokens=2400, window=24, epochs=1.0, lr=1e-3, batch=4, eval_every=10,
                     patience=0)  # fmt: skip
    report = heal(tmp_path / "c.ddlw", str(tmp_path / "tokens.npy"), tmp_path / "h.ddlw", run, backend="ref")
    assert report["steps"] > 0 and report["heldout_kl_best"] < report["heldout_kl_start"]
    export_hf_from_file(tmp_path / "h.ddlw", tmp_path / "out")
    assert check_folder(tmp_path / "out").ok  # after heal
    before, after = _raw_tensors(tmp_path / "hf"), _raw_tensors(tmp_path / "out")
    draft = sorted(n for n in before if n.startswith("mtp."))
    assert sorted(n for n in after if n.startswith("mtp.")) == draft
    healed = load_model(tmp_path / "h.ddlw")
    changed = 0
    for n in draft:
        assert after[n][:2] == before[n][:2], n  # dtype and shape as the folder had them
        changed += not np.array_equal(after[n][2], before[n][2])
    assert changed > 0  # the healed block's tensors, not the original draft
    q = "mtp.layers.0.self_attn.q_proj.weight"
    want = f32_to_bf16(healed.params["model.mtp.layers.0.self_attn.q_proj.weight"]).view(np.uint8).reshape(-1)
    assert np.array_equal(after[q][2], want)
    for n, v in before.items():
        if n.startswith("model.visual."):
            assert after[n][:2] == v[:2] and np.array_equal(after[n][2], v[2]), n
    text = json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]
    assert text["num_hidden_layers"] == 2 and text["layer_types"] == ["linear_attention", "full_attention"]
    # computed in f32 (transformers would compute a bf16 folder in bf16); the weights are the export's bf16, so
    # the reference is our loss on the exported folder, imported back
    back = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.float32)
    import_hf_to_file(tmp_path / "out", tmp_path / "back.ddlw")
    assert_close(hf_loss(back.eval()), our_loss(load_model(tmp_path / "back.ddlw"), "ref", tmp_path), 1e-5)


def _with_draft(folder, seed):
    """A folder transformers saved (its classes drop mtp.*) given an mtp.* draft as Qwen ships one, declared by
    mtp_num_hidden_layers (in text_config for the conditional-generation layout)."""
    torch, transformers = _torch()
    from safetensors.torch import save_file

    conf = json.loads((folder / "config.json").read_text())
    text = conf.get("text_config", conf)
    draft = _draft_tensors(torch, transformers, transformers.Qwen3_5TextConfig(**TEXT), seed)
    save_file(draft, str(folder / "mtp.safetensors"), metadata={"format": "pt"})
    if (folder / "model.safetensors").exists():  # one file: a shard of two, beside the draft's
        names = Weights(folder).names()
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        idx = {"metadata": {}, "weight_map": dict.fromkeys(names, "model-00001-of-00002.safetensors")}
    else:
        idx = json.loads((folder / "model.safetensors.index.json").read_text())
    idx["weight_map"].update(dict.fromkeys(draft, "mtp.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    text["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(conf, indent=2))


def test_an_imported_causal_folder_exports_the_draft_vllm_and_sglang_build(tmp_path):
    """A Qwen3_5ForCausalLM folder with an mtp.* draft: the folder, its export, and the exports after compress
    --drop-layers and --ffn-keep each hold the mtp.* shapes vLLM and SGLang build from their config.json; after
    --ffn-keep the draft is narrowed with the trunk (intermediate_size 24) and reads back as it was written."""
    causal_lm(False, seed=13).save_pretrained(tmp_path / "hf")
    _with_draft(tmp_path / "hf", 13)
    assert check_folder(tmp_path / "hf").ok and check_folder(tmp_path / "hf").tensors == 15
    s = import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    assert s["layout"] == "causal_lm" and s["mtp"]["trunk_hidden"] == "post_norm"
    compress_file(tmp_path / "m.ddlw", tmp_path / "d.ddlw", drop=[2])
    compress_file(tmp_path / "m.ddlw", tmp_path / "f.ddlw", keep=0.5)
    for name in ("m", "d", "f"):
        out = tmp_path / f"out_{name}"
        summary = export_hf_from_file(tmp_path / f"{name}.ddlw", out)
        assert check_folder(out).ok, (name, check_folder(out).problems)
        assert (
            summary["mtp"]["served"].startswith("vLLM and SGLang build all 15")
            and "warning" not in summary["mtp"]
        )
    conf = json.loads((tmp_path / "out_f" / "config.json").read_text())
    assert conf["intermediate_size"] == 24 and "ddl_mtp" not in conf
    assert Weights(tmp_path / "out_f").shape("mtp.layers.0.mlp.down_proj.weight") == (32, 24)
    import_hf_to_file(tmp_path / "out_f", tmp_path / "back.ddlw")
    assert load_model(tmp_path / "back.ddlw").cfg == load_model(tmp_path / "f.ddlw").cfg


def test_a_narrowed_conditional_generation_folder_exports_a_servable_draft(tmp_path):
    """compress --ffn-keep on an imported Qwen3.5 (conditional generation) narrows its draft with the trunk, so
    the export's mtp.* are what vLLM and SGLang build at the new intermediate_size; healing from the source at
    the init's width instead (--draft-width init) gives a draft export-hf refuses."""
    from ddl_wgpu.jobs.heal import HealConfig, heal

    conditional_generation(tmp_path / "hf", seed=12)
    import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    rec = compress_file(tmp_path / "m.ddlw", tmp_path / "c.ddlw", keep=0.5)
    c = load_model(tmp_path / "c.ddlw")
    assert c.cfg.ffn_hidden == 24 and c.cfg.mtp.ffn_hidden is None and rec["draft"]["ffn_hidden_after"] == 24
    s = export_hf_from_file(tmp_path / "c.ddlw", tmp_path / "out")
    assert check_folder(tmp_path / "out").ok and "warning" not in s["mtp"]
    assert (
        json.loads((tmp_path / "out" / "config.json").read_text())["text_config"]["intermediate_size"] == 24
    )
    import_hf_to_file(tmp_path / "out", tmp_path / "back.ddlw")
    assert load_model(tmp_path / "back.ddlw").cfg == c.cfg
    np.save(tmp_path / "tokens.npy", np.random.default_rng(4).integers(0, V, 2400).astype(np.uint16))
    run = HealConfig(chain=2, refresh=0, tokens=2400, window=24, epochs=0.2, batch=4, patience=0,
                     draft_width="init")  # fmt: skip
    heal(
        tmp_path / "c.ddlw",
        str(tmp_path / "tokens.npy"),
        tmp_path / "h.ddlw",
        run,
        init_path=tmp_path / "m.ddlw",
    )
    assert load_model(tmp_path / "h.ddlw").cfg.mtp.ffn_hidden == 48
    with pytest.raises(HfError, match=r"keep the first 24 of its 48 channels.*--draft-width model"):
        export_hf_from_file(tmp_path / "h.ddlw", tmp_path / "wide")
    assert not (tmp_path / "wide").exists()
