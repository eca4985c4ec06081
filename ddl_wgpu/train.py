"""Variant sweeps with the reference trainer's semantics (the Rust trainer whose behaviour `train` reproduces,
described in docs/): configuration and its validation,
the cosine warm-up schedule, AdamW after gradient-norm clipping (each tensor by its own norm, as the reference
trainer clips; `grad_clip_mode` "global": one norm over all), evaluation and spectral telemetry
every `eval_interval` steps, best-validation tracking, the `TrainingReport` / `TrainingComparisonReport`,
checkpoints, and the two kinds of resume.

Where we differ from the reference trainer, on purpose:
- a new phase (`resume --steps N`) continues the data order where the last phase stopped: the batch of global
  step s is `batches[(s - data_start) % num_batches]`, data_start 0 unless a phase restarted the order
  (`resume --steps N --restart-data`, the reference trainer's behaviour: its phases start at the first batch);
- checkpoints also carry the run's position, so an interrupted run (`--stop-after`, Ctrl-C, a crash
  between saves) continues bit for bit on the same device.

What it deliberately does not do: know about GPUs. It drives any backend with the `Net`/`Work` interface
(`net.Net` on wgpu, `refnet.RefNet` on numpy).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from ddl_ref.config import ModelConfig, ModelVariant
from ddl_ref.optim import CLIP_MODES, CosineWarmupSchedule
from ddl_ref.spectral import SpectralAccumulator
from ddl_wgpu.backend import make_net
from ddl_wgpu.container import CheckpointError, open_checkpoint, save
from ddl_wgpu.data import TokenDataset
from ddl_wgpu.errors import UserError
from ddl_wgpu.modelfile import load_config, read_params
from ddl_wgpu.run import Best, Cadence, DeferredInterrupt, Events, drive
from ddl_wgpu.rundir import CHECKPOINT, REPORT, write_json
from ddl_wgpu.safeio import load_json
from ddl_wgpu.step import AdamW

MAX_INT = (1 << 63) - 1  # every integer setting is stored in the checkpoint's msgpack header (int64)
PHASE_FIXED = ("batch_size", "seq_len", "seed")  # the data's batching and order: the run's, in every phase


class TrainingError(UserError):
    """The reference trainer's `TrainingError`: each kind keeps its message."""

    @classmethod
    def invalid_config(cls, message: str, **kw) -> TrainingError:
        """`message` starts with the field it is about (e.g. "max_steps must be ..."), when about one."""
        first = message.split()[0] if message else ""
        field = first if first in {f.name for f in fields(TrainingConfig)} else None
        return cls(f"invalid training configuration: {message}", field=kw.pop("field", field), **kw)

    @classmethod
    def empty_training_dataset(cls) -> TrainingError:
        return cls("training dataset does not contain any batches")

    @classmethod
    def empty_validation_dataset(cls) -> TrainingError:
        return cls("validation dataset does not contain any batches")

    @classmethod
    def empty_variant_set(cls) -> TrainingError:
        return cls("at least one model variant is required")

    @classmethod
    def resume_mismatch(cls, message: str, **kw) -> TrainingError:
        return cls(f"invalid resume state: {message}", **kw)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C ended a run; `message` says truthfully what was saved (and where)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class TrainingConfig:
    """The reference trainer's `TrainingConfig` (same fields, defaults and validation), plus the batch shape, the
    random seed and the evaluation budget, which the reference trainer kept elsewhere."""

    max_steps: int = 32  # optimizer steps in this phase
    eval_interval: int = 4  # evaluate (and record spectral telemetry) every N steps and on the last
    learning_rate: float = 1e-3  # peak learning rate (the DDL paper's 1e-3)
    min_learning_rate: float = 0.0  # cosine floor
    warmup_steps: int = 0  # linear warm-up steps at the start of the first phase
    weight_decay: float = (
        0.1  # decoupled (AdamW), applied to every parameter as the reference trainer's burn AdamW
    )
    beta1: float = 0.9
    beta2: float = 0.95
    epsilon: float = 1e-5
    grad_clip: float = 1.0  # gradient-norm clip
    # "per-tensor": each tensor by its own norm (the reference trainer's burn clipping); "global": one norm
    # over all (PyTorch's clip_grad_norm_). A checkpoint written before the field existed resumes "global".
    grad_clip_mode: str = "per-tensor"
    batch_size: int = 8  # rows per step
    seq_len: int = 128  # tokens per row
    seed: int = 0  # parameter init (and data shuffle) seed
    eval_batches: int = (
        0  # 0: every evaluation covers the whole split (the reference's); N: its first N batches
    )
    mtp_weight: float = 0.3  # joint MTP training (a model with a draft): weight of the draft's loss

    def validate(self) -> None:
        bad = TrainingError.invalid_config
        for name in (
            "max_steps",
            "eval_interval",
            "warmup_steps",
            "batch_size",
            "seq_len",
            "seed",
            "eval_batches",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise bad(f"{name} must be a non-negative integer")
            if v > MAX_INT:
                raise bad(f"{name} must be at most 2^63-1, got {v}")
        if self.max_steps == 0:
            raise bad("max_steps must be greater than zero")
        if self.eval_interval == 0:
            raise bad("eval_interval must be greater than zero")
        if not (math.isfinite(self.learning_rate) and self.learning_rate > 0.0):
            raise bad("learning_rate must be finite and positive")
        if not (math.isfinite(self.min_learning_rate) and self.min_learning_rate >= 0.0):
            raise bad("min_learning_rate must be finite and non-negative")
        if self.min_learning_rate > self.learning_rate:
            raise bad("min_learning_rate cannot exceed learning_rate")
        if self.warmup_steps > self.max_steps:
            raise bad("warmup_steps cannot exceed max_steps")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0.0):
            raise bad("weight_decay must be finite and non-negative")
        if not (math.isfinite(self.beta1) and 0.0 <= self.beta1 < 1.0):
            raise bad("beta1 must be in [0, 1)")
        if not (math.isfinite(self.beta2) and 0.0 <= self.beta2 < 1.0):
            raise bad("beta2 must be in [0, 1)")
        if not (math.isfinite(self.epsilon) and self.epsilon > 0.0):
            raise bad("epsilon must be finite and positive")
        if not (math.isfinite(self.grad_clip) and self.grad_clip > 0.0):
            raise bad("grad_clip must be finite and positive")
        if self.grad_clip_mode not in CLIP_MODES:
            raise bad(f"grad_clip_mode must be one of {', '.join(CLIP_MODES)}")
        if self.batch_size == 0:
            raise bad("batch_size must be greater than zero")
        if self.seq_len < 2:
            raise bad("seq_len must be at least 2")
        w = self.mtp_weight
        if isinstance(w, bool) or not isinstance(w, int | float) or not (math.isfinite(w) and w >= 0.0):
            raise bad("mtp_weight must be finite and non-negative")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainingConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise TrainingError.invalid_config(f"unknown field(s) {unknown}")
        return cls(**d)


def schedule_for_phase(tcfg: TrainingConfig, previous_lr: float | None) -> CosineWarmupSchedule:
    """The reference trainer's phase schedule: the first phase warms up to `learning_rate`; a later phase starts its
    cosine at the previous phase's last rate, clamped to [min_learning_rate, learning_rate], no warm-up."""
    if previous_lr is None:
        base, warmup = tcfg.learning_rate, tcfg.warmup_steps
    else:
        base, warmup = min(max(previous_lr, tcfg.min_learning_rate), tcfg.learning_rate), 0
    try:
        return CosineWarmupSchedule(base, tcfg.min_learning_rate, warmup, tcfg.max_steps)
    except ValueError as e:
        raise TrainingError.invalid_config(str(e).removeprefix("invalid training configuration: ")) from e


def metrics(loss_sum: float, count: int) -> dict:
    """The reference trainer's `CausalLmMetrics`: mean loss over predictions and its perplexity."""
    loss = loss_sum / count if count else 0.0
    return {"loss": float(loss), "perplexity": float(math.exp(min(loss, 700.0)))}


# ---------------------------------------------------------------------------------------------------------
# evaluation


def evaluate(net, dataset: TokenDataset, max_batches: int = 0, spectral: bool = False) -> dict:
    """Mean loss over every prediction of the dataset's first `max_batches` batches (0: all), with the
    spectral snapshot averaged by prediction count when the model is a DDL model and `spectral` is set."""
    n = dataset.num_batches if max_batches <= 0 else min(max_batches, dataset.num_batches)
    work = net.work(dataset.batch_size, dataset.seq_len)
    total, count = 0.0, 0
    acc = None
    for i in range(n):
        b = dataset.batch(i)
        s, c, snap = work.eval_batch(b.ids, b.lengths, spectral=spectral)  # one forward for both
        total += s
        count += c
        if snap is not None:
            acc = acc or SpectralAccumulator()
            acc.observe(snap, max(c, 1))
    return {"metrics": metrics(total, count), "spectral": acc.finish() if acc else None}


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
    return {"phase": dict(phase), "steps_completed": raw["steps_completed"]}


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
    return out


# ---------------------------------------------------------------------------------------------------------
# one variant


@dataclass
class RunOptions:
    """How a run is driven, as opposed to what it trains."""

    backend: str = "wgpu"
    device: str | None = None
    save_interval: int = 0  # save a checkpoint every N steps (0: only at the end / on stop)
    stop_after: int = 0  # end this process after N steps with a resumable checkpoint (0: run to the end)
    progress: object = None  # callable(event: dict) for progress display (`run.Events` schema)
    # how the run's datasets were loaded (spec, validation spec or fraction, token cap), kept in the checkpoint
    # so that a resume can load them again without being told
    data: dict | None = None
    # the sweep the run is part of ({"variants": [slugs], "base": base ModelConfig dict}), kept in the
    # checkpoint so that resuming one variant can finish the sweep and write its ranked report
    sweep: dict | None = None


def _check_datasets(train: TokenDataset, val: TokenDataset | None) -> None:
    if train.num_batches == 0:
        raise TrainingError.empty_training_dataset()
    if val is not None and val.num_batches == 0:
        raise TrainingError.empty_validation_dataset()


class _NonFinite(Exception):
    """A step whose loss or gradient is not finite: the variant's run ends as `failed`."""

    def __init__(self, step: int, reason: str):
        super().__init__(reason)
        self.step, self.reason = step, reason


class _Variant:
    """One variant's run in progress: its net, report, phase and best-validation weights; the `run.Job` of
    the step loop."""

    def __init__(self, net, report: dict, phase: dict, best: Best, train, val, tcfg, out_dir, opts, events):
        self.net, self.report, self.phase, self.best = net, report, phase, best
        self.train, self.val, self.tcfg, self.opts, self.events = train, val, tcfg, opts, events
        self.history = report["history"]
        self.ckpt = out_dir / CHECKPOINT if out_dir is not None else None
        self.out_dir = out_dir
        self.schedule = schedule_for_phase(tcfg, phase["previous_lr"])
        self.work = net.work(tcfg.batch_size, tcfg.seq_len)
        self.cadence = Cadence(tcfg.eval_interval, phase["start_step"] + tcfg.max_steps, phase["start_step"])
        self.tokens_per_step = tcfg.batch_size * tcfg.seq_len
        self.steps_this_process = 0
        self.step_seconds = 0.0  # wall time inside the optimizer steps (no evaluation, spectra, checkpoints)
        self.t0 = time.perf_counter()
        self.interrupt = DeferredInterrupt()  # replaced by the run's own in `train_variant`

    # the run.Job interface

    def step(self, done: int) -> dict:
        """Global step `done` (0-based over the whole run) -> step `done` + 1."""
        tcfg = self.tcfg
        in_phase = done - self.phase["start_step"]
        # the data order runs on across phases unless one restarted it (`data_start`, `resume --restart-data`)
        batch = self.train.batch((done - self.phase.get("data_start", 0)) % self.train.num_batches)
        train_spectral = None
        if self.cadence.due(done + 1) and hasattr(self.work, "spectral"):
            train_spectral = self.work.spectral(batch.ids, batch.lengths)
        lr = self.schedule.learning_rate(in_phase)
        hyper = AdamW(lr=lr, step=done + 1, beta1=tcfg.beta1, beta2=tcfg.beta2, eps=tcfg.epsilon,
                      weight_decay=tcfg.weight_decay, grad_clip=tcfg.grad_clip,
                      grad_clip_mode=tcfg.grad_clip_mode)  # fmt: skip
        t = time.perf_counter()
        res = self.work.step(batch.ids, batch.lengths, update=hyper)  # synchronous: it reads the loss back
        self.step_seconds += time.perf_counter() - t
        if not res.finite:
            raise _NonFinite(done + 1, f"non-finite loss or gradient (loss {res.loss}, gradient norm "
                             f"{res.grad_norm}); a lower learning rate may help")  # fmt: skip
        entry = {
            "step": done + 1,
            "learning_rate": lr,
            "train": metrics(res.loss, 1),
            "validation": None,
            "train_spectral": train_spectral,
            "validation_spectral": None,
            "grad_norm": res.grad_norm,
        }
        if self.net.cfg.mtp is not None:  # joint MTP training: "train" is the combined loss
            entry["train_loss_main"], entry["train_loss_mtp"] = res.loss_main, res.loss_mtp
        self.history.append(entry)
        self.report["steps_completed"] = len(self.history)
        self.steps_this_process += 1
        elapsed = time.perf_counter() - self.t0
        return {
            "variant": self.report["variant"],
            "loss": res.loss,
            "loss_main": res.loss_main,
            "loss_mtp": res.loss_mtp,
            "lr": lr,
            "tokens_per_s": self.steps_this_process * self.tokens_per_step / max(elapsed, 1e-9),
            "s_per_step": elapsed / self.steps_this_process,
        }

    def evaluate(self, done: int) -> float | None:
        if self.val is None:
            return None
        ev = evaluate(self.net, self.val, self.tcfg.eval_batches, spectral=True)
        entry = self.history[-1]
        entry["validation"], entry["validation_spectral"] = ev["metrics"], ev["spectral"]
        self.events("eval", variant=self.report["variant"], step=done, validation=ev["metrics"])
        if self.best.value is None or ev["metrics"]["loss"] < self.best.value:
            self._record_best(ev, done)
        return ev["metrics"]["loss"]

    def snapshot(self):
        return self.net.snapshot()

    def after_step(self, done: int) -> bool:
        n, last = done - self.phase["start_step"], done == self.cadence.end
        if self.opts.save_interval and n % self.opts.save_interval == 0 and not last:
            self.checkpoint()
        if self.opts.stop_after and self.steps_this_process >= self.opts.stop_after and not last:
            self.checkpoint()
            return True
        if not last:  # step `done` and its evaluation are recorded: a Ctrl-C may end the run here (after the
            self.interrupt.check()  # last step, the final evaluation runs first and the run completes)
        return False

    # the rest of the run

    def _record_best(self, ev: dict, step: int) -> None:
        self.report["best_validation"] = ev["metrics"]
        self.report["best_validation_spectral"] = ev["spectral"]
        self.report["best_validation_step"] = step

    def checkpoint(self) -> None:
        if self.ckpt is None:
            return
        best = self.net.export_snapshot(self.best.snapshot) if self.best.snapshot is not None else None
        position = {"phase": self.phase, "steps_completed": self.report["steps_completed"]}
        save_checkpoint(self.ckpt, self.net, self.report, best, position, self.opts.data, self.opts.sweep)
        write_json(self.out_dir / REPORT, self.report)

    def finish(self) -> None:
        """The final evaluation (the reference trainer's: whole datasets, here capped by eval_batches), the
        status and throughput."""
        report, tcfg = self.report, self.tcfg
        fin_train = evaluate(self.net, self.train, tcfg.eval_batches, spectral=True)
        report["final_train"], report["final_train_spectral"] = fin_train["metrics"], fin_train["spectral"]
        if self.val is not None:
            fin_val = evaluate(self.net, self.val, tcfg.eval_batches, spectral=True)
            report["final_validation"] = fin_val["metrics"]
            report["final_validation_spectral"] = fin_val["spectral"]
            if self.best.offer(fin_val["metrics"]["loss"], self.cadence.end, self.snapshot):
                self._record_best(fin_val, self.cadence.end)
        report["status"] = "completed"
        elapsed = time.perf_counter() - self.t0
        tokens = self.steps_this_process * self.tokens_per_step
        report["throughput"] = {  # this process's part of the run
            "steps": self.steps_this_process,
            "seconds": elapsed,
            # the whole run, evaluations and checkpoints included
            "tokens_per_s": tokens / max(elapsed, 1e-9),
            "step_seconds": self.step_seconds,
            "step_tokens_per_s": tokens / max(self.step_seconds, 1e-9),  # the optimizer steps alone
        }


def _fresh(base, variant, train, val, tcfg, opts, events):
    """A new run: the variant's net from the random seed, the initial evaluation and an empty report."""
    cfg = variant.resolve_config(base)
    net = make_net(cfg, None, opts.backend, opts.device, tcfg.seed, tcfg.mtp_weight)
    phase = {"start_step": 0, "training": tcfg.to_dict(), "previous_lr": None}
    events("start", variant=variant.slug, num_params=net.num_params, cfg=cfg.to_dict())
    t_eval = time.perf_counter()
    init_train = evaluate(net, train, tcfg.eval_batches, spectral=True)
    init_val = evaluate(net, val, tcfg.eval_batches, spectral=True) if val is not None else None
    events("eval", variant=variant.slug, step=0, train=init_train["metrics"],
           validation=init_val and init_val["metrics"], seconds=time.perf_counter() - t_eval)  # fmt: skip
    report = {
        "variant": variant.slug,
        "config": cfg.to_dict(),
        "training": tcfg.to_dict(),
        "num_params": net.num_params,
        "train_dataset": train.summary(),
        "validation_dataset": val.summary() if val is not None else None,
        "steps_completed": 0,
        "initial_train": init_train["metrics"],
        "initial_validation": init_val and init_val["metrics"],
        "final_train": None,
        "final_validation": None,
        "best_validation": init_val and init_val["metrics"],
        "initial_train_spectral": init_train["spectral"],
        "initial_validation_spectral": init_val and init_val["spectral"],
        "final_train_spectral": None,
        "final_validation_spectral": None,
        "best_validation_spectral": init_val and init_val["spectral"],
        "best_validation_step": 0 if init_val else None,
        "history": [],
    }
    best = Best(init_val["metrics"]["loss"], 0, net.snapshot()) if init_val else Best(None, None)
    return net, report, phase, best


def _resumed(resume: dict, opts: RunOptions):
    """A run continued from a loaded checkpoint: its net (weights and moments), report, phase and best."""
    cfg, report, phase = resume["cfg"], resume["report"], resume["position"]["phase"]
    w = TrainingConfig.from_dict(phase["training"]).mtp_weight
    net = make_net(cfg, resume["params"], opts.backend, opts.device, mtp_weight=w)
    snap = _snapshot_of(net, resume["best"]) if resume["best"] is not None else None
    if resume["m"]:  # after the best snapshot: `_snapshot_of` goes through `net.load`, which zeroes moments
        net.load_moments(resume["m"], resume["v"])
    bv = report["best_validation"]
    best = Best(bv["loss"] if bv else None, report["best_validation_step"], snap)
    return net, report, phase, best


def train_variant(
    base: ModelConfig,
    variant: ModelVariant,
    train: TokenDataset,
    val: TokenDataset | None,
    tcfg: TrainingConfig,
    out_dir: Path | None,
    opts: RunOptions,
    resume: dict | None = None,
) -> dict:
    """Train one variant (or continue one from `resume`, a loaded checkpoint); returns the report."""
    tcfg.validate()
    _check_datasets(train, val)
    events = Events(opts.progress, "train")
    # Ctrl-C is held back (run.DeferredInterrupt) and acted on only where the state is whole: after a step
    # and its evaluation are recorded, or after the initial evaluation; the checkpoint then saved is exactly
    # that of the last completed step, and `resume` continues bit for bit. A second Ctrl-C abandons the step
    # in flight and saves nothing (its state may be torn).
    with DeferredInterrupt() as intr:
        try:
            if resume is None:
                net, report, phase, best = _fresh(base, variant, train, val, tcfg, opts, events)
            else:
                net, report, phase, best = _resumed(resume, opts)
                tcfg = TrainingConfig.from_dict(phase["training"])
        except KeyboardInterrupt:
            raise TrainingInterrupted(
                f"interrupted before the first step of {variant.slug}: nothing saved"
            ) from None
        run = _Variant(net, report, phase, best, train, val, tcfg, out_dir, opts, events)
        run.interrupt = intr
        start = report["steps_completed"]
        try:
            intr.check()
            if drive(run, start, run.cadence, best, events)[0] == "stopped":
                report["status"] = "stopped"
                return report
        except _NonFinite as e:
            # The reference finishes the sweep and ranks every run: this variant is marked failed (its last
            # good weights checkpointed, its report written) and the sweep goes on.
            report["status"] = "failed"
            report["failure"] = {"step": e.step, "reason": e.reason}
            run.checkpoint()
            events("failed", variant=report["variant"], step=e.step, reason=e.reason)
            return report
        except KeyboardInterrupt:
            raise _interrupted(run, intr) from None
        try:
            run.finish()
            events("done", variant=report["variant"], report=report)
            run.checkpoint()
        except KeyboardInterrupt:
            raise _interrupted(run, intr) from None
    return report


def _interrupted(run: _Variant, intr: DeferredInterrupt) -> TrainingInterrupted:
    """Save what a Ctrl-C leaves whole and say what that is."""
    done, name = run.report["steps_completed"], run.report["variant"]
    if intr.hard:
        return TrainingInterrupted(
            f"interrupted twice: the step in flight of {name} was abandoned, nothing saved since the last "
            f"checkpoint{f' ({run.ckpt})' if run.ckpt is not None and run.ckpt.exists() else ''}"
        )
    if run.ckpt is None:
        return TrainingInterrupted(
            f"interrupted after step {done} of {name} (no output folder: nothing saved)"
        )
    run.checkpoint()
    run.report["status"] = "interrupted"
    return TrainingInterrupted(
        f"interrupted: resumable checkpoint of step {done} of {name} saved as {run.ckpt}"
    )


def _snapshot_of(net, params: dict):
    """A snapshot of `params` in `net`'s layout (on the GPU: device buffers), the live weights untouched."""
    live = net.snapshot()
    net.load(params)
    snap = net.snapshot()
    net.restore(live)
    return snap


# ---------------------------------------------------------------------------------------------------------
# sweeps


def rank(reports: list[dict], key: str) -> list[str] | None:
    """Variants by their `key` loss; failed runs (no final metrics) last, in the sweep's order. None when a run
    that did not fail has no `key` (e.g. no validation data)."""
    ok = [r for r in reports if r.get("status") != "failed"]
    entries = [(r["variant"], r[key]["loss"]) for r in ok if r.get(key)]
    if len(entries) != len(ok):
        return None
    # the reference trainer's stable sort by `f32::total_cmp`: ties keep the sweep's order, NaN ranks last
    ranked = [v for v, _ in sorted(entries, key=lambda e: (math.isnan(e[1]), e[1]))]
    return ranked + [r["variant"] for r in reports if r.get("status") == "failed"]


def comparison_report(
    reports: list[dict], train: TokenDataset, val: TokenDataset | None, tcfg: TrainingConfig
) -> dict:
    """The reference trainer's `TrainingComparisonReport`."""
    return _comparison(reports, train.summary(), val.summary() if val is not None else None, tcfg.to_dict())


def _comparison(reports: list[dict], train_summary: dict, val_summary: dict | None, training: dict) -> dict:
    tr = rank(reports, "final_train") or []
    vr = rank(reports, "final_validation") if val_summary is not None else None
    return {
        "train_dataset": train_summary,
        "validation_dataset": val_summary,
        "training": training,
        "reports": reports,
        "final_train_loss_ranking": tr,
        "best_final_train_variant": tr[0] if tr else None,
        "final_validation_loss_ranking": vr,
        "best_final_validation_variant": vr[0] if vr else None,
    }


def train_variants(
    base: ModelConfig,
    variants: list[ModelVariant],
    train: TokenDataset,
    val: TokenDataset | None,
    tcfg: TrainingConfig,
    out_dir: Path | None,
    opts: RunOptions,
) -> dict:
    """Train every variant on the same data and config; write DIR/VARIANT/ and DIR/report.json."""
    if not variants:
        raise TrainingError.empty_variant_set()
    tcfg.validate()
    if train.num_batches == 0:
        raise TrainingError.empty_training_dataset()
    if val is not None and val.num_batches == 0:
        raise TrainingError.empty_validation_dataset()
    if out_dir is not None and opts.sweep is None:
        opts = replace(opts, sweep={"variants": [v.slug for v in variants], "base": base.to_dict()})
    reports = []
    # One Ctrl-C for the whole sweep: the variant in progress acts on it. The sweep's report is written inside
    # the same `with`: a Ctrl-C after the last variant's last step (which nothing acts on any more: the work is
    # done and saved) cannot cut the report short.
    with DeferredInterrupt():
        for v in variants:
            d = out_dir / v.slug if out_dir is not None else None
            r = train_variant(base, v, train, val, tcfg, d, opts)
            reports.append(r)
            if r.get("status") == "stopped":
                break
        comp = (
            comparison_report(reports, train, val, tcfg)
            if all(r.get("status") in ("completed", "failed") for r in reports)
            else None
        )
        if out_dir is not None and comp is not None:
            write_json(out_dir / REPORT, comp)
    return comp or {"reports": reports, "status": "stopped"}


# ---------------------------------------------------------------------------------------------------------
# resume


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


def resume(
    checkpoint: Path,
    train: TokenDataset,
    val: TokenDataset | None,
    opts: RunOptions,
    out_dir: Path | None = None,
    steps: int | None = None,
    overrides: dict | None = None,
    restart_data: bool = False,
) -> dict:
    """Continue an interrupted run (no `steps`), or train a new phase of `steps` more steps with the
    reference trainer's phase schedule (`overrides` change training options of the new phase). A new phase
    continues the data order; `restart_data` starts it at the first batch again, as the reference trainer's
    phases do."""
    ck = load_checkpoint(Path(checkpoint))
    check_resume(ck, train, val)
    if opts.data is None:  # the continued run keeps recording how its data is loaded
        opts = replace(opts, data=ck["data"])
    rep = ck["report"]
    phase = ck["position"]["phase"]
    done = rep["steps_completed"]
    if steps is None:
        if overrides:
            raise TrainingError.invalid_config(
                "training options can only change in a new phase", kind="needs_phase"
            )
        if restart_data:
            raise TrainingError.invalid_config(
                "the data order can only restart in a new phase", kind="needs_phase"
            )
        if done >= phase["start_step"] + phase["training"]["max_steps"]:
            raise TrainingError.resume_mismatch(
                f"the run already completed its {done} steps", kind="run_completed"
            )
    else:
        data_fields = sorted(set(overrides or {}) & set(PHASE_FIXED))
        if data_fields:
            raise TrainingError.invalid_config(
                f"{data_fields[0]} cannot change in a new phase: it shapes the run's data",
                field=data_fields[0],
            )
        # The reference's caller passes a whole configuration per phase; what is not given is the last phase's,
        # except warm-up: a later phase never warms up (`schedule_for_phase`), so an inherited warm-up longer
        # than the new phase must not refuse it.
        tcfg = TrainingConfig.from_dict(
            {**phase["training"], "warmup_steps": 0, **(overrides or {}), "max_steps": steps}
        )
        tcfg.validate()
        if done < phase["start_step"] + phase["training"]["max_steps"]:
            raise TrainingError.resume_mismatch(
                f"the run stopped at step {done} of its phase, which must finish first",
                kind="phase_unfinished",
            )
        prev = rep["history"][-1]["learning_rate"] if rep["history"] else None
        if prev is not None and schedule_for_phase(tcfg, prev).learning_rate(0) <= 0.0:
            # The reference trainer's phase schedule starts where the last phase stopped; after a decay to a floor of 0 the
            # new phase would train nothing. Say so instead of idling.
            raise TrainingError.invalid_config(
                "the last phase ended at learning rate 0, so a new phase would not train (the reference trainer's phase "
                "schedule starts where the last one stopped); the new phase needs min_learning_rate > 0",
                field="min_learning_rate",
            )
        ck["position"]["phase"] = {"start_step": done, "training": tcfg.to_dict(), "previous_lr": prev}
        data_start = done if restart_data else phase.get("data_start", 0)
        if data_start:  # recorded only when not 0, the order's start before phases could restart it
            ck["position"]["phase"]["data_start"] = data_start
        rep["training"] = tcfg.to_dict()
    out = Path(out_dir) if out_dir is not None else Path(checkpoint).parent
    variant = ModelVariant.parse(rep["variant"])
    tcfg = TrainingConfig.from_dict(ck["position"]["phase"]["training"])
    in_sweep = steps is None and ck["sweep"] is not None and out == Path(checkpoint).parent
    if not in_sweep:
        return train_variant(ck["cfg"], variant, train, val, tcfg, out, opts, resume=ck)
    if opts.sweep is None:
        opts = replace(opts, sweep=ck["sweep"])
    with DeferredInterrupt():
        report = train_variant(ck["cfg"], variant, train, val, tcfg, out, opts, resume=ck)
        if report.get("status") == "completed" and phase["start_step"] == 0:
            finish_sweep(out.parent, ck["sweep"], train, val, tcfg, opts)
    return report


def finish_sweep(
    sweep_dir: Path, sweep: dict, train: TokenDataset, val: TokenDataset | None, tcfg, opts: RunOptions
) -> Path | None:
    """After a resumed variant of a sweep completed: train the sweep's variants that never started (an
    interrupt ended the sweep before them), then write the ranked `sweep_dir/report.json` when every variant
    has completed; -> its path, or None while some variant is still unfinished (resume it)."""
    try:
        slugs = [ModelVariant.parse(str(v)).slug for v in sweep["variants"]]
        base = ModelConfig.from_dict(dict(sweep["base"]))
    except (KeyError, TypeError, ValueError) as e:
        raise TrainingError.resume_mismatch(f"the checkpoint's sweep record is malformed: {e}") from None
    reports = []
    for slug in slugs:
        d = sweep_dir / slug
        if not (d / CHECKPOINT).exists():
            reports.append(train_variant(base, ModelVariant.parse(slug), train, val, tcfg, d, opts))
            if reports[-1].get("status") != "completed":
                return None
            continue
        try:
            r = load_json((d / REPORT).read_bytes(), str(d / REPORT), TrainingError)
        except OSError:
            return None
        if not isinstance(r, dict) or r.get("status") != "completed":
            return None
        reports.append(r)
    path = sweep_dir / REPORT
    training = reports[0].get("training", tcfg.to_dict())
    write_json(
        path, _comparison(reports, train.summary(), val.summary() if val is not None else None, training)
    )
    return path
