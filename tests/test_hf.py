"""Hugging Face import/export (ddl_wgpu.hf): tiny folders written here, no network.

The torch/transformers parity tests run only where both are importable (not in the project venv)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from ddl_ref.config import ModelConfig
from ddl_ref.model import forward
from ddl_ref.params import init_params, param_table
from ddl_wgpu.container import bf16_to_f32, f32_to_bf16
from ddl_wgpu.hf import (
    HfError,
    export_hf,
    export_hf_from_file,
    export_raw,
    import_hf,
    import_hf_to_file,
)
from ddl_wgpu.modelfile import Model, load_model, save_model

# head_dim 32 != hidden 64 / heads 4: catches the Qwen3-0.6B pitfall (mtp-heal.md §3).
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
    assert "hf.mtp_tensors_skipped" not in m.metadata
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


def test_tied_folder_with_lm_head_ignores_it(tmp_path):
    cfg = our_config(True)
    params = random_params(cfg)
    extra = dict(params, **{"lm_head.weight": np.full((256, 64), 9.0, np.float32)})
    write_folder(tmp_path / "m", hf_config(True), extra)
    m = import_hf(tmp_path / "m")
    assert "lm_head.weight" not in m.params
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


def test_mtp_tensors_recorded_as_skipped(tmp_path):
    cfg = our_config(True)
    params = random_params(cfg)
    mtp = {"mtp.fc.weight": np.zeros((64, 128), np.float32), "mtp.norm.weight": np.zeros(64, np.float32),
           "mtp.layers.0.input_layernorm.weight": np.zeros(64, np.float32),
           "model.mtp.enorm.weight": np.zeros(64, np.float32)}  # fmt: skip
    write_folder(tmp_path / "m", hf_config(True), {**params, **mtp})
    m = import_hf(tmp_path / "m")
    assert m.metadata["hf.mtp_tensors_skipped"] == sorted(mtp)
    assert set(m.params) == set(params)


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
    export_hf(Model(cfg=cfg, params=random_params(cfg, seed=1)), tmp_path / "out")
    p2 = random_params(cfg, seed=2)
    export_hf(Model(cfg=cfg, params=p2), tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.partial"))
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
    write_folder(tmp_path / "hf", hf_config(False), {**params, "mtp.norm.weight": np.zeros(64, np.float32)})
    s = import_hf_to_file(tmp_path / "hf", tmp_path / "m.ddlw")
    assert s["architecture"] == "Qwen3ForCausalLM" and s["tied"] is False and s["mtp_tensors_skipped"] == 1
    assert s["num_params"] == sum(a.size for a in params.values())
    m = load_model(tmp_path / "m.ddlw")
    assert m.tokenizer == b'{"model": "tiny"}' and m.metadata["hf.mtp_tensors_skipped"] == ["mtp.norm.weight"]
    s2 = export_hf_from_file(tmp_path / "m.ddlw", tmp_path / "out")
    assert s2["architecture"] == "Qwen3ForCausalLM" and s2["raw"] is False
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
        ({"residual": "delta"}, "export_raw"),
    ],
)
def test_error_export_unrepresentable(tmp_path, change, pattern):
    cfg = dataclasses.replace(our_config(True), **change)
    with pytest.raises(HfError, match=pattern):
        export_hf(Model(cfg=cfg, params=init_params(cfg, 0)), tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- parity with transformers


PARITY_CASES = [("Qwen3ForCausalLM", True), ("Qwen3ForCausalLM", False), ("LlamaForCausalLM", False)]


def _hf_model(arch: str, tied: bool, seed: int):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
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
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
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
