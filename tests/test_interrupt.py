"""Ctrl-C never breaks the bit-exact resume: SIGINT at random moments of a run (inside a step, between a
step's update and its record, in an evaluation, in the initial or final evaluation, in a checkpoint write),
then `resume`, gives the history of the uninterrupted run every time.

Most trials run in this process (a timer thread sends SIGINT to the process, whose main thread is training),
so that many of them fit in a few seconds on the numpy backend; a few run on wgpu (lavapipe here), and a few
go through the command line (a subprocess `train`, SIGINT, then `resume`), which also checks what it says.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_sizes, tiny_cfg

from ddl_ref.config import ModelVariant
from ddl_wgpu.data import ByteTokenizer, load_datasets
from ddl_wgpu.jobs import train as T
from ddl_wgpu.jobs.run import DeferredInterrupt
from ddl_wgpu.jobs.train import RunOptions, TrainingConfig, TrainingInterrupted

REPO = Path(__file__).resolve().parents[1]
CFG = tiny_cfg(n_layers=1)
BASELINE = ModelVariant("baseline")
TCFG = TrainingConfig(max_steps=10, eval_interval=3, learning_rate=1e-2, min_learning_rate=1e-3, warmup_steps=2,
                      batch_size=2, seq_len=16, eval_batches=2, seed=0)  # fmt: skip
REF_TRIALS = 40
WGPU_TRIALS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory, corpus_words):
    rng = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("interrupt") / "corpus.txt"
    p.write_text(" ".join(corpus_words[int(i)] for i in rng.integers(0, len(corpus_words), 500)))
    trn, val = load_datasets(str(p), tokenizer=ByteTokenizer(), seq_len=16, batch_size=2, val_fraction=0.2,
                             vocab_size=256, seed=0)  # fmt: skip
    return p, trn, val


def _history(report: dict) -> list:
    return [json.dumps(e, sort_keys=True) for e in report["history"]]


def _outcome(report: dict) -> tuple:
    keys = ("final_train", "final_validation", "best_validation", "best_validation_step", "steps_completed")
    return _history(report), tuple(json.dumps(report[k], sort_keys=True) for k in keys)


class _Stray:
    """SIGINT that lands outside a run (before it starts or after it ends) must not end the test session."""

    def __enter__(self):
        self.previous = signal.signal(signal.SIGINT, lambda *a: None)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self.previous)


def _interrupted_then_resumed(
    trn, val, out: Path, opts: RunOptions, delay: float, tcfg=TCFG
) -> tuple[str, dict]:
    """One trial: train into `out`, SIGINT after `delay` s, resume when interrupted. -> (what happened, the
    final report)."""
    with _Stray():
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            rep = T.train_variant(CFG, BASELINE, trn, val, tcfg, out, opts)
            what = "completed"
        except TrainingInterrupted as e:
            what = "interrupted"
            assert "resumable checkpoint of step" in e.message, e.message
        finally:
            timer.cancel()
            timer.join()
    if what == "interrupted":
        rep = T.resume(out / T.CHECKPOINT, trn, val, opts)
    return what, rep


def _trials(data, tmp_path, opts: RunOptions, n: int, seed: int, tcfg=TCFG):
    _, trn, val = data
    want = _outcome(T.train_variant(CFG, BASELINE, trn, val, tcfg, tmp_path / "straight", opts))
    # warm runs (the first compiles the GPU pipelines) time the window the delays fall in: from the start of
    # the initial evaluation to the end of the last step (the final evaluation runs to completion). The
    # quickest of three: one run slowed by a hiccup of the machine would stretch the window past the trials'
    # runs, and most delays would then land after them
    windows = []
    for r in range(3):
        marks = {}
        t0 = time.perf_counter()
        timed = replace(
            opts, progress=lambda ev, m=marks, t0=t0: m.setdefault(ev["event"], time.perf_counter() - t0)
        )
        again = T.train_variant(CFG, BASELINE, trn, val, tcfg, tmp_path / f"again{r}", timed)
        assert _outcome(again) == want
        windows.append((marks["done"] - marks["start"], marks["start"], marks["done"]))
    _, lo, hi = min(windows)
    rng = np.random.default_rng(seed)
    seen = []
    for i in range(n):
        what, rep = _interrupted_then_resumed(
            trn, val, tmp_path / f"t{i}", opts, float(rng.uniform(lo, hi)), tcfg
        )
        seen.append(what)
        assert _outcome(rep) == want, f"trial {i}: the resumed run differs from the uninterrupted one"
    return seen


def test_ctrl_c_at_random_moments_resumes_bit_exact_numpy(data, tmp_path):
    seen = _trials(data, tmp_path, RunOptions(backend="ref"), REF_TRIALS, seed=1)
    assert seen.count("interrupted") >= REF_TRIALS // 2, seen  # the delays mostly land inside the run


def test_ctrl_c_at_random_moments_resumes_bit_exact_wgpu(data, tmp_path):
    seen = _trials(data, tmp_path, RunOptions(backend="wgpu"), WGPU_TRIALS, seed=2)
    assert "interrupted" in seen, seen


def test_ctrl_c_at_random_moments_resumes_bit_exact_mixed(data, tmp_path):
    """Mixed precision (docs/precision.md) with a scale that overflows, backs off and grows within the run:
    the scaler's state is part of what a Ctrl-C saves, so the resumed run skips the same steps at the same
    scales (both in the history compared) and ends with the same weights."""
    tcfg = replace(TCFG, precision="mixed", loss_scale=2.0**64, loss_scale_interval=2)
    straight = T.train_variant(CFG, BASELINE, *data[1:], tcfg, None, RunOptions(backend="ref"))
    assert any(h["skipped"] for h in straight["history"]), "the run must overflow for this test to mean much"
    seen = _trials(data, tmp_path, RunOptions(backend="ref"), REF_TRIALS // 2, seed=3, tcfg=tcfg)
    # that enough delays land inside the run for the trials to mean something (each trial's bits are the
    # property, asserted above); a quarter, not half: one `make test` on the 2-core machine saw 8 of 20
    assert seen.count("interrupted") >= REF_TRIALS // 8, seen


def test_ctrl_c_in_the_initial_evaluation_saves_step_0(data, tmp_path, monkeypatch):
    """SIGINT during the initial evaluation: the output folder holds a step-0 checkpoint that resumes."""
    _, trn, val = data
    real = T.evaluate
    calls = []

    def evaluate(*a, **kw):
        if not calls:
            os.kill(os.getpid(), signal.SIGINT)  # lands inside the first (initial) evaluation
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(T, "evaluate", evaluate)
    opts = RunOptions(backend="ref")
    with pytest.raises(TrainingInterrupted, match="checkpoint of step 0"):
        T.train_variant(CFG, BASELINE, trn, val, TCFG, tmp_path / "a", opts)
    monkeypatch.setattr(T, "evaluate", real)
    rep = T.resume(tmp_path / "a" / T.CHECKPOINT, trn, val, opts)
    straight = T.train_variant(CFG, BASELINE, trn, val, TCFG, tmp_path / "b", opts)
    assert _outcome(rep) == _outcome(straight)


def test_ctrl_c_in_the_final_evaluation_completes_the_run(data, tmp_path, monkeypatch):
    """SIGINT during the final evaluation: the run completes and its checkpoint and report are written."""
    _, trn, val = data
    real = T.evaluate
    calls = []

    def evaluate(net, dataset, *a, **kw):
        calls.append(1)
        if dataset is trn and len(calls) > 2:  # the final evaluation of the training set
            os.kill(os.getpid(), signal.SIGINT)
        return real(net, dataset, *a, **kw)

    monkeypatch.setattr(T, "evaluate", evaluate)
    out = tmp_path / "a"
    rep = T.train_variant(CFG, BASELINE, trn, val, TCFG, out, RunOptions(backend="ref"))
    assert rep["status"] == "completed"
    assert json.loads((out / T.REPORT).read_text())["status"] == "completed"
    assert T.load_checkpoint(out / T.CHECKPOINT)["report"]["final_validation"] == rep["final_validation"]


def test_second_ctrl_c_abandons_the_step_and_saves_nothing(data, tmp_path, monkeypatch):
    """Two SIGINTs inside one step: the step is abandoned at once and nothing is written (it may be torn)."""
    _, trn, val = data
    real = T._Variant.step

    def step(self, done):
        if done == 4:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, done)

    monkeypatch.setattr(T._Variant, "step", step)
    out = tmp_path / "a"
    with pytest.raises(TrainingInterrupted, match="interrupted twice"):
        T.train_variant(CFG, BASELINE, trn, val, TCFG, out, RunOptions(backend="ref"))
    assert not (out / T.CHECKPOINT).exists()


def test_deferred_interrupt_outside_the_main_thread_changes_nothing():
    seen = []

    def worker():
        with DeferredInterrupt() as intr:
            seen.append(intr.pending)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [False] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _cli(*args) -> list[str]:
    return [sys.executable, "-m", "ddl_wgpu.cli", *map(str, args)]


def _env() -> dict:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}


CLI_ARGS = ["--variants", "baseline,ddl", "--max-steps", "10", "--eval-interval", "3", "--batch-size", "2",
            "--seq-len", "16", "--eval-batches", "2", "--learning-rate", "1e-2", "--warmup-steps", "2",
            "--min-learning-rate", "1e-3", "--backend", "ref", "--no-plots",
            *cli_sizes(n_layers=1)]  # fmt: skip


def test_cli_ctrl_c_then_resume_finishes_the_sweep(data, tmp_path):
    """The command line: SIGINT a two-variant sweep at random moments of its training; `resume` of the
    interrupted variant finishes the sweep, and every variant's history and the ranked report match the
    uninterrupted sweep."""
    corpus = data[0]
    straight = tmp_path / "straight"
    subprocess.run(_cli("train", "--data", corpus, "--out", straight, *CLI_ARGS), env=_env(), check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    want = json.loads((straight / T.REPORT).read_text())
    rng = np.random.default_rng(3)
    resumed = 0
    for i in range(3):
        out = tmp_path / f"t{i}"
        p = subprocess.Popen(_cli("train", "--data", corpus, "--out", out, *CLI_ARGS), env=_env(), text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        for line in p.stdout:  # the options are checked and the data loaded: the run is about to start
            if line.startswith("  tokens per step"):
                break
        time.sleep(float(rng.uniform(0.0, 0.4)))
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=300)
        assert "Traceback" not in stderr, stderr
        assert p.returncode in (0, 130), stderr
        line = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        if "resumable checkpoint of step" in line:
            ck = Path(line.rsplit(" saved as ", 1)[1])
            assert ck.exists() and ck.parent.parent == out
            r = subprocess.run(_cli("resume", ck), env=_env(), capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
            assert f"sweep report: {out / T.REPORT}" in r.stdout
            resumed += 1
        else:  # the signal came after the sweep completed (its report written) or before it started
            after = line.startswith(
                "interrupted after training completed: its reports and checkpoints are saved"
            )
            before = line in ("interrupted", "interrupted before training started: nothing saved")
            assert p.returncode == 0 or before or after, stderr
            if after:
                assert (out / T.REPORT).exists()
            if not (out / T.REPORT).exists():
                continue
        got = json.loads((out / T.REPORT).read_text())
        assert got["final_validation_loss_ranking"] == want["final_validation_loss_ranking"]
        for a, b in zip(got["reports"], want["reports"], strict=True):
            assert _outcome(a) == _outcome(b), f"trial {i}: variant {a['variant']} differs"
        assert not (out / ".lock").exists()
    assert resumed >= 1
