"""What the Hugging Face architecture families share (`ddl_wgpu.files.hf.convert` drives them): the plans a family hands the
driver (`ImportPlan`, `ExportPlan`), reading config.json values, the raw export's marker, and the MTP draft: its
layouts, its names in each, and finding it in a folder.

MTP draft (one block, `cfg.mtp`, `ddl_ref.params.mtp_specs`). Import reads it from three layouts (on a Qwen3/Llama
trunk the trunk decides the norm style, "standard" w·x̂ for the whole model, the draft's norms included; on a
Qwen3.5 trunk "offset" (1+w)·x̂, and only the "mtp." layout):

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
raise HfError. A draft trained with (1+w) norms and grafted onto a w·x̂ trunk cannot be told apart by its
names: its norm weights must be converted (w + 1) before import.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ddl_ref.config import ConfigError, ModelConfig, MtpConfig
from ddl_wgpu.files.hf.folder import HfError, StTensor

RAW_ARCHITECTURE = "DdlForCausalLM"  # export_raw's marker; import_hf reads it back
RAW_HINT = (
    "a raw export (`ddl-wgpu export-hf --raw`, export_hf_from_file(..., raw=True)) writes any model under "
    "ddl-wgpu's own tensor names, which import-hf reads back but transformers cannot load"
)
QWEN35_SUPPORTED = (
    "Qwen3_5ForCausalLM (model_type 'qwen3_5_text'), Qwen3_5ForConditionalGeneration (model_type 'qwen3_5')"
)
MAX_INT64 = (1 << 63) - 1  # the container's header stores integers as msgpack int64

# ------------------------------------------------------------------------------------------------ plans


@dataclasses.dataclass
class ImportPlan:
    """How to read one folder: what a family's `plan(hf, have, where)` returns and `hf.import_hf` carries out."""

    cfg: ModelConfig  # the model, its draft included
    arch: str  # the folder's architecture
    names: dict[str, str]  # our parameter -> the folder's tensor
    shapes: dict[str, tuple[int, ...]] = dataclasses.field(
        default_factory=dict
    )  # the folder's, where not ours
    draft: Draft | None = None
    note: str | None = None  # for the import summary (a declared draft the folder does not hold)
    keep_dtypes: bool = False  # each parameter stored in the folder's dtype (else float32)
    # The family writes the folder back as it came (`ddl_wgpu.files.hf.keep`): the layout it records, the tensors kept
    # byte for byte and the small files kept beside config.json. None: nothing is kept.
    layout: str | None = None
    kept: tuple[str, ...] = ()
    keep_files: re.Pattern | None = None


@dataclasses.dataclass
class ExportPlan:
    """What a family's `export_plan(model, record)` says to write: config.json, the tensors (names, dtypes and
    shapes of the folder; bytes read piece by piece), the small files, the shard size (0: one file)."""

    config: dict
    tensors: list[StTensor]
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)
    shard_bytes: int = 0
    layout: str | None = None  # for the summary
    mtp_note: str = ""  # how runtimes read the draft's tensors in this family's folders
    check_draft: Callable[[Path], dict] | None = None  # the written folder's draft against its runtimes


# ------------------------------------------------------------------------------------------------ names

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


def need(cfg: dict, key: str, where: str, kind: type = int) -> Any:
    if key not in cfg:
        raise HfError(f"{where}: missing {key!r}")
    v = cfg[key]
    ok = (isinstance(v, int | float) if kind is float else isinstance(v, kind)) and not isinstance(v, bool)
    if not ok:
        raise HfError(f"{where}: {key!r} must be {kind.__name__}, got {v!r}")
    return v


def optional(cfg: dict, key: str, default, where: str, kind: type) -> Any:
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


def more(xs: list, k: int = 4) -> str:
    return f"{xs[:k]}" + (f" and {len(xs) - k} more" if len(xs) > k else "")


# ------------------------------------------------------------------------------------------------ draft


@dataclasses.dataclass(frozen=True)
class Draft:
    layout: str
    mtp: MtpConfig
    conventions: str  # "ddl_mtp" (read from config.json) or "layout default"
    ignored: tuple[str, ...]  # shared embedding/head copies (DeepSeek layout)


_LAYER_INDEX = {
    LAYOUT_OURS: re.compile(r"^model\.mtp\.layers\.(\d+)\."),
    LAYOUT_QWEN35: re.compile(r"^mtp\.layers\.(\d+)\."),
}
_TRUNK_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def declared_mtp_layers(hf: dict, where: str) -> tuple[int | None, str | None]:
    """The draft layer count config.json declares and the key that declares it ((None, None): no key)."""
    declared, by = None, None
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
        declared, by = v, key
    return declared, by


def find_draft(hf: dict, have: set[str], n_layers: int, where: str, trunk_layer: re.Pattern = _TRUNK_LAYER
               ) -> Draft | None:  # fmt: skip
    """The draft a folder carries (None when it has none); HfError for one we cannot take. `hf` holds the text
    model's keys, `trunk_layer` matches the trunk's block names (DeepSeek's draft is the block after them)."""
    declared, by = declared_mtp_layers(hf, where)
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
        elif (m := trunk_layer.match(n)) and int(m.group(1)) >= n_layers and declared:
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
                raise HfError(f"{where}: {by} {declared}: config.json declares {declared} MTP draft layers; "
                              "ddl-wgpu supports exactly one draft block")  # fmt: skip
            return Draft(
                layout, conv or _LAYOUT_DEFAULTS[layout], "ddl_mtp" if conv else "layout default", ()
            )
        return None
    ((layout, names),) = groups.items()
    if declared == 0:
        raise HfError(f"{where}: {by} 0: config.json declares 0 MTP draft layers but the folder holds draft tensors "
                      f"({sorted(names)[:3]})")  # fmt: skip
    if layout == LAYOUT_DEEPSEEK:
        found = max(deepseek_idx) - n_layers + 1
    else:
        idx = {int(m.group(1)) for n in names if (m := _LAYER_INDEX[layout].match(n))}
        found = max(idx) + 1 if idx else 1
    count = max(found, declared or 0)
    if count != 1:
        evidence = [f"config.json declares {declared} with {by}"] if declared is not None else []
        evidence += [f"tensors under {layout} span {found} layer(s)"]
        raise HfError(f"{where}: the folder carries {count} MTP draft layers ({'; '.join(evidence)}); ddl-wgpu "
                      "supports exactly one draft block")  # fmt: skip
    ignored: tuple[str, ...] = ()
    if layout == LAYOUT_DEEPSEEK:
        ignored = tuple(
            f"model.layers.{n_layers}.{s}" for s in _DEEPSEEK_SHARED if f"model.layers.{n_layers}.{s}" in have
        )
    return Draft(layout, conv or _LAYOUT_DEFAULTS[layout], "ddl_mtp" if conv else "layout default", ignored)
