"""Sweeps as Ray tasks (`train --ray local|auto|ADDRESS`): one task per job, each claiming one adapter of
its node; the task writes its job folder into the sweep's folder when it sees it (shared storage), else
returns the files to the driver. `sweep.run` hands its jobs here when the runner is Ray; a task runs its job
with `sweep_job.attempt`, as every other runner does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
from pathlib import Path

from ddl_wgpu.files.safeio import write_atomic
from ddl_wgpu.jobs import train as train_lib
from ddl_wgpu.jobs.rundir import SWEEP
from ddl_wgpu.jobs.sweep_job import STOP, Forward, Job, Sweep, SweepError, attempt, gpu_adapters

# ---------------------------------------------------------------------------------------------------------
# Ray tasks
#
# A task takes one unit of the custom resource `wgpu_adapter` (the numpy backend: one CPU), which every node
# declares as its number of adapters (`ray start --resources '{"wgpu_adapter": 2}'`; a local cluster is
# started with one per worker). Ray keeps no instance ids for a custom resource (get_accelerator_ids() lists
# only its own accelerator kinds, whose ids are CUDA's numbering, not Vulkan's), so a task picks its adapter
# on its node: it locks the first free slot file (fcntl, released when the task's process ends) of the node,
# and slot i is the i-th adapter of `--devices all` (or of the local cluster's device list). Ray runs at most
# as many such tasks on a node as it declared, so a slot is always free. A task runs in a fresh process
# (max_calls=1), so the adapter's memory goes back when it ends.
#
# Output: a task writes its job's folder straight into OUT when it sees the sweep's own OUT/sweep.json (one
# host, or shared storage at the same path); elsewhere it trains in a temporary folder and returns the
# folder's files as bytes, which the driver writes into OUT (checkpoints travel through Ray's object store).
# Ctrl-C puts an item in a `stop` queue that each task watches: its job ends after its current step with a
# checkpoint (`StopRequest`), the task returns as for any other end, and a task not yet started returns at
# once. (Not ray.cancel: the KeyboardInterrupt it raises can cut a step in two.)

ADAPTER_RESOURCE = "wgpu_adapter"
_SLOTS = "ddl-wgpu-adapter-slots"


def _claim_slot():
    """-> (slot index, the open lock file that holds it)."""
    import fcntl
    import tempfile

    d = Path(tempfile.gettempdir()) / _SLOTS
    d.mkdir(exist_ok=True)
    i = 0
    while True:
        f = open(d / f"slot-{i}.lock", "a")  # noqa: SIM115 (held until the task ends)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return i, f
        except OSError:
            f.close()
            i += 1


def _sees(root: Path, sweep_id: str) -> bool:
    try:
        return isinstance(r := json.loads((Path(root) / SWEEP).read_text()), dict) and r.get("id") == sweep_id
    except (OSError, ValueError):
        return False


def _files(folder: Path) -> dict[str, bytes]:
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def _watch(stop, done) -> None:
    """A task's thread: the driver's Ctrl-C (an item in the `stop` queue) becomes this process's STOP."""
    while not done.wait(0.5):
        if not stop.empty():
            STOP()
            return


def _ray_task(
    sweep: Sweep, job: Job, root: str, devices: list, files: dict, launch: tuple, events, stop
) -> dict:
    """One job as a Ray task -> its result, with `files` (the job folder's) when OUT is not shared."""
    import shutil
    import tempfile
    import threading

    if not stop.empty():  # the sweep was interrupted before this task started
        return {"status": "interrupted", "report": {}, "error": None}
    previous = None
    with contextlib.suppress(ValueError):  # a SIGINT to the worker itself (main thread only)
        previous = signal.signal(signal.SIGINT, STOP)
    done = threading.Event()
    threading.Thread(target=_watch, args=(stop, done), daemon=True).start()
    lock, device = None, None
    if sweep.backend == "wgpu":
        from ddl_wgpu.runtime.gpu import ENV_ADAPTER

        slot, lock = _claim_slot()
        listed = devices or gpu_adapters()
        device = listed[slot % len(listed)]
        if device is not None:
            os.environ[ENV_ADAPTER] = str(device)
    shared = _sees(Path(root), sweep.id)
    work = Path(root) if shared else Path(tempfile.mkdtemp(prefix="ddl-wgpu-job-"))
    try:
        for rel, data in files.items():
            (work / job.name / rel).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(work / job.name / rel, lambda f, data=data: f.write(data))
        sink = Forward(lambda name, ev: events.put_nowait((name, ev)), job.name)
        res = attempt(sweep, job, work, device, sink, *launch)
        res["where"] = socket.gethostname() + ("" if device is None else f", adapter {device}")
        if not shared and (work / job.name).is_dir():
            res["files"] = _files(work / job.name)
        return res
    finally:
        done.set()
        if (
            previous is not None
        ):  # the process may run other work after this task (a test calls it in-process)
            signal.signal(signal.SIGINT, previous)
        if lock is not None:
            lock.close()
        if not shared:
            shutil.rmtree(work, ignore_errors=True)


def run_tasks(sweep, jobs, root, runner, launch, view) -> dict:
    try:
        import ray
        from ray.util.queue import Queue
    except ImportError:
        raise SweepError("--ray needs Ray: pip install 'ddl-wgpu[ray]'") from None
    local = runner.ray == "local"
    wgpu = sweep.backend == "wgpu"
    if local:
        # the workers import this very package (a source checkout included), not another installed copy
        paths = [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]
        n = len(runner.devices)
        ray.init(address="local", num_cpus=None if wgpu or not n else n, resources={ADAPTER_RESOURCE: n} if wgpu else None,
                 include_dashboard=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}})  # fmt: skip
    else:
        ray.init(address=runner.ray, configure_logging=False)
    try:
        need = {"num_cpus": 0, "resources": {ADAPTER_RESOURCE: 1}} if wgpu else {"num_cpus": 1}
        task = ray.remote(max_calls=1, **need)(_ray_task)
        events, stop = Queue(actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0})
        devices = list(runner.devices) if local else []
        refs = {}
        for job in jobs:
            folder = root / job.name
            files = _files(folder) if launch[1] and (folder / train_lib.CHECKPOINT).is_file() else {}
            refs[task.remote(sweep, job, str(root), devices, files, launch, events, stop)] = job
        return _ray_wait(ray, refs, root, events, stop, view)
    finally:
        ray.shutdown()


def _ray_wait(ray, refs: dict, root: Path, events, stop, view) -> dict:
    results = {}

    def pump():
        while not events.empty():
            view.event(*events.get_nowait())

    def collect(ref, job):
        try:
            res = ray.get(ref)
        except Exception as e:
            text = str(e).strip().splitlines()
            res = {
                "status": "failed",
                "report": None,
                "error": f"{type(e).__name__}: {text[0] if text else ''}",
            }
        for rel, data in (res.pop("files", None) or {}).items():
            (root / job.name / rel).parent.mkdir(parents=True, exist_ok=True)
            write_atomic(root / job.name / rel, lambda f, data=data: f.write(data))
        pump()
        results[job.name] = res
        view.result(job.name, res)

    try:
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=0.5)
            pump()
            for ref in ready:
                collect(ref, refs.pop(ref))
    except KeyboardInterrupt:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            view.say(f"interrupted: {len(refs)} Ray task(s) stop after their current step")
            stop.put(True)
            for ref, job in refs.items():
                collect(ref, job)
        finally:
            signal.signal(signal.SIGINT, previous)  # the entry point's, or Python's
        raise
    return results
