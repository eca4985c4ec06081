"""Library side of `ddl-wgpu inspect`: summarise a checkpoint (`.ddlw`, a single file or a shard set).

`describe(path)` returns a JSON-serialisable dict; `render_text(desc)` turns it into plain text. Reading a
checkpoint touches only its header (whose checksum is always checked, from format version 2 on) unless
`verify=True`, which hashes every tensor. A bad file raises
`CheckpointError` (from `ddl_wgpu.files.container`), which the CLI reports as one line.
"""

from __future__ import annotations

import math
import os
from typing import Any

from ddl_ref.config import ConfigError, ModelConfig

from .container import Checkpoint, open_checkpoint

__all__ = ["describe", "render_text"]


def _jsonable(v: Any) -> Any:
    """Header values -> JSON types. Binary blobs become a size note (their bytes are not readable text).
    The reader bounds header nesting (container.MAX_DEPTH), so recursion here is safe."""
    if isinstance(v, bytes):
        return f"<{len(v)} bytes>"
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # strict JSON has no NaN/inf
    return v


def describe(path: str | os.PathLike, verify: bool = False) -> dict:
    """Summary of the checkpoint at `path` as a JSON-serialisable dict.

    Keys: path, format_version, file_size (bytes of all files), files, num_tensors, total_params (sum of
    element counts), tensor_bytes, dtypes ({dtype: {"tensors", "params", "nbytes"}}), config, metadata,
    provenance, has_tokenizer, tokenizer_bytes, shard (None, or {"count", "set_id"}), tensors (list of
    {name, dtype, shape, nbytes, hash, file}), header_checksum (True when the format has one: it was checked
    on opening), verified (True when `verify` ran and passed; a failed
    verification raises CheckpointError) and layers (the blocks' token mixers, `_layers`; None without a
    valid model config).
    """
    with open_checkpoint(path) as ck:
        return _describe(ck, path, verify)


def _describe(ck: Checkpoint, path: str | os.PathLike, verify: bool) -> dict:
    if verify:
        ck.verify()
    dtypes: dict[str, dict[str, int]] = {}
    tensors = []
    for name in ck.names():
        t = ck.info(name)
        d = dtypes.setdefault(t.dtype, {"tensors": 0, "params": 0, "nbytes": 0})
        d["tensors"] += 1
        d["params"] += t.numel
        d["nbytes"] += t.nbytes
        tensors.append(
            {
                "name": t.name,
                "dtype": t.dtype,
                "shape": list(t.shape),
                "nbytes": t.nbytes,
                "hash": t.hash,
                "file": os.path.basename(t.file),
            }
        )
    shard = ck.shard
    return {
        "path": os.fspath(path),
        "format_version": ck.version,
        "header_checksum": ck.version >= 2,
        "file_size": ck.file_size,
        "files": [os.fspath(f) for f in ck.files],
        "num_tensors": len(tensors),
        "total_params": sum(d["params"] for d in dtypes.values()),
        "tensor_bytes": ck.nbytes,
        "dtypes": dict(sorted(dtypes.items())),
        "config": _jsonable(ck.config),
        "metadata": _jsonable(ck.metadata),
        "provenance": _jsonable(ck.provenance),
        "has_tokenizer": ck.tokenizer is not None,
        "tokenizer_bytes": len(ck.tokenizer) if ck.tokenizer is not None else 0,
        "shard": None if shard is None else {"count": shard["count"], "set_id": shard["set_id"]},
        "tensors": tensors,
        "verified": bool(verify),
        "layers": _layers(ck.config),
    }


MIXER_NAMES = {"linear_attention": "Gated DeltaNet", "full_attention": "softmax attention"}


def _layers(config: Any) -> dict | None:
    """The blocks' token mixers of a model config (a hybrid trunk's per-layer types, the full attention's
    output gate and rotated dims, the draft's block), or None when the header holds no valid model config
    (a header is shown whatever it holds; its config is only summarised when it is one)."""
    try:
        cfg = ModelConfig.from_dict(dict(config)) if isinstance(config, dict) else None
    except (ConfigError, TypeError, ValueError):
        cfg = None
    if cfg is None:
        return None
    if cfg.layer_types is not None:  # as long as the header, which the reader bounds
        types, counts = (
            list(cfg.layer_types),
            {t: cfg.layer_types.count(t) for t in dict.fromkeys(cfg.layer_types)},
        )
    else:  # a header's n_layers may be anything: no list of that length is built
        types, counts = None, {"full_attention": cfg.n_layers}
    return {
        "n_layers": cfg.n_layers,
        "types": types,  # per block; None for a plain transformer (every block full attention)
        "counts": counts,
        "attn_output_gate": cfg.attn_output_gate,
        "rope_dim": cfg.rope_dim,
        "head_dim": cfg.head_dim,
        "draft": "full_attention" if cfg.mtp is not None else None,  # a draft block is always full attention
    }


def _layers_line(lay: dict) -> str:
    """`3 blocks LLF: 2 linear_attention (Gated DeltaNet), 1 full_attention (softmax attention, gated, RoPE on 2
    of 8 dims); draft: full_attention (...)`: a hybrid's pattern has one letter per block."""
    full = MIXER_NAMES["full_attention"] + (", gated" if lay["attn_output_gate"] else "")
    if lay["rope_dim"] != lay["head_dim"]:
        full += f", RoPE on {lay['rope_dim']} of {lay['head_dim']} dims"
    what = {"linear_attention": MIXER_NAMES["linear_attention"], "full_attention": full}
    head = f"{lay['n_layers']} blocks"
    if lay["types"]:  # a hybrid's pattern, one letter per block
        head += " " + "".join("L" if t == "linear_attention" else "F" for t in lay["types"])
    kinds = ", ".join(f"{n} {t} ({what[t]})" for t, n in lay["counts"].items())
    line = f"{head}: {kinds}"
    return line + (f"; draft: full_attention ({full})" if lay["draft"] else "")


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def _flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Nested maps -> dotted keys (GGUF-style `model.variant`), for display."""
    if isinstance(d, dict) and d:
        out: list[tuple[str, Any]] = []
        for k, v in d.items():
            out.extend(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return [(prefix, d)]


def _section(title: str, d: Any) -> list[str]:
    if d is None or d == {}:
        return [f"{title}: (none)"]
    lines = [f"{title}:"]
    for k, v in _flatten(d):
        text = repr(v) if isinstance(v, str) else str(v)
        if len(text) > 100:
            text = text[:97] + "..."
        lines.append(f"  {k} = {text}")
    return lines


def render_text(desc: dict) -> str:
    """Plain-text report of a `describe()` result: summary, config, metadata, tensor table, provenance."""
    lines = [
        f"checkpoint  {desc['path']}",
        f"format      ddlw v{desc['format_version']}, {_human(desc['file_size'])} in {len(desc['files'])} file(s)",
    ]
    if desc["shard"]:
        lines.append(f"shards      {desc['shard']['count']} (set {desc['shard']['set_id']})")
    dt = ", ".join(f"{k}: {v['tensors']} tensors / {_count(v['params'])}" for k, v in desc["dtypes"].items())
    lines += [
        f"tensors     {desc['num_tensors']}, {_count(desc['total_params'])} parameters "
        f"({desc['total_params']}), {_human(desc['tensor_bytes'])}",
        f"dtypes      {dt or '(none)'}",
        f"tokenizer   {_human(desc['tokenizer_bytes']) if desc['has_tokenizer'] else '(none)'}",
    ]
    if desc.get("layers"):
        lines.append(f"layers      {_layers_line(desc['layers'])}")
    if desc.get("verified"):
        what = "header checksum and all tensor hashes match"
        if not desc["header_checksum"]:
            what = "all tensor hashes match (format version 1 has no header checksum)"
        lines.append(f"verified    {what}")
    lines.append("")
    lines += _section("config", desc["config"])
    lines += _section("metadata", desc["metadata"])
    lines.append("")
    rows = [("name", "dtype", "shape", "size", "hash")]
    rows += [
        (t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", _human(t["nbytes"]), t["hash"])
        for t in desc["tensors"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for i, r in enumerate(rows):
        lines.append(
            "  ".join(
                c.rjust(w) if j == 3 else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines += _section("provenance", desc["provenance"])
    return "\n".join(lines) + "\n"
