"""A training run's checkpoint: writing it (the model under its usual names, the best-validation model, AdamW's
moments, the report, the run's position, data and backend, in one atomic file), reading it back as untrusted
input (each malformed piece one precise line), and the reference trainer's resume checks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ddl_ref.config import ModelVariant
from ddl_wgpu.data import TokenDataset
from ddl_wgpu.engine.step import LOSS_SCALE_BACKOFF, LOSS_SCALE_MAX, LOSS_SCALE_MIN
from ddl_wgpu.files.container import CheckpointError, open_checkpoint, save
from ddl_wgpu.files.modelfile import load_config, read_params
from ddl_wgpu.files.safeio import load_json
from ddl_wgpu.jobs.train_config import MAX_INT, TrainingConfig, TrainingError

# ---------------------------------------------------------------------------------------------------------
# checkpoints


def save_checkpoint(
    path: Path,
    net,
    report: dict,
    best: dict | None,
    position: dict,
    data: dict | None = None,
    sweep: dict | None = None,
) -> None:
    """Model (its usual names, so `eval`/`heal` read a checkpoint like a model file), best-validation model
    (`best.` prefix), AdamW moments (`optim.m.` / `optim.v.`), report, position, how the run's data was
    loaded (`data`, `RunOptions.data`) and the sweep it belongs to (`sweep`, `RunOptions.sweep`), in one
    atomic file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    params = net.export()
    m, v = net.moments()

    def tensors():
        for n, a in params.items():
            yield n, a
        if best is not None:
            for n, a in best.items():
                yield "best." + n, a
        for n, a in m.items():
            yield "optim.m." + n, a
        for n, a in v.items():
            yield "optim.v." + n, a

    meta = {
        "model.variant": report["variant"],
        "train.report": json.dumps(report),
        "train.position": position,
        "train.has_best": best is not None,
        "train.backend": backend_record(net),
    }
    if data is not None:
        meta["train.data"] = data
    if sweep is not None:
        meta["train.sweep"] = sweep
    save(
        path,
        tensors(),
        config=net.cfg.to_dict(),
        metadata=meta,
        provenance={"train": {"tool": "ddl-wgpu train"}},
    )


def backend_record(net) -> dict:
    """Where a run trains, kept in its checkpoint (`train.backend`): an exact resume continues there, bit for
    bit (another backend takes another float path); the device kind is the adapter's `gpu.Gpu.name`."""
    gpu = getattr(net, "gpu", None)  # the wgpu engine's Net holds its device; the numpy RefNet none
    return (
        {"backend": "wgpu", "device": gpu.name} if gpu is not None else {"backend": "ref", "device": "numpy"}
    )


def _checked_backend(raw, path) -> dict | None:
    if raw is None:  # a checkpoint from before the backend was recorded
        return None
    if not (
        isinstance(raw, dict) and raw.get("backend") in ("wgpu", "ref") and isinstance(raw.get("device"), str)
    ):
        raise _bad(
            path, f"train.backend must record the backend (wgpu or ref) and the device, got {raw!r:.80}"
        )
    return {"backend": raw["backend"], "device": raw["device"]}


def _bad(path, message: str) -> TrainingError:
    return TrainingError.resume_mismatch(f"{path}: {message}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_INT


DATA_FIELDS = {"data", "val_data", "val_fraction", "max_tokens"}  # RunOptions.data
REPORT_FIELDS = {"variant": str, "history": list, "steps_completed": int, "train_dataset": dict,
                 "training": dict}  # fmt: skip


def _checked_report(raw, path) -> dict:
    """`train.report`: JSON of a dict with the fields resume relies on, each of the right type."""
    if not isinstance(raw, str):
        raise _bad(path, f"train.report is {type(raw).__name__}, not the report's JSON text")
    report = load_json(raw, f"{path}: train.report", TrainingError)
    if not isinstance(report, dict):
        raise _bad(path, f"train.report is a JSON {type(report).__name__}, not an object")
    for name, kind in REPORT_FIELDS.items():
        v = report.get(name)
        if not (_int(v) if kind is int else isinstance(v, kind)):
            raise _bad(path, f"train.report field {name!r} is missing or not a {kind.__name__}")
    if not all(
        isinstance(e, dict) and isinstance(e.get("learning_rate"), int | float) for e in report["history"]
    ):
        raise _bad(path, "train.report history holds an entry without a learning rate")
    vd, bv = report.get("validation_dataset"), report.get("best_validation")
    if vd is not None and not isinstance(vd, dict):
        raise _bad(path, "train.report field 'validation_dataset' is not an object")
    if bv is not None and not (isinstance(bv, dict) and isinstance(bv.get("loss"), int | float)):
        raise _bad(path, "train.report field 'best_validation' has no loss")
    try:
        ModelVariant.parse(report["variant"])
    except (ValueError, KeyError) as e:
        raise _bad(path, f"train.report variant {report['variant']!r}: {e}") from None
    return report


def _checked_position(raw, path, report: dict) -> dict:
    """`train.position`: the phase (first step, training options, previous rate) and the steps done."""
    if not isinstance(raw, dict) or not isinstance(raw.get("phase"), dict) or not raw["phase"]:
        raise _bad(path, "train.position is missing or has no phase")
    phase = raw["phase"]
    if not _int(phase.get("start_step")) or not isinstance(phase.get("training"), dict):
        raise _bad(path, "train.position phase needs a start_step and its training options")
    prev = phase.get("previous_lr")
    if prev is not None and (isinstance(prev, bool) or not isinstance(prev, int | float)):
        raise _bad(path, f"train.position previous_lr is {prev!r}, not a number")
    start = phase.get("data_start", 0)
    if not _int(start) or start > phase["start_step"]:
        raise _bad(path, f"train.position data_start is {start!r}, not a step at or before the phase's start")
    try:
        TrainingConfig.from_dict(dict(phase["training"])).validate()
    except (TypeError, ValueError) as e:
        raise _bad(path, f"train.position phase training options: {e}") from None
    if raw.get("steps_completed") != report["steps_completed"]:
        raise _bad(path, f"train.position records {raw.get('steps_completed')!r} steps, the report "
                         f"{report['steps_completed']}")  # fmt: skip
    out = {"phase": dict(phase), "steps_completed": raw["steps_completed"]}
    if raw.get("scaler") is not None:
        out["scaler"] = _checked_scaler(raw["scaler"], path)
    return out


def _checked_scaler(raw, path) -> dict:
    """`train.position.scaler` (a mixed-precision run's `LossScaler.state`): a power-of-two scale no lower than
    a failed run leaves it (one halving below the floor) and two step counts."""
    ok = isinstance(raw, dict) and set(raw) == {"scale", "good_steps", "skipped_steps"}
    scale = raw.get("scale") if ok else None
    ok = ok and isinstance(scale, float) and _int(raw["good_steps"]) and _int(raw["skipped_steps"])
    if not (
        ok and LOSS_SCALE_MIN * LOSS_SCALE_BACKOFF <= scale <= LOSS_SCALE_MAX and math.frexp(scale)[0] == 0.5
    ):
        raise _bad(
            path, f"train.position scaler must hold a power-of-two scale and two step counts, got {raw!r:.80}"
        )
    return dict(raw)


def load_checkpoint(path: Path, verify: bool = True) -> dict:
    """-> {cfg, params, best, m, v, report, position, data, sweep, backend}; raises CheckpointError or
    TrainingError, one precise line per malformed piece. The config is checked (valid, fits in memory for
    training) and then against every tensor read (shape, float dtype); tensors no parameter of the config
    names are never read. `data` is how the run loaded its data (`RunOptions.data`) and `sweep` the sweep it
    is part of (`RunOptions.sweep`), `backend` where it trained (`backend_record`), None in a checkpoint
    written before they were recorded. `verify=False` skips the tensor hash check (trusted input)."""
    with open_checkpoint(path, verify=verify) as ck:
        meta = dict(ck.metadata or {})
        if "train.report" not in meta:
            raise TrainingError.resume_mismatch(f"{path} is not a training checkpoint (no train.report)")
        report = _checked_report(meta["train.report"], path)
        position = _checked_position(meta.get("train.position"), path, report)
        cfg = load_config(ck, path, training=True)
        params = read_params(ck, cfg, path)
        has_best = any(n.startswith("best.") for n in ck.names())
        best = read_params(ck, cfg, path, prefix="best.") if has_best else None
        m = read_params(ck, cfg, path, prefix="optim.m.", require_all=False)
        v = read_params(ck, cfg, path, prefix="optim.v.", require_all=False)
        for a, b, pre in ((params, m, "optim.m."), (params, v, "optim.v.")):
            if (m or v) and set(a) != set(b):
                missing = sorted(set(a) - set(b))
                raise CheckpointError(f"{path}: missing optimizer tensor {pre}{missing[0]}")
        data, sweep = meta.get("train.data"), meta.get("train.sweep")
        if data and not (isinstance(data, dict) and set(data) >= DATA_FIELDS):
            raise _bad(path, f"train.data must record {sorted(DATA_FIELDS)}")
        out = {
            "cfg": cfg,
            "params": params,
            "best": best,
            "m": m,
            "v": v,
            "report": report,
            "position": position,
            "data": dict(data) if isinstance(data, dict) and data else None,
            "sweep": dict(sweep) if isinstance(sweep, dict) and sweep else None,
            "backend": _checked_backend(meta.get("train.backend"), path),
        }
    # a checkpoint from before grad_clip_mode clipped globally: it resumes so, bit for bit
    for training in (out["report"].get("training"), out["position"].get("phase", {}).get("training")):
        if isinstance(training, dict):
            training.setdefault("grad_clip_mode", "global")
            training.setdefault("precision", "f32")  # from before mixed precision: an f32 run
    return out


def check_resume(ck: dict, train: TokenDataset, val: TokenDataset | None) -> None:
    """The reference trainer's resume checks, each with its message."""
    rep = ck["report"]
    ts = train.summary()
    if rep["train_dataset"] != ts:
        raise TrainingError.resume_mismatch(
            f"training dataset summary {ts} does not match saved artifact {rep['train_dataset']}"
        )
    vs = val.summary() if val is not None else None
    if rep["validation_dataset"] != vs:
        raise TrainingError.resume_mismatch(
            f"validation dataset summary {vs} does not match saved artifact {rep['validation_dataset']}"
        )
    if rep["steps_completed"] != len(rep["history"]):
        raise TrainingError.resume_mismatch(
            f"saved report recorded {rep['steps_completed']} completed steps but {len(rep['history'])} "
            "history entries"
        )
    if rep["steps_completed"] > 0 and not ck["m"]:
        raise TrainingError.resume_mismatch("saved training artifact is missing optimizer state")
    variant = ModelVariant.parse(rep["variant"])
    is_ddl = ck["cfg"].residual == "delta"
    if is_ddl and not variant.uses_ddl:
        raise TrainingError.resume_mismatch(
            f"saved report expects variant {variant.slug} but checkpoint contains a DDL model"
        )
    if not is_ddl and variant.uses_ddl:
        raise TrainingError.resume_mismatch(
            f"saved report expects variant {variant.slug} but checkpoint contains a baseline model"
        )
    _check_saved_state(ck)


def _is_ddl_model(params: dict) -> bool:
    """A model's kind from its tensors: a DDL model has Deep Delta tensors (`model.layers.I.ddl_attn.*`)."""
    return any(".ddl_attn." in n for n in params)


def _check_saved_state(ck: dict) -> None:
    """The reference trainer's checks of a saved run's optimizer state and best-validation model: every
    model tensor has both Adam moments of its shape, and the best model is of the checkpoint's kind."""
    if ck["report"]["steps_completed"] > 0 and (ck["m"] or ck["v"]):
        for kind in ("m", "v"):
            for n, p in ck["params"].items():
                if n not in ck[kind]:
                    raise TrainingError(f"optimizer state serialization failed: tensor optim.{kind}.{n} is "
                                        "missing from the checkpoint", kind="optimizer_state")  # fmt: skip
                if ck[kind][n].shape != p.shape:
                    raise TrainingError(f"optimizer state serialization failed: tensor optim.{kind}.{n} has "
                                        f"shape {ck[kind][n].shape}, the model's {n} {p.shape}",
                                        kind="optimizer_state")  # fmt: skip
    best = ck["best"]
    if best is not None and _is_ddl_model(best) != (ck["cfg"].residual == "delta"):
        kind = "DDL" if ck["cfg"].residual == "delta" else "baseline"
        raise TrainingError.resume_mismatch(
            f"best-validation checkpoint kind does not match the {kind} artifact"
        )
