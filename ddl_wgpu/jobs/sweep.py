"""Sweeps of `train`: every (variant, seed) is one job with its own folder, run one after another in this
process, by worker processes over the adapters of a host (`--devices`, `--workers`), or as Ray tasks on a
cluster (`--ray`); one comparison report over them, each variant ranked by its mean over the seeds.

A job is exactly `train --variants V --seed S` (the random seed sets the initialisation, the data order and the
validation split): it loads the data itself from the sweep's data spec and trains with `train.train_variant`,
so its report and checkpoint are bit-identical to that run on the same kind of adapter, wherever it runs.

Layout of a sweep's folder OUT:
    OUT/sweep.json                what the sweep trains and how it ran (what `resume OUT` reads)
    OUT/VARIANT/                  a job's report.json and checkpoint.ddlw, with one seed (today's layout)
    OUT/VARIANT/seed-S/           the same, with several seeds
    OUT/report.json               the comparison report, once every job has ended

Workers: one process per entry of the device list (the 'spawn' context: a forked wgpu or BLAS state is not
safe to share). Each process selects its adapter the way every command does (`RunOptions.device` and the
DDL_WGPU_ADAPTER variable: Vulkan ignores CUDA_VISIBLE_DEVICES). Jobs are handed out as workers free up; a job
that raises, or whose worker dies, is marked failed and the others go on. Ctrl-C (SIGINT to the process group,
as a terminal sends it, or to this process alone, which forwards it) ends every running job after its current
step with a resumable checkpoint (`StopRequest`); `resume OUT` then finishes the unfinished jobs and keeps the
finished ones.

Ray: the same jobs as tasks, one adapter each (`sweep_ray.py`: how a task finds its adapter and where its
files go).

This module is the driver: `parse_seeds`, `run`, `resume`, `comparison`, `table`, `SweepView`. The record and
one job (`Sweep`, `Job`, `Runner`, `attempt`, ...) are `sweep_job.py`, which the driver, the checks made
before any job (`sweep_checks.py`) and the Ray tasks import; `Sweep`, `Job`, `Runner` and `SweepError` are
re-exported here, the names a caller of the driver needs.
"""

from __future__ import annotations

import math
import os
import queue
import signal
import sys
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

from ddl_wgpu.jobs import train as train_lib
from ddl_wgpu.jobs.rundir import write_json
from ddl_wgpu.jobs.sweep_checks import check_jobs
from ddl_wgpu.jobs.sweep_job import (
    STOP,
    Forward,
    Job,
    Runner,
    Sweep,
    SweepError,
    attempt,
    check_data,
    finished_report,
)
from ddl_wgpu.jobs.sweep_ray import run_tasks
from ddl_wgpu.jobs.train_config import MAX_INT

__all__ = ["Job", "Runner", "Sweep", "SweepError", "SweepView", "comparison", "parse_seeds", "resume", "run",
           "table"]  # fmt: skip

# the statistics of the comparison over seeds, per variant and loss
LOSS_KEYS = ("final_train", "final_validation", "best_validation")


def parse_seeds(text: str) -> list[int]:
    """'0,1,2' -> [0, 1, 2]: non-negative, no repeats."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise SweepError(f"seeds must be a comma list of integers, got {text!r}", field="seeds") from None
    if not seeds or any(s < 0 for s in seeds) or len(set(seeds)) != len(seeds):
        raise SweepError(f"seeds must be distinct non-negative integers, got {text!r}", field="seeds")
    if max(seeds) > MAX_INT:  # each job's seed is stored in its checkpoint's header (int64)
        raise SweepError(f"seeds must be at most 2^63-1, got {max(seeds)}", field="seeds")
    return seeds


# ---------------------------------------------------------------------------------------------------------
# the live view


class SweepView:
    """One progress view of every job: a plain line per job event, prefixed with the job's name, readable in
    a terminal and in a log alike."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr

    def say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def event(self, job: str, ev: dict) -> None:
        kind, p = ev["event"], f"[{job}]"
        if kind == "start":
            self.say(f"{p} start: {ev['num_params']:,} parameters")
        elif kind == "eval" and ev["step"] == 0:
            v = ev.get("validation")
            vtxt = f", validation {v['loss']:.4f}" if v else ""
            self.say(f"{p} initial evaluation: train {ev['train']['loss']:.4f}{vtxt}")
        elif kind == "eval":
            self.say(f"{p} step {ev['step']}: validation {ev['validation']['loss']:.4f}")
        elif kind == "step":
            self.say(f"{p} step {ev['step']}/{ev['total']}  loss {ev['loss']:.4f}  lr {ev['lr']:.2e}  "
                     f"{ev['tokens_per_s']:,.0f} tok/s  {ev['s_per_step']:.3f} s/step")  # fmt: skip

    def result(self, job: str, res: dict) -> None:
        p, rep = f"[{job}]", res.get("report") or {}
        where = f" on {res['where']}" if res.get("where") else ""
        if res["status"] == "completed":
            fv = (rep.get("final_validation") or {}).get("loss", float("nan"))
            self.say(
                f"{p} completed{where}: final train {rep['final_train']['loss']:.4f}, final validation {fv:.4f}"
            )
        elif res["status"] == "failed":
            self.say(f"{p} FAILED{where}: {res['error']}")
        else:
            self.say(f"{p} {res['status']} after step {rep.get('steps_completed', 0)} (resumable)")


# ---------------------------------------------------------------------------------------------------------
# running the jobs


def _inline(sweep, jobs, root, launch, view) -> dict:
    results = {}
    try:
        previous = signal.signal(signal.SIGINT, STOP)
    except ValueError:  # not the main thread: Ctrl-C is not this sweep's to handle
        previous = None
    try:
        for job in jobs:
            if STOP.requested:
                raise KeyboardInterrupt
            res = attempt(sweep, job, root, None, Forward(view.event, job.name), *launch)
            results[job.name] = res
            view.result(job.name, res)
        if STOP.requested:
            raise KeyboardInterrupt
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        STOP.requested = False
    return results


def _worker(index: int, device, inbox, outbox) -> None:
    """A worker process: jobs from `inbox` until None (or Ctrl-C); events, then each job's result, into
    `outbox`."""
    signal.signal(signal.SIGINT, STOP)
    if device is not None:
        from ddl_wgpu.runtime.gpu import ENV_ADAPTER

        os.environ[ENV_ADAPTER] = str(device)
    while not STOP.requested and (msg := inbox.get()) is not None:
        sweep, job, root, launch = msg
        sink = Forward(lambda name, ev: outbox.put(("event", index, name, ev)), job.name)
        res = attempt(sweep, job, root, device, sink, *launch)
        res["where"] = f"worker {index}" + ("" if device is None else f", adapter {device}")
        outbox.put(("result", index, job.name, res))


class _Pool:
    """Worker processes, one per device entry, each with its own inbox; jobs handed out as they free up."""

    def __init__(self, devices, sweep, root, launch, view):
        import multiprocessing as mp

        self.ctx = mp.get_context("spawn")
        self.outbox = self.ctx.Queue()
        self.devices, self.view = list(devices), view
        self.msg = lambda job: (sweep, job, str(root), launch)
        self.procs: list = [None] * len(self.devices)
        self.inboxes: list = [None] * len(self.devices)
        self.running: dict[int, object] = {}  # worker index -> job
        self.results: dict[str, dict] = {}

    def start(self, i: int) -> None:
        self.inboxes[i] = self.ctx.Queue()
        self.procs[i] = self.ctx.Process(target=_worker, args=(i, self.devices[i], self.inboxes[i], self.outbox),
                                         name=f"ddl-wgpu-worker-{i}")  # fmt: skip
        self.procs[i].start()

    def hand(self, i: int, pending: deque) -> None:
        if pending:
            job = pending.popleft()
            self.running[i] = job
            self.inboxes[i].put(self.msg(job))
        else:
            self.inboxes[i].put(None)

    def take(self, msg) -> int | None:
        """Handle one message; -> the index of a worker that just finished a job."""
        kind, i, name, payload = msg
        if kind == "event":
            self.view.event(name, payload)
            return None
        self.results[name] = payload
        self.running.pop(i, None)
        self.view.result(name, payload)
        return i

    def drain(self, timeout: float, most: float = 60.0) -> list[int]:
        """Messages until none comes for `timeout` s or for `most` s (a dead worker must be noticed)."""
        freed = []
        end = time.monotonic() + most
        try:
            while (left := end - time.monotonic()) > 0:
                i = self.take(self.outbox.get(timeout=min(timeout, left)))
                if i is not None:
                    freed.append(i)
        except queue.Empty:
            pass
        return freed

    def run(self, jobs) -> dict:
        pending = deque(jobs)
        try:
            for i in range(len(self.devices)):
                self.start(i)
                self.hand(i, pending)
            while self.running:
                for i in self.drain(0.5, most=1.0):
                    self.hand(i, pending)
                for i, job in list(self.running.items()):
                    if not self.procs[i].is_alive():
                        self._lost(i, job, pending)
        except KeyboardInterrupt:
            self.stop()
            raise
        finally:
            for p in self.procs:
                if p is not None:
                    p.join(timeout=5)
            for q in (*self.inboxes, self.outbox):  # their semaphores go back now, not at interpreter exit
                if q is not None:
                    q.close()
        return self.results

    def _lost(self, i: int, job, pending: deque) -> None:
        """Worker i died with a job in hand: its last messages may still be in flight, then the job failed."""
        for j in self.drain(0.2, most=2.0):
            self.hand(j, pending)
        if self.running.get(i) is job:
            code = self.procs[i].exitcode
            self.take(("result", i, job.name, {"status": "failed", "report": None,
                                               "error": f"worker process exited with code {code}"}))  # fmt: skip
            self.start(i)
            self.hand(i, pending)

    def stop(self) -> None:
        """Ctrl-C: every running job ends after its current step with a resumable checkpoint, idle workers
        exit; wait for them all (a further Ctrl-C is ignored)."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.view.say(f"interrupted: {len(self.running)} running job(s) stop after their current step")
            for i, p in enumerate(self.procs):
                if p is not None and p.is_alive():
                    os.kill(
                        p.pid, signal.SIGINT
                    )  # the terminal may not have sent it (a SIGINT to this process)
                    self.inboxes[i].put(None)
            while self.running and any(p is not None and p.is_alive() for p in self.procs):
                self.drain(0.5)
            self.drain(0.2)
        finally:
            signal.signal(signal.SIGINT, previous)  # the entry point's, or Python's


# ---------------------------------------------------------------------------------------------------------
# the comparison over jobs and seeds


def _stats(values: list[float]) -> dict:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


def _ranking(summary: dict, key: str) -> list[str] | None:
    """Variants by mean loss (NaN last, ties in sweep order), as the reference trainer's ranking; None when a
    variant has no such loss."""
    entries = [(v, s[key]) for v, s in summary.items()]
    if any(st is None for _, st in entries):
        return None
    return [v for v, st in sorted(entries, key=lambda e: (math.isnan(e[1]["mean"]), e[1]["mean"]))]


def comparison(sweep: Sweep, results: dict) -> dict:
    """The comparison report: with one seed, the reference trainer's `TrainingComparisonReport` of the
    completed jobs (what `train` without a sweep writes); with several, its rankings by each variant's mean
    over the seeds, `seed_summary` (mean, sample std, min, max per loss) and the datasets per seed. Both list
    every job with its status (`jobs`) and every completed job's report (`reports`, in sweep order)."""
    jobs = sweep.jobs()
    done = [
        (j, results[j.name]["report"]) for j in jobs if results.get(j.name, {}).get("status") == "completed"
    ]
    summary = {}
    for v in sweep.variants:
        reps = [r for j, r in done if j.variant == v]
        if reps:
            summary[v] = {"seeds": [r["training"]["seed"] for r in reps]}
            for key in LOSS_KEYS:
                losses = [r[key]["loss"] for r in reps if r.get(key)]
                summary[v][key] = _stats(losses) if len(losses) == len(reps) else None
    tr = _ranking(summary, "final_train") or []
    vr = _ranking(summary, "final_validation")
    first = done[0][1] if done else {}
    comp = {
        "train_dataset": first.get("train_dataset"),
        "validation_dataset": first.get("validation_dataset"),
        "training": sweep.training,
        "reports": [r for _, r in done],
        "final_train_loss_ranking": tr,
        "best_final_train_variant": tr[0] if tr else None,
        "final_validation_loss_ranking": vr,
        "best_final_validation_variant": vr[0] if vr else None,
    }
    if len(sweep.seeds) > 1:
        comp["train_dataset"] = comp["validation_dataset"] = None  # each seed splits and orders its own
        comp["seeds"] = sweep.seeds
        comp["datasets"] = {str(r["training"]["seed"]): {"train": r["train_dataset"],
                                                         "validation": r["validation_dataset"]} for _, r in done}  # fmt: skip
        comp["seed_summary"] = summary
    comp["jobs"] = [{"job": j.name, "variant": j.variant, "seed": j.seed, "folder": j.name,
                     "status": results.get(j.name, {}).get("status", "not run"),
                     "error": results.get(j.name, {}).get("error")} for j in jobs]  # fmt: skip
    return comp


# ---------------------------------------------------------------------------------------------------------
# a sweep


def run(sweep: Sweep, root: Path, runner: Runner, stop_after: int = 0, view: SweepView | None = None,
        resuming: bool = False) -> dict:  # fmt: skip
    """Run every job of `sweep` into ROOT -> the comparison report (also ROOT/report.json), or {"status":
    "stopped", "jobs": ...} when --stop-after left jobs unfinished. `resuming`: keep the jobs that completed
    and continue the others from their checkpoints (else every job starts afresh, as `train` always does).
    Ctrl-C: KeyboardInterrupt once every running job has saved its checkpoint. Worker processes are spawned:
    a script that calls this with `runner.devices` does so under `if __name__ == "__main__":`."""
    root = Path(root)
    view = view or SweepView()
    if runner.ray in (None, "local"):  # this host's workers see what this process sees: say so once, now
        check_data(sweep.data)
    sweep = replace(sweep, runner={"devices": list(runner.devices), "ray": runner.ray})
    root.mkdir(parents=True, exist_ok=True)
    sweep.save(root)
    jobs = sweep.jobs()
    results, todo, launch = {}, [], (stop_after, resuming)
    for job in jobs:  # finished in an earlier run of the sweep: kept as they are
        rep = finished_report(root / job.name) if resuming else None
        if rep is None:
            todo.append(job)
        else:
            results[job.name] = {"status": "completed", "report": rep, "error": None}
            view.result(job.name, results[job.name])
    if len(runner.devices) > len(todo):  # a worker per job left at most: more would only sit idle
        runner = replace(runner, devices=runner.devices[: len(todo)])
    if todo and runner.ray is not None:
        results.update(run_tasks(sweep, todo, root, runner, launch, view))
    elif todo and runner.devices:
        results.update(_Pool(runner.devices, sweep, root, launch, view).run(todo))
    elif todo:
        results.update(_inline(sweep, todo, root, launch, view))
    if any(results.get(j.name, {}).get("status") in ("stopped", "interrupted") for j in jobs):
        return {"status": "stopped", "jobs": comparison(sweep, results)["jobs"]}
    comp = comparison(sweep, results)
    write_json(root / train_lib.REPORT, comp)
    return comp


def resume(root: Path, runner: Runner | None = None, backend: str | None = None, stop_after: int = 0,
           view: SweepView | None = None) -> dict:  # fmt: skip
    """Continue the sweep in ROOT: finished jobs kept, unfinished ones resumed from their checkpoints, jobs
    not started (or failed) run; the comparison written anew. `runner` (default: the sweep's own) and
    `backend` (default: the sweep's own) may change where the jobs run."""
    sweep = Sweep.load(root)
    check_jobs(sweep, root)  # before any job starts: a job of other options would be ranked with the rest
    if backend is not None:
        sweep = replace(sweep, backend=backend)
    if runner is None:
        r = sweep.runner or {}
        runner = Runner(tuple(r.get("devices") or ()), r.get("ray"))
    return run(sweep, root, runner, stop_after, view, resuming=True)


def table(comp: dict) -> str:
    """The ranked table over seeds: mean ± std [min, max] of the final losses per variant, then each job."""
    summary, nan = comp.get("seed_summary") or {}, float("nan")
    order = comp.get("final_validation_loss_ranking") or comp.get("final_train_loss_ranking") or []

    def cell(st):
        return f"{st['mean']:.4f} ± {st['std']:.4f} [{st['min']:.4f}, {st['max']:.4f}]" if st else "-"

    rows = [f"{'rank':<5}{'variant':<14}{'seeds':>6}  {'final val: mean ± std [min, max]':<38}"
            f"{'final train: mean ± std [min, max]':<38}"]  # fmt: skip
    for i, v in enumerate(order, 1):
        s = summary[v]
        rows.append(
            f"{i:<5}{v:<14}{len(s['seeds']):>6}  {cell(s['final_validation']):<38}{cell(s['final_train'])}"
        )
    rows.append("")
    by = {(r["variant"], r["training"]["seed"]): r for r in comp["reports"]}
    for j in comp["jobs"]:
        r = by.get((j["variant"], j["seed"]))
        if r is None:
            rows.append(f"  {j['job']:<24}{j['status']}{': ' + j['error'] if j['error'] else ''}")
            continue
        fv = (r.get("final_validation") or {}).get("loss", nan)
        rows.append(f"  {j['job']:<24}final train {r['final_train']['loss']:.4f}  final val {fv:.4f}")
    return "\n".join(rows)
