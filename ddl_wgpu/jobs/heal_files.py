"""`heal`'s files: the model checked for a draft and read (`require_draft`, `load`), the starting draft fitted
to the FFN width heal trains it at (`fit_draft`, from --init weights when given: `init_weights`), and OUT
written back, the trained tensors in their stored dtype and every other tensor byte for byte (`write_back`);
the heal record a healed file carries (`heal_record`); `HealError`, the one-line error of every heal step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from ddl_ref import mtp as ref_mtp
from ddl_ref.params import MTP_LAYER_PREFIX, param_table
from ddl_wgpu.errors import UserError
from ddl_wgpu.files.container import CheckpointError, f32_to_bf16, open_checkpoint, save
from ddl_wgpu.files.modelfile import FLOAT_DTYPES, Model, load_model, read_f32
from ddl_wgpu.jobs.compress import narrow_ffn

PROVENANCE_KEY = "mtp_heal"  # the reference heal tool's key
OLD_PROVENANCE_KEY = "heal_mtp"  # written by earlier versions; still read
# A draft is present iff these are in the file (the reference heal tool checks the first three).
GATE = "model.mtp.layers.0.mlp.gate_proj.weight"  # its rows: the draft's FFN width
REQUIRED = ("model.mtp.eh_proj.weight", "model.mtp.enorm.weight", "model.mtp.hnorm.weight",
            "model.mtp.layers.0.self_attn.q_proj.weight", "model.mtp.norm.weight")  # fmt: skip
# An --init file needs only what heal reads from it, the draft's block and final norm (the reference heal tool
# reads only the draft block): the input projection is the healed model's own.
INIT_REQUIRED = REQUIRED[3:]


class HealError(UserError):
    """A heal that cannot run or had to stop, with one clear line."""


def heal_record(provenance: dict) -> dict | None:
    """A healed model's heal record: `mtp_heal`, or `heal_mtp` as earlier versions wrote it."""
    prov = provenance or {}
    return prov.get(PROVENANCE_KEY, prov.get(OLD_PROVENANCE_KEY))


def require_draft(path, required=REQUIRED) -> None:
    try:
        with open_checkpoint(path) as ck:
            names = set(ck.names())
    except CheckpointError as e:
        raise HealError(f"heal: {e}") from e
    for n in required:
        if n not in names:
            raise HealError(f"heal: {path} carries no MTP draft (missing tensor {n})")


def load(path, what: str, verify: bool = True, lazy: bool = False) -> Model:
    """The model; `lazy`: its draft's tensors only (a GPU trunk reads its own from the file, a piece at a time:
    `stream.WeightSource`), and so without the check that the whole model fits in host memory."""
    try:
        if lazy:
            return load_model(path, names=lambda n: n.startswith(ref_mtp.MTP_PREFIX), verify=verify,
                              check_memory=False)  # fmt: skip
        return load_model(path, verify=verify)
    except CheckpointError as e:
        raise HealError(f"heal: {what}: {e}") from e


def with_width(model: Model, width: int) -> Model:
    """`model` whose config gives its draft `width` SwiGLU channels (`MtpConfig.ffn_hidden`, None: the trunk's)."""
    mtp = dataclasses.replace(model.cfg.mtp, ffn_hidden=None if width == model.cfg.ffn_hidden else width)
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, mtp=mtp))


def fit_draft(model: Model, init_path, rule: str, verify: bool = True) -> tuple[Model, dict | None, dict]:
    """The model with its draft at the width `rule` gives, and the draft's starting weights (from `init_path`,
    else None: the model's own) -> (model, init weights, the width record).

    The starting draft is the init model's (its width the rows of its gate_proj) or the model's own. "init" keeps
    its width (the reference heal tool's rule); "model" heals at the model's FFN width (its trunk's, the
    `intermediate_size` an export writes), narrowing a wider draft by `compress.narrow_ffn`'s importance rule; a
    narrower one cannot be widened (HealError naming --draft-width init)."""
    source = ref_mtp.draft_ffn_hidden(model.cfg)
    if init_path is not None:
        with open_checkpoint(init_path) as ck:
            source = int(ck.info(GATE).shape[0]) if GATE in ck.names() else source
    target = source if rule == "init" else model.cfg.ffn_hidden
    whose = "the init model's" if init_path is not None else "the model's"
    if target > source:
        raise HealError(f"heal: --draft-width model: {whose} draft has {source} SwiGLU channels, fewer than the "
                        f"model's FFN width {target}; a draft cannot be widened (--draft-width init heals it at "
                        f"{source}; --init a model whose draft has at least {target} heals at {target})",
                        field="draft_width")  # fmt: skip
    model = with_width(model, source)
    init = init_weights(init_path, model, verify) if init_path is not None else None
    rec = {"rule": rule, "ffn_hidden": target, "source_ffn_hidden": source}
    if target < source:  # the starting draft narrowed by the importance rule compress --ffn-keep uses
        weights = dict(init if init is not None else model.params)
        rec["kept_importance_fraction"] = narrow_ffn(weights, MTP_LAYER_PREFIX, target)
        if init is not None:
            init = {n: weights[n] for n in init}
        else:
            model = dataclasses.replace(model, params=weights)
        model = with_width(model, target)
    return model, init, rec


def init_weights(init_path, model: Model, verify: bool = True) -> dict:
    """The trained tensors (the draft's block and final norm) read from `init_path`, nothing else of it: its
    config and its other tensors (the input projection included) may be anything or absent."""
    shapes = {spec.name: tuple(spec.shape) for spec in param_table(model.cfg)}
    out = {}
    try:
        with open_checkpoint(init_path, verify=verify) as ck:
            for n in ref_mtp.trained_names(model.params):
                info = ck.info(n) if n in ck else None
                if info is None or tuple(info.shape) != shapes[n] or info.dtype not in FLOAT_DTYPES:
                    have = "no such tensor" if info is None else f"{info.dtype} {tuple(info.shape)}"
                    raise HealError(f"heal: the init model {init_path}: {n} is {have}, the model needs a "
                                    f"float tensor of shape {shapes[n]}", field="init")  # fmt: skip
                out[n] = read_f32(ck, n, init_path)
    except CheckpointError as e:
        raise HealError(f"heal: the init model: {e}") from e
    return out


def encode(array: np.ndarray, dtype: str):
    """A trained float32 tensor in the stored dtype of the tensor it replaces."""
    if dtype == "bf16":
        return f32_to_bf16(np.asarray(array, np.float32)), "bf16"
    np_dtype = {"f32": np.float32, "f16": np.float16, "f64": np.float64}.get(dtype)
    if np_dtype is None:
        raise HealError(f"heal: cannot write a trained tensor back as {dtype}")
    return np.asarray(array).astype(np_dtype), dtype


def write_back(model_path, out_path, trained: dict, provenance_key: str, record: dict,
               config: dict | None = None, verify: bool = True) -> Path:  # fmt: skip
    """OUT = MODEL with `trained` tensors replaced (stored dtype kept) and every other tensor copied byte for
    byte; `provenance[provenance_key] = record`; `config` replaces MODEL's (a draft healed at another FFN
    width). Atomic (the container writes a partial file of its own, then renames it)."""
    with open_checkpoint(model_path, verify=verify) as ck:
        prov = dict(ck.provenance or {})
        prov[provenance_key] = record

        def tensors():
            for name in ck.names():
                dtype = ck.info(name).dtype
                if name in trained:
                    arr, dt = encode(trained[name], dtype)
                    yield name, arr, dt
                else:
                    yield name, ck.tensor(name, copy=False), dtype

        paths = save(out_path, tensors(), config=config or ck.config, metadata=ck.metadata, provenance=prov,
                     tokenizer=ck.tokenizer)  # fmt: skip
    return paths[0]
