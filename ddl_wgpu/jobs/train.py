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
  between saves) continues bit for bit on the same device;
- `precision` "mixed" (docs/precision.md) adds dynamic loss scaling (`step.LossScaler`, PyTorch GradScaler's
  rules): a step whose scaled gradient overflows is skipped and recorded as such, not a failure; its scale
  and good-step count are part of the checkpoint's position.

What it deliberately does not do: know about GPUs. It drives any backend with the `Net`/`Work` interface
(`net.Net` on wgpu, `refnet.RefNet` on numpy).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ddl_ref.config import ModelConfig, ModelVariant
from ddl_ref.spectral import SpectralAccumulator
from ddl_wgpu.backend import apply_precision, make_net
from ddl_wgpu.data import TokenDataset
from ddl_wgpu.engine.step import LOSS_SCALE_MIN, AdamW, LossScaler
from ddl_wgpu.files.safeio import load_json
from ddl_wgpu.jobs.checkpoint import check_resume, load_checkpoint, save_checkpoint
from ddl_wgpu.jobs.run import Best, Cadence, DeferredInterrupt, Events, drive
from ddl_wgpu.jobs.rundir import CHECKPOINT, REPORT, write_json
from ddl_wgpu.jobs.train_config import (
    PHASE_FIXED,
    TrainingConfig,
    TrainingError,
    TrainingInterrupted,
    schedule_for_phase,
)


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
    batches = (dataset.batch(i) for i in range(n))
    return summarize_eval(
        work.eval_batch(b.ids, b.lengths, spectral=spectral) for b in batches
    )  # one forward


def summarize_eval(results) -> dict:
    """{"metrics", "spectral"} of evaluation batches given as (loss sum, predictions, spectral snapshot or None),
    in order: the mean loss over every prediction, the snapshots averaged by prediction count."""
    total, count, acc = 0.0, 0, None
    for s, c, snap in results:
        total += s
        count += c
        if snap is not None:
            acc = acc or SpectralAccumulator()
            acc.observe(snap, max(c, 1))
    return {"metrics": metrics(total, count), "spectral": acc.finish() if acc else None}


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
        self.scaler = None  # mixed precision's LossScaler (`train_variant` sets it)

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
        sc = self.scaler
        # a skipped step is no optimizer step: AdamW's bias correction counts the applied ones (GradScaler's
        # skip leaves torch.optim's step count alone too)
        hyper = AdamW(lr=lr, step=done + 1 - (sc.skipped if sc else 0), beta1=tcfg.beta1, beta2=tcfg.beta2,
                      eps=tcfg.epsilon, weight_decay=tcfg.weight_decay, grad_clip=tcfg.grad_clip,
                      grad_clip_mode=tcfg.grad_clip_mode, loss_scale=sc.scale if sc else 1.0)  # fmt: skip
        t = time.perf_counter()
        res = self.work.step(batch.ids, batch.lengths, update=hyper)  # synchronous: it reads the loss back
        self.step_seconds += time.perf_counter() - t
        skipped = False
        if sc is None and not res.finite:
            raise _NonFinite(done + 1, f"non-finite loss or gradient (loss {res.loss}, gradient norm "
                             f"{res.grad_norm}); a lower learning rate may help")  # fmt: skip
        if sc is not None:
            # The loss is unscaled (the forward never sees S): a non-finite loss is the run's, not the
            # scaler's. A non-finite gradient at a finite loss is an overflow of S * gradient: skipped, S halved,
            # until S falls below LOSS_SCALE_MIN, where no overflow explains it any more.
            if not math.isfinite(res.loss):
                raise _NonFinite(done + 1, f"non-finite loss {res.loss}; a lower learning rate may help")
            skipped = not sc.update(res.finite)
            if sc.failed:
                raise _NonFinite(done + 1, f"non-finite gradient (norm {res.grad_norm}) at every loss scale "
                                 f"down to {LOSS_SCALE_MIN}: {sc.skipped} steps skipped; a lower learning "
                                 "rate may help")  # fmt: skip
            if skipped:
                self.events("skip", variant=self.report["variant"], step=done + 1, loss_scale=sc.scale,
                            skipped=sc.skipped)  # fmt: skip
        entry = {
            "step": done + 1,
            "learning_rate": lr,
            "train": metrics(res.loss, 1),
            "validation": None,
            "train_spectral": train_spectral,
            "validation_spectral": None,
            "grad_norm": None if skipped else res.grad_norm,
        }
        if sc is not None:  # mixed precision: the scale this step ran at, and whether it was skipped
            entry["loss_scale"] = hyper.loss_scale
            entry["skipped"] = skipped
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
        if self.scaler is not None:
            position["scaler"] = self.scaler.state()
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
    tcfg = with_precision(tcfg, opts)
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
        if tcfg.precision == "mixed":
            saved = resume["position"].get("scaler") if resume is not None else None
            run.scaler = (
                LossScaler.from_state(saved, tcfg.loss_scale_interval)
                if saved is not None
                else LossScaler(tcfg.loss_scale, tcfg.loss_scale_interval)
            )
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


def with_precision(tcfg: TrainingConfig, opts: RunOptions) -> TrainingConfig:
    """`tcfg` validated, its precision resolved on the run's backend ("auto" -> "f32" or "mixed": what the
    run records) and the Gpu's products set to match (`backend.apply_precision`)."""
    tcfg.validate()
    return replace(tcfg, precision=apply_precision(tcfg.precision, opts.backend, opts.device).name)


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
    tcfg = with_precision(tcfg, opts)
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
