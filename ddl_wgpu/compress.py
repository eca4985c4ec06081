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

Both return a new `Model` with `provenance.compress` recorded (a previous record is kept under `previous`); the
draft head is carried over (by `ffn_keep` narrowed as said, its record under `draft`): heal it against the new
trunk (`ddl_wgpu.heal`).

What this file deliberately does not do: attention-head pruning, quantisation, or any evaluation of the result.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ddl_ref.config import ModelConfig, select_layers
from ddl_ref.mtp import draft_ffn_hidden
from ddl_ref.params import MTP_LAYER_PREFIX, param_table
from ddl_wgpu.container import open_checkpoint
from ddl_wgpu.draft_layout import width_follows_trunk
from ddl_wgpu.errors import UserError
from ddl_wgpu.modelfile import Model, check_fits, load_config, load_model, save_model
from ddl_wgpu.safeio import refuse_overwrite_input


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


def _record(model: Model, rec: dict) -> dict:
    prov = dict(model.provenance)
    if "compress" in prov:
        rec = {**rec, "previous": prov["compress"]}
    prov["compress"] = rec
    return prov


def drop_layers(model: Model, layers: Iterable[int]) -> Model:
    """`model` without the blocks in `layers`; the rest renumbered in order."""
    cfg = model.cfg
    drop = _check_layers(layers, cfg.n_layers)
    keep = [i for i in range(cfg.n_layers) if i not in drop]
    if not keep:
        raise CompressError(f"compress: dropping {drop} would leave no block")
    new_cfg = select_layers(cfg, keep)  # a hybrid's kept blocks keep their layer types
    params, dtypes = {}, {}
    for spec in param_table(new_cfg):
        m = _BLOCK.match(spec.name)
        old = f"model.layers.{keep[int(m.group(1))]}.{m.group(2)}" if m else spec.name
        params[spec.name] = np.array(model.params[old], copy=True)
        assert params[spec.name].shape == spec.shape, spec.name
        if old in model.dtypes:  # a block's storage dtype moves with it
            dtypes[spec.name] = model.dtypes[old]
    rec = {"method": "drop_layers", "dropped": drop, "n_layers_before": cfg.n_layers,
           "n_layers_after": len(keep), "kept_layers": keep}  # fmt: skip
    return dataclasses.replace(
        model, cfg=new_cfg, params=params, dtypes=dtypes, provenance=_record(model, rec)
    )


def ffn_importance(params: dict, prefix: str) -> np.ndarray:
    """(F,) ‖gate row c‖·‖up row c‖·‖down column c‖ of the SwiGLU under `prefix` ("model.layers.3.")."""
    g = np.linalg.norm(np.asarray(params[prefix + "mlp.gate_proj.weight"], np.float64), axis=1)
    u = np.linalg.norm(np.asarray(params[prefix + "mlp.up_proj.weight"], np.float64), axis=1)
    d = np.linalg.norm(np.asarray(params[prefix + "mlp.down_proj.weight"], np.float64), axis=0)
    return g * u * d


def narrow_ffn(params: dict, prefix: str, n: int) -> float:
    """Keep the `n` most important channels (`ffn_importance`, in their original order) of the SwiGLU under
    `prefix` in `params` (replaced in place) -> the fraction of the importance kept."""
    imp = ffn_importance(params, prefix)
    keep = np.sort(np.argsort(-imp, kind="stable")[:n])
    params[prefix + "mlp.gate_proj.weight"] = params[prefix + "mlp.gate_proj.weight"][keep]
    params[prefix + "mlp.up_proj.weight"] = params[prefix + "mlp.up_proj.weight"][keep]
    params[prefix + "mlp.down_proj.weight"] = params[prefix + "mlp.down_proj.weight"][:, keep]
    return float(imp[keep].sum() / max(imp.sum(), 1e-30))


def ffn_keep(model: Model, fraction: float) -> Model:
    """Keep the fraction `fraction` (0 < f <= 1) of every SwiGLU's channels, the most important per block."""
    cfg = model.cfg
    if not (isinstance(fraction, int | float) and 0.0 < float(fraction) <= 1.0):
        raise CompressError(
            f"compress: the FFN keep fraction must be in (0, 1], got {fraction!r}", field="ffn_keep"
        )
    F = cfg.ffn_hidden
    F2 = max(1, int(round(float(fraction) * F)))
    params = {n: np.array(a, copy=True) for n, a in model.params.items()}
    kept_mass = [narrow_ffn(params, f"model.layers.{i}.", F2) for i in range(cfg.n_layers)]
    new_cfg = dataclasses.replace(cfg, ffn_hidden=F2)
    rec = {"method": "ffn_keep", "fraction": float(fraction), "ffn_hidden_before": F, "ffn_hidden_after": F2,
           "importance": "norm(gate row) * norm(up row) * norm(down column)",
           "kept_importance_fraction": kept_mass}  # fmt: skip
    if cfg.mtp is not None:
        new_cfg, rec["draft"] = _draft_width(params, cfg, new_cfg)
    for spec in param_table(new_cfg):
        assert params[spec.name].shape == spec.shape, spec.name
    return dataclasses.replace(model, cfg=new_cfg, params=params, provenance=_record(model, rec))


def _draft_width(params: dict, cfg: ModelConfig, new_cfg: ModelConfig) -> tuple[ModelConfig, dict]:
    """The draft after `ffn_keep` narrowed the trunk to `new_cfg.ffn_hidden`: narrowed with it when its runtime
    builds it at the trunk's width (and it is at least that wide), else whole (its width recorded when it now
    differs from the trunk's) -> (the config, the record)."""
    width, F2 = draft_ffn_hidden(cfg), new_cfg.ffn_hidden
    follows, why = width_follows_trunk(cfg)
    rec = {"ffn_hidden_before": width, "rule": why}
    if follows and width >= F2:
        rec["kept_importance_fraction"] = narrow_ffn(params, MTP_LAYER_PREFIX, F2)
        width = F2
    rec["ffn_hidden_after"] = width
    mtp = dataclasses.replace(cfg.mtp, ffn_hidden=None if width == F2 else width)
    return dataclasses.replace(new_cfg, mtp=mtp), rec


def compress_file(model_path, out_path, drop: Iterable[int] | str | None = None,
                  keep: float | None = None, verify: bool = True) -> dict:  # fmt: skip
    """The `compress MODEL --out OUT (--drop-layers LIST | --ffn-keep F)` entry point -> provenance.compress.

    Exactly one of `drop` (a list or '1,3-5') and `keep` must be given. Each tensor of the output keeps its
    storage dtype in the source (a moved block its own), the tensors outside the parameter table (an imported
    folder's vision tower and files, `modelfile.EXTRA_PREFIXES`) are carried byte for byte, and the output is
    written atomically. Refused before any work: an output that is the
    input, and a model that does not fit in memory; `verify=False` skips the tensor hash check."""
    if (drop is None) == (keep is None):
        raise CompressError(
            "compress: give exactly one of a list of blocks to drop and an FFN keep fraction",
            kind="one_method",
        )
    refuse_overwrite_input(out_path, [model_path], CompressError)
    with open_checkpoint(model_path, verify=verify) as ck:
        cfg = load_config(ck, model_path)
    layers = None
    if drop is not None:  # checked against the model before its tensors are read
        layers = _check_layers(parse_layers(drop) if isinstance(drop, str) else list(drop), cfg.n_layers)
    # the source and the compressed copy are in memory together
    lt = None if cfg.layer_types is None else cfg.layer_types * 2
    check_fits(
        dataclasses.replace(cfg, n_layers=2 * cfg.n_layers, layer_types=lt), False, f"compress: {model_path}"
    )
    model = load_model(model_path, verify=verify, extra=True)
    if layers is not None:
        out = drop_layers(model, layers)
    else:
        out = ffn_keep(model, float(keep))
    storable = {n: d if d in ("f32", "f16", "bf16") else "f32" for n, d in out.dtypes.items()}  # f64 -> f32
    save_model(Path(out_path), out, dtype=storable)
    return out.provenance["compress"]
