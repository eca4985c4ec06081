"""Hugging Face import/export (ddl_wgpu.files.hf.convert): tiny folders written here, no network.

The torch/transformers parity tests need both (the `test` extra installs them) and fail, not skip, without
them."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ddl_ref import mtp as ref_mtp
from ddl_ref.config import ModelConfig, MtpConfig
from ddl_ref.model import forward, hidden_states
from ddl_ref.params import init_params, param_table
from ddl_wgpu.files.container import bf16_to_f32, f32_to_bf16
from ddl_wgpu.files.hf.convert import (
    HfError,
    export_hf,
    export_hf_from_file,
    export_raw,
    import_hf,
    import_hf_to_file,
)
from ddl_wgpu.files.modelfile import Model, load_model, save_model

# head_dim 32 != hidden 64 / heads 4: catches the Qwen3-0.6B pitfall
# (docs/model.md#configuration-ddl_refconfigpy).
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=256, rms_norm_eps=1e-6, rope_theta=1e6,
            max_position_embeddings=256)  # fmt: skip


def hf_config(tied=True, arch="Qwen3ForCausalLM", **kw):
    d = {"architectures": [arch], "model_type": "qwen3" if arch.startswith("Qwen3") else "llama",
         "tie_word_embeddings": tied, "hidden_act": "silu", "attention_bias": False, **TINY}  # fmt: skip
    d.update(kw)
    return d


def our_config(tied=True, qk_norm="pre_rope") -> ModelConfig:
    return ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32,
                       ffn_hidden=128, max_seq_len=256, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=tied,
                       norm_style="standard", qk_norm=qk_norm)  # fmt: skip


def random_params(cfg: ModelConfig, seed=0) -> dict[str, np.ndarray]:
    """Table params with norm weights moved off 1, so a norm applied wrongly or not at all shows up."""
    rng = np.random.default_rng(seed)
    p = init_params(cfg, seed)
    for name in p:
        if name.endswith("norm.weight"):
            p[name] = (1.0 + 0.2 * rng.standard_normal(p[name].shape)).astype(np.float32)
    return p


def write_bf16_safetensors(path, tensors: dict[str, np.ndarray]):
    """By hand: raw bf16 bits behind a JSON header (safetensors.numpy cannot write bf16)."""
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        b = f32_to_bf16(np.asarray(a, np.float32)).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(len(hb).to_bytes(8, "little") + hb + b"".join(blobs))


def write_folder(folder, hfcfg, tensors, dtype="f32", shards=None, tokenizer=b'{"model": "tiny"}'):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hfcfg))
    if tokenizer is not None:
        (folder / "tokenizer.json").write_bytes(tokenizer)
    writer = (
        (lambda p, t: save_file(t, str(p), metadata={"format": "pt"}))
        if dtype == "f32"
        else write_bf16_safetensors
    )
    if not shards:
        writer(folder / "model.safetensors", tensors)
        return folder
    names = list(tensors)
    parts = np.array_split(np.arange(len(names)), shards)
    weight_map = {}
    for k, idx in enumerate(parts):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        writer(folder / fname, {names[i]: tensors[names[i]] for i in idx})
        weight_map.update({names[i]: fname for i in idx})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


IDS = np.array([[1, 7, 42, 255, 3, 99, 0, 12], [5, 5, 200, 17, 64, 128, 33, 2]])


# ---------------------------------------------------------------------------------------------- import


@pytest.mark.parametrize("tied", [True, False])
def test_import_qwen3_f32(tmp_path, tied):
    cfg = our_config(tied)
    params = random_params(cfg)
    write_folder(tmp_path / "m", hf_config(tied), params)
    m = import_hf(tmp_path / "m")
    assert m.cfg == cfg
    assert list(m.params) == [s.name for s in param_table(cfg)]
    for name, a in params.items():
        assert m.params[name].dtype == np.float32
        np.testing.assert_array_equal(m.params[name], a, err_msg=name)
    assert m.tokenizer == b'{"model": "tiny"}'
    assert m.metadata["hf.architecture"] == "Qwen3ForCausalLM"
    assert m.cfg.mtp is None and "hf.mtp_layout" not in m.metadata
    logits, loss, _ = forward(m.params, m.cfg, IDS)
    assert logits.shape == (2, 8, 256) and np.isfinite(loss)
    np.testing.assert_array_equal(logits, forward(params, cfg, IDS)[0])


def test_import_bf16(tmp_path):
    cfg = our_config(False)
    params = random_params(cfg, seed=3)
    write_folder(tmp_path / "m", hf_config(False), params, dtype="bf16")
    m = import_hf(tmp_path / "m")
    assert m.provenance["import_hf"]["dtypes"] == ["BF16"]
    for name, a in params.items():
        want = bf16_to_f32(f32_to_bf16(a))
        np.testing.assert_array_equal(m.params[name], want, err_msg=name)
        assert np.max(np.abs(m.params[name] - a)) <= np.max(np.abs(a)) * 2**-8
    assert np.isfinite(forward(m.params, m.cfg, IDS)[1])


def test_import_f16_mixed_with_f32(tmp_path):
    cfg = our_config(True)
    params = random_params(cfg, seed=4)
    stored = {n: (a.astype(np.float16) if a.ndim == 2 else a) for n, a in params.items()}
    write_folder(tmp_path / "m", hf_config(True), stored)
    m = import_hf(tmp_path / "m")
    for name, a in stored.items():
        np.testing.assert_array_equal(m.params[name], a.astype(np.float32))


def test_tied_folder_with_a_copy_of_the_embedding_as_lm_head_ignores_it(tmp_path):
    """A distinct lm_head is kept apart (tests/test_hostile_inputs.py); a copy of the embedding is the same model."""
    cfg = our_config(True)
    params = random_params(cfg)
    extra = dict(params, **{"lm_head.weight": params["model.embed_tokens.weight"].copy()})
    write_folder(tmp_path / "m", hf_config(True), extra)
    m = import_hf(tmp_path / "m")
    assert "lm_head.weight" not in m.params and m.cfg.tie_embeddings
    np.testing.assert_array_equal(m.params["model.embed_tokens.weight"], params["model.embed_tokens.weight"])


def test_tied_folder_holding_only_lm_head(tmp_path):
    cfg = our_config(True)
    params = random_params(cfg)
    stored = {("lm_head.weight" if n == "model.embed_tokens.weight" else n): a for n, a in params.items()}
    write_folder(tmp_path / "m", hf_config(True), stored)
    m = import_hf(tmp_path / "m")
    np.testing.assert_array_equal(m.params["model.embed_tokens.weight"], params["model.embed_tokens.weight"])


def test_head_dim_default_and_rope_parameters_v5(tmp_path):
    # Llama without head_dim: hidden // heads. v5 configs carry the base in rope_parameters.
    cfg = dataclasses.replace(our_config(False, "none"), head_dim=16, rope_theta=5e5)
    hfc = hf_config(False, "LlamaForCausalLM", rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    del hfc["head_dim"], hfc["rope_theta"]
    write_folder(tmp_path / "m", hfc, random_params(cfg))
    m = import_hf(tmp_path / "m")
    assert m.cfg == cfg
    assert m.cfg.rope_theta == 5e5 and m.cfg.qk_norm == "none" and m.cfg.head_dim == 16


def test_sharded_folder(tmp_path):
    cfg = our_config(False)
    params = random_params(cfg, seed=7)
    write_folder(tmp_path / "m", hf_config(False), params, shards=3)
    m = import_hf(tmp_path / "m")
    assert m.provenance["import_hf"]["shards"] == 3
    for name, a in params.items():
        np.testing.assert_array_equal(m.params[name], a, err_msg=name)


def test_sharded_bf16_folder(tmp_path):
    cfg = our_config(True)
    params = random_params(cfg, seed=8)
    write_folder(tmp_path / "m", hf_config(True), params, dtype="bf16", shards=2)
    m = import_hf(tmp_path / "m")
    for name, a in params.items():
        np.testing.assert_array_equal(m.params[name], bf16_to_f32(f32_to_bf16(a)), err_msg=name)


# ------------------------------------------------------------------------------------------- MTP draft

QWEN35_NAMES = {"model.mtp.eh_proj.weight": "mtp.fc.weight", "model.mtp.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
                "model.mtp.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "model.mtp.norm.weight": "mtp.norm.weight"}  # fmt: skip


def mtp_config(tied=True, qk_norm="pre_rope", **mtp) -> ModelConfig:
    return dataclasses.replace(our_config(tied, qk_norm), mtp=MtpConfig(**mtp))


def as_qwen35(params: dict) -> dict:
    """Our names -> the Qwen3.5 `mtp.*` names, written by hand (not through the module under test)."""
    out = {}
    for n, a in params.items():
        if n in QWEN35_NAMES:
            n = QWEN35_NAMES[n]
        elif n.startswith("model.mtp.layers."):
            n = "mtp.layers." + n[len("model.mtp.layers.") :]
        out[n] = a
    return out


def as_deepseek(params: dict, L: int) -> dict:
    out = {}
    for n, a in params.items():
        if n.startswith("model.mtp."):
            rest = n[len("model.mtp.") :]
            rest = "shared_head.norm.weight" if rest == "norm.weight" else rest.removeprefix("layers.0.")
            n = f"model.layers.{L}.{rest}"
        out[n] = a
    return out


def assert_same_params(got: dict, want: dict):
    assert list(got) == list(want)
    for name, a in want.items():
        np.testing.assert_array_equal(got[name], a, err_msg=name)


@pytest.mark.parametrize("tied, arch", [(True, "Qwen3ForCausalLM"), (False, "LlamaForCausalLM")])
def test_import_mtp_our_layout(tmp_path, tied, arch):
    cfg = mtp_config(tied, "pre_rope" if arch.startswith("Qwen3") else "none")
    params = random_params(cfg, seed=31)
    write_folder(tmp_path / "m", hf_config(tied, arch), params)
    m = import_hf(tmp_path / "m")
    # model.mtp.* is the CMF/cortiq layout: that runtime feeds pre-norm hiddens (docs/heal.md#the-draft-block)
    assert m.cfg == cfg and m.cfg.mtp == MtpConfig(trunk_hidden="pre_norm", chain_hidden="pre_norm")
    assert_same_params(m.params, params)
    assert m.metadata["hf.mtp_layout"] == "model.mtp."
    assert m.provenance["import_hf"]["mtp"]["conventions"] == "layout default"
    assert m.cfg.norm_style == "standard"
    if arch == "LlamaForCausalLM":
        assert not any("q_norm" in n for n in m.params)


@pytest.mark.parametrize("count_key", [None, "mtp_num_hidden_layers", "num_nextn_predict_layers"])
def test_import_mtp_qwen35_names(tmp_path, count_key):
    cfg = mtp_config(True, trunk_hidden="post_norm", chain_hidden="post_norm")
    params = random_params(cfg, seed=32)
    stored = as_qwen35(params)
    assert "mtp.fc.weight" in stored and "mtp.layers.0.self_attn.q_norm.weight" in stored
    extra = {count_key: 1} if count_key else {}
    write_folder(tmp_path / "m", hf_config(True, **extra), stored, dtype="bf16", shards=2)
    m = import_hf(tmp_path / "m")
    # Qwen3.5/Qwen3-Next names: vLLM/SGLang feed post-norm hiddens (docs/heal.md#the-draft-block)
    assert m.cfg == cfg
    assert m.metadata["hf.mtp_layout"] == "mtp."
    assert_same_params(m.params, {n: bf16_to_f32(f32_to_bf16(a)) for n, a in params.items()})
    # the imported draft runs
    pre, post = hidden_states(m.params, m.cfg, IDS)
    logits = ref_mtp.draft_chain(m.params, m.cfg, IDS, [8, 8], pre, post, 2)
    assert len(logits) == 2 and logits[0].shape == (2, 8, 256) and np.all(np.isfinite(logits[1]))


def test_import_mtp_deepseek_layout(tmp_path):
    cfg = mtp_config(False, trunk_hidden="post_norm", chain_hidden="post_norm")
    params = random_params(cfg, seed=33)
    shared = {"model.layers.2.embed_tokens.weight": params["model.embed_tokens.weight"],
              "model.layers.2.shared_head.head.weight": params["lm_head.weight"]}  # fmt: skip
    stored = {**as_deepseek(params, 2), **shared}
    write_folder(tmp_path / "m", hf_config(False, num_nextn_predict_layers=1), stored)
    m = import_hf(tmp_path / "m")
    assert m.cfg == cfg and m.metadata["hf.mtp_layout"] == "model.layers.{L}."
    assert_same_params(m.params, params)
    assert m.provenance["import_hf"]["mtp"]["ignored"] == sorted(shared)
    # undeclared, model.layers.2.* is not a draft but a surplus block (num_hidden_layers may be wrong)
    write_folder(tmp_path / "u", hf_config(False), stored)
    with pytest.raises(HfError, match=r"unexpected tensor.*model\.layers\.2\."):
        import_hf(tmp_path / "u")


def test_import_mtp_conventions_from_config(tmp_path):
    cfg = mtp_config(True, concat="emb_first", trunk_hidden="pre_norm", chain_hidden="post_norm")
    params = random_params(cfg, seed=34)
    write_folder(tmp_path / "m", hf_config(True, ddl_mtp=cfg.mtp.to_dict()), as_qwen35(params))
    m = import_hf(tmp_path / "m")
    assert m.cfg.mtp == cfg.mtp and m.provenance["import_hf"]["mtp"]["conventions"] == "ddl_mtp"
    write_folder(tmp_path / "b", hf_config(True, ddl_mtp={"trunk_hidden": "middle"}), as_qwen35(params))
    with pytest.raises(HfError, match="bad 'ddl_mtp'.*trunk_hidden"):
        import_hf(tmp_path / "b")


@pytest.mark.parametrize("layout", ["ours", "qwen35"])
def test_error_mtp_more_than_one_layer(tmp_path, layout):
    cfg = mtp_config(True)
    params = random_params(cfg, seed=35)
    second = {
        n.replace("layers.0.", "layers.1."): a
        for n, a in params.items()
        if n.startswith("model.mtp.layers.0.")
    }
    stored = {**params, **second}
    write_folder(tmp_path / "m", hf_config(True), as_qwen35(stored) if layout == "qwen35" else stored)
    with pytest.raises(HfError, match="carries 2 MTP draft layers.*exactly one draft block"):
        import_hf(tmp_path / "m")


def test_error_mtp_declared_count(tmp_path):
    cfg = mtp_config(True)
    stored = as_qwen35(random_params(cfg, seed=36))
    write_folder(tmp_path / "a", hf_config(True, mtp_num_hidden_layers=3), stored)
    with pytest.raises(HfError, match=r"carries 3 MTP draft layers \(config.json declares 3"):
        import_hf(tmp_path / "a")
    write_folder(tmp_path / "b", hf_config(True, mtp_num_hidden_layers=0), stored)
    with pytest.raises(HfError, match="declares 0 MTP draft layers but the folder holds draft tensors"):
        import_hf(tmp_path / "b")
    write_folder(tmp_path / "c", hf_config(True, mtp_num_hidden_layers=1, num_nextn_predict_layers=2), stored)
    with pytest.raises(HfError, match="disagree"):
        import_hf(tmp_path / "c")


def test_error_mtp_missing_pieces(tmp_path):
    cfg = mtp_config(True)
    stored = as_qwen35(random_params(cfg, seed=37))
    del stored["mtp.pre_fc_norm_hidden.weight"], stored["mtp.layers.0.mlp.down_proj.weight"]
    write_folder(tmp_path / "m", hf_config(True), stored)
    with pytest.raises(HfError, match=r"MTP draft \(mtp\. layout\) is missing 2 tensor\(s\): "
                                      r"\['mtp\.pre_fc_norm_hidden\.weight', 'mtp\.layers\.0\.mlp\.down_proj\.weight'\]"):  # fmt: skip
        import_hf(tmp_path / "m")
    # a lone draft tensor: everything else is listed (15 = 3 input + 11 block + 1 norm, minus mtp.norm)
    trunk = random_params(our_config(True))
    write_folder(tmp_path / "n", hf_config(True), {**trunk, "mtp.norm.weight": np.ones(64, np.float32)})
    with pytest.raises(
        HfError, match=r"missing 14 tensor\(s\): \['mtp\.pre_fc_norm_embedding\.weight'.*mtp\.fc"
    ):
        import_hf(tmp_path / "n")
    # declared, with no draft tensors at all
    write_folder(tmp_path / "d", hf_config(True, mtp_num_hidden_layers=1), trunk)
    with pytest.raises(HfError, match=r"missing 15 tensor\(s\)"):
        import_hf(tmp_path / "d")


def test_error_mtp_shape_disagrees_with_trunk(tmp_path):
    cfg = mtp_config(True)
    stored = as_qwen35(random_params(cfg, seed=38))
    bad = dict(stored, **{"mtp.fc.weight": np.zeros((64, 64), np.float32)})
    write_folder(tmp_path / "a", hf_config(True), bad)
    with pytest.raises(
        HfError, match=r"MTP draft tensor mtp\.fc\.weight has shape \(64, 64\); the trunk's geometry"
    ):
        import_hf(tmp_path / "a")
    # Qwen3-Next's gated q_proj is [2·heads·head_dim, H]
    bad = dict(stored, **{"mtp.layers.0.self_attn.q_proj.weight": np.zeros((256, 64), np.float32)})
    write_folder(tmp_path / "b", hf_config(True), bad)
    with pytest.raises(
        HfError, match=r"q_proj\.weight has shape \(256, 64\); the trunk's geometry.*\(128, 64\)"
    ):
        import_hf(tmp_path / "b")


def test_error_mtp_layouts(tmp_path):
    params = random_params(mtp_config(True), seed=39)
    mixed = dict(as_qwen35(params), **{"model.mtp.enorm.weight": np.ones(64, np.float32)})
    write_folder(tmp_path / "a", hf_config(True), mixed)
    with pytest.raises(HfError, match="mixes MTP draft layouts"):
        import_hf(tmp_path / "a")
    trunk = random_params(our_config(True))
    write_folder(
        tmp_path / "b",
        hf_config(True),
        {**trunk, "model.mtp_layers.0.input_proj.weight": np.zeros((64, 128), np.float32)},
    )
    with pytest.raises(HfError, match="MiMo"):
        import_hf(tmp_path / "b")
    # a draft layer with q/k norms on a Llama trunk (no q/k norms) is not a block of that trunk
    llama = mtp_config(False, "none")
    stored = as_qwen35(random_params(llama, seed=40))
    stored["mtp.layers.0.self_attn.q_norm.weight"] = np.ones(32, np.float32)
    write_folder(tmp_path / "c", hf_config(False, "LlamaForCausalLM"), stored)
    with pytest.raises(HfError, match=r"unexpected tensor.*mtp\.layers\.0\.self_attn\.q_norm.*MTP draft"):
        import_hf(tmp_path / "c")


@pytest.mark.parametrize(
    "key, model_type, arch",
    [("model_type", "qwen3_next", "Qwen3NextForCausalLM"), ("architectures", None, "Qwen3NextForCausalLM")],
)
def test_error_qwen3_next_trunk(tmp_path, key, model_type, arch):
    # a mixture-of-experts trunk: refused naming the key (the dense Qwen3.5 family: tests/test_hf_qwen35.py)
    hfc = hf_config(True, model_type=model_type, architectures=[arch], mtp_num_hidden_layers=1)
    write_folder(tmp_path / "m", hfc, as_qwen35(random_params(mtp_config(True))))
    with pytest.raises(HfError, match=rf"config.json: {key} .*Qwen3-Next.* is not supported"):
        import_hf(tmp_path / "m")


@pytest.mark.parametrize(
    "tied, qk_norm, mtp",
    [
        (True, "pre_rope", {}),
        (False, "pre_rope", {"trunk_hidden": "post_norm", "chain_hidden": "post_norm"}),
        (False, "none", {"concat": "hidden_first", "chain_hidden": "post_norm"}),
    ],
)
def test_export_import_round_trip_mtp(tmp_path, tied, qk_norm, mtp):
    cfg = mtp_config(tied, qk_norm, **mtp)
    model = Model(cfg=cfg, params=random_params(cfg, seed=41))
    export_hf(model, tmp_path / "out")
    hfc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hfc["mtp_num_hidden_layers"] == 1 and hfc["ddl_mtp"] == cfg.mtp.to_dict()
    raw = load_file(str(tmp_path / "out" / "model.safetensors"))
    draft = sorted(n for n in raw if "mtp" in n)
    assert draft == sorted(as_qwen35({n: 0 for n in model.params if n.startswith("model.mtp.")}))
    eh = model.params["model.mtp.eh_proj.weight"]
    # mtp.fc is always embedding first (the Qwen3.5 convention): a hidden_first draft's halves are swapped
    want_fc = np.concatenate([eh[:, 64:], eh[:, :64]], axis=1) if cfg.mtp.concat == "hidden_first" else eh
    np.testing.assert_array_equal(raw["mtp.fc.weight"], want_fc)
    back = import_hf(tmp_path / "out")
    assert back.cfg == cfg and back.cfg.mtp == cfg.mtp
    assert_same_params(back.params, model.params)


def test_export_hidden_first_draft_is_exact_as_emb_first(tmp_path):
    # Without ddl_mtp an MTP runtime reads mtp.fc embedding first: the draft must compute the same logits.
    cfg = mtp_config(True, concat="hidden_first")
    model = Model(cfg=cfg, params=random_params(cfg, seed=42))
    export_hf(model, tmp_path / "out")
    hfc = json.loads((tmp_path / "out" / "config.json").read_text())
    hfc["ddl_mtp"] = {"concat": "emb_first"}
    (tmp_path / "out" / "config.json").write_text(json.dumps(hfc))
    back = import_hf(tmp_path / "out")
    assert back.cfg.mtp == MtpConfig(concat="emb_first")
    pre, post = hidden_states(model.params, cfg, IDS)
    want = ref_mtp.draft_chain(model.params, cfg, IDS, [8, 8], pre, post, 2)
    got = ref_mtp.draft_chain(back.params, back.cfg, IDS, [8, 8], pre, post, 2)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


def test_export_raw_round_trip_mtp(tmp_path):
    cfg = mtp_config(True, "post_rope", concat="hidden_first")
    model = Model(cfg=cfg, params=random_params(cfg, seed=43))
    export_raw(model, tmp_path / "raw")
    raw = load_file(str(tmp_path / "raw" / "model.safetensors"))
    assert "model.mtp.eh_proj.weight" in raw and not any(n.startswith("mtp.") for n in raw)
    back = import_hf(tmp_path / "raw")
    assert back.cfg == cfg
    assert_same_params(back.params, model.params)


def test_mtp_file_conveniences(tmp_path):
    cfg = mtp_config(False)
    params = random_params(cfg, seed=44)
    write_folder(tmp_path / "hf", hf_config(False, mtp_num_hidden_layers=1), as_qwen35(params))
    s = import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    assert s["mtp"]["layout"] == "mtp." and s["mtp"]["trunk_hidden"] == "post_norm"
    assert s["num_params"] == sum(a.size for a in params.values())
    m = load_model(tmp_path / "m.ddlw")
    assert m.cfg.mtp == MtpConfig(trunk_hidden="post_norm", chain_hidden="post_norm")
    s2 = export_hf_from_file(tmp_path / "m.ddlw", tmp_path / "out")
    assert (
        s2["mtp"]["names"] == "mtp.*" and "transformers" in s2["mtp"]["note"] and "warning" not in s2["mtp"]
    )
    assert_same_params(import_hf(tmp_path / "out").params, m.params)
    # a pre-norm draft: the summary warns that vLLM/SGLang feed post-norm hiddens
    pre = dataclasses.replace(m, cfg=dataclasses.replace(m.cfg, mtp=MtpConfig()))
    save_model(tmp_path / "p.ddlw", pre)
    assert "post-norm" in export_hf_from_file(tmp_path / "p.ddlw", tmp_path / "out2")["mtp"]["warning"]


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("tied", [True, False])
def test_export_import_round_trip(tmp_path, tied):
    cfg = our_config(tied)
    model = Model(cfg=cfg, params=random_params(cfg, seed=11), tokenizer=b"{}")
    export_hf(model, tmp_path / "out")
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer.json"]
    hfc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hfc["architectures"] == ["Qwen3ForCausalLM"] and hfc["model_type"] == "qwen3"
    assert hfc["head_dim"] == 32 and hfc["hidden_size"] == 64 and hfc["tie_word_embeddings"] is tied
    assert hfc["use_sliding_window"] is False and hfc["sliding_window"] is None
    # read back with the safetensors package itself: the file is standard
    raw = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert ("lm_head.weight" in raw) is (not tied)
    assert all(a.dtype == np.float32 for a in raw.values())
    back = import_hf(tmp_path / "out")
    assert back.cfg == cfg
    assert back.tokenizer == b"{}"
    assert list(back.params) == list(model.params)
    for name, a in model.params.items():
        np.testing.assert_array_equal(back.params[name], a, err_msg=name)


def test_export_llama_for_qk_norm_none(tmp_path):
    cfg = our_config(False, qk_norm="none")
    model = Model(cfg=cfg, params=random_params(cfg, seed=5))
    export_hf(model, tmp_path / "out")
    hfc = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hfc["architectures"] == ["LlamaForCausalLM"] and hfc["model_type"] == "llama"
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    raw = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert not any("q_norm" in n or "k_norm" in n for n in raw)
    back = import_hf(tmp_path / "out")
    assert back.cfg == cfg
    for name, a in model.params.items():
        np.testing.assert_array_equal(back.params[name], a, err_msg=name)


def test_export_overwrites_atomically(tmp_path):
    cfg = our_config(True)
    export_hf(Model(cfg=cfg, params=random_params(cfg, seed=1), tokenizer=b"{}"), tmp_path / "out")
    p2 = random_params(cfg, seed=2)
    export_hf(Model(cfg=cfg, params=p2), tmp_path / "out", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial or old folder left
    np.testing.assert_array_equal(
        import_hf(tmp_path / "out").params["model.norm.weight"], p2["model.norm.weight"]
    )


def test_export_raw_round_trip(tmp_path):
    cfg = our_config(True, qk_norm="post_rope")
    model = Model(cfg=cfg, params=random_params(cfg, seed=9))
    export_raw(model, tmp_path / "raw")
    hfc = json.loads((tmp_path / "raw" / "config.json").read_text())
    assert hfc["architectures"] == ["DdlForCausalLM"] and "transformers" in hfc["note"]
    assert hfc["qk_norm"] == "post_rope" and hfc["d_model"] == 64
    back = import_hf(tmp_path / "raw")
    assert back.cfg == cfg
    for name, a in model.params.items():
        np.testing.assert_array_equal(back.params[name], a)


def test_file_conveniences(tmp_path):
    cfg = our_config(False)
    params = random_params(cfg, seed=13)
    write_folder(tmp_path / "hf", hf_config(False), params)
    s = import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    assert s["architecture"] == "Qwen3ForCausalLM" and s["tied"] is False and s["mtp"] is None
    assert s["num_params"] == sum(a.size for a in params.values())
    m = load_model(tmp_path / "m.ddlw")
    assert m.tokenizer == b'{"model": "tiny"}' and m.cfg.mtp is None
    s2 = export_hf_from_file(tmp_path / "m.ddlw", tmp_path / "out")
    assert s2["architecture"] == "Qwen3ForCausalLM" and s2["raw"] is False and s2["mtp"] is None
    back = import_hf(tmp_path / "out")
    for name, a in params.items():
        np.testing.assert_array_equal(back.params[name], a)
    # a post_rope model cannot be Qwen3: raw on request
    save_model(
        tmp_path / "p.ddlw",
        Model(cfg=our_config(True, "post_rope"), params=random_params(our_config(True, "post_rope"))),
    )
    assert (
        export_hf_from_file(tmp_path / "p.ddlw", tmp_path / "raw", raw=True)["architecture"]
        == "DdlForCausalLM"
    )


# ---------------------------------------------------------------------------------------------- errors


def test_error_no_config(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(HfError, match="no config.json"):
        import_hf(tmp_path / "m")


def test_error_missing_tensor(tmp_path):
    cfg = our_config(False)
    params = random_params(cfg)
    del params["model.layers.1.self_attn.k_norm.weight"]
    write_folder(tmp_path / "m", hf_config(False), params)
    with pytest.raises(HfError, match=r"missing tensor.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        import_hf(tmp_path / "m")


def test_error_untied_without_lm_head(tmp_path):
    cfg = our_config(True)
    write_folder(tmp_path / "m", hf_config(False), random_params(cfg))  # config says untied
    with pytest.raises(HfError, match="lm_head.weight"):
        import_hf(tmp_path / "m")


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}, r"unsupported architectures.*Qwen3ForCausalLM.*LlamaForCausalLM"),
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "llama"}, "model_type"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3'"),
        ({"attention_bias": True}, "attention_bias"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "sliding"),
        ({"num_key_value_heads": 3}, "n_kv_heads"),
    ],
)  # fmt: skip
def test_error_bad_config(tmp_path, change, pattern):
    write_folder(tmp_path / "m", hf_config(True, **change), random_params(our_config(True)))
    with pytest.raises(HfError, match=pattern):
        import_hf(tmp_path / "m")


def test_error_shape_mismatch(tmp_path):
    params = random_params(our_config(True))
    params["model.layers.0.mlp.up_proj.weight"] = np.zeros((100, 64), np.float32)
    write_folder(tmp_path / "m", hf_config(True), params)
    with pytest.raises(HfError, match=r"up_proj.weight has shape \(100, 64\).*\(128, 64\)"):
        import_hf(tmp_path / "m")


def test_error_unexpected_tensor(tmp_path):
    params = random_params(our_config(True))
    params["model.layers.0.self_attn.q_proj.bias"] = np.zeros(128, np.float32)
    write_folder(tmp_path / "m", hf_config(True), params)
    with pytest.raises(HfError, match=r"unexpected tensor.*q_proj\.bias"):
        import_hf(tmp_path / "m")


def test_error_unsupported_dtype(tmp_path):
    params = random_params(our_config(True))
    params["model.norm.weight"] = np.ones(64, np.int32)
    write_folder(tmp_path / "m", hf_config(True), params)
    with pytest.raises(HfError, match="unsupported dtype I32"):
        import_hf(tmp_path / "m")


def test_error_missing_shard(tmp_path):
    write_folder(tmp_path / "m", hf_config(False), random_params(our_config(False)), shards=3)
    (tmp_path / "m" / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(HfError, match=r"shard model-00002-of-00003.safetensors is missing"):
        import_hf(tmp_path / "m")


def test_error_index_escapes_folder(tmp_path):
    write_folder(tmp_path / "m", hf_config(False), random_params(our_config(False)), shards=2)
    idx = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.norm.weight"] = "../evil.safetensors"
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(HfError, match="not a plain file name"):
        import_hf(tmp_path / "m")


def test_error_no_weights(tmp_path):
    write_folder(tmp_path / "m", hf_config(True), random_params(our_config(True)))
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(HfError, match="no model.safetensors"):
        import_hf(tmp_path / "m")


def test_error_corrupt_safetensors(tmp_path):
    write_folder(tmp_path / "m", hf_config(True), random_params(our_config(True)))
    p = tmp_path / "m" / "model.safetensors"
    p.write_bytes(p.read_bytes()[:-100])  # truncated: the last tensor's offsets run past the end
    with pytest.raises(HfError, match="outside the data section"):
        import_hf(tmp_path / "m")
    p.write_bytes((10**12).to_bytes(8, "little") + b"{}")
    with pytest.raises(HfError, match="header length"):
        import_hf(tmp_path / "m")


@pytest.mark.parametrize(
    "change, pattern",
    [
        ({"qk_norm": "post_rope"}, "post_rope.*BEFORE RoPE"),
        ({"norm_style": "offset"}, "offset"),
        ({"residual": "delta"}, "Deep Delta"),
    ],
)
def test_error_export_unrepresentable(tmp_path, change, pattern):
    cfg = dataclasses.replace(our_config(True), **change)
    with pytest.raises(HfError, match=pattern) as ei:
        export_hf(Model(cfg=cfg, params=init_params(cfg, 0)), tmp_path / "out")
    # the way out, in CLI and library terms (not a bare Python function name)
    assert "`ddl-wgpu export-hf --raw`" in str(ei.value) and "raw=True" in str(ei.value)
    assert "use export_raw" not in str(ei.value)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------ hostile folders (issue 14)


def _folder(tmp_path, name="hf", **kw):
    cfg = our_config(True)
    return write_folder(tmp_path / name, hf_config(True, **kw), random_params(cfg)), cfg


@pytest.mark.parametrize("target", ["model.safetensors", "config.json", "tokenizer.json", "."])
def test_import_refuses_to_write_over_its_input(tmp_path, target):
    folder, _ = _folder(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    out = folder / target if target != "." else folder
    with pytest.raises(HfError, match="output .* (is the input|holds the input)"):
        import_hf_to_file(folder, out)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # through a symlink too
    link = tmp_path / "link.safetensors"
    link.symlink_to(folder / "model.safetensors")
    with pytest.raises(HfError, match="is the input"):
        import_hf_to_file(folder, link)
    import_hf_to_file(folder, folder / "model.ddlw")  # a new file beside the inputs is fine


def test_refuse_overwrite_input_helper(tmp_path):
    from ddl_wgpu.files.safeio import refuse_overwrite_input

    a = tmp_path / "a.ddlw"
    a.write_bytes(b"x")
    (tmp_path / "l.ddlw").symlink_to(a)
    (tmp_path / "h.ddlw").hardlink_to(a)
    for out in (a, tmp_path / "l.ddlw", tmp_path / "h.ddlw", tmp_path / "." / "a.ddlw"):
        with pytest.raises(ValueError, match="is the input"):
            refuse_overwrite_input(out, [None, a])
    with pytest.raises(ValueError, match="holds the input"):
        refuse_overwrite_input(tmp_path, [a])
    with pytest.raises(ValueError, match="inside the input folder"):
        refuse_overwrite_input(tmp_path / "d" / "x", [tmp_path / "d"])
    refuse_overwrite_input(tmp_path / "b.ddlw", [a, None])


def test_export_into_a_non_empty_folder(tmp_path):
    cfg = our_config(True)
    foreign = write_folder(tmp_path / "out", hf_config(True), random_params(cfg), shards=2,
                           tokenizer=b'{"foreign": 1}')  # fmt: skip
    before = sorted(p.name for p in foreign.iterdir())
    model = Model(cfg=cfg, params=random_params(cfg, seed=5))  # no tokenizer of its own
    with pytest.raises(
        HfError, match="folder is not empty .*new or empty folder.*`ddl-wgpu export-hf --force`"
    ):
        export_hf(model, foreign)
    assert sorted(p.name for p in foreign.iterdir()) == before
    # a previous export is replaced whole: no foreign tokenizer, index or shards survive
    export_hf(model, foreign, overwrite=True)
    assert sorted(p.name for p in foreign.iterdir()) == ["config.json", "model.safetensors"]
    assert import_hf(foreign).tokenizer is None
    # a folder holding anything else is never replaced
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(HfError, match=r"holds \['notes.txt'\], which is not part of a Hugging Face export"):
        export_hf(model, foreign, overwrite=True)
    (tmp_path / "empty").mkdir()
    export_hf(model, tmp_path / "empty")  # an empty folder is fine
    with pytest.raises(HfError, match="holds the input"):
        save_model(tmp_path / "empty" / "m.ddlw", model)
        export_hf_from_file(tmp_path / "empty" / "m.ddlw", tmp_path / "empty", overwrite=True)


def test_export_disk_full_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    import ddl_wgpu.files.hf.convert as H

    cfg = our_config(True)
    model = Model(cfg=cfg, params=random_params(cfg, seed=5), tokenizer=b"{}")
    export_hf(model, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

    def full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(H, "write_bytes", full)
    for folder, overwrite in ((tmp_path / "out", True), (tmp_path / "new", False)):
        with pytest.raises(
            HfError, match=r"cannot write the export: No space left on device .* is unchanged"
        ):
            export_hf(model, folder, overwrite=overwrite)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _rewrite_offsets(path, change):
    """Rewrite a safetensors header's data_offsets (same header length) with `change(name, [start, end])`."""
    blob = path.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    for name, t in header.items():
        if name != "__metadata__":
            t["data_offsets"] = change(name, t["data_offsets"])
    hb = json.dumps(header, separators=(",", ":")).encode()
    assert len(hb) <= n
    path.write_bytes(blob[:8] + hb + b" " * (n - len(hb)) + blob[8 + n :])


def test_overlapping_offsets_holes_and_trailing_bytes_are_refused(tmp_path):
    folder, _ = _folder(tmp_path)
    st = folder / "model.safetensors"
    good = st.read_bytes()
    header = json.loads(good[8 : 8 + int.from_bytes(good[:8], "little")])
    names = sorted((t["data_offsets"][0], k) for k, t in header.items() if k != "__metadata__")
    first, second = names[0][1], names[1][1]
    size = header[first]["data_offsets"][1]
    # same-size tensors: the second points at the first one's bytes
    norm = [k for k, t in header.items() if k.endswith("layernorm.weight")]
    a, b = sorted(norm, key=lambda k: header[k]["data_offsets"][0])[:2]
    _rewrite_offsets(st, lambda n, o: header[a]["data_offsets"] if n == b else o)
    with pytest.raises(HfError, match=rf"tensor '({a}|{b})' data_offsets .* overlap tensor"):
        import_hf(folder)
    st.write_bytes(good)
    _rewrite_offsets(st, lambda n, o: [o[0] + 4, o[1] + 4] if n != first else o)  # a hole after the first
    blob = st.read_bytes()
    st.write_bytes(blob + b"\0" * 4)
    with pytest.raises(HfError, match=rf"tensor '{second}' starts at {size + 4}, leaving a hole of 4 bytes"):
        import_hf(folder)
    st.write_bytes(good + b"\0" * 8)
    with pytest.raises(HfError, match="8 bytes after the last tensor's data"):
        import_hf(folder)


def test_integer_tensors_are_refused_precisely(tmp_path):
    cfg = our_config(True)
    params = random_params(cfg)
    params["model.norm.weight"] = params["model.norm.weight"].view(np.int32)
    write_folder(tmp_path / "m", hf_config(True), params)
    with pytest.raises(HfError, match=r"tensor 'model.norm.weight' has unsupported dtype I32"):
        import_hf(tmp_path / "m")


HOSTILE_JSON = [
    ("deep", b"[" * 100_000 + b"]" * 100_000, "nests deeper than 64 levels"),
    ("surrogate", b'{"architectures": ["\\ud800"]}', "lone UTF-16 surrogate"),
    ("bigint", b'{"vocab_size": ' + b"9" * 5000 + b"}", "too many digits"),
    ("nan", b'{"rope_theta": NaN}', "NaN is not valid JSON"),
    ("dup", b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    ("utf8", b'{"a": "\xff"}', "not UTF-8"),
]


@pytest.mark.parametrize("kind, raw, pattern", HOSTILE_JSON, ids=[h[0] for h in HOSTILE_JSON])
def test_hostile_config_json(tmp_path, kind, raw, pattern):
    folder, _ = _folder(tmp_path)
    (folder / "config.json").write_bytes(raw)
    with pytest.raises(HfError, match=rf"config.json: .*{pattern}") as ei:
        import_hf(folder)
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("kind, raw, pattern", HOSTILE_JSON, ids=[h[0] for h in HOSTILE_JSON])
def test_hostile_safetensors_header_and_index(tmp_path, kind, raw, pattern):
    folder, _ = _folder(tmp_path)
    st = folder / "model.safetensors"
    st.write_bytes(len(raw).to_bytes(8, "little") + raw)
    with pytest.raises(HfError, match=rf"model.safetensors: safetensors header: .*{pattern}"):
        import_hf(folder)
    st.unlink()
    (folder / "model.safetensors.index.json").write_bytes(raw)
    with pytest.raises(HfError, match=rf"index.json: .*{pattern}"):
        import_hf(folder)


def test_absurd_config_sizes_are_refused_at_once(tmp_path):
    import time

    for key, value in (("num_hidden_layers", 10**9), ("vocab_size", 10**9), ("hidden_size", 10**9),
                       ("intermediate_size", 10**9)):  # fmt: skip
        folder, _ = _folder(tmp_path, name=key, **{key: value})
        t0 = time.perf_counter()
        with pytest.raises(HfError, match=r"config.json: the model needs about .* GiB of memory to load"):
            import_hf(folder)
        assert time.perf_counter() - t0 < 5


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX FIFOs")
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_fifo_in_the_folder_is_refused_without_blocking(tmp_path, name):
    import signal

    folder, _ = _folder(tmp_path)
    (folder / name).unlink()
    os.mkfifo(folder / name)
    signal.alarm(20)  # a regression would block forever on open(); fail loudly instead
    try:
        with pytest.raises(HfError, match=rf"{name}: is a FIFO, not a regular file"):
            import_hf(folder)
    finally:
        signal.alarm(0)


def test_export_reads_verified_tensors(tmp_path):
    from ddl_wgpu.files.container import CheckpointError, open_checkpoint

    cfg = our_config(True)
    save_model(tmp_path / "m.ddlw", Model(cfg=cfg, params=random_params(cfg)))
    with open_checkpoint(tmp_path / "m.ddlw") as ck:
        info = ck.info("model.norm.weight")
        n = int.from_bytes((tmp_path / "m.ddlw").read_bytes()[8:16], "little")
    blob = bytearray((tmp_path / "m.ddlw").read_bytes())
    blob[(16 + n + 8 + 63) // 64 * 64 + info.offset] ^= 1
    (tmp_path / "m.ddlw").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="hash mismatch"):
        export_hf_from_file(tmp_path / "m.ddlw", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    export_hf_from_file(tmp_path / "m.ddlw", tmp_path / "out", verify=False)


# ----------------------------------------------------------------------------- parity with transformers


PARITY_CASES = [("Qwen3ForCausalLM", True), ("Qwen3ForCausalLM", False), ("LlamaForCausalLM", False)]


def _torch_transformers():
    """torch and transformers; a failure (not a skip) without them: `make test` must compare with HF."""
    try:
        import torch
        import transformers
    except ImportError as e:
        pytest.fail(f"{e}: the parity tests need the `test` extra (pip install -e '.[test]')")
    return torch, transformers


def _hf_model(arch: str, tied: bool, seed: int):
    torch, transformers = _torch_transformers()
    kw = {k: v for k, v in TINY.items()}
    cls_cfg = transformers.Qwen3Config if arch.startswith("Qwen3") else transformers.LlamaConfig
    config = cls_cfg(**kw, tie_word_embeddings=tied, attn_implementation="eager", attention_bias=False)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval().float()
    with torch.no_grad():  # random values everywhere, norms included, so every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(
                    torch.randn_like(p)
                    * (0.02 if "embed" in name or "lm_head" in name else 0.5 / math.sqrt(64))
                )
    return torch, transformers, model


def _hf_logits(torch, model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


@pytest.mark.parametrize("arch, tied", PARITY_CASES)
def test_parity_import_from_transformers(tmp_path, arch, tied):
    torch, _, hf = _hf_model(arch, tied, seed=0)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    m = import_hf(tmp_path / "hf")
    assert m.cfg.head_dim == 32 and m.cfg.tie_embeddings is tied
    ours = forward(m.params, m.cfg, IDS)[0]
    diff = float(np.max(np.abs(ours - _hf_logits(torch, hf, IDS))))
    print(f"\nPARITY import {arch} tied={tied}: max|logits diff| = {diff:.3e}")
    assert diff < 1e-4


@pytest.mark.parametrize("arch, tied", PARITY_CASES)
def test_parity_export_to_transformers(tmp_path, arch, tied):
    torch, transformers = _torch_transformers()
    cfg = our_config(tied, "pre_rope" if arch.startswith("Qwen3") else "none")
    model = Model(cfg=cfg, params=random_params(cfg, seed=21))
    export_hf(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    ).eval()
    assert type(hf).__name__ == arch
    assert hf.config.head_dim == 32 and hf.config.tie_word_embeddings is tied
    ours = forward(model.params, cfg, IDS)[0]
    diff = float(np.max(np.abs(ours - _hf_logits(torch, hf, IDS))))
    print(f"\nPARITY export {arch} tied={tied}: max|logits diff| = {diff:.3e}")
    assert diff < 1e-4
