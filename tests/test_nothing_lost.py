"""Issue 25 (round 3), sweeps and resume: nothing a run wrote is lost or mixed with another run.

- data loss: a stopped seed sweep, another run's folder under `resume --out`, and a model file under `init`,
  `compress`, `heal` or `import-hf` are never written over unasked (items 1-3);
- an exact resume continues on the backend it trained on (item 4);
- `sweep.json` is untrusted input, held against its jobs (items 5, 10, 16);
- workers are capped at the job count (7); checks a job would make run before any job (16);
- a refused command leaves no empty folder (17); damaged `.lock` files (18);
- the "also seen" decisions: `--overwrite` leaves nothing of the old run, `resume DIR` writes plots as the
  sweep did, a dead worker is noticed while the others stream.

Every run is a tiny model on the numpy backend, except the one backend test (wgpu on lavapipe here).
"""

from __future__ import annotations

import io
import json
import os
import queue
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import typer
from helpers import SHAPES, tiny_cfg

from ddl_ref.config import MtpConfig
from ddl_ref.params import init_params
from ddl_wgpu.backend import choose_backend
from ddl_wgpu.cli import checks as cli_checks
from ddl_wgpu.files.container import open_checkpoint, save
from ddl_wgpu.files.hf.convert import export_raw
from ddl_wgpu.files.modelfile import Model, save_model
from ddl_wgpu.jobs import rundir
from ddl_wgpu.jobs import sweep as S
from ddl_wgpu.jobs import sweep_job as J
from ddl_wgpu.jobs import train as T

SHAPE = {**SHAPES["default"], "n_layers": 1}  # one block: a run of 4 steps takes a second on numpy
MODEL = [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()]  # the same shape as the CLI's options
SWEEP = "sweep.json"
TRAIN = ["--variants", "baseline", "--max-steps", "4", "--eval-interval", "2", "--batch-size", "2", "--seq-len",
         "16", "--eval-batches", "1", "--min-learning-rate", "1e-4", "--backend", "ref", "--no-plots",
         *MODEL]  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpus_words) -> Path:
    rng = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("lost") / "corpus.txt"
    p.write_text(" ".join(corpus_words[int(i)] for i in rng.integers(0, len(corpus_words), 600)))
    return p


@pytest.fixture(scope="module")
def stopped_sweep(tmp_path_factory, corpus, cli, ok) -> Path:
    """A seed sweep stopped after 2 of its 4 steps (`--no-plots`): resumable checkpoints, no ranked report."""
    out = tmp_path_factory.mktemp("lost_sweep") / "S"
    ok(cli("train", "--data", corpus, "--out", out, *TRAIN, "--seeds", "0,1", "--stop-after", "2"))
    assert (out / "baseline" / "seed-1" / T.CHECKPOINT).is_file() and not (out / T.REPORT).exists()
    return out


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus, cli, ok) -> Path:
    out = tmp_path_factory.mktemp("lost_run") / "R"
    ok(cli("train", "--data", corpus, "--out", out, *TRAIN))
    return out


def model(path: Path, seed: int = 0, **overrides) -> Model:
    """A freshly initialised model of SHAPE (what `init` writes), saved to `path`."""
    cfg = tiny_cfg(n_layers=1, **overrides)
    m = Model(cfg, init_params(cfg, seed))
    save_model(path, m)
    return m


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------------------
# data loss (items 1-3)


def test_a_stopped_seed_sweep_is_never_trained_over(stopped_sweep, corpus, cli, user_error):
    """Item 1: the run-folder check saw only DIR/report.json and DIR/*/checkpoint.ddlw."""
    before = snapshot(stopped_sweep)
    for extra in ([], ["--workers", "2"]):
        user_error(cli("train", "--data", corpus, "--out", stopped_sweep, *TRAIN, "--max-steps", "2", "--seeds",
                       "0,1", *extra), "already holds a training run", "sweep.json", "--overwrite")  # fmt: skip
    assert snapshot(stopped_sweep) == before


def test_every_kind_of_run_is_recognised(tmp_path):
    kinds = ["sweep.json", "report.json", "checkpoint.ddlw", "baseline/report.json", "ddl/checkpoint.ddlw",
             "ddl-cc/seed-3/checkpoint.ddlw", "baseline/seed-0/report.json"]  # fmt: skip
    for i, rel in enumerate(kinds):
        (tmp_path / str(i) / rel).parent.mkdir(parents=True)
        (tmp_path / str(i) / rel).write_text("{}")
        assert rundir.holds_run(tmp_path / str(i)) == tmp_path / str(i) / rel, rel
    other = tmp_path / "other"
    (other / "data").mkdir(parents=True)
    (other / "data" / "corpus.txt").write_text("x")
    (other / "notes.txt").write_text("x")
    assert rundir.holds_run(other) is None and rundir.holds_run(tmp_path / "missing") is None


def test_a_new_phase_never_writes_over_another_run(finished, corpus, tmp_path, cli, ok, user_error):
    """Item 2: `resume CK --steps N --out DIR` claims DIR as `train` does."""
    other = tmp_path / "O"
    ok(cli("train", "--data", corpus, "--out", other, *TRAIN, "--seed", "1"))
    before = snapshot(other)
    ck = finished / "baseline" / T.CHECKPOINT
    phase = ["resume", ck, "--steps", "2", "--min-learning-rate", "1e-4"]
    user_error(cli(*phase, "--out", other / "baseline"), "already holds a training run", "--overwrite")
    user_error(cli(*phase, "--out", other), "already holds a training run", str(other / T.REPORT))
    assert snapshot(other) == before
    ok(cli(*phase, "--out", tmp_path / "P"))
    assert json.loads((tmp_path / "P" / T.REPORT).read_text())["steps_completed"] == 6
    user_error(cli(*phase, "--out", finished, "--overwrite"), "holds the input")  # it would clear its input
    ok(cli(*phase, "--out", other / "baseline", "--overwrite"))
    assert json.loads((other / "baseline" / T.REPORT).read_text())["training"]["seed"] == 0


def test_model_files_are_never_replaced_unasked(corpus, tmp_path, cli, ok, user_error):
    """Item 3: init, compress, heal and import-hf refuse an existing output unless --force (as export-hf)."""
    m, v = tmp_path / "m.ddlw", tmp_path / "v.ddlw"
    export_raw(model(m, mtp=MtpConfig()), tmp_path / "hf")
    model(v, seed=1)
    before = v.read_bytes()
    user_error(cli("init", "--out", v, *MODEL), "--out", "already exists", "--force")
    user_error(cli("compress", m, "--out", v, "--ffn-keep", "0.5"), "already exists", "--force")
    user_error(cli("heal", m, "--data", corpus, "--out", v), "already exists", "--force")
    user_error(cli("import-hf", tmp_path / "hf", v), "already exists", "--force")
    assert v.read_bytes() == before
    ok(cli("compress", m, "--out", v, "--ffn-keep", "0.5", "--force"))
    assert v.read_bytes() != before
    ok(cli("import-hf", tmp_path / "hf", v, "--force"))


# ---------------------------------------------------------------------------------------------------------
# the backend of a resume (item 4)


def test_an_exact_resume_continues_on_the_backend_it_trained_on(corpus, tmp_path, monkeypatch, capsys, cli, ok,
                                                                 user_error):  # fmt: skip
    """A wgpu run resumed the way the tool says (no --backend): `auto` chose numpy on a CPU-only adapter and
    the history diverged from the first resumed step."""
    gpu = [a if a != "ref" else "wgpu" for a in TRAIN]
    ok(cli("train", "--data", corpus, "--out", tmp_path / "A", *gpu))
    ok(cli("train", "--data", corpus, "--out", tmp_path / "B", *gpu, "--stop-after", "2"))
    ck = tmp_path / "B" / "baseline" / T.CHECKPOINT
    rec = T.load_checkpoint(ck)["backend"]
    assert rec["backend"] == "wgpu" and rec["device"]
    user_error(cli("resume", ck, "--backend", "ref"), "--backend wgpu", "bit for bit", "--steps")
    monkeypatch.setenv("DDL_WGPU_ADAPTER", "no such adapter")  # this machine cannot run the recorded backend
    with pytest.raises(typer.Exit):
        cli_checks.resume_backend(rec, "auto", None, False)
    line = capsys.readouterr().err.strip()
    assert line.startswith("error: the run trained on the wgpu backend") and "cannot run" in line, line
    assert "--backend" in line and "\n" not in line
    monkeypatch.delenv("DDL_WGPU_ADAPTER")
    r = ok(cli("resume", ck))
    assert "backend: wgpu" in r.stdout
    want, got = (json.loads((tmp_path / d / "baseline" / T.REPORT).read_text()) for d in ("A", "B"))
    assert got["history"] == want["history"] and got["final_validation"] == want["final_validation"]
    r = ok(cli("resume", ck, "--steps", "1", "--backend", "ref", "--out", tmp_path / "C"))
    assert "backend switch: the run trained on the wgpu backend" in r.stdout
    assert T.load_checkpoint(tmp_path / "C" / T.CHECKPOINT)["backend"] == {
        "backend": "ref",
        "device": "numpy",
    }


def test_a_checkpoint_without_its_backend_resumes_as_before(finished, tmp_path):
    ck = finished / "baseline" / T.CHECKPOINT
    with open_checkpoint(ck) as c:
        tensors = [(n, np.array(c.tensor_f32(n))) for n in c.names()]
        meta = {k: v for k, v in dict(c.metadata).items() if k != "train.backend"}
        cfg = dict(c.config)
    save(tmp_path / "old.ddlw", tensors, config=cfg, metadata=meta)
    assert T.load_checkpoint(tmp_path / "old.ddlw")["backend"] is None
    assert cli_checks.resume_backend(None, "auto", None, False) == (choose_backend("auto"), None, None)
    save(tmp_path / "bad.ddlw", tensors, config=cfg, metadata={**meta, "train.backend": {"backend": "cuda"}})
    with pytest.raises(T.TrainingError, match="train.backend"):
        T.load_checkpoint(tmp_path / "bad.ddlw")


# ---------------------------------------------------------------------------------------------------------
# the sweep's record (items 5, 10, 16)


def _edit(src: Path, dst: Path, change) -> Path:
    copy(src, dst)
    rec = json.loads((dst / SWEEP).read_text())
    change(rec)
    (dst / SWEEP).write_text(json.dumps(rec))
    return dst


def test_an_edited_sweep_record_is_refused(stopped_sweep, tmp_path, cli, user_error):
    """Item 5 (and 16's `training: null`): an edited sweep.json is held against its jobs' checkpoints; through
    the command line for two edits, the checks themselves for the rest (the same one line)."""
    edits = [
        (lambda r: r.update(seeds=[0, 0]), "names a seed twice"),
        (lambda r: r["training"].update(learning_rate=0.5), "learning_rate"),
        (lambda r: r.update(variants=["baseline", "baseline"]), "names a variant twice"),
        (lambda r: r.update(seeds=["0"]), "'seeds'"),
        (lambda r: r.update(training=None), "'training'"),
        (lambda r: r["training"].update(seed=10**30), "'training'"),
        (lambda r: r["base"].update(d_model=24), "another model configuration"),
        (lambda r: r["data"].update(max_tokens=7), "data"),
        (lambda r: r.update(backend="cuda"), "'backend'"),
        (lambda r: r.update(surprise=1), "unknown field"),
    ]
    for i, (change, fragment) in enumerate(edits):
        d = _edit(stopped_sweep, tmp_path / str(i), change)
        before = snapshot(d)
        if i < 2:
            user_error(cli("resume", d), fragment)
        else:
            from ddl_wgpu.jobs.sweep_checks import check_jobs

            with pytest.raises(S.SweepError, match=fragment):
                check_jobs(S.Sweep.load(d), d)
        assert snapshot(d) == before, fragment


def test_a_damaged_sweep_is_one_line(stopped_sweep, tmp_path, cli, user_error):
    """Item 10."""
    for i, text in enumerate(["{", "[]", '"x"', "{}"]):
        d = copy(stopped_sweep, tmp_path / str(i))
        (d / SWEEP).write_text(text)
        if i == 0:
            user_error(cli("resume", d), str(d / SWEEP), "invalid JSON")
        else:
            with pytest.raises(S.SweepError, match=SWEEP):
                S.Sweep.load(d)
    d = copy(stopped_sweep, tmp_path / "torn")
    (d / "baseline" / "seed-1" / T.REPORT).write_text('{"variant": ')
    user_error(cli("resume", d), "invalid JSON", str(d / "baseline" / "seed-1" / T.REPORT))
    with pytest.raises(S.SweepError, match="invalid JSON"):
        J.finished_report(d / "baseline" / "seed-1")


def test_the_untouched_sweep_resumes_without_plots_as_it_ran(stopped_sweep, tmp_path, cli, ok):
    """The checks refuse nothing of an untouched sweep; `resume DIR` of a `--no-plots` sweep writes none."""
    d = copy(stopped_sweep, tmp_path / "S")
    assert json.loads((d / SWEEP).read_text())["plots"] is False
    ok(cli("resume", d))
    comp = json.loads((d / T.REPORT).read_text())
    assert [j["status"] for j in comp["jobs"]] == ["completed", "completed"]
    assert not list(d.glob("*.png"))


def test_checks_a_job_would_make_run_before_any_job(corpus, tmp_path, cli, user_error):
    """Item 16: they ended in 'N of N jobs failed ... `resume DIR` runs them again', and resume failed alike."""
    out = tmp_path / "X"
    user_error(
        cli("train", "--data", corpus, "--out", out, *TRAIN, "--seeds", str(10**23)), "--seeds", "2^63-1"
    )
    gpu = [a if a != "ref" else "wgpu" for a in TRAIN]
    user_error(
        cli("train", "--data", corpus, "--out", out, *gpu, "--devices", "7"), "adapter '7'", "--devices"
    )
    assert not out.exists()
    from ddl_wgpu.jobs.sweep_checks import check_runner

    with pytest.raises(S.SweepError, match="nosuchgpu") as e:
        check_runner(S.Runner(("0", "nosuchgpu")), "wgpu")
    assert e.value.field == "devices"
    with pytest.raises(S.SweepError, match="nosuchgpu") as e:
        check_runner(S.Runner(), "wgpu", "nosuchgpu")  # one job after another, on --device
    assert e.value.field == "device"
    check_runner(S.Runner(("0", "0")), "wgpu")
    check_runner(S.Runner((None, None)), "ref")


# ---------------------------------------------------------------------------------------------------------
# workers (item 7)


def test_workers_are_capped_at_the_job_count(corpus, tmp_path, cli, ok, user_error):
    r = ok(cli("train", "--data", corpus, "--out", tmp_path / "W", *TRAIN, "--workers", str(10**18)))
    assert f"1 worker processes: numpy ({10**18} workers asked for, at most one per job)" in r.stdout
    user_error(cli("train", "--data", corpus, "--out", tmp_path / "V", *TRAIN, "--workers", str(10**20)),
               "--workers")  # fmt: skip
    from ddl_wgpu.jobs.sweep_checks import capped_runner

    runner, note = capped_runner("ref", None, 1000, None, None, 3)
    assert runner == S.Runner((None,) * 3) and "1000 workers asked for" in note
    assert capped_runner("wgpu", "0,0,0", 0, None, None, 1)[0].devices == ("0",)
    assert capped_runner("ref", None, 2, None, None, 4) == (S.Runner((None, None)), "")


# ---------------------------------------------------------------------------------------------------------
# folders and locks (items 17, 18)


def test_a_refused_command_leaves_no_empty_folder(finished, corpus, tmp_path, cli, user_error):
    """Item 17."""
    ck = finished / "baseline" / T.CHECKPOINT
    cases = [
        ["train", "--data", corpus, *TRAIN, "--seeds", "0,0"],
        ["train", "--data", corpus, *TRAIN, "--seeds", "a"],
        ["train", "--data", tmp_path / "missing.txt", *TRAIN],
        ["train", "--data", tmp_path / "missing.txt", *TRAIN, "--seeds", "0,1"],
        ["resume", ck, "--steps", "2", "--learning-rate", "nan"],
    ]
    for i, args in enumerate(cases):
        user_error(cli(*args, "--out", tmp_path / f"n{i}" / "deeper"))
        assert not (tmp_path / f"n{i}").exists(), args


def test_damaged_locks(corpus, tmp_path, cli, ok, user_error):
    """Item 18: a lock holding a pid no process can have is stale; a lock that is a folder is one line."""
    for i, pid in enumerate(["99999999999999999999", str(1 << 40), "-5"]):
        out = tmp_path / f"o{i}"
        out.mkdir()
        (out / rundir.LOCK).write_text(pid)
        with rundir.RunLock(out):  # taken over: the process it names cannot exist
            assert (out / rundir.LOCK).read_text() == str(os.getpid())
        assert not (out / rundir.LOCK).exists()
    (out / rundir.LOCK).write_text("99999999999999999999")
    ok(cli("train", "--data", corpus, "--out", out, *TRAIN))  # through the command line too
    (out / rundir.LOCK).write_text(str(os.getpid()))  # a live process's: in use
    user_error(cli("train", "--data", corpus, "--out", out, *TRAIN, "--overwrite"), "in use by another run")
    out = tmp_path / "dir"
    (out / rundir.LOCK).mkdir(parents=True)
    user_error(cli("train", "--data", corpus, "--out", out, *TRAIN), "is not a regular file", rundir.LOCK)


def test_import_hf_into_an_unwritable_folder_says_so_as_the_others(tmp_path, monkeypatch, capsys, cli, ok):
    """Item 18: import-hf named `OUT.partial` where every other command says the folder is not writable (tried
    in this process: the tests may run as root, for whom every folder is writable)."""
    export_raw(model(tmp_path / "m.ddlw"), tmp_path / "hf")
    from ddl_wgpu.cli import app as cli_mod

    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode, **kw: False if Path(p) == tmp_path else real(p, mode, **kw)
    )
    monkeypatch.setattr(
        sys, "argv", ["ddl-wgpu", "import-hf", str(tmp_path / "hf"), str(tmp_path / "im.ddlw")]
    )
    previous = signal.getsignal(signal.SIGINT)
    try:
        assert cli_mod._main() == 2
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'im.ddlw'}: the folder {tmp_path} is not writable"]
    assert not (tmp_path / "im.ddlw").exists()


# ---------------------------------------------------------------------------------------------------------
# also seen: --overwrite, a dead worker


def test_overwrite_leaves_nothing_of_the_old_run(stopped_sweep, corpus, tmp_path, cli, ok):
    """`--overwrite` left the old run's other job folders beside the new run (a stale checkpoint's resume would
    write its sweep's report over the new one); files the run did not write stay."""
    d = copy(stopped_sweep, tmp_path / "S")
    (d / "notes.txt").write_text("mine")
    (d / "baseline" / "seed-0" / "mine.txt").write_text("mine")
    ok(cli("train", "--data", corpus, "--out", d, *TRAIN, "--overwrite"))
    assert not (d / SWEEP).exists() and not (d / "baseline" / "seed-1").exists()
    assert sorted(p.name for p in (d / "baseline" / "seed-0").iterdir()) == ["mine.txt"]
    assert (d / "notes.txt").read_text() == "mine"
    assert (d / "baseline" / T.CHECKPOINT).is_file() and (d / T.REPORT).is_file()


class _Proc:
    exitcode = -9

    def __init__(self, alive: bool):
        self.alive = alive

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout=None) -> None:
        pass


class _Streaming:
    """A worker's outbox that never pauses: an event every 10 ms until `done`, then its job's result."""

    def __init__(self):
        self.done, self.sent = threading.Event(), False

    def get(self, timeout):
        time.sleep(0.01)
        if not self.done.is_set():
            return ("event", 0, "a", {"event": "start", "num_params": 1})
        if self.sent:
            raise queue.Empty
        self.sent = True
        return (
            "result",
            0,
            "a",
            {"status": "completed", "report": {"final_train": {"loss": 1.0}}, "error": None},
        )

    def close(self) -> None:
        pass


def test_a_dead_worker_is_noticed_while_another_streams(monkeypatch):
    """The pool waited for a pause in its workers' messages before it looked at them: a worker that died
    while another streamed progress was noticed only once that one stopped."""
    pool = S._Pool([None, None], None, "/nowhere", (0, False), S.SweepView(io.StringIO()))
    pool.outbox, pool.inboxes = _Streaming(), [_Streaming(), _Streaming()]
    pool.procs = [_Proc(True), _Proc(False)]  # worker 1 has died with its job in hand
    monkeypatch.setattr(pool, "start", lambda i: None)
    monkeypatch.setattr(
        pool, "hand", lambda i, pending: pending and pool.running.update({i: pending.popleft()})
    )
    t = threading.Thread(
        target=pool.run, args=([S.Job("baseline", 0, "a"), S.Job("ddl", 0, "b")],), daemon=True
    )
    t.start()
    deadline = time.monotonic() + 10
    while "b" not in pool.results and time.monotonic() < deadline:
        time.sleep(0.05)
    noticed = "b" in pool.results
    pool.outbox.done.set()  # worker 0 finishes its job: the pool returns
    t.join(10)
    assert noticed, "the dead worker's job was not marked failed while the other worker streamed"
    assert not t.is_alive()
    assert pool.results["b"]["status"] == "failed" and "exited with code -9" in pool.results["b"]["error"]
    assert pool.results["a"]["status"] == "completed"
