"""An EAGLE-3 draft on disk (docs/eagle3.md#the-draft-file): a `.ddlw` container holding the draft's tensors
under their Hugging Face names (`ddl_ref.eagle3.eagle3_params`) plus `d2t` (i64) and `t2d` (bool), with no
model config (a draft is not a model: `load_model` refuses it) and its settings in the metadata:

    metadata["eagle3"] = {"config": Eagle3Config's fields, "max_position_embeddings": int,
                          "target": {"config_hash": ..., "tensors_hash": ..., "n_layers": L, "path": ...}}

The target's identity is two hashes read from the target file's header alone (`target_identity`): its model
config (canonical JSON) and its tensor table (every name with its stored hash), so a draft is refused for
any other target with one line, a compressed copy of it taken with its layers mapped (`eagle3_aux.plan_aux`).
The draft shares the target's embedding, which is therefore not in the file.

`load_draft` reads a file as untrusted input: the container's own checks, then the metadata's shape and
types, the config (`Eagle3Config` validates it), exactly the expected tensors with their shapes and dtypes,
finite weights, and a consistent d2t/t2d pair (`ddl_ref.eagle3.check_vocab_map`); each failure is one
`CheckpointError` line naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from ddl_ref import eagle3 as e3
from ddl_ref.config import ConfigError
from ddl_wgpu.files.container import CheckpointError, bf16_to_f32, open_checkpoint, save

KEY = "eagle3"  # the metadata key that marks a draft file
D2T, T2D = "d2t", "t2d"
FLOATS = ("f32", "f16", "bf16")
CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(e3.Eagle3Config))
MAX_POSITIONS = 1 << 24  # a context longer than any model's; refused above


@dataclass
class Eagle3Draft:
    cfg: e3.Eagle3Config
    params: dict[str, np.ndarray]  # float32, `eagle3_params` order
    d2t: np.ndarray  # int64 (Vd,)
    t2d: np.ndarray  # bool (V,)
    target: dict  # the target's identity (`target_identity`) and its path when trained
    max_position_embeddings: int
    provenance: dict = field(default_factory=dict)
    dtypes: dict[str, str] = field(default_factory=dict)  # each weight's stored dtype


def config_dict(cfg: e3.Eagle3Config) -> dict:
    d = dataclasses.asdict(cfg)
    d["aux_layers"] = list(cfg.aux_layers)
    return d


def config_from_dict(d, where: str) -> e3.Eagle3Config:
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: metadata eagle3.config is not a map")
    unknown = sorted(set(d) - set(CONFIG_FIELDS))
    if unknown:
        raise CheckpointError(f"{where}: metadata eagle3.config has unknown field {unknown[0]!r}")
    d = dict(d)
    if isinstance(d.get("aux_layers"), list):
        d["aux_layers"] = tuple(d["aux_layers"])
    try:
        return e3.Eagle3Config(**d)
    except (ConfigError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: bad EAGLE-3 config: {str(e).splitlines()[0]}") from None


def _hash(obj) -> str:
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(raw, digest_size=8).hexdigest()


def identity_of(ck) -> dict:
    """The identity of an opened model file: hashes of its config and of its tensor table (names and the
    stored hash of each tensor's bytes), and its layer count."""
    table = [[n, ck.info(n).dtype, list(ck.info(n).shape), ck.info(n).hash] for n in ck.names()]
    cfg = dict(ck.config or {})
    return {"config_hash": _hash(cfg), "tensors_hash": _hash(table), "n_layers": cfg.get("n_layers")}


def target_identity(path) -> dict:
    """`identity_of` the model file at `path` (its header only)."""
    with open_checkpoint(path) as ck:
        return identity_of(ck)


def is_draft_file(path) -> bool:
    """Whether the container at `path` is an EAGLE-3 draft (its metadata says so); False for any other file."""
    try:
        with open_checkpoint(path, verify=False) as ck:
            return isinstance((ck.metadata or {}).get(KEY), dict)
    except (CheckpointError, OSError):
        return False


def save_draft(path, draft: Eagle3Draft, dtype: str = "f32") -> list:
    """Write the draft file (atomically, by the container): weights in `dtype`, d2t i64, t2d bool."""
    if dtype not in FLOATS:
        raise CheckpointError(f"{path}: draft dtype must be one of {', '.join(FLOATS)}, got {dtype!r}")
    names = list(e3.eagle3_params(draft.cfg))
    cast = np.float16 if dtype == "f16" else np.float32  # bf16: the container rounds float32 itself
    tensors = [(n, np.asarray(draft.params[n], np.float32).astype(cast), dtype) for n in names]
    tensors += [(D2T, np.asarray(draft.d2t, np.int64), "i64"), (T2D, np.asarray(draft.t2d, bool), "bool")]
    meta = {KEY: {"config": config_dict(draft.cfg), "target": dict(draft.target),
                  "max_position_embeddings": int(draft.max_position_embeddings)}}  # fmt: skip
    return save(path, tensors, config=None, metadata=meta, provenance=draft.provenance)


def _float32(ck, name: str, where: str) -> np.ndarray:
    info = ck.info(name)
    if info.dtype not in FLOATS:
        raise CheckpointError(f"{where}: tensor {name!r} is {info.dtype}, not a float ({', '.join(FLOATS)})")
    a = ck.tensor(name)
    a = bf16_to_f32(a) if info.dtype == "bf16" else np.asarray(a, np.float32)
    if not np.all(np.isfinite(a)):
        raise CheckpointError(f"{where}: tensor {name!r} holds a non-finite value")
    return a


def load_draft(path, verify: bool = True) -> Eagle3Draft:
    """Read an EAGLE-3 draft file, checked as the module docstring says."""
    where = os.fspath(path)
    with open_checkpoint(path, verify=verify) as ck:
        meta = (ck.metadata or {}).get(KEY)
        if not isinstance(meta, dict):
            what = "a model file" if ck.config else "a container"
            raise CheckpointError(f"{where}: not an EAGLE-3 draft ({what} without metadata 'eagle3')")
        cfg = config_from_dict(meta.get("config"), where)
        target = meta.get("target")
        # an imported draft may record no target (None hashes: `eagle3_aux.plan_aux` checks its shapes alone)
        if not isinstance(target, dict) or not all(target.get(k) is None or isinstance(target.get(k), str)
                                                   for k in ("config_hash", "tensors_hash")):  # fmt: skip
            raise CheckpointError(f"{where}: metadata eagle3.target is not a map of config_hash/tensors_hash")
        mp = meta.get("max_position_embeddings")
        if isinstance(mp, bool) or not isinstance(mp, int) or not 1 <= mp <= MAX_POSITIONS:
            raise CheckpointError(f"{where}: metadata eagle3.max_position_embeddings is {mp!r:.40}, "
                                  f"not an integer in 1..{MAX_POSITIONS}")  # fmt: skip
        table = e3.eagle3_params(cfg)
        want = [*table, D2T, T2D]
        have = ck.names()
        missing = [n for n in want if n not in have]
        if missing:
            raise CheckpointError(f"{where}: missing tensor {missing[0]!r} of the EAGLE-3 draft")
        extra = [n for n in have if n not in want]
        if extra:
            raise CheckpointError(f"{where}: unexpected tensor {extra[0]!r} in an EAGLE-3 draft")
        shapes = {**{n: s for n, (s, _) in table.items()}, D2T: (cfg.draft_vocab,), T2D: (cfg.vocab,)}
        for n in want:
            if tuple(ck.info(n).shape) != tuple(shapes[n]):
                raise CheckpointError(f"{where}: tensor {n!r} has shape {list(ck.info(n).shape)}, the config "
                                      f"needs {list(shapes[n])}")  # fmt: skip
        params = {n: _float32(ck, n, where) for n in table}
        if ck.info(D2T).dtype != "i64":
            raise CheckpointError(f"{where}: tensor 'd2t' is {ck.info(D2T).dtype}, not i64")
        d2t = np.asarray(ck.tensor(D2T), np.int64)
        t2d = _bool_map(ck.tensor(T2D), ck.info(T2D).dtype, f"{where}: tensor 't2d'")
        try:
            e3.check_vocab_map(cfg, d2t, t2d)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from None
        return Eagle3Draft(cfg, params, d2t, t2d, dict(target), mp, dict(ck.provenance or {}),
                           {n: ck.info(n).dtype for n in table})  # fmt: skip


def _bool_map(a, dtype: str, what: str) -> np.ndarray:
    """t2d stored as bool or u8 (0/1) -> bool."""
    if dtype not in ("bool", "u8"):
        raise CheckpointError(f"{what} is {dtype}, not bool or u8")
    a = np.asarray(a)
    if dtype == "u8":
        if np.any(a > 1):
            raise CheckpointError(f"{what} holds a value other than 0 and 1")
        return a.astype(bool)
    return a.view(np.uint8).astype(bool) if a.dtype != bool else a


def draft_params_count(cfg: e3.Eagle3Config) -> int:
    return int(sum(math.prod(s) for s, _ in e3.eagle3_params(cfg).values()))
