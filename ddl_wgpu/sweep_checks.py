"""A sweep's record (`OUT/sweep.json`) read as untrusted input, and the checks `train` and `resume` make before
any job of a sweep starts.

`sweep.json` is a file anyone can edit: `read_record` refuses, with one line each, what would make the jobs
fail one by one (`training: null`, an unknown variant, a seed past int64) or run wrong (`"seeds": [0, 0]`,
two jobs at once into one folder). `check_jobs` holds the record against what the jobs of an earlier run wrote
(their checkpoints and reports): an edited learning rate would train the fresh jobs at the new rate and
resume the others at the old, and rank them together. `check_runner` names an adapter that does not exist
before a worker is spawned for it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ddl_ref.config import ConfigError, ModelConfig, ModelVariant
from ddl_wgpu import train as train_lib
from ddl_wgpu.checkpoint import DATA_FIELDS
from ddl_wgpu.container import CheckpointError, open_checkpoint
from ddl_wgpu.modelfile import check_fits
from ddl_wgpu.safeio import load_json, read_regular
from ddl_wgpu.sweep import SWEEP, Job, Runner, Sweep, SweepError
from ddl_wgpu.train_config import MAX_INT

MAX_RECORD_BYTES = 16 << 20  # a record is a few kilobytes (its configurations, variants and seeds)
FIELDS = {"base", "training", "variants", "seeds", "data", "backend", "save_interval", "precision", "runner",
          "id", "plots"}  # fmt: skip
REQUIRED = ("base", "training", "variants", "seeds", "data", "backend")


def _int(v, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= MAX_INT


def read_record(path: Path) -> dict:
    """The fields of a `Sweep` from `path`, each checked; SweepError (one line naming the file) otherwise."""
    where = str(path)
    d = load_json(read_regular(path, "a sweep record", SweepError, MAX_RECORD_BYTES), where, SweepError)

    def bad(message: str) -> SweepError:
        return SweepError(f"{where}: {message}; it is not the record `train` wrote (restore it, or train the "
                          "sweep anew)")  # fmt: skip

    if not isinstance(d, dict):
        raise bad(f"a JSON {type(d).__name__}, not an object")
    unknown, missing = sorted(set(d) - FIELDS), [k for k in REQUIRED if k not in d]
    if unknown or missing:
        raise bad(f"unknown field {unknown[0]!r}" if unknown else f"no {missing[0]!r}")
    if not isinstance(d["base"], dict):
        raise bad("'base' is not a model configuration")
    try:
        base = ModelConfig.from_dict(d["base"])
    except (ConfigError, TypeError) as e:
        raise bad(f"'base': {e}") from None
    variants = d["variants"]
    if not (isinstance(variants, list) and variants and all(isinstance(v, str) for v in variants)):
        raise bad("'variants' is not a list of variant names")
    for v in variants:
        try:
            if ModelVariant.parse(v).slug != v:
                raise ConfigError(f"{v!r} is not a variant's name")
        except ConfigError as e:
            raise bad(f"'variants': {e}") from None
    if len(set(variants)) != len(variants):
        raise bad(f"'variants' {variants} names a variant twice")
    seeds = d["seeds"]
    if not (isinstance(seeds, list) and seeds and all(_int(s) for s in seeds)):
        raise bad("'seeds' is not a list of integers between 0 and 2^63-1")
    if len(set(seeds)) != len(seeds):
        raise bad(f"'seeds' {seeds} names a seed twice (two jobs would train into one folder)")
    if not isinstance(d["training"], dict):
        raise bad("'training' is not the training options")
    # a record from before the clipping mode existed: its jobs clipped globally (as `train.load_checkpoint`)
    training = {"grad_clip_mode": "global", **d["training"]}
    try:
        # the record's own seed too, though each job trains with its own instead
        for s in (training.get("seed", 0), *seeds):
            train_lib.TrainingConfig.from_dict({**training, "seed": s}).validate()
    except (train_lib.TrainingError, TypeError) as e:
        raise bad(f"'training': {e}") from None
    if training["seq_len"] > base.max_seq_len:
        raise bad(
            f"'training' seq_len {training['seq_len']} exceeds the model's max_seq_len {base.max_seq_len}"
        )
    try:
        for v in variants:
            check_fits(ModelVariant.parse(v).resolve_config(base), True, f"variant {v}")
    except ConfigError as e:
        raise bad(str(e)) from None
    data = d["data"]
    if not (isinstance(data, dict) and set(data) == DATA_FIELDS and isinstance(data["data"], str)
            and data["data"] and (data["val_data"] is None or isinstance(data["val_data"], str))
            and isinstance(data["val_fraction"], int | float) and not isinstance(data["val_fraction"], bool)
            and math.isfinite(data["val_fraction"]) and 0 <= data["val_fraction"] <= 1
            and _int(data["max_tokens"])):  # fmt: skip
        raise bad(f"'data' must record {sorted(DATA_FIELDS)} as `train` does")
    if d["backend"] not in ("wgpu", "ref"):
        raise bad(f"'backend' {d['backend']!r} is not wgpu or ref")
    if not _int(d.get("save_interval", 0)):
        raise bad("'save_interval' is not a non-negative integer")
    if d.get("precision", "f32") not in ("f32", "f16"):
        raise bad(f"'precision' {d['precision']!r} is not f32 or f16")
    runner = d.get("runner", {})
    if not (isinstance(runner, dict) and set(runner) <= {"devices", "ray"}
            and isinstance(runner.get("devices", []), list)
            and all(x is None or isinstance(x, str) for x in runner.get("devices", []))
            and (runner.get("ray") is None or isinstance(runner["ray"], str))):  # fmt: skip
        raise bad("'runner' is not how the sweep ran (devices, ray)")
    if not isinstance(d.get("id", ""), str) or not isinstance(d.get("plots", True), bool):
        raise bad("'id' is not a string or 'plots' not true or false")
    return {**d, "training": training}


# ---------------------------------------------------------------------------------------------------------
# the record against its jobs


def _differences(want: dict, got: dict) -> list[str]:
    return [f"{k} {got.get(k)!r} where the sweep has {want[k]!r}" for k in want if got.get(k) != want[k]]


def _check_job(sweep: Sweep, job: Job, folder: Path, record: Path) -> None:
    """The job's checkpoint and report, when it has them, are of this sweep's options."""
    want_cfg = ModelVariant.parse(job.variant).resolve_config(ModelConfig.from_dict(sweep.base))
    want = sweep.tcfg(job.seed).to_dict()
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
    from ddl_wgpu import gpu as gpu_mod

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
