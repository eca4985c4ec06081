"""Hugging Face interop: import a `config.json` + `*.safetensors` folder, export a baseline model as Qwen3.

Supported on import: `Qwen3ForCausalLM` (q/k RMSNorm over head_dim before RoPE -> qk_norm "pre_rope") and
`LlamaForCausalLM` (qk_norm "none"), with bf16/f16/f32 weights in one `model.safetensors` or in shards listed
by `model.safetensors.index.json`. Our parameter names are the Hugging Face names
(docs/model.md#parameters-names-and-the-one-table-ddl_refparamspy), so the trunk's rename is the identity; the
only translations are the MTP draft names (docs/heal.md#the-draft-block), kept in `MTP_RENAMES`.

MTP draft (one block, `cfg.mtp`, `ddl_ref.params.mtp_specs`). Import reads it from three layouts on a Qwen3/Llama
trunk (the trunk decides the norm style: "standard" w·x̂ for the whole model, the draft's norms included):

    layout        names                                                                 default hiddens
    "model.mtp."  model.mtp.{enorm,hnorm,eh_proj,norm}.weight + model.mtp.layers.0.*     pre_norm / pre_norm
                  (ours; the CMF/cortiq layout, whose runtime feeds pre-norm hiddens)
    "mtp."        mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}.weight         post_norm / post_norm
                  + mtp.layers.0.* (Qwen3.5/Qwen3-Next names; vLLM/SGLang feed the trunk's post-final-norm
                  hidden and chain the post-mtp.norm one, docs/heal.md#the-draft-block)
    "model.layers.{L}."  DeepSeek/GLM: {enorm,hnorm,eh_proj}.weight, shared_head.norm.weight  post_norm / post_norm
                  and the block at index L = num_hidden_layers; only when config.json declares the draft (else
                  those tensors are an error, as a wrong num_hidden_layers would be). Its embed_tokens and
                  shared_head.head copies are ignored: the draft shares the trunk's embedding and head.

The default hiddens are those of the runtime that consumes each layout; `concat` is always "emb_first" (all
three store eh_proj/fc as [H, 2H] with the embedding's columns first). A config.json key `ddl_mtp` (the
MtpConfig as a dict, written by our export) overrides the defaults exactly; its `concat: hidden_first` means our
model's eh_proj halves are swapped relative to the emb-first file. The draft count comes from
`mtp_num_hidden_layers` / `num_nextn_predict_layers` and from the layer indices of the tensors; more than one
draft layer, a declared draft with missing pieces, or draft shapes that disagree with the trunk's geometry
raise HfError. Qwen3-Next/Qwen3.5 folders themselves are refused: their trunks (hybrid linear attention, MoE,
(1+w) norms) are not ours. A draft trained with (1+w) norms and grafted onto a w·x̂ trunk cannot be told apart
by its names: its norm weights must be converted (w + 1) before import.

On export, a model with qk_norm "pre_rope" becomes `Qwen3ForCausalLM`, one with "none" `LlamaForCausalLM`. A
model with "post_rope" (the DDL code's q/k norm after RoPE) or "offset" norms ((1+w)·x̂) has no exact
`transformers` class and is refused; `export_raw` writes any model (DDL included) under our own names with a
config.json that says transformers cannot load it. A draft is written under the Qwen3.5 names (`mtp.fc`
emb-first, `mtp.pre_fc_norm_*`, `mtp.layers.0.*`, `mtp.norm`) with `mtp_num_hidden_layers: 1` and `ddl_mtp`;
transformers' Qwen3/Llama classes ignore these tensors (they load the trunk), MTP-aware runtimes read them.

The folder's files (safetensors, the sharded index, config.json, tokenizer.json) are read and written by
`ddl_wgpu.hf_files`, which treats every one as untrusted; every bad input raises one `HfError`. An export is
written into a fresh folder that is renamed into place.

What this module deliberately does not do: the CLI (`cli.py` calls `import_hf_to_file` / `export_hf_from_file`),
tokenizer parsing (tokenizer.json bytes are carried as they are), MiMo's `model.mtp_layers.*` drafts (hidden
first, Qwen2 blocks with biases) or more than one draft layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from ddl_ref.config import ConfigError, ModelConfig, ModelVariant, MtpConfig
from ddl_ref.params import MTP_PREFIX, mtp_specs, param_table
from ddl_wgpu.hf_files import (
    MAX_TOKENIZER,
    HfError,
    Weights,
    read_json,
    write_bytes,
    write_safetensors,
)
from ddl_wgpu.modelfile import Model, check_fits, load_model, save_model
from ddl_wgpu.safeio import read_regular, refuse_overwrite_input

__all__ = ["HfError", "config_from_hf", "config_to_hf", "export_hf", "export_hf_from_file", "export_raw",
           "import_hf", "import_hf_to_file"]  # fmt: skip


# ------------------------------------------------------------------------------------------------ names

SUPPORTED = {  # architectures entry -> (model_type, qk_norm)
    "Qwen3ForCausalLM": ("qwen3", "pre_rope"),
    "LlamaForCausalLM": ("llama", "none"),
}
RAW_ARCHITECTURE = "DdlForCausalLM"  # export_raw's marker; import_hf reads it back
RAW_HINT = (
    "a raw export (`ddl-wgpu export-hf --raw`, export_hf_from_file(..., raw=True)) writes any model under "
    "ddl-wgpu's own tensor names, which import-hf reads back but transformers cannot load"
)

# MTP draft tensors. Qwen3.5 / Qwen3-Next store the draft as `mtp.*`; our table (`ddl_ref.params`) uses
# `model.mtp.*` (docs/heal.md#the-draft-block). HF (Qwen3.5 names) -> ours; export writes the inverse.
MTP_RENAMES = {
    "mtp.fc.weight": "model.mtp.eh_proj.weight",
    "mtp.pre_fc_norm_embedding.weight": "model.mtp.enorm.weight",
    "mtp.pre_fc_norm_hidden.weight": "model.mtp.hnorm.weight",
    "mtp.norm.weight": "model.mtp.norm.weight",
}
MTP_PREFIX_RENAMES = {"mtp.layers.": "model.mtp.layers."}  # then the block's own names, unchanged
MTP_COUNT_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")  # Qwen3.5 / DeepSeek, GLM, Qwen3-Next
MTP_CONVENTION_KEY = "ddl_mtp"  # config.json: our MtpConfig as a dict (written by export_hf)

# Layouts a draft is read from (see the module docstring) and the hiddens their consuming runtimes feed
# (docs/heal.md#the-draft-block).
LAYOUT_OURS, LAYOUT_QWEN35, LAYOUT_DEEPSEEK, LAYOUT_MIMO = (
    "model.mtp.",
    "mtp.",
    "model.layers.{L}.",
    "model.mtp_layers.",
)
_LAYOUT_DEFAULTS = {
    LAYOUT_OURS: MtpConfig(),  # cortiq/CMF: pre-final-norm trunk hidden, pre-norm chain
    LAYOUT_QWEN35: MtpConfig(trunk_hidden="post_norm", chain_hidden="post_norm"),  # vLLM/SGLang
    LAYOUT_DEEPSEEK: MtpConfig(trunk_hidden="post_norm", chain_hidden="post_norm"),  # vLLM/SGLang
}
_DEEPSEEK_RENAMES = {
    "shared_head.norm.weight": "norm.weight"
}  # then enorm/hnorm/eh_proj as ours, block -> layers.0
_DEEPSEEK_SHARED = ("embed_tokens.weight", "shared_head.head.weight")  # copies of the shared embedding / head

# Tensors some checkpoints carry that are not parameters (old Llama saves kept the RoPE buffer).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def mtp_our_name(hf_name: str) -> str:
    """HF MTP tensor name -> our name (identity for names already in our `model.mtp.*` form)."""
    if hf_name in MTP_RENAMES:
        return MTP_RENAMES[hf_name]
    for src, dst in MTP_PREFIX_RENAMES.items():
        if hf_name.startswith(src):
            return dst + hf_name[len(src) :]
    return hf_name


_MTP_EXPORT = {v: k for k, v in MTP_RENAMES.items()}
_MTP_PREFIX_EXPORT = {v: k for k, v in MTP_PREFIX_RENAMES.items()}


def our_to_hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face name written on export: the trunk's are identical, the draft's are
    the Qwen3.5 names (the inverse of `mtp_our_name`)."""
    if name in _MTP_EXPORT:
        return _MTP_EXPORT[name]
    for ours, theirs in _MTP_PREFIX_EXPORT.items():
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def draft_hf_name(name: str, layout: str, n_layers: int) -> str:
    """Our draft parameter name (`model.mtp.*`) -> its name in a folder of `layout`."""
    if layout == LAYOUT_OURS:
        return name
    if layout == LAYOUT_QWEN35:
        return our_to_hf_name(name)
    if layout == LAYOUT_DEEPSEEK:
        rest = name[len("model.mtp.") :]
        rest = {v: k for k, v in _DEEPSEEK_RENAMES.items()}.get(rest, rest)
        if rest.startswith("layers.0."):
            rest = rest[len("layers.0.") :]
        return f"model.layers.{n_layers}.{rest}"
    raise ValueError(f"unknown MTP layout {layout!r}")


def swap_eh_halves(w: np.ndarray) -> np.ndarray:
    """eh_proj [C, 2C] with its two column halves swapped: converts between "emb_first" and "hidden_first"
    (eh·[a; b] = swapped(eh)·[b; a]); its own inverse."""
    c = w.shape[1] // 2
    return np.ascontiguousarray(np.concatenate([w[:, c:], w[:, :c]], axis=1))


# ------------------------------------------------------------------------------------------------ config


def _need(cfg: dict, key: str, where: str, kind: type = int) -> Any:
    if key not in cfg:
        raise HfError(f"{where}: missing {key!r}")
    v = cfg[key]
    ok = (isinstance(v, int | float) if kind is float else isinstance(v, kind)) and not isinstance(v, bool)
    if not ok:
        raise HfError(f"{where}: {key!r} must be {kind.__name__}, got {v!r}")
    return v


def _optional(cfg: dict, key: str, default, where: str, kind: type) -> Any:
    """`cfg[key]` of `kind` (float: any number; bool: true or false), `default` when absent or null."""
    if cfg.get(key) is None:
        return default
    v = cfg[key]
    ok = isinstance(v, bool) if kind is bool else isinstance(v, int | float) and not isinstance(v, bool)
    if not ok:
        raise HfError(
            f"{where}: {key!r} must be {'true or false' if kind is bool else 'a number'}, got {v!r:.40}"
        )
    return v


MAX_INT64 = (1 << 63) - 1  # the container's header stores integers as msgpack int64


def _architecture(hf: dict, where: str) -> str:
    supported = ", ".join(f"{a} (model_type {t!r})" for a, (t, _) in SUPPORTED.items())
    archs = hf.get("architectures")
    model_type = hf.get("model_type")
    names = ([model_type] if isinstance(model_type, str) else []) + (archs if isinstance(archs, list) else [])
    qnext = [
        n
        for n in names
        if isinstance(n, str) and n.lower().startswith(("qwen3_next", "qwen3next", "qwen3_5"))
    ]
    if qnext:
        raise HfError(f"{where}: {qnext[0]} is a Qwen3-Next/Qwen3.5 model, whose trunk (hybrid linear attention, "
                      f"MoE, (1+w) norms) is not supported; supported: {supported} (their `mtp.*` draft names "
                      "are read on those trunks)")  # fmt: skip
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
    """RoPE base from v5 `rope_parameters` or v4 top-level `rope_theta`; any scaling is refused."""
    rp = hf.get("rope_parameters")
    if rp is None:
        # v4's scaling dict (null for plain RoPE); v5 treats it as rope_parameters
        rp = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    if rp is not None:
        if not isinstance(rp, dict):
            raise HfError(f"{where}: rope_parameters/rope_scaling must be an object or null, got {rp!r:.80}")
        rtype = rp.get("rope_type", rp.get("type", "default"))
        if rtype != "default":
            raise HfError(f"{where}: RoPE scaling {rtype!r} is not supported (only plain RoPE: "
                          "rope_scaling null or rope_type 'default')")  # fmt: skip
        extra = sorted(set(rp) - {"rope_type", "type", "rope_theta"})
        if extra and not (extra == ["partial_rotary_factor"] and rp["partial_rotary_factor"] == 1.0):
            raise HfError(f"{where}: unsupported RoPE parameters {extra}")
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
    """A transformers config dict -> (ModelConfig, architecture). Raises HfError for what we cannot run."""
    if not isinstance(hf, dict):
        raise HfError(f"{where}: must be a JSON object")
    arch = _architecture(hf, where)
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
    C = _need(hf, "hidden_size", where)
    H = _need(hf, "num_attention_heads", where)
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
            vocab_size=_need(hf, "vocab_size", where),
            d_model=C,
            n_layers=_need(hf, "num_hidden_layers", where),
            n_heads=H,
            n_kv_heads=K,
            head_dim=head_dim,
            ffn_hidden=_need(hf, "intermediate_size", where),
            max_seq_len=hf.get("max_position_embeddings", default_max_pos),
            rope_theta=_rope_theta(hf, where),
            rms_eps=float(_optional(hf, "rms_norm_eps", 1e-6, where, float)),
            tie_embeddings=_optional(hf, "tie_word_embeddings", False, where, bool),  # both default to untied
            norm_style="standard",
            qk_norm=qk_norm,
            residual="add",
        )
    except (ConfigError, TypeError) as e:
        raise HfError(f"{where}: {e}") from None
    return cfg, arch


def config_to_hf(cfg: ModelConfig, bos_token_id: int | None = None, eos_token_id: int | None = None) -> dict:
    """A baseline ModelConfig -> a transformers config dict (Qwen3 for pre_rope q/k norm, Llama for none)."""
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


# ------------------------------------------------------------------------------------------------ draft


@dataclasses.dataclass(frozen=True)
class _Draft:
    layout: str
    mtp: MtpConfig
    conventions: str  # "ddl_mtp" (read from config.json) or "layout default"
    ignored: tuple[str, ...]  # shared embedding/head copies (DeepSeek layout)


_LAYER_INDEX = {
    LAYOUT_OURS: re.compile(r"^model\.mtp\.layers\.(\d+)\."),
    LAYOUT_QWEN35: re.compile(r"^mtp\.layers\.(\d+)\."),
}
_TRUNK_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _declared_mtp_layers(hf: dict, where: str) -> int | None:
    declared = None
    for key in MTP_COUNT_KEYS:
        v = hf.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise HfError(f"{where}: {key!r} must be a non-negative integer, got {v!r}")
        if declared is not None and v != declared:
            raise HfError(
                f"{where}: {MTP_COUNT_KEYS[0]!r} and {MTP_COUNT_KEYS[1]!r} disagree ({declared} vs {v})"
            )
        declared = v
    return declared


def _find_draft(hf: dict, have: set[str], n_layers: int, where: str) -> _Draft | None:
    """The draft a Qwen3/Llama folder carries (None when it has none); HfError for one we cannot take."""
    declared = _declared_mtp_layers(hf, where)
    conv = hf.get(MTP_CONVENTION_KEY)
    if conv is not None:
        try:
            conv = MtpConfig.from_dict(conv)
        except (ConfigError, TypeError) as e:
            raise HfError(f"{where}: bad {MTP_CONVENTION_KEY!r}: {e}") from None
    groups: dict[str, list[str]] = {}
    deepseek_idx: set[int] = set()
    for n in have:
        if n.startswith(LAYOUT_MIMO):
            groups.setdefault(LAYOUT_MIMO, []).append(n)
        elif n.startswith(LAYOUT_OURS):
            groups.setdefault(LAYOUT_OURS, []).append(n)
        elif n.startswith(LAYOUT_QWEN35):
            groups.setdefault(LAYOUT_QWEN35, []).append(n)
        elif (m := _TRUNK_LAYER.match(n)) and int(m.group(1)) >= n_layers and declared:
            # model.layers.{L}.* is a draft only when config.json declares one (DeepSeek/GLM)
            groups.setdefault(LAYOUT_DEEPSEEK, []).append(n)
            deepseek_idx.add(int(m.group(1)))
    if LAYOUT_MIMO in groups:
        raise HfError(f"{where}: MiMo-style draft tensors ({sorted(groups[LAYOUT_MIMO])[0]!r}, ...) are not "
                      "supported (hidden-first concat, Qwen2 blocks with biases)")  # fmt: skip
    if len(groups) > 1:
        found = {k: sorted(v)[0] for k, v in sorted(groups.items())}
        raise HfError(f"{where}: the folder mixes MTP draft layouts {found}; expected one of them")
    if not groups:
        if declared or conv is not None:
            declared = declared or 1
            layout = LAYOUT_QWEN35 if MTP_COUNT_KEYS[0] in hf or conv is not None else LAYOUT_DEEPSEEK
            if declared > 1:
                raise HfError(f"{where}: config.json declares {declared} MTP draft layers; ddl-wgpu supports "
                              "exactly one draft block")  # fmt: skip
            return _Draft(
                layout, conv or _LAYOUT_DEFAULTS[layout], "ddl_mtp" if conv else "layout default", ()
            )
        return None
    ((layout, names),) = groups.items()
    if declared == 0:
        raise HfError(f"{where}: config.json declares 0 MTP draft layers but the folder holds draft tensors "
                      f"({sorted(names)[:3]})")  # fmt: skip
    if layout == LAYOUT_DEEPSEEK:
        found = max(deepseek_idx) - n_layers + 1
    else:
        idx = {int(m.group(1)) for n in names if (m := _LAYER_INDEX[layout].match(n))}
        found = max(idx) + 1 if idx else 1
    count = max(found, declared or 0)
    if count != 1:
        evidence = [f"config.json declares {declared}"] if declared is not None else []
        evidence += [f"tensors under {layout} span {found} layer(s)"]
        raise HfError(f"{where}: the folder carries {count} MTP draft layers ({'; '.join(evidence)}); ddl-wgpu "
                      "supports exactly one draft block")  # fmt: skip
    ignored: tuple[str, ...] = ()
    if layout == LAYOUT_DEEPSEEK:
        ignored = tuple(
            f"model.layers.{n_layers}.{s}" for s in _DEEPSEEK_SHARED if f"model.layers.{n_layers}.{s}" in have
        )
    return _Draft(layout, conv or _LAYOUT_DEFAULTS[layout], "ddl_mtp" if conv else "layout default", ignored)


# ------------------------------------------------------------------------------------------------ import


def _more(xs: list, k: int = 4) -> str:
    return f"{xs[:k]}" + (f" and {len(xs) - k} more" if len(xs) > k else "")


def import_hf(folder) -> Model:
    """A Hugging Face model folder -> Model (float32 parameters in table order, tokenizer bytes if present,
    the MTP draft when the folder carries one)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HfError(f"{folder}: not a directory")
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise HfError(f"{folder}: no config.json (not a Hugging Face model folder?)")
    hf = read_json(cfg_path)
    cfg, arch = config_from_hf(hf, str(cfg_path))
    for key in (
        "bos_token_id",
        "eos_token_id",
    ):  # kept in the header: refused now, not at the save after the work
        v = hf.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= MAX_INT64:
            raise HfError(f"{cfg_path}: {key} {v} is not a token id (not between 0 and 2^63-1)")
    try:  # before anything is sized from the config (a table of 1e9 layers alone takes minutes)
        check_fits(cfg, training=False, what=f"{cfg_path}: the model")
    except ConfigError as e:
        raise HfError(str(e)) from None
    weights = Weights(folder)
    have = set(weights.names())
    draft = None if arch == RAW_ARCHITECTURE else _find_draft(hf, have, cfg.n_layers, str(cfg_path))
    if draft is not None:
        cfg = dataclasses.replace(cfg, mtp=draft.mtp)
    table = param_table(cfg)
    want = {s.name: s for s in table}
    src = {n: n for n in want}  # our name -> the folder's name
    if draft is not None:
        src.update({s.name: draft_hf_name(s.name, draft.layout, cfg.n_layers) for s in mtp_specs(cfg)})
    # A tied checkpoint may hold the shared matrix under either name (transformers keeps one of the two).
    if cfg.tie_embeddings and "model.embed_tokens.weight" not in have and "lm_head.weight" in have:
        src["model.embed_tokens.weight"] = "lm_head.weight"
    is_draft = {n: n.startswith(MTP_PREFIX) for n in want}
    missing = [n for n in want if src[n] not in have and not is_draft[n]]
    if missing:
        raise HfError(f"{folder}: missing tensor(s) {_more(missing)} for a {arch} with this config.json")
    missing = [src[n] for n in want if src[n] not in have and is_draft[n]]
    if missing:
        raise HfError(f"{folder}: the MTP draft ({draft.layout} layout) is missing {len(missing)} tensor(s): "
                      f"{missing}")  # fmt: skip
    used = set(src.values())
    ignored = sorted(
        n for n in have - used if _IGNORED.search(n) or (n == "lm_head.weight" and cfg.tie_embeddings)
    )
    if draft is not None:
        ignored += draft.ignored
    unexpected = sorted(have - used - set(ignored))
    if unexpected:
        raise HfError(f"{folder}: unexpected tensor(s) {_more(unexpected)}"
                      + f" (not part of a {arch}{' + MTP draft' if draft else ''} with this config.json)")  # fmt: skip
    params: dict[str, np.ndarray] = {}
    dtypes: set[str] = set()
    for name, spec in want.items():
        shape = weights.shape(src[name])
        if tuple(shape) != tuple(spec.shape):
            if is_draft[name]:
                raise HfError(f"{folder}: MTP draft tensor {src[name]} has shape {tuple(shape)}; the trunk's "
                              f"geometry (config.json) implies {spec.shape}")  # fmt: skip
            raise HfError(
                f"{folder}: tensor {src[name]} has shape {tuple(shape)}, config.json implies {spec.shape}"
            )
        dtypes.add(weights.dtype(src[name]))
        params[name] = weights.read_f32(src[name])
    if draft is not None and cfg.mtp.concat == "hidden_first":  # an HF fc/eh_proj is embedding first
        params["model.mtp.eh_proj.weight"] = swap_eh_halves(params["model.mtp.eh_proj.weight"])
    tok = folder / "tokenizer.json"
    tokenizer = read_regular(tok, "a tokenizer.json", HfError, MAX_TOKENIZER) if tok.exists() else None
    metadata: dict[str, Any] = {"hf.architecture": arch}
    for key in ("bos_token_id", "eos_token_id"):
        if isinstance(hf.get(key), int) and not isinstance(hf.get(key), bool):
            metadata[f"hf.{key}"] = hf[key]
    provenance = {"import_hf": {"source": str(folder.resolve()), "architecture": arch, "dtypes": sorted(dtypes),
                                "shards": len(weights.files)}}  # fmt: skip
    if draft is not None:
        metadata["hf.mtp_layout"] = draft.layout
        provenance["import_hf"]["mtp"] = {"layout": draft.layout, "conventions": draft.conventions,
                                          **draft.mtp.to_dict(), "ignored": list(draft.ignored)}  # fmt: skip
    # the variant follows from the config (a raw export of a DDL model imports as that DDL variant)
    variant = ModelVariant.of_config(cfg).slug
    return Model(cfg=cfg, params=params, variant=variant, tokenizer=tokenizer, provenance=provenance,
                 metadata=metadata)  # fmt: skip


# ------------------------------------------------------------------------------------------------ export


def _check_params(model: Model) -> list[str]:
    names = []
    for spec in param_table(model.cfg):
        a = model.params.get(spec.name)
        if a is None:
            raise HfError(f"model is missing parameter {spec.name}")
        if tuple(np.shape(a)) != tuple(spec.shape):
            raise HfError(f"parameter {spec.name} has shape {tuple(np.shape(a))}, config needs {spec.shape}")
        names.append(spec.name)
    return names


def _tokenizer_bytes(model: Model) -> bytes | None:
    tok = model.tokenizer
    return tok.encode("utf-8") if isinstance(tok, str) else tok


def _token_id(model: Model, key: str) -> int | None:
    v = model.metadata.get(f"hf.{key}")
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# What a Hugging Face export folder holds (ours, or a previous one of transformers); with overwrite=True only
# a folder holding nothing else is replaced, so a mistyped path never deletes unrelated files.
_EXPORT_FILES = re.compile(
    r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|vocab|added_tokens)\.json"
    r"|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|merges\.txt|README\.md"
)


def _check_target(folder: Path, overwrite: bool) -> bool:
    """Whether `folder` exists (an empty folder, or with overwrite=True a previous export); HfError else."""
    if not (folder.exists() or folder.is_symlink()):
        return False
    if folder.is_symlink() or not folder.is_dir():
        raise HfError(f"{folder}: exists and is not a folder; export into a new or empty folder")
    entries = sorted(os.listdir(folder))
    if entries and not overwrite:
        raise HfError(f"{folder}: folder is not empty ({_more(entries, 3)}); export into a new or empty folder "
                      "(another model's tokenizer.json, index or shards would be mixed with this one), or "
                      "replace a previous export (`ddl-wgpu export-hf --force`, overwrite=True)")  # fmt: skip
    foreign = [e for e in entries if not (_EXPORT_FILES.fullmatch(e) and (folder / e).is_file())]
    if foreign:
        raise HfError(f"{folder}: holds {_more(foreign, 3)}, which is not part of a Hugging Face export; "
                      "refusing to replace the folder (export into a new or empty one)")  # fmt: skip
    return True


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):  # makes the renames durable on POSIX; not possible on Windows
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _exists(p: Path) -> bool:
    try:
        return os.path.lexists(p) or p.exists()
    except OSError:  # a name the file system cannot hold (too long): nothing is there
        return False


def _put_back(old: Path, folder: Path, tmp: Path) -> None:
    """After a failed export: the previous folder back under its name, the partial one gone. Never raises:
    the failure it cleans up after is the one to report (a name too long fails every look at it too)."""
    with contextlib.suppress(OSError):
        if _exists(old) and not _exists(folder):
            os.rename(old, folder)
    with contextlib.suppress(OSError):
        shutil.rmtree(tmp, ignore_errors=True)


def _write_folder(
    model: Model, folder: Path, config: dict, tensors: list[tuple[str, np.ndarray]], overwrite: bool = False
) -> list[Path]:
    """Write the export into a fresh sibling folder, then rename it onto `folder`: the result holds exactly
    this model's files, and a failure (disk full, Ctrl-C) leaves `folder` as it was."""
    exists = _check_target(folder, overwrite)
    parent = folder.absolute().parent
    tmp = parent / f".{folder.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    old = parent / f".{folder.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    names = ["config.json", "model.safetensors"]
    try:
        parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(tmp)
        write_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
        write_bytes(tmp / "config.json", (json.dumps(config, indent=2) + "\n").encode("utf-8"))
        tok = _tokenizer_bytes(model)
        if tok is not None:
            write_bytes(tmp / "tokenizer.json", tok)
            names.append("tokenizer.json")
        _fsync_dir(tmp)
        if exists:
            os.rename(folder, old)
        os.rename(tmp, folder)
    except OSError as e:
        _put_back(old, folder, tmp)
        raise HfError(
            f"{folder}: cannot write the export: {e.strerror or e} ({folder} is unchanged)"
        ) from None
    except BaseException:
        _put_back(old, folder, tmp)
        raise
    shutil.rmtree(old, ignore_errors=True)
    _fsync_dir(parent)
    return [folder / n for n in names]


def _hf_tensors(model: Model, names: list[str]) -> list[tuple[str, np.ndarray]]:
    """(HF name, array) in table order; a "hidden_first" draft's eh_proj is written embedding first (mtp.fc)."""
    out = []
    for n in names:
        a = model.params[n]
        if n == "model.mtp.eh_proj.weight" and model.cfg.mtp.concat == "hidden_first":
            a = swap_eh_halves(np.asarray(a))
        out.append((our_to_hf_name(n), a))
    return out


def export_hf(model: Model, folder, overwrite: bool = False) -> list[Path]:
    """Write a baseline model as a folder transformers loads (Qwen3ForCausalLM, or LlamaForCausalLM for
    qk_norm 'none'): config.json, model.safetensors (f32; no lm_head when tied), tokenizer.json if any.
    An MTP draft goes under the Qwen3.5 `mtp.*` names (transformers ignores them) with
    `mtp_num_hidden_layers: 1` and `ddl_mtp` in config.json; `import_hf` reads it back exactly.

    `folder` must be new or empty; `overwrite=True` replaces a previous export (a folder holding only the
    files of one). The folder is written whole and renamed into place, so it never mixes two models."""
    config = config_to_hf(model.cfg, _token_id(model, "bos_token_id"), _token_id(model, "eos_token_id"))
    return _write_folder(model, Path(folder), config, _hf_tensors(model, _check_params(model)), overwrite)


def export_raw(model: Model, folder, overwrite: bool = False) -> list[Path]:
    """Write any model (DDL included) under our own names: model.safetensors + a config.json with our
    ModelConfig fields, marked `DdlForCausalLM`. transformers cannot load it; `import_hf` can."""
    config = {
        "architectures": [RAW_ARCHITECTURE],
        "model_type": "ddl",
        "note": "ddl-wgpu model (ModelConfig fields below); transformers has no class for this architecture, "
        "so AutoModel cannot load it. Read it with ddl_wgpu.hf.import_hf.",
        "variant": model.variant,
        **model.cfg.to_dict(),
    }
    tensors = [(n, model.params[n]) for n in _check_params(model)]
    return _write_folder(model, Path(folder), config, tensors, overwrite)


# ------------------------------------------------------------------------------------- file conveniences


def _folder_inputs(folder: Path) -> list[Path]:
    """Every file of `folder` that import_hf may read."""
    names = ["config.json", "tokenizer.json", "model.safetensors.index.json"]
    return [folder / n for n in names] + sorted(folder.glob("*.safetensors"))


def import_hf_to_file(folder, out_path) -> dict:
    """import_hf + save_model; -> a short summary for the CLI. Refuses, before reading anything, an output that
    is one of the folder's files (`F/model.safetensors`, `F/config.json`, ...) or the folder itself."""
    folder = Path(folder)
    refuse_overwrite_input(out_path, _folder_inputs(folder), HfError)
    model = import_hf(folder)
    path = save_model(out_path, model)
    return {
        "path": str(path),
        "architecture": model.metadata["hf.architecture"],
        "num_params": int(sum(s.numel for s in param_table(model.cfg))),
        "tensors": len(model.params),
        "dtypes": model.provenance["import_hf"]["dtypes"],
        "tied": model.cfg.tie_embeddings,
        "tokenizer": model.tokenizer is not None,
        "mtp": model.provenance["import_hf"].get("mtp"),  # None: the folder has no draft
    }


def export_hf_from_file(
    model_path, folder, raw: bool | None = None, overwrite: bool = False, verify: bool = True
) -> dict:
    """load_model + export_hf (or export_raw: `raw=True`, or by default for residual 'delta' models).
    `overwrite` and the folder rules: see `export_hf`; `verify=False` skips the tensor hash check."""
    refuse_overwrite_input(folder, [model_path], HfError)
    model = load_model(model_path, verify=verify)
    if raw is None:
        raw = model.cfg.residual != "add"
    files = export_raw(model, folder, overwrite) if raw else export_hf(model, folder, overwrite)
    config = json.loads((Path(folder) / "config.json").read_text())
    summary = {
        "folder": str(folder),
        "architecture": config["architectures"][0],
        "raw": raw,
        "num_params": int(sum(s.numel for s in param_table(model.cfg))),
        "files": [p.name for p in files],
        "mtp": None,
    }
    if model.cfg.mtp is not None:
        summary["mtp"] = _mtp_export_summary(model.cfg.mtp, raw)
    return summary


def _mtp_export_summary(mtp: MtpConfig, raw: bool) -> dict:
    if raw:
        return {"names": "model.mtp.*", **mtp.to_dict(), "note": "draft written under our own names"}
    note = (
        "transformers' Qwen3/Llama classes ignore the mtp.* tensors (the trunk loads, with an 'unused "
        "weights' warning); MTP-aware runtimes read them as a Qwen3.5 draft (mtp.fc embedding first)"
    )
    out = {"names": "mtp.*", **mtp.to_dict(), "note": note}
    if mtp.trunk_hidden != "post_norm" or mtp.chain_hidden != "post_norm":
        out["warning"] = (
            "vLLM/SGLang feed the draft post-norm hiddens (docs/heal.md#the-draft-block); this draft "
            f"expects trunk {mtp.trunk_hidden}, chain {mtp.chain_hidden}"
        )
    return out
