"""A sweep's record and one job of it, wherever the job runs: in the driver's process, a worker process of
this host (`sweep._Pool`) or a Ray task (`sweep_ray.py`). The driver (`sweep.py`), the checks made before any
job starts (`sweep_checks.py`) and the Ray tasks all import this module, and it imports none of them.

- the record: `Sweep` (what a sweep trains, OUT/sweep.json) and `read_record`, which reads it back as
  untrusted input (a file anyone can edit) within its limits (`MAX_RECORD_BYTES`, `FIELDS`, `REQUIRED`);
- the runner: `Runner`, where the jobs run (worker processes over adapters, or Ray);
- one job: `Job`, `run_job` / `attempt` (a job exactly as `train --variants V --seed S` runs it, so its report
  and checkpoint are bit-identical to that run's), `finished_report`, `check_data`, the Ctrl-C request that
  ends a job after its current step (`StopRequest`, `STOP`) and the progress sink that forwards its events
  (`Forward`).
"""

from __future__ import annotations

import math
import os
import socket
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddl_ref.config import ConfigError, ModelConfig, ModelVariant
from ddl_wgpu.data import STDLIB_SPEC, DataError, load_source
from ddl_wgpu.errors import UserError
from ddl_wgpu.files.modelfile import check_fits
from ddl_wgpu.files.safeio import load_json, read_regular
from ddl_wgpu.jobs import train as train_lib
from ddl_wgpu.jobs.checkpoint import DATA_FIELDS
from ddl_wgpu.jobs.rundir import SWEEP, write_json
from ddl_wgpu.jobs.train_config import MAX_INT


class SweepError(UserError):
    """A sweep that cannot be set up or resumed, with one line for the user."""


# ---------------------------------------------------------------------------------------------------------
# the record

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


@dataclass(frozen=True)
class Job:
    variant: str
    seed: int
    name: str  # "ddl" (one seed) or "ddl/seed-1": the progress prefix and the folder under OUT


@dataclass(frozen=True)
class Sweep:
    """What a sweep trains; written to OUT/sweep.json."""

    base: dict  # ModelConfig.to_dict()
    training: dict  # TrainingConfig.to_dict(); each job replaces its seed
    variants: list[str]
    seeds: list[int]
    data: dict  # how every job loads its data (`RunOptions.data`)
    backend: str  # "wgpu" or "ref", resolved
    save_interval: int = 0
    runner: dict = field(default_factory=dict)  # how it ran (`Runner`): what `resume` does by default
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # Ray workers recognise a shared OUT by it
    plots: bool = True  # `train --plots/--no-plots`: `resume OUT` writes them, or not, as the sweep did

    def jobs(self) -> list[Job]:
        many = len(self.seeds) > 1
        return [Job(v, s, f"{v}/seed-{s}" if many else v) for v in self.variants for s in self.seeds]

    def tcfg(self, seed: int) -> train_lib.TrainingConfig:
        return train_lib.TrainingConfig.from_dict({**self.training, "seed": seed})

    def save(self, root: Path) -> None:
        write_json(Path(root) / SWEEP, asdict(self))

    @classmethod
    def load(cls, root: Path, say=None) -> Sweep:
        """The sweep recorded in ROOT, read as untrusted input (`read_record`); `say(line)` hears about a record
        that no longer applies."""
        path = Path(root) / SWEEP
        if not path.exists():
            raise SweepError(f"{root} is not a sweep folder (no {SWEEP}); resume a run with its checkpoint")
        record = read_record(path)
        # Sweeps of `train --precision f16` (f16 GEMM products; removed after it measured slower than f32,
        # docs/experiments.md) recorded their precision here: they resume in f32, the only precision left.
        precision = record.pop("precision", "f32")
        if precision != "f32" and say is not None:
            say(f"{root} was trained with --precision {precision}, which no longer exists: it resumes in f32")
        return cls(**record)


# ---------------------------------------------------------------------------------------------------------
# where the jobs run


@dataclass(frozen=True)
class Runner:
    """Where the jobs run: `devices` has one entry per worker process (an adapter index or name; None: the
    default adapter, or the numpy backend); none and no `ray`: one after another in this process. `ray`:
    "local" (start a local cluster) or a cluster's address."""

    devices: tuple = ()
    ray: str | None = None

    @classmethod
    def parse(cls, backend: str, devices: str | None, workers: int, ray: str | None, device: str | None):
        """The options of `train`: `--devices all|LIST` (one worker per entry; repeat an entry for several
        workers on one adapter), `--workers N` (N workers, spread over the devices; on numpy the only way to
        ask for workers), `--ray local|ADDRESS`."""
        if workers < 0:
            raise SweepError("--workers must be non-negative", field="workers")
        if backend == "ref":
            if devices is not None:
                raise SweepError(
                    "--devices picks GPU adapters, and this sweep runs on the numpy backend: ask for worker "
                    "processes with --workers N"
                )
            return cls((None,) * workers, ray)
        if ray is not None and ray != "local":
            if devices is not None:
                raise SweepError(
                    "--devices picks adapters of this host; a Ray cluster's nodes declare their own"
                )
            return cls((), ray)
        if devices is None:
            # a local Ray cluster gets a slot per GPU unless one adapter was named
            listed = gpu_adapters() if ray == "local" and device is None else [device]
        elif devices.strip() == "all":
            listed = gpu_adapters()
        else:
            listed = [d.strip() for d in devices.split(",") if d.strip()]
            if not listed:
                raise SweepError(f"--devices: no adapter in {devices!r}", field="devices")
        n = workers or (len(listed) if devices is not None or ray == "local" else 0)
        return cls(tuple(listed[i % len(listed)] for i in range(n)), ray)

    def describe(self) -> str:
        if self.ray is not None:
            where = "a local Ray cluster" if self.ray == "local" else f"the Ray cluster at {self.ray}"
            return f"Ray tasks on {where}" + (f" ({len(self.devices)} slots)" if self.devices else "")
        if not self.devices:
            return "one job after another in this process"
        return f"{len(self.devices)} worker processes: " + ", ".join(
            "numpy" if d is None else f"adapter {d}" for d in self.devices
        )


def gpu_adapters() -> list[str]:
    """`--devices all`: the index of every real GPU adapter (not OpenGL, not a CPU implementation), else of
    every non-OpenGL one (a CPU-only machine running `--backend wgpu`)."""
    from ddl_wgpu.backend import _GL_BACKENDS, cpu_implementation
    from ddl_wgpu.runtime import gpu as gpu_mod

    infos = [dict(a.info) for a in gpu_mod.enumerate_adapters()]
    usable = [i for i, info in enumerate(infos) if info.get("backend_type") not in _GL_BACKENDS]
    real = [i for i in usable if cpu_implementation(infos[i]) is None]
    if not (real or usable):
        raise SweepError(gpu_mod.DRIVER_HINT)
    return [str(i) for i in real or usable]


# ---------------------------------------------------------------------------------------------------------
# one job, in whichever process runs it


def check_data(source: dict) -> None:
    """Every data spec of the sweep is readable here: each worker checks before it trains."""
    for key, what in (("data", "training data"), ("val_data", "validation data")):
        spec = source.get(key)
        if spec and spec != STDLIB_SPEC and not os.path.exists(spec):
            raise DataError(
                f"{socket.gethostname()} cannot see the {what} {spec}: every worker of a sweep reads the data "
                "at the same path (put it on storage that every worker sees, or use --data stdlib)"
            )


def _load(sweep: Sweep, tcfg: train_lib.TrainingConfig):
    return load_source(sweep.data, tcfg.seq_len, tcfg.batch_size, sweep.base["vocab_size"], tcfg.seed)


def finished_report(folder: Path) -> dict | None:
    """The report of a job that completed in an earlier run of the sweep, else None."""
    path = folder / train_lib.REPORT
    if not path.is_file():
        return None
    rep = load_json(read_regular(path, "a job's report", SweepError, 1 << 28), str(path), SweepError)
    return rep if isinstance(rep, dict) and rep.get("status") == "completed" else None


class StopRequest:
    """Ctrl-C reaching a process that runs jobs: its job ends after the step in progress (and that step's
    evaluation) with a resumable checkpoint, through `RunOptions.stop_after`, and no other job starts. A
    KeyboardInterrupt would land wherever the signal does, and a step cut between its update and its history
    entry saves weights one step ahead of the report, which a resume then trains again. Callable as a SIGINT
    handler; asking again changes nothing."""

    stops_between_steps = True  # run.DeferredInterrupt leaves Ctrl-C to this handler

    def __init__(self):
        self.requested, self.opts = False, None

    def __call__(self, *_signal) -> None:
        self.requested = True
        if self.opts is not None:
            self.opts.stop_after = 1  # read after every step: "stop now" once a step has run in this process


STOP = StopRequest()


def run_job(sweep: Sweep, job: Job, root: Path, device, progress, stop_after: int = 0,
            resuming: bool = False) -> dict:  # fmt: skip
    """Train `job` into ROOT/job.name -> its report; `resuming`: continue its checkpoint when it has one."""
    folder = Path(root) / job.name
    check_data(sweep.data)
    tcfg = sweep.tcfg(job.seed)
    trn, val = _load(sweep, tcfg)
    opts = train_lib.RunOptions(backend=sweep.backend, device=device, save_interval=sweep.save_interval,
                                stop_after=1 if STOP.requested else stop_after, progress=progress,
                                data=sweep.data)  # fmt: skip
    ck = folder / train_lib.CHECKPOINT
    STOP.opts = opts  # `train.resume` keeps this very object: the run's data is recorded in it
    try:
        if resuming and ck.is_file():
            return train_lib.resume(ck, trn, val, opts)
        base = ModelConfig.from_dict(sweep.base)
        return train_lib.train_variant(base, ModelVariant.parse(job.variant), trn, val, tcfg, folder, opts)
    finally:
        STOP.opts = None


def attempt(sweep: Sweep, job: Job, root: Path, device, progress, stop_after: int = 0,
            resuming: bool = False) -> dict:  # fmt: skip
    """`run_job` -> a result {status, report, error}: status "completed", "stopped" (--stop-after) or
    "failed" (the error's first line). Ctrl-C passes through (the run saved its checkpoint)."""
    try:
        rep = run_job(sweep, job, root, device, progress, stop_after, resuming)
    except Exception as e:
        text = str(e).strip().splitlines()
        return {"status": "failed", "report": None, "error": f"{type(e).__name__}: {text[0] if text else ''}"}
    return {"status": rep.get("status", "stopped"), "report": rep, "error": None}


class Forward:
    """A job's progress sink that passes its events on through `put(job, event)`: the step events of every
    tenth of the run and the last, every other event, without the bulky report and configuration."""

    def __init__(self, put, job: str):
        self.put, self.job = put, job

    def __call__(self, ev: dict) -> None:
        if ev["event"] == "step" and not (
            ev["step"] % max(ev["total"] // 10, 1) == 0 or ev["step"] == ev["total"]
        ):
            return
        self.put(self.job, {k: v for k, v in ev.items() if k not in ("report", "cfg")})
