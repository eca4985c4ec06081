"""Nothing lost: what an import keeps of a Hugging Face folder so that export writes it back
(docs/container.md#hugging-face-interop), for every family whose import plan names a layout (`ImportPlan.layout`).

- the folder's tensors we do not run (a vision tower) as raw bytes, container tensor `hf.keep.NAME` (u8, 1-D),
  with its safetensors dtype and shape in the record;
- `config.json` and the small files the family keeps (`ImportPlan.keep_files`: `generation_config.json`,
  `tokenizer_config.json`, ...) as `hf.file.NAME`, at most MAX_FILE bytes each and MAX_FILES together;
- the record, `metadata[SOURCE_KEY]`: the architecture, the layout, the kept tensors' dtypes and shapes, the files
  and the source's shard size.

`source_of` reads the record back as untrusted and holds it against the tensors it names, before any work.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from ddl_wgpu.files.hf.common import more
from ddl_wgpu.files.hf.folder import ST_ITEMSIZE, HfError
from ddl_wgpu.files.modelfile import EXTRA_PREFIXES, LazyModel
from ddl_wgpu.files.safeio import read_regular

SOURCE_KEY = "hf.source"  # metadata: what the folder was (layout, kept tensors, files, shard size)
KEEP_PREFIX, FILE_PREFIX = EXTRA_PREFIXES
# One limit at both ends: config.json is read at import, and checked at export, at most this long (a real one
# is KBs, a vocab.json a few MB).
MAX_FILE = 32 * 1024 * 1024
MAX_FILES = 64 * 1024 * 1024  # the kept small files together


def kept_files(folder: Path, pattern: re.Pattern) -> dict[str, bytes]:
    """The small files of `folder` whose names match `pattern` (config.json, tokenizer.json and the weights
    are read on their own), each and all together within the limits."""
    out, total = {}, 0
    for name in sorted(os.listdir(folder)):
        if pattern.fullmatch(name):
            data = read_regular(folder / name, "a Hugging Face folder file", HfError, MAX_FILE)
            total += len(data)
            if total > MAX_FILES:
                raise HfError(f"{folder}: its small files exceed {MAX_FILES} bytes together (at {name})")
            out[name] = data
    return out


def source_record(arch: str, layout: str, kept: dict[str, tuple[str, tuple]], files: list[str],
                  shard_bytes: int) -> dict:  # fmt: skip
    """metadata[SOURCE_KEY] of an imported folder."""
    return {"architecture": arch, "layout": layout, "files": sorted(files), "shard_bytes": int(shard_bytes),
            "keep": {n: {"dtype": d, "shape": list(s)} for n, (d, s) in sorted(kept.items())}}  # fmt: skip


def _shape(v: Any) -> bool:
    return (
        isinstance(v, list)
        and len(v) <= 8
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v)
    )


def source_of(model: LazyModel, where: str, layouts: dict[str, re.Pattern]) -> dict | None:
    """The model's checked SOURCE_KEY record (None for a model imported without one), every entry held against
    the tensors it names in `model.extra`: a hostile file is one HfError, before any work. `layouts`: every
    layout a family writes back -> the small files it keeps."""
    rec = model.metadata.get(SOURCE_KEY)
    if rec is None:
        return None
    bad = f"{where}: metadata {SOURCE_KEY}"
    if (
        not isinstance(rec, dict)
        or not {"layout", "keep", "files"} <= set(rec)
        or not isinstance(rec["layout"], str)
        or rec["layout"] not in layouts
    ):
        raise HfError(f"{bad} must be an object with a layout ({', '.join(layouts)}), keep and files")
    keep, files = rec["keep"], rec["files"]
    if (
        not isinstance(keep, dict)
        or not isinstance(files, list)
        or not all(isinstance(f, str) for f in files)
    ):
        raise HfError(f"{bad}: keep must be an object and files a list of names")
    sb = rec.get("shard_bytes", 0)
    if isinstance(sb, bool) or not isinstance(sb, int) or sb < 0:
        raise HfError(f"{bad}: shard_bytes must be a non-negative integer, got {sb!r:.40}")
    want = {}
    for name, info in keep.items():
        if not (
            name
            and isinstance(info, dict)
            and isinstance(info.get("dtype"), str)
            and info["dtype"] in ST_ITEMSIZE
            and _shape(info.get("shape"))
        ):
            raise HfError(
                f"{bad}: kept tensor {name!r:.80} needs a dtype of {sorted(ST_ITEMSIZE)} and a shape"
            )
        want[KEEP_PREFIX + name] = math.prod(info["shape"]) * ST_ITEMSIZE[info["dtype"]]
    for f in files:
        if not (f == "config.json" or layouts[rec["layout"]].fullmatch(f)):
            raise HfError(f"{bad}: file {f!r:.80} is not one a Hugging Face folder keeps here")
        want[FILE_PREFIX + f] = None
    if "config.json" not in files:
        raise HfError(f"{bad}: the folder's config.json is not among its files")
    for name, n in want.items():
        t = model.extra.get(name)
        if t is None:
            raise HfError(f"{where}: tensor {name} is missing (the folder's {SOURCE_KEY} names it; a library caller "
                          "reads a model's kept tensors with load_model(..., extra=True))")  # fmt: skip
        if (
            t.dtype != "u8"
            or len(t.shape) != 1
            or (n is not None and t.numel != n)
            or (n is None and t.numel > MAX_FILE)
        ):
            size = f"{n} bytes" if n is not None else f"at most {MAX_FILE} bytes"
            raise HfError(
                f"{where}: tensor {name} must be raw u8 bytes ({size}), got {t.dtype}{list(t.shape)}"
            )
    stray = sorted(set(model.extra) - set(want))
    if stray:
        raise HfError(f"{where}: tensor(s) {more(stray, 3)} are not in the folder's {SOURCE_KEY} record")
    return rec
