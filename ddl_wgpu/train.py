"""Variant sweeps with the reference trainer's semantics (the Rust trainer whose behaviour `train` reproduces,
described in docs/): configuration and its validation,
the cosine warm-up schedule, AdamW with global gradient-norm clipping, evaluation and spectral telemetry
every `eval_interval` steps, best-validation tracking, the `TrainingReport` / `TrainingComparisonReport`,
checkpoints, and the two kinds of resume.

Where we differ from the reference trainer, on purpose:
- evaluation of the *training* set (initial/final) reads at most `eval_batches` batches: a real corpus has
  far more batches than a report needs, and the reference trainer's toy datasets never had that problem;
- a new phase (`resume --steps N`) continues the data order where the last phase stopped (the reference trainer
  restarts at the first batch): the batch of global step s is `batches[s % num_batches]`;
- checkpoints also carry the run's position, so an interrupted run (`--stop-after`, Ctrl-C, a crash
  between saves) continues bit for bit on the same device.

What it deliberately does not do: know about GPUs. It drives any backend with the `Net`/`Work` interface
(`engine.Net` on wgpu, `refnet.RefNet` on numpy).
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
from ddl_wgpu.container import open_checkpoint, save
from ddl_wgpu.data import TokenDataset
from ddl_wgpu.errors import UserError
from ddl_wgpu.run import Best, Cadence, Events, drive
from ddl_wgpu.step import AdamW

CHECKPOINT = "checkpoint.ddlw"
REPORT = "report.json"


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
    eval_batches: int = 16  # at most this many batches per evaluation of a dataset (0: all)
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


def _report_path(d: Path) -> Path:
    return d / REPORT


def write_json(path: Path, obj) -> None:
    """Atomic JSON write (temp name, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(obj, indent=2, allow_nan=True))
    tmp.replace(path)


def save_checkpoint(
    path: Path, net, report: dict, best: dict | None, position: dict, data: dict | None = None
) -> None:
    """Model (its usual names, so `eval`/`heal` read a checkpoint like a model file), best-validation model
    (`best.` prefix), AdamW moments (`optim.m.` / `optim.v.`), report, position and how the run's data was
    loaded (`data`, `RunOptions.data`), in one atomic file."""
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
    }
    if data is not None:
        meta["train.data"] = data
    save(
        path,
        tensors(),
        config=net.cfg.to_dict(),
        metadata=meta,
        provenance={"train": {"tool": "ddl-wgpu train"}},
    )


def load_checkpoint(path: Path) -> dict:
    """-> {cfg, params, best, m, v, report, position, data}; raises CheckpointError or TrainingError. `data` is
    how the run loaded its data (`RunOptions.data`), None in a checkpoint written before it was recorded."""
    with open_checkpoint(path) as ck:
        meta = dict(ck.metadata or {})
        if "train.report" not in meta:
            raise TrainingError.resume_mismatch(f"{path} is not a training checkpoint (no train.report)")
        cfg = ModelConfig.from_dict(dict(ck.config))
        names = ck.names()
        model = [n for n in names if not n.startswith(("best.", "optim."))]
        out = {
            "cfg": cfg,
            "params": {n: ck.tensor_f32(n) for n in model},
            "best": {n[5:]: ck.tensor_f32(n) for n in names if n.startswith("best.")} or None,
            "m": {n[8:]: ck.tensor_f32(n) for n in names if n.startswith("optim.m.")},
            "v": {n[8:]: ck.tensor_f32(n) for n in names if n.startswith("optim.v.")},
            "report": json.loads(meta["train.report"]),
            "position": dict(meta.get("train.position") or {}),
            "data": dict(meta["train.data"]) if meta.get("train.data") else None,
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
    precision: str = "f32"  # "f16": mixed precision (f16 GEMM products, dynamic loss scaling; wgpu only)
    save_interval: int = 0  # save a checkpoint every N steps (0: only at the end / on stop)
    stop_after: int = 0  # end this process after N steps with a resumable checkpoint (0: run to the end)
    progress: object = None  # callable(event: dict) for progress display (`run.Events` schema)
    # how the run's datasets were loaded (spec, validation spec or fraction, token cap), kept in the checkpoint
    # so that a resume can load them again without being told
    data: dict | None = None


def _check_datasets(train: TokenDataset, val: TokenDataset | None) -> None:
    if train.num_batches == 0:
        raise TrainingError.empty_training_dataset()
    if val is not None and val.num_batches == 0:
        raise TrainingError.empty_validation_dataset()


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
        self.t0 = time.perf_counter()

    # the run.Job interface

    def step(self, done: int) -> dict:
        """Global step `done` (0-based over the whole run) -> step `done` + 1."""
        tcfg = self.tcfg
        in_phase = done - self.phase["start_step"]
        batch = self.train.batch(done % self.train.num_batches)
        train_spectral = None
        if self.cadence.due(done + 1) and hasattr(self.work, "spectral"):
            train_spectral = self.work.spectral(batch.ids, batch.lengths)
        lr = self.schedule.learning_rate(in_phase)
        hyper = AdamW(lr=lr, step=done + 1, beta1=tcfg.beta1, beta2=tcfg.beta2, eps=tcfg.epsilon,
                      weight_decay=tcfg.weight_decay, grad_clip=tcfg.grad_clip,
                      grad_clip_mode=tcfg.grad_clip_mode)  # fmt: skip
        res = self.work.step(batch.ids, batch.lengths, update=hyper)
        if not res.finite:
            self.checkpoint()
            raise TrainingError(
                f"non-finite loss or gradient at step {done + 1} (loss {res.loss}); the last good "
                f"checkpoint is {self.ckpt}; a lower learning rate may help",
                kind="non_finite",
            )
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
        save_checkpoint(self.ckpt, self.net, self.report, best, position, self.opts.data)
        write_json(_report_path(self.out_dir), self.report)

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
        report["throughput"] = {
            "steps": self.steps_this_process,
            "seconds": elapsed,
            "tokens_per_s": self.steps_this_process * self.tokens_per_step / max(elapsed, 1e-9),
        }


def _fresh(base, variant, train, val, tcfg, opts, events):
    """A new run: the variant's net from the random seed, the initial evaluation and an empty report."""
    cfg = variant.resolve_config(base)
    net = make_net(cfg, None, opts.backend, opts.device, tcfg.seed, tcfg.mtp_weight, opts.precision)
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
    net = make_net(cfg, resume["params"], opts.backend, opts.device, mtp_weight=w, precision=opts.precision)
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
    if resume is None:
        net, report, phase, best = _fresh(base, variant, train, val, tcfg, opts, events)
    else:
        net, report, phase, best = _resumed(resume, opts)
        tcfg = TrainingConfig.from_dict(phase["training"])
    run = _Variant(net, report, phase, best, train, val, tcfg, out_dir, opts, events)
    start = report["steps_completed"]
    try:
        if drive(run, start, run.cadence, best, events)[0] == "stopped":
            report["status"] = "stopped"
            return report
    except KeyboardInterrupt:
        run.checkpoint()
        report["status"] = "interrupted"
        raise
    run.finish()
    events("done", variant=report["variant"], report=report)
    run.checkpoint()
    return report


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
    entries = [(r["variant"], r[key]["loss"]) for r in reports if r.get(key)]
    if len(entries) != len(reports):
        return None
    # the reference trainer's stable sort by `f32::total_cmp`: ties keep the sweep's order, NaN ranks last
    return [v for v, _ in sorted(entries, key=lambda e: (math.isnan(e[1]), e[1]))]


def comparison_report(
    reports: list[dict], train: TokenDataset, val: TokenDataset | None, tcfg: TrainingConfig
) -> dict:
    """The reference trainer's `TrainingComparisonReport`."""
    tr = rank(reports, "final_train") or []
    vr = rank(reports, "final_validation")
    return {
        "train_dataset": train.summary(),
        "validation_dataset": val.summary() if val is not None else None,
        "training": tcfg.to_dict(),
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
    reports = []
    for v in variants:
        d = out_dir / v.slug if out_dir is not None else None
        r = train_variant(base, v, train, val, tcfg, d, opts)
        reports.append(r)
        if r.get("status") == "stopped":
            break
    comp = (
        comparison_report(reports, train, val, tcfg)
        if all(r.get("status") == "completed" for r in reports)
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


def resume(
    checkpoint: Path,
    train: TokenDataset,
    val: TokenDataset | None,
    opts: RunOptions,
    out_dir: Path | None = None,
    steps: int | None = None,
    overrides: dict | None = None,
) -> dict:
    """Continue an interrupted run (no `steps`), or train a new phase of `steps` more steps with the
    reference trainer's phase schedule (`overrides` change training options of the new phase)."""
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
        if done >= phase["start_step"] + phase["training"]["max_steps"]:
            raise TrainingError.resume_mismatch(
                f"the run already completed its {done} steps", kind="run_completed"
            )
    else:
        tcfg = TrainingConfig.from_dict({**phase["training"], **(overrides or {}), "max_steps": steps})
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
        rep["training"] = tcfg.to_dict()
    out = Path(out_dir) if out_dir is not None else Path(checkpoint).parent
    variant = ModelVariant.parse(rep["variant"])
    tcfg = TrainingConfig.from_dict(ck["position"]["phase"]["training"])
    return train_variant(ck["cfg"], variant, train, val, tcfg, out, opts, resume=ck)
