"""Hugging Face interop: import a `config.json` + `*.safetensors` folder, export a model as a folder transformers
loads (docs/container.md#hugging-face-interop).

This module is the driver and knows no family. The families (`FAMILIES`, tried in order on import):

- `ddl_wgpu.files.hf.qwen35`: `Qwen3_5ForCausalLM` and `Qwen3_5ForConditionalGeneration` (hybrid Gated DeltaNet
  trunks), written back as they came (tensors we do not run and small files kept, `ddl_wgpu.files.hf.keep`);
- `ddl_wgpu.files.hf.llama`: `Qwen3ForCausalLM` and `LlamaForCausalLM`, and the raw export's `DdlForCausalLM`; it
  claims whatever the others do not, and refuses it naming what is supported.

A family is a module with `claims(hf)` (does this config.json belong to it), `config_from_hf(hf, where)`,
`plan(hf, have, where) -> ImportPlan` (our parameter -> the folder's name and shape, the draft, what is kept),
`exports(cfg, record)` and `export_plan(model, record) -> ExportPlan` (config.json, the tensors, the files), and
`LAYOUTS` / `KEEP_FILES` (the layouts it writes back and the small files it keeps; empty and None for none).
The next family is a new module and one entry in `FAMILIES`. `ddl_wgpu.files.hf.common` holds what they share (the
plans, the MTP draft's layouts and names, config.json readers).

Both directions go tensor by tensor and piece by piece (`ddl_wgpu.files.lazy`): the import reads each tensor of the
folder a piece at a time and streams it into the `.ddlw` container, the export reads each of the model file and
streams it into the safetensors shards, so their memory is a few pieces whatever the model's size. `import_hf`
and `export_hf` (a Model in memory) take the same paths.

What this module deliberately does not do: the CLI (`cli/app.py` calls `import_hf_to_file` / `export_hf_from_file`),
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ddl_ref.config import ConfigError, ModelConfig, ModelVariant
from ddl_ref.params import MTP_PREFIX, param_table
from ddl_wgpu.files import eagle3file
from ddl_wgpu.files.hf import eagle3 as hf_eagle3
from ddl_wgpu.files.hf import llama as hf_llama
from ddl_wgpu.files.hf import qwen35 as hf_qwen35
from ddl_wgpu.files.hf.common import (
    _IGNORED,
    MAX_INT64,
    RAW_ARCHITECTURE,
    ExportPlan,
    ImportPlan,
    more,
    swap_eh_halves,
)
from ddl_wgpu.files.hf.folder import MAX_TOKENIZER, HfError, StTensor, Weights, write_bytes, write_safetensors
from ddl_wgpu.files.hf.keep import (
    FILE_PREFIX,
    KEEP_PREFIX,
    MAX_FILE,
    SOURCE_KEY,
    kept_files,
    source_of,
    source_record,
)
from ddl_wgpu.files.lazy import Progress, finite, from_array
from ddl_wgpu.files.modelfile import LazyModel, Model, check_fits, open_model, param_count, write_model
from ddl_wgpu.files.safeio import load_json, read_regular, refuse_overwrite_input, resolved, utf8_text

__all__ = ["FAMILIES", "HfError", "config_from_hf", "export_hf", "export_hf_from_file", "export_raw", "import_hf",
           "import_hf_to_file"]  # fmt: skip

FAMILIES = (hf_qwen35, hf_llama)  # the first that claims a config.json reads it; hf_llama claims the rest
# every layout a family writes back -> the small files it keeps (what hf_keep.source_of holds a record against)
_WRITTEN_BACK = {layout: f.KEEP_FILES for f in FAMILIES for layout in f.LAYOUTS}
_HEAD, _EMBED = "lm_head.weight", "model.embed_tokens.weight"  # the head's folder name in every family


def _family(hf: dict):
    return next(f for f in FAMILIES if f.claims(hf))


def config_from_hf(hf: dict, where: str = "config.json") -> tuple[ModelConfig, str]:
    """A transformers config dict -> (ModelConfig of the trunk, architecture). HfError for what we cannot run."""
    if not isinstance(hf, dict):
        raise HfError(f"{where}: must be a JSON object")
    return _family(hf).config_from_hf(hf, where)


# ------------------------------------------------------------------------------------------------ import


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


def _check_size(cfg: ModelConfig, where: str, resident: bool) -> None:
    """Before anything is sized from the config (a table of 1e9 layers alone takes minutes): a model held in
    memory must fit there (`resident`), one streamed to a file only be possible on some machine."""
    try:
        check_fits(cfg, training=False, what=f"{where}: the model", resident=resident)
    except ConfigError as e:
        raise HfError(str(e)) from None


def _check_backed(cfg: ModelConfig, weights: Weights, where: str) -> None:
    """The folder must hold the bytes its config describes (a parameter takes at least 2, as bf16 or f16)."""
    n, have = param_count(cfg), weights.total_bytes()
    if 2 * n > have:
        raise HfError(f"{where}: describes a model of {n:,} parameters (at least {2 * n:,} bytes as bf16), but the "
                      f"folder's safetensors hold {have:,} bytes of tensors")  # fmt: skip


def _same_bytes(weights: Weights, a: str, b: str) -> bool:
    if (weights.dtype(a), weights.shape(a)) != (weights.dtype(b), weights.shape(b)):
        return False
    return all(
        np.array_equal(x, y)
        for x, y in zip(weights.lazy_raw(a).pieces(), weights.lazy_raw(b).pieces(), strict=True)
    )


def _read_folder(folder, resident: bool) -> tuple[LazyModel, list[Path]]:
    """A Hugging Face folder as a LazyModel (only the headers read; the tensors are read when it is written or
    loaded) and the files it reads. `resident`: the caller holds the whole model in memory."""
    folder = Path(folder)
    for name in ("", "config.json", "tokenizer.json", "model.safetensors.index.json", "model.safetensors"):
        resolved(
            folder / name, HfError
        )  # a symbolic link loop is one line, not a folder or file said missing
    if not folder.is_dir():
        raise HfError(f"{folder}: not a directory")
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise HfError(f"{folder}: no config.json (not a Hugging Face model folder?)")
    where = str(cfg_path)
    cfg_raw = read_regular(cfg_path, "a JSON file", HfError, MAX_FILE)
    hf = load_json(cfg_raw, where, HfError)
    cfg, arch = config_from_hf(hf, where)
    ids = _token_ids(hf, where)
    _check_size(cfg, where, resident)
    weights = Weights(folder)
    _check_backed(cfg, weights, where)
    have = set(weights.names())
    plan = _family(hf).plan(hf, have, where)
    cfg, draft, src = plan.cfg, plan.draft, dict(plan.names)
    embed = src[_EMBED]
    untied = False
    # A tied checkpoint may hold the shared matrix under either name (transformers keeps one of the two); one that
    # holds two different ones is untied, as transformers unties it ("we will NOT tie them"): nothing is dropped.
    if cfg.tie_embeddings and embed not in have and _HEAD in have:
        src[_EMBED] = _HEAD
    elif cfg.tie_embeddings and embed in have and _HEAD in have and not _same_bytes(weights, embed, _HEAD):
        cfg, untied = dataclasses.replace(cfg, tie_embeddings=False), True
        src[_HEAD] = _HEAD
    want = {s.name: s for s in param_table(cfg)}
    is_draft = {n: n.startswith(MTP_PREFIX) for n in want}
    missing = [src[n] for n in want if src[n] not in have and not is_draft[n]]
    if missing:
        raise HfError(f"{folder}: missing tensor(s) {more(missing)} for a {arch} with this config.json")
    missing = [src[n] for n in want if src[n] not in have and is_draft[n]]
    if missing:
        raise HfError(f"{folder}: the MTP draft ({draft.layout} layout) is missing {len(missing)} tensor(s): "
                      f"{missing}")  # fmt: skip
    used = set(src.values())
    ignored = sorted(n for n in have - used if _IGNORED.search(n) or (n == _HEAD and cfg.tie_embeddings))
    if draft is not None:
        ignored += draft.ignored
    kept = [n for n in plan.kept if n not in used]
    unexpected = sorted(have - used - set(ignored) - set(kept))
    if unexpected:
        raise HfError(f"{folder}: unexpected tensor(s) {more(unexpected)}"
                      + f" (not part of a {arch}{' + MTP draft' if draft else ''} with this config.json)")  # fmt: skip
    tensors, dtypes = {}, {}
    for name, spec in want.items():
        shape, expect = weights.shape(src[name]), plan.shapes.get(name, spec.shape)
        if tuple(shape) != tuple(expect):
            if is_draft[name]:
                raise HfError(f"{folder}: MTP draft tensor {src[name]} has shape {tuple(shape)}; the trunk's "
                              f"geometry (config.json) implies {tuple(expect)}")  # fmt: skip
            raise HfError(
                f"{folder}: tensor {src[name]} has shape {tuple(shape)}, config.json implies {tuple(expect)}"
            )
        dtypes[name] = weights.dtype(src[name])
        t = finite(weights.lazy(src[name]), src[name], folder).reshape(spec.shape)  # checked as it converts
        if (
            name == "model.mtp.eh_proj.weight"
            and cfg.mtp.concat == "hidden_first"
            and arch != RAW_ARCHITECTURE
        ):
            t = t.map(swap_eh_halves)  # an HF fc/eh_proj is embedding first; a raw export keeps our order
        tensors[name] = t if plan.keep_dtypes else t.to("f32")
    tok = folder / "tokenizer.json"
    tokenizer = read_regular(tok, "a tokenizer.json", HfError, MAX_TOKENIZER) if tok.exists() else None
    utf8_text(tokenizer or b"", str(tok), HfError)  # carried as bytes, decoded by every command that loads it
    metadata: dict[str, Any] = {"hf.architecture": arch, **{f"hf.{k}": v for k, v in ids.items()}}
    rec = {"source": str(folder.resolve()), "architecture": arch, "dtypes": sorted(set(dtypes.values())),
           "shards": len(weights.files)}  # fmt: skip
    if draft is not None:
        metadata["hf.mtp_layout"] = draft.layout
        rec["mtp"] = {"layout": draft.layout, "conventions": draft.conventions, **draft.mtp.to_dict(),
                      "ignored": list(draft.ignored)}  # fmt: skip
    if untied:
        rec["untied"] = (
            f"config.json ties the embedding, but {_HEAD} differs from {embed}: both kept, as transformers does"
        )
    if plan.note:
        rec["note"] = plan.note
    model = LazyModel(cfg=cfg, tensors=tensors, variant=ModelVariant.of_config(cfg).slug, tokenizer=tokenizer,
                      provenance={"import_hf": rec}, metadata=metadata)  # fmt: skip
    inputs = [cfg_path, *(p for p in (tok, folder / "model.safetensors.index.json") if p.exists())]
    inputs += [f.path for f in weights.files]
    if plan.layout is not None:
        inputs += _keep(model, plan, folder, weights, kept, cfg_raw)
    return model, inputs


def _keep(model: LazyModel, plan: ImportPlan, folder: Path, weights: Weights, kept: list[str],
          cfg_raw: bytes) -> list[Path]:  # fmt: skip
    """What a family that writes the folder back keeps (`ddl_wgpu.files.hf.keep`): the tensors we do not run, byte for
    byte, config.json and the small files, and their record -> the small files read."""
    files = {"config.json": cfg_raw, **kept_files(folder, plan.keep_files)}
    model.extra = {KEEP_PREFIX + n: weights.lazy_raw(n) for n in kept}
    model.extra.update({FILE_PREFIX + n: from_array(np.frombuffer(b, np.uint8)) for n, b in files.items()})
    shard_bytes = weights.data_bytes() if len(weights.files) > 1 else 0
    info = {n: (weights.dtype(n), weights.shape(n)) for n in kept}
    model.metadata[SOURCE_KEY] = source_record(plan.arch, plan.layout, info, list(files), shard_bytes)
    model.provenance["import_hf"].update(layout=plan.layout, kept_tensors=len(kept), files=sorted(files))
    return [folder / n for n in files if n != "config.json"]


def import_hf(folder) -> Model:
    """A Hugging Face model folder -> Model in memory (float32 parameters in table order, tokenizer bytes if
    present, the MTP draft when the folder carries one, each parameter's storage dtype; for a family that writes
    the folder back, the tensors we do not run and the folder's small files)."""
    model, _ = _read_folder(folder, resident=True)
    return model.load()


def _eagle3_folder(folder) -> bool:
    """Whether `folder`'s config.json names an EAGLE-3 draft (`hf/eagle3.py` reads it); False when unreadable
    (the model import then says what is wrong)."""
    try:
        raw = read_regular(Path(folder) / "config.json", "a JSON file", HfError, MAX_FILE)
        return hf_eagle3.claims(load_json(raw, "config.json", HfError))
    except (HfError, OSError):
        return False


def import_eagle3_to_file(folder, out_path, target=None) -> dict:
    """An EAGLE-3 draft folder -> a draft file (`files/eagle3file.py`); `target` (a model file) gives the aux
    layer ids' default when the folder names none, and binds a draft whose folder records no target to it.
    -> a short summary for the CLI."""
    ident = None
    if target is not None:
        ident = eagle3file.target_identity(target)
    draft, notes, inputs = hf_eagle3.read_folder(folder, None if ident is None else ident["n_layers"])
    if ident is not None and not draft.target.get("config_hash"):
        # the folder names no target and the user named one: bound to it, so that `accept`, `generate` and
        # `heal` check it and map its layers onto a compressed copy (`files.eagle3_aux`)
        draft.target = {**ident, "path": str(target)}
        notes = [n for n in notes if not n.startswith("no target recorded")]
        notes.append(f"bound to the target {target} (--target)")
    refuse_overwrite_input(out_path, inputs, HfError)
    kinds = set(draft.dtypes.values())  # the folder's dtype when it has one (bf16 stays bf16), else f32
    eagle3file.save_draft(out_path, draft, kinds.pop() if len(kinds) == 1 else "f32")
    return {"path": str(out_path), "architecture": hf_eagle3.ARCHITECTURES[0], "eagle3": True,
            "num_params": eagle3file.draft_params_count(draft.cfg), "dtypes": sorted(set(draft.dtypes.values())),
            "draft_vocab": draft.cfg.draft_vocab, "aux_layers": list(draft.cfg.aux_layers),
            "bound_to_target": bool(draft.target.get("config_hash")), "notes": notes}  # fmt: skip


def import_hf_to_file(folder, out_path, say: Callable[[str], None] | None = None, target=None) -> dict:
    """A Hugging Face folder -> a model file, tensor by tensor (the memory a few pieces, whatever the model's
    size); -> a short summary for the CLI. Refuses, before writing anything, an output that is one of the files
    the import reads (`F/model.safetensors`, `F/config.json`, ...) or a folder that holds one. `say`: where a
    long import says its progress. An EAGLE-3 draft folder becomes a draft file (`import_eagle3_to_file`,
    `target` its default aux layers' model)."""
    if _eagle3_folder(folder):
        return import_eagle3_to_file(folder, out_path, target)
    model, inputs = _read_folder(folder, resident=False)
    refuse_overwrite_input(out_path, inputs, HfError)
    path = write_model(out_path, model, say)
    rec = model.provenance["import_hf"]
    out = {
        "path": str(path),
        "architecture": model.metadata["hf.architecture"],
        "num_params": int(sum(s.numel for s in param_table(model.cfg))),
        "tensors": len(model.tensors),
        "dtypes": rec["dtypes"],
        "tied": model.cfg.tie_embeddings,
        "tokenizer": model.tokenizer is not None,
        "mtp": rec.get("mtp"),  # None: the folder has no draft
    }
    if "layout" in rec:  # what is kept for export
        out.update(layout=rec["layout"], kept_tensors=rec["kept_tensors"], files=rec["files"])
    for key in ("untied", "note"):
        if key in rec:
            out[key] = rec[key]
    return out


# ------------------------------------------------------------------------------------------------ export


def _check_params(model: Model) -> None:
    for spec in param_table(model.cfg):
        a = model.params.get(spec.name)
        if a is None:
            raise HfError(f"model is missing parameter {spec.name}")
        if tuple(np.shape(a)) != tuple(spec.shape):
            raise HfError(f"parameter {spec.name} has shape {tuple(np.shape(a))}, config needs {spec.shape}")


# What a Hugging Face export folder holds (ours, or a previous one of transformers); with overwrite=True only
# a folder holding nothing else is replaced, so a mistyped path never deletes unrelated files (nor a model
# card, README.md, which no export writes: the user's).
_EXPORT_FILES = re.compile(
    r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|vocab|added_tokens"
    r"|preprocessor_config|video_preprocessor_config|processor_config|chat_template)\.json|chat_template\.jinja"
    r"|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|merges\.txt"
)


# What an export writes as the model's, whole: the weights (one file, or shards and their index) and the
# tokenizer.json the model carries (a model without one has none), so a replaced export's go, whatever the new
# one's sharding, and no other model's tokenizer is left beside this model; every other file of the folder
# that the export does not write stays (`_carry`).
_WEIGHTS = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|tokenizer\.json")


def _carry(src: Path, dst: Path) -> None:
    """A file of the replaced folder into the new one, as it is: a hard link (no copy), else a copy."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


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
        n = t.data.nbytes
        if groups[-1] and used + n > limit:
            groups.append([])
            used = 0
        groups[-1].append(t)
        used += n
    return groups


def _write_folder(tokenizer: bytes | str | None, folder: Path, plan: ExportPlan, overwrite: bool = False,
                  say: Callable[[str], None] | None = None) -> list[Path]:  # fmt: skip
    """Write the export into a fresh sibling folder, then rename it onto `folder`: the result holds exactly
    this model's files, and a failure (disk full, Ctrl-C) leaves `folder` as it was. The tensors go into one
    model.safetensors, or shards of about `plan.shard_bytes` with their index, a piece at a time; the files are
    written as they are."""
    exists = _check_target(folder, overwrite)
    progress = Progress(f"writing {folder}", [t.data for t in plan.tensors], say)
    plan = dataclasses.replace(plan, tensors=[t._replace(data=progress.wrap(t.data)) for t in plan.tensors])
    parent = folder.absolute().parent
    tmp = parent / f".{folder.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    old = parent / f".{folder.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    names = ["config.json"]
    try:
        parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(tmp)
        groups = _shards(plan.tensors, plan.shard_bytes)
        if len(groups) == 1:
            write_safetensors(tmp / "model.safetensors", plan.tensors, {"format": "pt"})
            names.append("model.safetensors")
        else:
            weight_map, total = {}, 0
            for k, group in enumerate(groups):
                shard = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
                total += write_safetensors(tmp / shard, group, {"format": "pt"})
                weight_map.update({t.name: shard for t in group})
                names.append(shard)
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            write_bytes(tmp / "model.safetensors.index.json", (json.dumps(index, indent=2) + "\n").encode())
            names.append("model.safetensors.index.json")
        write_bytes(tmp / "config.json", (json.dumps(plan.config, indent=2) + "\n").encode("utf-8"))
        tok = tokenizer.encode("utf-8") if isinstance(tokenizer, str) else tokenizer
        if tok is not None:
            write_bytes(tmp / "tokenizer.json", tok)
            names.append("tokenizer.json")
        for name, data in sorted(plan.files.items()):
            write_bytes(tmp / name, data)
            names.append(name)
        if (
            exists
        ):  # --force replaces what the export writes (and the model's weights and tokenizer): the rest stays
            for name in sorted(os.listdir(folder)):
                if name not in names and not _WEIGHTS.fullmatch(name):
                    _carry(folder / name, tmp / name)
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


def _raw_plan(model: LazyModel) -> ExportPlan:
    """The raw export (`DdlForCausalLM`): any model under our own names, float32, with a config.json of our
    ModelConfig fields that import reads back and transformers cannot load (no family: every model has one)."""
    config = {
        "architectures": [RAW_ARCHITECTURE],
        "model_type": "ddl",
        "note": "ddl-wgpu model (ModelConfig fields below); transformers has no class for this architecture, "
        "so AutoModel cannot load it. Read it with ddl_wgpu.files.hf.convert.import_hf.",
        "variant": model.variant,
        **model.cfg.to_dict(),
    }
    tensors = [StTensor(n, "F32", t.shape, t.to("f32")) for n, t in model.tensors.items()]
    return ExportPlan(config=config, tensors=tensors)


def _export(model: LazyModel, folder, overwrite: bool, raw: bool, where: str = "model",
            say: Callable[[str], None] | None = None) -> tuple[list[Path], ExportPlan]:  # fmt: skip
    """Plan and write an export: the raw one, or the family's that writes this model (the one it was imported
    from, by its kept record, checked before any work; else the first whose `exports` takes the config)."""
    if raw:
        plan = _raw_plan(model)
    else:
        rec = source_of(model, where, _WRITTEN_BACK)
        family = next(f for f in FAMILIES if f.exports(model.cfg, rec))
        plan = family.export_plan(model, rec)
    return _write_folder(model.tokenizer, Path(folder), plan, overwrite, say), plan


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
    _check_params(model)
    return _export(model.lazy(), folder, overwrite, raw=False)[0]


def export_raw(model: Model, folder, overwrite: bool = False) -> list[Path]:
    """Write any model (DDL included) under our own names: model.safetensors + a config.json with our
    ModelConfig fields, marked `DdlForCausalLM`. transformers cannot load it; `import_hf` can."""
    _check_params(model)
    return _export(model.lazy("f32"), folder, overwrite, raw=True)[0]


# ------------------------------------------------------------------------------------- file conveniences


def export_eagle3(draft_path, folder, dtype: str = "bf16", overwrite: bool = False, verify: bool = True,
                  say: Callable[[str], None] | None = None) -> dict:  # fmt: skip
    """A draft file -> the EAGLE-3 folder vLLM and SGLang load (`hf/eagle3.py`), checked after writing
    against what vLLM's loader requires (`hf_eagle3.check_folder`)."""
    draft = eagle3file.load_draft(draft_path, verify)
    plan = hf_eagle3.export_plan(draft, dtype)
    files = _write_folder(None, Path(folder), plan, overwrite, say)
    return {"folder": str(folder), "architecture": plan.config["architectures"][0], "eagle3": True,
            "dtype": dtype, "num_params": eagle3file.draft_params_count(draft.cfg),
            "files": [p.name for p in files], "served": hf_eagle3.check_folder(folder)}  # fmt: skip


def export_hf_from_file(model_path, folder, raw: bool | None = None, overwrite: bool = False, verify: bool = True,
                        say: Callable[[str], None] | None = None, dtype: str | None = None) -> dict:  # fmt: skip
    """A model file -> a Hugging Face folder, tensor by tensor (export_hf, or the raw export: `raw=True`, or by
    default for residual 'delta' models); the memory a few pieces, whatever the model's size. `overwrite` and
    the folder rules: see `export_hf`; `verify=False` skips the tensor hash check; `say`: where a long export
    says its progress."""
    refuse_overwrite_input(folder, [model_path], HfError)
    if eagle3file.is_draft_file(model_path):  # an EAGLE-3 draft: the folder vLLM and SGLang load
        return export_eagle3(model_path, folder, dtype or "bf16", overwrite, verify, say)
    if dtype is not None:
        raise HfError("--dtype sets an EAGLE-3 draft's export dtype; a model keeps its own dtypes")
    with open_model(model_path, verify=verify) as model:
        if raw is None:
            raw = model.cfg.residual != "add"
        files, plan = _export(model, folder, overwrite, raw, str(model_path), say)
    summary = {
        "folder": str(folder),
        "architecture": plan.config["architectures"][0],
        "raw": raw,
        "num_params": int(sum(s.numel for s in param_table(model.cfg))),
        "files": [p.name for p in files],
        "mtp": None,
    }
    if plan.layout is not None:
        summary["layout"] = plan.layout
    if model.cfg.mtp is not None:
        summary["mtp"] = _mtp_export_summary(model.cfg, raw, plan.mtp_note)
        if plan.check_draft is not None:  # the written folder's draft against what its runtimes build
            summary["mtp"]["served"] = plan.check_draft(Path(folder))
    return summary


def _mtp_export_summary(cfg: ModelConfig, raw: bool, note: str) -> dict:
    mtp = cfg.mtp
    if raw:
        return {"names": "model.mtp.*", **mtp.to_dict(), "note": "draft written under our own names"}
    out = {"names": "mtp.*", **mtp.to_dict(), "note": note}
    if mtp.trunk_hidden != "post_norm" or mtp.chain_hidden != "post_norm":
        out["warning"] = ("vLLM/SGLang feed the draft post-norm hiddens (docs/heal.md#the-draft-block); this draft "
                          f"expects trunk {mtp.trunk_hidden}, chain {mtp.chain_hidden}")  # fmt: skip
    return out
