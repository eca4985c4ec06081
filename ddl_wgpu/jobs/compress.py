"""`compress`: structural shrinking of a model file, the trunk change that `heal` repairs the draft after.

- `drop_layers(model, layers)`: remove whole blocks; the remaining blocks are renumbered 0..L'−1 in their
  order (every tensor of a block moves with it, DDL ones included).
- `ffn_keep(model, fraction)`: keep round(fraction·F) (at least 1) SwiGLU channels of every block, chosen per
  block by importance ‖gate row c‖·‖up row c‖·‖down column c‖ (a channel's output is down[:, c]·silu(g_c)·u_c,
  so the product of the three norms bounds its contribution for a unit input). Kept channels stay in their
  original order (`narrow_ffn`). The MTP draft follows the rule of the runtime it is laid out for
  (`draft_layout.width_follows_trunk`): a Qwen3.5-layout model's draft is narrowed with the trunk by the same rule
  (vLLM and SGLang build it at `intermediate_size`); any other draft is left whole, as the reference heal tool
  expects (it takes the draft's FFN width from the model it starts from), its width then recorded as
  `MtpConfig.ffn_hidden`.

Each method is a `Plan` (`plan_drop_layers`, `plan_ffn_keep`): the new config and, for every new parameter, the
input tensor it comes from and a per-tensor transform (`take_rows`, `take_columns`). `apply` runs a plan lazily,
tensor by tensor and piece by piece (`ddl_wgpu.files.lazy`): `compress_file` streams a model file into the output so
its memory does not grow with the model; `drop_layers` and `ffn_keep` give a `Model` in memory. Each records
`provenance.compress` (a previous record is kept under `previous`; `compress_file` adds `source`, the input's
identity as an EAGLE-3 draft records its target's, `files.eagle3file.identity_of`); the draft head is carried over (by
`ffn_keep` narrowed as said, its record under `draft`): heal it against the new trunk (`ddl_wgpu.jobs.heal`).

What this file deliberately does not do: attention-head pruning, quantisation, or any evaluation of the result.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from ddl_ref.config import ModelConfig, select_layers
from ddl_ref.mtp import draft_ffn_hidden
from ddl_ref.params import MTP_LAYER_PREFIX, param_table
from ddl_wgpu.errors import UserError
from ddl_wgpu.files.container import open_checkpoint
from ddl_wgpu.files.eagle3file import identity_of
from ddl_wgpu.files.hf.draft_layout import width_follows_trunk
from ddl_wgpu.files.lazy import Lazy, convert, from_array
from ddl_wgpu.files.modelfile import LazyModel, Model, open_model, write_model
from ddl_wgpu.files.safeio import refuse_overwrite_input


class CompressError(UserError):
    """A compress request that cannot be applied, with one clear line."""


MAX_LAYER = 1 << 20
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def _check_layers(layers: Iterable[int], n_layers: int) -> list[int]:
    drop = sorted({int(i) for i in layers})
    bad = [i for i in drop if not 0 <= i < n_layers]
    if bad:
        more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
        raise CompressError(f"compress: layer(s) {bad[:3]}{more} out of range 0..{n_layers - 1}")
    return drop


def parse_layers(spec: str) -> list[int]:
    """'1,3-5' -> [1, 3, 4, 5] (sorted, unique)."""
    out: set[int] = set()
    for part in (p.strip() for p in str(spec).split(",")):
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise CompressError(f"compress: bad layer list {spec!r} (expected e.g. '1,3-5')")
        a, b = int(m.group(1)), int(m.group(2) or m.group(1))
        if b < a:
            raise CompressError(f"compress: bad layer range {part!r} in {spec!r}")
        if b >= MAX_LAYER:  # no model has this many blocks; a set of them would not fit in memory
            raise CompressError(
                f"compress: layer {b} in {spec!r} is beyond any model (at most {MAX_LAYER - 1})"
            )
        out.update(range(a, b + 1))
    if not out:
        raise CompressError(f"compress: empty layer list {spec!r}")
    return sorted(out)


def _record(provenance: dict, rec: dict) -> dict:
    prov = dict(provenance)
    if "compress" in prov:
        rec = {**rec, "previous": prov["compress"]}
    prov["compress"] = rec
    return prov


# ------------------------------------------------------------------------------------------------ plans


@dataclasses.dataclass
class Plan:
    """What a compress does, tensor by tensor: the new config, the provenance record, and for every parameter of
    the new config the input parameter it is made from and how (`transforms`; absent: unchanged). Applied to a
    model file it streams (`compress_file`), to a Model in memory it gives one (`drop_layers`, `ffn_keep`)."""

    cfg: ModelConfig
    record: dict
    sources: dict[str, str]
    transforms: dict[str, Callable[[Lazy], Lazy]] = dataclasses.field(default_factory=dict)


def plan_drop_layers(cfg: ModelConfig, layers: Iterable[int]) -> Plan:
    """Without the blocks in `layers`; the rest renumbered in order, every tensor of a block moving with it."""
    drop = _check_layers(layers, cfg.n_layers)
    keep = [i for i in range(cfg.n_layers) if i not in drop]
    if not keep:
        raise CompressError(f"compress: dropping {drop} would leave no block")
    new_cfg = select_layers(cfg, keep)  # a hybrid's kept blocks keep their layer types
    sources = {}
    for spec in param_table(new_cfg):
        m = _BLOCK.match(spec.name)
        sources[spec.name] = f"model.layers.{keep[int(m.group(1))]}.{m.group(2)}" if m else spec.name
    rec = {"method": "drop_layers", "dropped": drop, "n_layers_before": cfg.n_layers,
           "n_layers_after": len(keep), "kept_layers": keep}  # fmt: skip
    return Plan(new_cfg, rec, sources)


def _f64_pieces(t: Lazy):
    return ((convert(p, "bf16", "f32") if t.dtype == "bf16" else p).astype(np.float64) for p in t.pieces())


def _row_norms(t: Lazy) -> np.ndarray:
    """‖row r‖ of a 2-D tensor for every r, in float64, a piece at a time."""
    return np.concatenate([np.linalg.norm(p, axis=1) for p in _f64_pieces(t)])


def _column_norms(t: Lazy) -> np.ndarray:
    """‖column c‖ of a 2-D tensor for every c, in float64, a piece at a time: the squares summed row after row,
    in order, so the sums are those of `np.linalg.norm(whole, axis=0)` bit for bit."""
    acc = None
    for p in _f64_pieces(t):
        sq = p * p
        acc = np.add.reduce(sq if acc is None else np.concatenate([acc[None], sq]), axis=0)
    return np.sqrt(acc)


def ffn_importance(tensors: dict[str, Lazy], prefix: str) -> np.ndarray:
    """(F,) ‖gate row c‖·‖up row c‖·‖down column c‖ of the SwiGLU under `prefix` ("model.layers.3.")."""
    g = _row_norms(tensors[prefix + "mlp.gate_proj.weight"])
    u = _row_norms(tensors[prefix + "mlp.up_proj.weight"])
    d = _column_norms(tensors[prefix + "mlp.down_proj.weight"])
    return g * u * d


def ffn_channels(tensors: dict[str, Lazy], prefix: str, n: int) -> tuple[np.ndarray, float]:
    """The `n` most important channels (`ffn_importance`) of the SwiGLU under `prefix`, in their original order,
    and the fraction of the importance they hold."""
    imp = ffn_importance(tensors, prefix)
    keep = np.sort(np.argsort(-imp, kind="stable")[:n])
    return keep, float(imp[keep].sum() / max(imp.sum(), 1e-30))


def take_rows(keep: np.ndarray) -> Callable[[Lazy], Lazy]:
    """The tensor's rows `keep` (a SwiGLU's gate or up projection narrowed to its kept channels)."""
    return lambda t: t.take_rows(keep)


def take_columns(keep: np.ndarray) -> Callable[[Lazy], Lazy]:
    """The tensor's columns `keep` (a SwiGLU's down projection narrowed to its kept channels)."""
    return lambda t: t.map(lambda p: np.ascontiguousarray(p[:, keep]), (t.shape[0], len(keep)))


FFN = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")  # a SwiGLU's tensors


def narrow(prefix: str, keep: np.ndarray) -> dict[str, Callable[[Lazy], Lazy]]:
    """The transforms that narrow the SwiGLU under `prefix` to the channels `keep`."""
    gate, up, down = (prefix + n for n in FFN)
    return {gate: take_rows(keep), up: take_rows(keep), down: take_columns(keep)}


def narrow_ffn(params: dict, prefix: str, n: int) -> float:
    """Keep the `n` most important channels (`ffn_channels`) of the SwiGLU under `prefix` in `params`, arrays in
    memory (replaced in place) -> the fraction of the importance kept."""
    tensors = {prefix + k: from_array(params[prefix + k]) for k in FFN}
    keep, mass = ffn_channels(tensors, prefix, n)
    for name, how in narrow(prefix, keep).items():
        params[name] = how(tensors[name]).array()
    return mass


def plan_ffn_keep(model: LazyModel, fraction: float) -> Plan:
    """Keep the fraction `fraction` (0 < f <= 1) of every SwiGLU's channels, the most important per block (their
    norms read a piece at a time); the draft as `_draft_width` says."""
    cfg = model.cfg
    if not (isinstance(fraction, int | float) and 0.0 < float(fraction) <= 1.0):
        raise CompressError(
            f"compress: the FFN keep fraction must be in (0, 1], got {fraction!r}", field="ffn_keep"
        )
    F = cfg.ffn_hidden
    F2 = max(1, int(round(float(fraction) * F)))
    transforms, kept_mass = {}, []
    for p in (f"model.layers.{i}." for i in range(cfg.n_layers)):
        keep, mass = ffn_channels(model.tensors, p, F2)
        transforms.update(narrow(p, keep))
        kept_mass.append(mass)
    new_cfg = dataclasses.replace(cfg, ffn_hidden=F2)
    rec = {"method": "ffn_keep", "fraction": float(fraction), "ffn_hidden_before": F, "ffn_hidden_after": F2,
           "importance": "norm(gate row) * norm(up row) * norm(down column)",
           "kept_importance_fraction": kept_mass}  # fmt: skip
    if cfg.mtp is not None:
        new_cfg, rec["draft"] = _draft_width(model.tensors, cfg, new_cfg, transforms)
    return Plan(new_cfg, rec, {s.name: s.name for s in param_table(new_cfg)}, transforms)


def _draft_width(tensors: dict[str, Lazy], cfg: ModelConfig, new_cfg: ModelConfig,
                 transforms: dict) -> tuple[ModelConfig, dict]:  # fmt: skip
    """The draft after `ffn_keep` narrowed the trunk to `new_cfg.ffn_hidden`: narrowed with it (its transforms
    added) when its runtime builds it at the trunk's width (and it is at least that wide), else whole (its
    width recorded when it now differs from the trunk's) -> (the config, the record)."""
    width, F2 = draft_ffn_hidden(cfg), new_cfg.ffn_hidden
    follows, why = width_follows_trunk(cfg)
    rec = {"ffn_hidden_before": width, "rule": why}
    if follows and width >= F2:
        keep, rec["kept_importance_fraction"] = ffn_channels(tensors, MTP_LAYER_PREFIX, F2)
        transforms.update(narrow(MTP_LAYER_PREFIX, keep))
        width = F2
    rec["ffn_hidden_after"] = width
    mtp = dataclasses.replace(cfg.mtp, ffn_hidden=None if width == F2 else width)
    return dataclasses.replace(new_cfg, mtp=mtp), rec


def apply(plan: Plan, model: LazyModel) -> LazyModel:
    """The compressed model: each new parameter made from its source, lazily; the extra tensors (an imported
    folder's vision tower and files) carried as they are; `provenance.compress` recorded (a previous record kept
    under `previous`)."""
    tensors = {}
    for spec in param_table(plan.cfg):
        t = model.tensors[plan.sources[spec.name]]
        t = plan.transforms.get(spec.name, lambda x: x)(t)
        assert tuple(t.shape) == tuple(spec.shape), spec.name
        tensors[spec.name] = t
    return dataclasses.replace(
        model, cfg=plan.cfg, tensors=tensors, provenance=_record(model.provenance, plan.record)
    )


def _in_memory(plan: Plan, model: Model) -> Model:
    """`apply` to a Model in memory: its float32 values as they are, each storage dtype moving with its tensor."""
    out = apply(plan, model.lazy("f32")).load()
    out.dtypes = {n: model.dtypes[src] for n, src in plan.sources.items() if src in model.dtypes}
    return out


def drop_layers(model: Model, layers: Iterable[int]) -> Model:
    """`model` without the blocks in `layers`; the rest renumbered in order."""
    return _in_memory(plan_drop_layers(model.cfg, layers), model)


def ffn_keep(model: Model, fraction: float) -> Model:
    """Keep the fraction `fraction` (0 < f <= 1) of every SwiGLU's channels, the most important per block."""
    return _in_memory(plan_ffn_keep(model.lazy("f32"), fraction), model)


def compress_file(model_path, out_path, drop: Iterable[int] | str | None = None, keep: float | None = None,
                  verify: bool = True, say: Callable[[str], None] | None = None) -> dict:  # fmt: skip
    """The `compress MODEL --out OUT (--drop-layers LIST | --ffn-keep F)` entry point -> provenance.compress.

    Exactly one of `drop` (a list or '1,3-5') and `keep` must be given. The model goes tensor by tensor from
    input to output, a piece at a time, so the memory is a few pieces whatever the model's size. Each tensor of
    the output keeps its storage dtype in the source (a moved block its own; f64 is written as f32), the tensors
    outside the parameter table (an imported folder's vision tower and files, `modelfile.EXTRA_PREFIXES`) are
    carried byte for byte, and the output is written atomically. Refused before any work: an output that is the
    input; `verify=False` skips the tensor hash check; `say`: where a long compress says its progress."""
    if (drop is None) == (keep is None):
        raise CompressError(
            "compress: give exactly one of a list of blocks to drop and an FFN keep fraction",
            kind="one_method",
        )
    refuse_overwrite_input(out_path, [model_path], CompressError)
    with (
        open_checkpoint(model_path, verify=False) as model_header,
        open_model(model_path, verify=verify) as model,
    ):
        if drop is not None:  # checked against the model before its tensors are read
            layers = parse_layers(drop) if isinstance(drop, str) else list(drop)
            plan = plan_drop_layers(model.cfg, layers)
        else:
            plan = plan_ffn_keep(model, float(keep))
        # what this was made from: the identity an EAGLE-3 draft records of its target, so that a draft for the
        # input can find its layers on the output (`files.eagle3_aux`)
        plan.record["source"] = identity_of(model_header)
        out = apply(plan, model)
        out.tensors = {n: t.to("f32") if t.dtype == "f64" else t for n, t in out.tensors.items()}
        write_model(Path(out_path), out, say)
    return out.provenance["compress"]
