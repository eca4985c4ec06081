"""Hugging Face interop: import a `config.json` + `*.safetensors` folder, export a model as a folder transformers
loads (docs/container.md#hugging-face-interop).

This module is the driver and what every family shares: the one table-driven import (our parameter table -> the
folder's names and shapes, every tensor checked, missing and unexpected ones refused), the export folder (written
whole and renamed into place), and the file conveniences the CLI calls. The families:

- `ddl_wgpu.hf_llama`: `Qwen3ForCausalLM` and `LlamaForCausalLM` (and the raw export `DdlForCausalLM`);
- `ddl_wgpu.hf_qwen35`: `Qwen3_5ForCausalLM` and `Qwen3_5ForConditionalGeneration` (hybrid Gated DeltaNet
  trunks), whose tensors we do not run (the vision tower) and small files are kept and written back;
- `ddl_wgpu.hf_common`: the MTP draft's layouts and names, shared by both.

Weights are bf16/f16/f32, in one `model.safetensors` or in shards listed by `model.safetensors.index.json`. Our
parameter names are transformers' names for the text model
(docs/model.md#parameters-names-and-the-one-table-ddl_refparamspy): the trunk's rename is the identity (a Qwen3.5 conditional-generation folder adds
`model.language_model.`), the draft's is `MTP_RENAMES`.

On export, a Qwen3.5-family model (an imported one, or a hybrid made here) is written by `hf_qwen35`; a baseline
model with qk_norm "pre_rope" becomes `Qwen3ForCausalLM`, "none" `LlamaForCausalLM`; what no transformers class
computes exactly is refused, naming `export_raw`, which writes any model (DDL included) under our own names.

The folder's files (safetensors, the sharded index, config.json, tokenizer.json) are read and written by
`ddl_wgpu.hf_files`, which treats every one as untrusted; every bad input raises one `HfError`.

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

from ddl_ref.config import ConfigError, ModelConfig, ModelVariant
from ddl_ref.params import MTP_PREFIX, mtp_specs, param_table
from ddl_wgpu import hf_qwen35, served_draft
from ddl_wgpu.hf_common import (
    LAYOUT_DEEPSEEK,
    LAYOUT_MIMO,
    LAYOUT_OURS,
    LAYOUT_QWEN35,
    MAX_INT64,
    MTP_CONVENTION_KEY,
    MTP_COUNT_KEYS,
    MTP_PREFIX_RENAMES,
    MTP_RENAMES,
    RAW_ARCHITECTURE,
    RAW_HINT,
    draft_hf_name,
    find_draft,
    more,
    mtp_our_name,
    our_to_hf_name,
    swap_eh_halves,
)
from ddl_wgpu.hf_files import (
    MAX_JSON_FILE,
    MAX_TOKENIZER,
    HfError,
    StTensor,
    Weights,
    write_bytes,
    write_safetensors,
)
from ddl_wgpu.hf_llama import SUPPORTED, config_to_hf
from ddl_wgpu.hf_llama import config_from_hf as _llama_config
from ddl_wgpu.modelfile import Model, check_fits, load_model, save_model
from ddl_wgpu.safeio import load_json, read_regular, refuse_overwrite_input

__all__ = ["HfError", "config_from_hf", "config_to_hf", "export_hf", "export_hf_from_file", "export_raw",
           "import_hf", "import_hf_to_file"]  # fmt: skip
# names other modules and older callers take from here
_REEXPORTED = (LAYOUT_DEEPSEEK, LAYOUT_MIMO, LAYOUT_OURS, LAYOUT_QWEN35, MTP_CONVENTION_KEY, MTP_COUNT_KEYS,
               MTP_PREFIX_RENAMES, MTP_RENAMES, RAW_HINT, SUPPORTED, draft_hf_name, mtp_our_name, our_to_hf_name)  # fmt: skip

# Tensors some checkpoints carry that are not parameters (old Llama saves kept the RoPE buffer).
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def config_from_hf(hf: dict, where: str = "config.json") -> tuple[ModelConfig, str]:
    """A transformers config dict -> (ModelConfig of the trunk, architecture). HfError for what we cannot run."""
    if not isinstance(hf, dict):
        raise HfError(f"{where}: must be a JSON object")
    if hf_qwen35.claims(hf):
        cfg, src = hf_qwen35.read_config(hf, where)
        return cfg, src.arch
    return _llama_config(hf, where)


# ------------------------------------------------------------------------------------------------ import


def _llama_plan(hf: dict, have: set[str], where: str) -> dict[str, Any]:
    """How to read a Qwen3/Llama (or raw export) folder: our names are its names; a draft in any layout."""
    cfg, arch = _llama_config(hf, where)
    draft = None if arch == RAW_ARCHITECTURE else find_draft(hf, have, cfg.n_layers, where)
    if draft is not None:
        cfg = dataclasses.replace(cfg, mtp=draft.mtp)
    names = {s.name: s.name for s in param_table(cfg)}
    if draft is not None:
        names.update({s.name: draft_hf_name(s.name, draft.layout, cfg.n_layers) for s in mtp_specs(cfg)})
    return {"cfg": cfg, "arch": arch, "names": names, "shapes": {}, "draft": draft, "kept": [], "note": None,
            "source": None}  # fmt: skip


def _token_ids(hf: dict, where: str) -> dict[str, int]:
    """bos/eos token ids (a conditional-generation config may keep them in text_config), kept in the header:
    refused now, not at the save after the work."""
    text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
    out = {}
    for key in ("bos_token_id", "eos_token_id"):
        v = hf.get(key) if hf.get(key) is not None else text.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            if not 0 <= v <= MAX_INT64:
                raise HfError(f"{where}: {key} {v} is not a token id (not between 0 and 2^63-1)")
            out[key] = v
    return out


def _kept_files(folder: Path) -> dict[str, bytes]:
    """The small files a Qwen3.5 folder carries besides config.json, tokenizer.json and the weights."""
    out, total = {}, 0
    for name in sorted(os.listdir(folder)):
        if hf_qwen35.KEEP_FILES.fullmatch(name):
            data = read_regular(folder / name, "a Hugging Face folder file", HfError, hf_qwen35.MAX_FILE)
            total += len(data)
            if total > hf_qwen35.MAX_FILES:
                raise HfError(
                    f"{folder}: its small files exceed {hf_qwen35.MAX_FILES} bytes together (at {name})"
                )
            out[name] = data
    return out


def import_hf(folder) -> Model:
    """A Hugging Face model folder -> Model (float32 parameters in table order, tokenizer bytes if present,
    the MTP draft when the folder carries one; for the Qwen3.5 family also each tensor's dtype, the tensors we do
    not run and the folder's small files, for export)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HfError(f"{folder}: not a directory")
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise HfError(f"{folder}: no config.json (not a Hugging Face model folder?)")
    where = str(cfg_path)
    cfg_raw = read_regular(cfg_path, "a JSON file", HfError, MAX_JSON_FILE)
    hf = load_json(cfg_raw, where, HfError)
    cfg, arch = config_from_hf(hf, where)
    ids = _token_ids(hf, where)
    try:  # before anything is sized from the config (a table of 1e9 layers alone takes minutes)
        check_fits(cfg, training=False, what=f"{where}: the model")
    except ConfigError as e:
        raise HfError(str(e)) from None
    weights = Weights(folder)
    have = set(weights.names())
    qwen35 = hf_qwen35.claims(hf)
    plan = hf_qwen35.plan(hf, have, where) if qwen35 else _llama_plan(hf, have, where)
    cfg, draft, src = plan["cfg"], plan["draft"], dict(plan["names"])
    table = param_table(cfg)
    want = {s.name: s for s in table}
    head, embed = "lm_head.weight", src["model.embed_tokens.weight"]  # the head's name in every layout
    # A tied checkpoint may hold the shared matrix under either name (transformers keeps one of the two).
    if cfg.tie_embeddings and embed not in have and head in have:
        src["model.embed_tokens.weight"] = head
    is_draft = {n: n.startswith(MTP_PREFIX) for n in want}
    missing = [src[n] for n in want if src[n] not in have and not is_draft[n]]
    if missing:
        raise HfError(f"{folder}: missing tensor(s) {more(missing)} for a {arch} with this config.json")
    missing = [src[n] for n in want if src[n] not in have and is_draft[n]]
    if missing:
        raise HfError(f"{folder}: the MTP draft ({draft.layout} layout) is missing {len(missing)} tensor(s): "
                      f"{missing}")  # fmt: skip
    used = set(src.values())
    ignored = sorted(n for n in have - used if _IGNORED.search(n) or (n == head and cfg.tie_embeddings))
    if draft is not None:
        ignored += draft.ignored
    kept = [n for n in plan["kept"] if n not in used]
    unexpected = sorted(have - used - set(ignored) - set(kept))
    if unexpected:
        raise HfError(f"{folder}: unexpected tensor(s) {more(unexpected)}"
                      + f" (not part of a {arch}{' + MTP draft' if draft else ''} with this config.json)")  # fmt: skip
    params: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name, spec in want.items():
        shape, expect = weights.shape(src[name]), plan["shapes"].get(name, spec.shape)
        if tuple(shape) != tuple(expect):
            if is_draft[name]:
                raise HfError(f"{folder}: MTP draft tensor {src[name]} has shape {tuple(shape)}; the trunk's "
                              f"geometry (config.json) implies {tuple(expect)}")  # fmt: skip
            raise HfError(
                f"{folder}: tensor {src[name]} has shape {tuple(shape)}, config.json implies {tuple(expect)}"
            )
        dtypes[name] = weights.dtype(src[name])
        params[name] = weights.read_f32(src[name]).reshape(spec.shape)
    if draft is not None and cfg.mtp.concat == "hidden_first":  # an HF fc/eh_proj is embedding first
        params["model.mtp.eh_proj.weight"] = swap_eh_halves(params["model.mtp.eh_proj.weight"])
    tok = folder / "tokenizer.json"
    tokenizer = read_regular(tok, "a tokenizer.json", HfError, MAX_TOKENIZER) if tok.exists() else None
    metadata: dict[str, Any] = {"hf.architecture": arch, **{f"hf.{k}": v for k, v in ids.items()}}
    provenance = {"import_hf": {"source": str(folder.resolve()), "architecture": arch,
                                "dtypes": sorted(set(dtypes.values())), "shards": len(weights.files)}}  # fmt: skip
    if draft is not None:
        metadata["hf.mtp_layout"] = draft.layout
        provenance["import_hf"]["mtp"] = {"layout": draft.layout, "conventions": draft.conventions,
                                          **draft.mtp.to_dict(), "ignored": list(draft.ignored)}  # fmt: skip
    model = Model(cfg=cfg, params=params, variant=ModelVariant.of_config(cfg).slug, tokenizer=tokenizer,
                  provenance=provenance, metadata=metadata)  # fmt: skip
    if qwen35:
        _keep_source(model, plan, folder, weights, kept, dtypes, cfg_raw)
    return model


def _keep_source(model: Model, plan: dict, folder: Path, weights: Weights, kept: list[str], dtypes: dict,
                 cfg_raw: bytes) -> None:  # fmt: skip
    """A Qwen3.5 import keeps what export writes back: each parameter's dtype, the tensors we do not run (raw
    bytes), config.json and the small files, and the layout (docs/container.md#hugging-face-interop)."""
    files = {"config.json": cfg_raw, **_kept_files(folder)}
    model.dtypes = {n: hf_qwen35.OURS_OF[d] for n, d in dtypes.items()}
    model.extra = {hf_qwen35.KEEP_PREFIX + n: weights.read_raw(n) for n in kept}
    model.extra.update(
        {hf_qwen35.FILE_PREFIX + n: np.frombuffer(b, np.uint8).copy() for n, b in files.items()}
    )
    shard_bytes = weights.data_bytes() if len(weights.files) > 1 else 0
    info = {n: (weights.dtype(n), weights.shape(n)) for n in kept}
    model.metadata[hf_qwen35.SOURCE_KEY] = hf_qwen35.source_record(
        plan["source"], info, list(files), shard_bytes
    )
    rec = model.provenance["import_hf"]
    rec.update(layout=plan["source"].layout, kept_tensors=len(kept), files=sorted(files))
    if plan["note"]:
        rec["note"] = plan["note"]


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
    r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|vocab|added_tokens"
    r"|preprocessor_config|video_preprocessor_config|processor_config|chat_template)\.json|chat_template\.jinja"
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
        raise HfError(f"{folder}: folder is not empty ({more(entries, 3)}); export into a new or empty folder "
                      "(another model's tokenizer.json, index or shards would be mixed with this one), or "
                      "replace a previous export (`ddl-wgpu export-hf --force`, overwrite=True)")  # fmt: skip
    foreign = [e for e in entries if not (_EXPORT_FILES.fullmatch(e) and (folder / e).is_file())]
    if foreign:
        raise HfError(f"{folder}: holds {more(foreign, 3)}, which is not part of a Hugging Face export; "
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


def _shards(tensors: list, limit: int) -> list[list]:
    """Tensors grouped in order into shards of at most `limit` bytes (a larger tensor alone); 0: one file."""
    if not limit:
        return [tensors]
    groups, used = [[]], 0
    for t in tensors:
        n = t.data.nbytes if isinstance(t, StTensor) else np.asarray(t[1]).size * 4
        if groups[-1] and used + n > limit:
            groups.append([])
            used = 0
        groups[-1].append(t)
        used += n
    return groups


def _write_folder(model: Model, folder: Path, config: dict, tensors: list, overwrite: bool = False,
                  files: dict[str, bytes] | None = None, shard_bytes: int = 0) -> list[Path]:  # fmt: skip
    """Write the export into a fresh sibling folder, then rename it onto `folder`: the result holds exactly
    this model's files, and a failure (disk full, Ctrl-C) leaves `folder` as it was. `tensors` go into one
    model.safetensors, or shards of about `shard_bytes` with their index; `files` are written as they are."""
    exists = _check_target(folder, overwrite)
    parent = folder.absolute().parent
    tmp = parent / f".{folder.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    old = parent / f".{folder.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    names = ["config.json"]
    try:
        parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(tmp)
        groups = _shards(tensors, shard_bytes)
        if len(groups) == 1:
            write_safetensors(tmp / "model.safetensors", tensors, {"format": "pt"})
            names.append("model.safetensors")
        else:
            weight_map, total = {}, 0
            for k, group in enumerate(groups):
                shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
                total += write_safetensors(tmp / shard, group, {"format": "pt"})
                weight_map.update({(t.name if isinstance(t, StTensor) else t[0]): shard for t in group})
                names.append(shard)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_bytes(tmp / "model.safetensors.index.json", (json.dumps(index, indent=2) + "\n").encode())
            names.append("model.safetensors.index.json")
        write_bytes(tmp / "config.json", (json.dumps(config, indent=2) + "\n").encode("utf-8"))
        tok = _tokenizer_bytes(model)
        if tok is not None:
            write_bytes(tmp / "tokenizer.json", tok)
            names.append("tokenizer.json")
        for name, data in sorted((files or {}).items()):
            write_bytes(tmp / name, data)
            names.append(name)
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
    """Write a model as a folder transformers loads.

    A Qwen3.5-family model (imported from such a folder, or a hybrid trunk made here) is written by `hf_qwen35`:
    the layout it came from (`Qwen3_5ForCausalLM` for one made here), each tensor in its dtype, the folder's
    kept tensors and files. A baseline model becomes Qwen3ForCausalLM (or LlamaForCausalLM for qk_norm 'none'):
    config.json, model.safetensors (f32; no lm_head when tied), tokenizer.json if any; an MTP draft goes under
    the Qwen3.5 `mtp.*` names (transformers ignores them) with `mtp_num_hidden_layers: 1` and `ddl_mtp` in
    config.json; `import_hf` reads it back exactly.

    `folder` must be new or empty; `overwrite=True` replaces a previous export (a folder holding only the
    files of one). The folder is written whole and renamed into place, so it never mixes two models."""
    names = _check_params(model)
    if hf_qwen35.is_qwen35(model.cfg) or model.metadata.get(hf_qwen35.SOURCE_KEY) is not None:
        p = hf_qwen35.export_plan(model)
        # vLLM and SGLang build the draft from config.json: a tensor of another shape is refused before writing
        served_draft.refuse_unservable(p["config"], {t.name: t.shape for t in p["tensors"]})
        return _write_folder(
            model, Path(folder), p["config"], p["tensors"], overwrite, p["files"], p["shard_bytes"]
        )
    config = config_to_hf(model.cfg, _token_id(model, "bos_token_id"), _token_id(model, "eos_token_id"))
    return _write_folder(model, Path(folder), config, _hf_tensors(model, names), overwrite)


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
    kept = (
        sorted(p for p in folder.glob("*") if hf_qwen35.KEEP_FILES.fullmatch(p.name))
        if folder.is_dir()
        else []
    )
    return [folder / n for n in names] + sorted(folder.glob("*.safetensors")) + kept


def import_hf_to_file(folder, out_path) -> dict:
    """import_hf + save_model; -> a short summary for the CLI. Refuses, before reading anything, an output that
    is one of the folder's files (`F/model.safetensors`, `F/config.json`, ...) or the folder itself."""
    folder = Path(folder)
    refuse_overwrite_input(out_path, _folder_inputs(folder), HfError)
    model = import_hf(folder)
    path = save_model(out_path, model, dtype=model.dtypes)  # f32 where no dtype is kept (Qwen3/Llama)
    rec = model.provenance["import_hf"]
    out = {
        "path": str(path),
        "architecture": model.metadata["hf.architecture"],
        "num_params": int(sum(s.numel for s in param_table(model.cfg))),
        "tensors": len(model.params),
        "dtypes": rec["dtypes"],
        "tied": model.cfg.tie_embeddings,
        "tokenizer": model.tokenizer is not None,
        "mtp": rec.get("mtp"),  # None: the folder has no draft
    }
    if "layout" in rec:  # the Qwen3.5 family: what is kept for export
        out.update(layout=rec["layout"], kept_tensors=rec["kept_tensors"], files=rec["files"])
        if "note" in rec:
            out["note"] = rec["note"]
    return out


def export_hf_from_file(
    model_path, folder, raw: bool | None = None, overwrite: bool = False, verify: bool = True
) -> dict:
    """load_model + export_hf (or export_raw: `raw=True`, or by default for residual 'delta' models).
    `overwrite` and the folder rules: see `export_hf`; `verify=False` skips the tensor hash check."""
    refuse_overwrite_input(folder, [model_path], HfError)
    model = load_model(model_path, verify=verify, extra=True)
    if raw is None:
        raw = model.cfg.residual != "add"
    if not raw:  # a hostile record of kept tensors is refused before any work
        hf_qwen35.source_of(model, str(model_path))
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
    if summary["architecture"] in hf_qwen35.ARCHS:
        summary["layout"] = hf_qwen35.layout_of(summary["architecture"])
    if model.cfg.mtp is not None:
        summary["mtp"] = _mtp_export_summary(model.cfg, raw, summary["architecture"])
        if "layout" in summary:  # the written folder's mtp.* against what vLLM and SGLang build
            summary["mtp"]["served"] = served_draft.check_folder(folder).summary()
    return summary


def _mtp_export_summary(cfg: ModelConfig, raw: bool, arch: str = "") -> dict:
    mtp = cfg.mtp
    if raw:
        return {"names": "model.mtp.*", **mtp.to_dict(), "note": "draft written under our own names"}
    if arch in hf_qwen35.ARCHS:
        note = ("transformers' Qwen3.5 classes drop the mtp.* tensors on load (the trunk loads); vLLM's and "
                "SGLang's Qwen3.5 MTP loaders read them (mtp.fc embedding first)")  # fmt: skip
    else:
        note = (
            "transformers' Qwen3/Llama classes ignore the mtp.* tensors (the trunk loads, with an 'unused "
            "weights' warning); MTP-aware runtimes read them as a Qwen3.5 draft (mtp.fc embedding first)"
        )
    out = {"names": "mtp.*", **mtp.to_dict(), "note": note}
    if mtp.trunk_hidden != "post_norm" or mtp.chain_hidden != "post_norm":
        out["warning"] = ("vLLM/SGLang feed the draft post-norm hiddens (docs/heal.md#the-draft-block); this draft "
                          f"expects trunk {mtp.trunk_hidden}, chain {mtp.chain_hidden}")  # fmt: skip
    return out
