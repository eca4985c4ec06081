"""The Qwen3 and Llama families of `ddl_wgpu.files.hf.convert` (and the raw export's `DdlForCausalLM`): config.json <->
ModelConfig, the import plan and the export plan.

Import: `Qwen3ForCausalLM` (q/k RMSNorm over head_dim before RoPE -> qk_norm "pre_rope") and `LlamaForCausalLM`
(qk_norm "none"), "standard" w·x̂ norms, the trunk's names ours (the rename is the identity), an MTP draft in any
of the layouts of `ddl_wgpu.files.hf.common`; parameters are stored as float32, and nothing else of the folder is kept.
Export: a model with qk_norm "pre_rope" becomes `Qwen3ForCausalLM`, one with "none" `LlamaForCausalLM`. A model
with "post_rope" (the DDL code's q/k norm after RoPE), "offset" norms ((1+w)·x̂) or a hybrid trunk's features
(gated attention, partial RoPE, Gated DeltaNet layers: `ddl_wgpu.files.hf.qwen35`) has no exact class here and is
refused, naming the raw export.

The driver tries this family last: it claims every config.json the others do not, and refuses what it cannot
read by naming every architecture the package supports.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ddl_ref.config import ConfigError, ModelConfig
from ddl_ref.params import mtp_specs, param_table
from ddl_wgpu.files.hf.common import (
    LAYOUT_OURS,
    MTP_CONVENTION_KEY,
    MTP_COUNT_KEYS,
    QWEN35_SUPPORTED,
    RAW_ARCHITECTURE,
    RAW_HINT,
    Draft,
    ExportPlan,
    ImportPlan,
    draft_hf_name,
    find_draft,
    need,
    optional,
    our_to_hf_name,
    swap_eh_halves,
)
from ddl_wgpu.files.hf.folder import HfError, StTensor
from ddl_wgpu.files.modelfile import LazyModel

SUPPORTED = {  # architectures entry -> (model_type, qk_norm)
    "Qwen3ForCausalLM": ("qwen3", "pre_rope"),
    "LlamaForCausalLM": ("llama", "none"),
}


def architecture(hf: dict, where: str) -> str:
    """The Qwen3/Llama (or raw export) architecture a config names; HfError for any other (the Qwen3.5 family is
    recognised before, by `hf_qwen35.claims`)."""
    supported = (
        ", ".join(f"{a} (model_type {t!r})" for a, (t, _) in SUPPORTED.items()) + ", " + QWEN35_SUPPORTED
    )
    archs = hf.get("architectures")
    model_type = hf.get("model_type")
    if archs is not None:
        if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
            raise HfError(f"{where}: 'architectures' must be a list of names, got {archs!r}")
        if RAW_ARCHITECTURE in archs:
            return RAW_ARCHITECTURE
        known = [a for a in archs if a in SUPPORTED]
        if not known:
            raise HfError(f"{where}: unsupported architectures {archs}; supported: {supported}")
        arch = known[0]
    else:
        by_type = {t: a for a, (t, _) in SUPPORTED.items()}
        if model_type not in by_type:
            raise HfError(f"{where}: no 'architectures' and unsupported model_type {model_type!r}; "
                          f"supported: {supported}")  # fmt: skip
        arch = by_type[model_type]
    if model_type is not None and model_type != SUPPORTED[arch][0]:
        raise HfError(f"{where}: architectures says {arch} but model_type is {model_type!r} "
                      f"(expected {SUPPORTED[arch][0]!r})")  # fmt: skip
    return arch


def _rope_theta(hf: dict, where: str) -> float:
    """RoPE base as transformers 5 reads it: `rope_scaling`, when set (v4's scaling dict), replaces
    `rope_parameters` whole; the top-level `rope_theta` fills in a dict without one. Any scaling is refused."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rp = hf.get(key)
    theta = hf.get("rope_theta")
    if rp is not None:
        if not isinstance(rp, dict):
            raise HfError(f"{where}: {key} must be an object or null, got {rp!r:.80}")
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype != "default":
            raise HfError(f"{where}: RoPE scaling {rtype!r} is not supported (only plain RoPE: "
                          "rope_scaling null or rope_type 'default')")  # fmt: skip
        extra = sorted(set(rp) - {"rope_type", "type", "rope_theta"})
        if extra and not (extra == ["partial_rotary_factor"] and rp["partial_rotary_factor"] == 1.0):
            raise HfError(f"{where}: unsupported RoPE parameters {extra} ({key})")
        theta = rp.get("rope_theta", theta)  # v5 gives rope_parameters priority over a top-level value
    prf = hf.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise HfError(f"{where}: partial_rotary_factor {prf} is not supported (only full-width RoPE)")
    if theta is None:
        theta = 10000.0  # transformers' default_theta
    if isinstance(theta, bool) or not isinstance(theta, int | float) or not theta > 0:
        raise HfError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def config_from_hf(hf: dict, where: str = "config.json") -> tuple[ModelConfig, str]:
    """A Qwen3/Llama (or raw export) config dict -> (ModelConfig, architecture). HfError for what we cannot run."""
    arch = architecture(hf, where)
    if arch == RAW_ARCHITECTURE:
        fields = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "note", "variant")}
        try:
            return ModelConfig.from_dict(fields), arch
        except (ConfigError, TypeError) as e:
            raise HfError(f"{where}: bad {RAW_ARCHITECTURE} config: {e}") from None
    model_type, qk_norm = SUPPORTED[arch]
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise HfError(f"{where}: {key}=true is not supported (our blocks have no biases)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise HfError(f"{where}: hidden_act {act!r} is not supported (SwiGLU with silu only)")
    if hf.get("use_sliding_window", False):
        raise HfError(f"{where}: use_sliding_window=true is not supported (full causal attention only)")
    lt = hf.get("layer_types")
    if isinstance(lt, list) and any(t != "full_attention" for t in lt):
        raise HfError(f"{where}: layer_types {sorted(set(lt))} not supported (full_attention only)")
    C = need(hf, "hidden_size", where)
    H = need(hf, "num_attention_heads", where)
    K = hf.get("num_key_value_heads") or H
    head_dim = hf.get("head_dim")
    if head_dim is None:
        # transformers' own default: Qwen3Config has head_dim=128, LlamaConfig hidden_size // heads.
        if model_type == "qwen3":
            head_dim = 128
        else:
            if not isinstance(H, int) or H <= 0 or C % H:
                raise HfError(f"{where}: no head_dim and hidden_size {C} is not a multiple of heads {H}")
            head_dim = C // H
    default_max_pos = {"qwen3": 32768, "llama": 2048}[model_type]
    try:
        cfg = ModelConfig(
            vocab_size=need(hf, "vocab_size", where),
            d_model=C,
            n_layers=need(hf, "num_hidden_layers", where),
            n_heads=H,
            n_kv_heads=K,
            head_dim=head_dim,
            ffn_hidden=need(hf, "intermediate_size", where),
            max_seq_len=hf.get("max_position_embeddings", default_max_pos),
            rope_theta=_rope_theta(hf, where),
            rms_eps=float(optional(hf, "rms_norm_eps", 1e-6, where, float)),
            tie_embeddings=optional(hf, "tie_word_embeddings", False, where, bool),  # both default to untied
            norm_style="standard",
            qk_norm=qk_norm,
            residual="add",
        )
    except (ConfigError, TypeError) as e:
        raise HfError(f"{where}: {e}") from None
    return cfg, arch


LAYOUTS: dict = {}  # nothing of the folder is kept to write back (`ddl_wgpu.files.hf.keep`)
KEEP_FILES = None


def claims(hf: dict) -> bool:
    """Every config.json the other families do not claim: read here, or refused naming what is supported."""
    return True


def plan(hf: dict, have: set[str], where: str) -> ImportPlan:
    """How to read a Qwen3/Llama (or raw export) folder: our names are its names; a draft in any layout (a raw
    export's is ours, described by its config)."""
    cfg, arch = config_from_hf(hf, where)
    if arch == RAW_ARCHITECTURE:
        draft = None if cfg.mtp is None else Draft(LAYOUT_OURS, cfg.mtp, "config.json", ())
    else:
        draft = find_draft(hf, have, cfg.n_layers, where)
    if draft is not None:
        cfg = dataclasses.replace(cfg, mtp=draft.mtp)
    names = {s.name: s.name for s in param_table(cfg)}
    if draft is not None:
        names.update({s.name: draft_hf_name(s.name, draft.layout, cfg.n_layers) for s in mtp_specs(cfg)})
    return ImportPlan(cfg=cfg, arch=arch, names=names, draft=draft)


def exports(cfg: ModelConfig, record: dict | None) -> bool:
    """The family of every model no other family writes (and the raw export's)."""
    return True


MTP_NOTE = ("transformers' Qwen3/Llama classes ignore the mtp.* tensors (the trunk loads, with an 'unused weights' "
            "warning); MTP-aware runtimes read them as a Qwen3.5 draft (mtp.fc embedding first)")  # fmt: skip


def export_plan(model: LazyModel, record: dict | None) -> ExportPlan:
    """Qwen3ForCausalLM / LlamaForCausalLM: config.json and every parameter as float32 under its Hugging Face name
    (no lm_head when tied; a "hidden_first" draft's eh_proj written embedding first, as mtp.fc)."""
    config = config_to_hf(model.cfg, _token_id(model, "bos_token_id"), _token_id(model, "eos_token_id"))
    tensors = []
    for n, t in model.tensors.items():
        if n == "model.mtp.eh_proj.weight" and model.cfg.mtp.concat == "hidden_first":
            t = t.map(swap_eh_halves)
        tensors.append(StTensor(our_to_hf_name(n), "F32", t.shape, t.to("f32")))
    return ExportPlan(config=config, tensors=tensors, mtp_note=MTP_NOTE)


def _token_id(model: LazyModel, key: str) -> int | None:
    v = model.metadata.get(f"hf.{key}")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def config_to_hf(cfg: ModelConfig, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """A baseline ModelConfig -> a transformers config dict (Qwen3 for pre_rope q/k norm, Llama for none)."""
    hybrid = [f for f, on in (("layer_types", cfg.layer_types is not None), ("attn_output_gate", cfg.attn_output_gate),
                              ("rotary_dim", cfg.rotary_dim is not None)) if on]  # fmt: skip
    if hybrid:
        raise HfError(f"{hybrid[0]} (a Qwen3.5-style trunk) cannot be exported as Qwen3 or Llama; {RAW_HINT}")
    if cfg.residual != "add":
        raise HfError(
            f"residual {cfg.residual!r} (Deep Delta Learning) has no transformers class; {RAW_HINT}"
        )
    if cfg.norm_style != "standard":
        raise HfError(f"norm_style {cfg.norm_style!r} ((1+w)·x̂) cannot be exported as Qwen3 or Llama, whose norms "
                      f"are w·x̂; {RAW_HINT}")  # fmt: skip
    if cfg.qk_norm == "post_rope":
        raise HfError("qk_norm 'post_rope' cannot be exported as Qwen3: Qwen3 normalises q/k BEFORE RoPE and "
                      f"RMSNorm does not commute with the rotation, so the logits would differ; {RAW_HINT}")  # fmt: skip
    arch = "Qwen3ForCausalLM" if cfg.qk_norm == "pre_rope" else "LlamaForCausalLM"
    d: dict[str, Any] = {
        "architectures": [arch],
        "model_type": SUPPORTED[arch][0],
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": float(cfg.rope_theta),
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(cfg.rope_theta)},  # transformers v5
        "rms_norm_eps": float(cfg.rms_eps),
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }
    if arch == "Qwen3ForCausalLM":
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    else:
        d.update(mlp_bias=False, pretraining_tp=1)
    if cfg.mtp is not None:
        # Qwen3.5's key; transformers keeps unknown keys as attributes. ddl_mtp makes the import exact.
        d[MTP_COUNT_KEYS[0]] = 1
        d[MTP_CONVENTION_KEY] = cfg.mtp.to_dict()
    return d
