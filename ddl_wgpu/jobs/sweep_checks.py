"""The checks `train` and `resume` make before any job of a sweep starts.

`sweep.json` is a file anyone can edit: `sweep_job.read_record` refuses, with one line each, what would make
the jobs fail one by one (`training: null`, an unknown variant, a seed past int64) or run wrong
(`"seeds": [0, 0]`, two jobs at once into one folder). `check_jobs` holds the record against what the jobs of
an earlier run wrote (their checkpoints and reports): an edited learning rate would train the fresh jobs at
the new rate and resume the others at the old, and rank them together. `check_runner` names an adapter that
does not exist before a worker is spawned for it; `capped_runner` starts at most one worker per job.
"""

from __future__ import annotations

import os
from pathlib import Path

from ddl_ref.config import ConfigError, ModelConfig, ModelVariant
from ddl_wgpu.files.container import CheckpointError, open_checkpoint
from ddl_wgpu.files.safeio import load_json, read_regular
from ddl_wgpu.jobs import train as train_lib
from ddl_wgpu.jobs.rundir import SWEEP
from ddl_wgpu.jobs.sweep_job import MAX_RECORD_BYTES, Job, Runner, Sweep, SweepError

# ---------------------------------------------------------------------------------------------------------
# the record against its jobs


def _differences(want: dict, got: dict) -> list[str]:
    return [f"{k} {got.get(k)!r} where the sweep has {want[k]!r}" for k in want if got.get(k) != want[k]]


def _check_job(sweep: Sweep, job: Job, folder: Path, record: Path) -> None:
    """The job's checkpoint and report, when it has them, are of this sweep's options."""
    want_cfg = ModelVariant.parse(job.variant).resolve_config(ModelConfig.from_dict(sweep.base))
    want = sweep.tcfg(job.seed).to_dict()
    if want["precision"] == "auto":  # each job resolves it on its own adapter and records f32 or mixed
        del want["precision"]
    ck = folder / train_lib.CHECKPOINT
    found = []  # (what, variant, training options, model config, data)
    if ck.exists():
        with open_checkpoint(ck, verify=False) as c:  # the header alone: no tensor is read
            meta = dict(c.metadata or {})
            cfg = c.config
        position, raw = meta.get("train.position"), meta.get("train.report")
        phase = position.get("phase") if isinstance(position, dict) else None
        rep = load_json(raw, f"{ck}: train.report", SweepError) if isinstance(raw, str) else None
        found.append((str(ck), rep.get("variant") if isinstance(rep, dict) else None,
                      phase.get("training") if isinstance(phase, dict) else None, cfg,
                      meta.get("train.data")))  # fmt: skip
    report = folder / train_lib.REPORT
    if report.exists():
        rep = load_json(read_regular(report, "a job's report", SweepError, MAX_RECORD_BYTES << 4), str(report),
                        SweepError)  # fmt: skip
        if not isinstance(rep, dict):
            raise SweepError(f"{report}: a JSON {type(rep).__name__}, not a job's report")
        found.append((str(report), rep.get("variant"), rep.get("training"), rep.get("config"), sweep.data))
    for where, variant, training, cfg, data in found:
        if variant != job.variant:
            raise SweepError(f"{where} is of variant {variant!r}, not the job {job.name}'s")
        if not isinstance(training, dict):
            raise SweepError(f"{where} records no training options")
        diff = _differences(want, {"grad_clip_mode": "global", **training})
        try:
            same_model = isinstance(cfg, dict) and ModelConfig.from_dict(cfg) == want_cfg
        except (ConfigError, TypeError):
            same_model = False
        if not same_model:
            diff.append("another model configuration")
        if data is not None and data != sweep.data:  # None: a checkpoint from before the data was recorded
            diff.append(f"data {data!r} where the sweep has {sweep.data!r}")
        if diff:
            raise SweepError(f"{where} trained with {diff[0]}: the job {job.name} is not the sweep's (was "
                             f"{record} edited?); resume the job alone with `resume CHECKPOINT`, or train the "
                             "sweep anew")  # fmt: skip


def check_jobs(sweep: Sweep, root: Path) -> None:
    """Every job folder under `root` holds what this sweep trains (`_check_job`); SweepError otherwise."""
    for job in sweep.jobs():
        try:
            _check_job(sweep, job, Path(root) / job.name, Path(root) / SWEEP)
        except CheckpointError as e:
            raise SweepError(f"job {job.name}: {e}") from None


# ---------------------------------------------------------------------------------------------------------
# where the jobs run


def check_runner(runner: Runner, backend: str, device: str | None = None) -> None:
    """Every adapter the jobs of a wgpu sweep are to run on exists on this host (a Ray cluster's nodes pick
    their own); SweepError naming --devices (or --device) otherwise."""
    if backend != "wgpu" or (runner.ray is not None and runner.ray != "local"):
        return
    from ddl_wgpu.runtime import gpu as gpu_mod

    flag = "devices" if runner.devices else "device"
    for d in dict.fromkeys(runner.devices or (device,)):
        try:
            gpu_mod.select_adapter(d)
        except gpu_mod.NoAdapterError as e:
            what = (
                "the default adapter"
                if d is None and not os.environ.get(gpu_mod.ENV_ADAPTER)
                else f"adapter {d!r}"
            )
            raise SweepError(f"{what}: {str(e).splitlines()[0]}", field=flag) from None


def capped_runner(backend: str, devices: str | None, workers: int, ray: str | None, device: str | None,
                  jobs: int) -> tuple[Runner, str]:  # fmt: skip
    """`Runner.parse` with at most one worker process per job (more would only sit idle, and `--workers 1000`
    for one job started a thousand processes) -> (the runner, a note for the sweep's line when capped)."""
    runner = Runner.parse(backend, devices, min(workers, jobs), ray, device)
    asked = max(workers, len(runner.devices))
    if len(runner.devices) <= jobs and workers <= jobs:
        return runner, ""
    runner = Runner(runner.devices[:jobs], runner.ray)
    return runner, f" ({asked} workers asked for, at most one per job)"
