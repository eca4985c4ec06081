"""The trainer against the reference trainer's `training.rs`: TrainingConfig defaults and every validation message, the
cosine warm-up schedule and the phase schedule, loss/perplexity every step, evaluation and spectral
telemetry on the reference trainer's steps, best-validation tracking (initial evaluation included) with the best model
kept, the TrainingReport / TrainingComparisonReport fields and ranking, the reference trainer's errors, the checkpoint
artifact, both kinds of resume with the reference trainer's checks, a SIGKILLed run, and ref vs wgpu histories.

Everything runs a tiny model (d_model 32, one block) on a few KB of text, so the wgpu runs stay cheap on
lavapipe. Exactness claims (`==` on losses) are made on one device within one process or across processes
on the same device."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_sizes, tiny_cfg

from ddl_ref.config import ModelVariant
from ddl_ref.optim import CosineWarmupSchedule
from ddl_ref.params import init_params, param_table
from ddl_wgpu.backend import make_net
from ddl_wgpu.data import ByteTokenizer, TokenDataset, load_datasets
from ddl_wgpu.engine.step import AdamW
from ddl_wgpu.jobs import train as T
from ddl_wgpu.jobs.train import (
    RunOptions,
    TrainingConfig,
    TrainingError,
    check_resume,
    evaluate,
    load_checkpoint,
    resume,
    schedule_for_phase,
    train_variant,
    train_variants,
)

CFG = tiny_cfg("train")
BASELINE = ModelVariant("baseline")
# warm-up, a cosine to a non-zero floor, evaluation every 2 steps: every schedule branch in 6 steps
TCFG = TrainingConfig(
    max_steps=6,
    eval_interval=2,
    learning_rate=1e-2,
    min_learning_rate=1e-3,
    warmup_steps=2,
    batch_size=2,
    seq_len=16,
    eval_batches=2,
    seed=0,
)
CLI_MODEL_ARGS = cli_sizes("train")

REPORT_FIELDS = [  # the reference trainer's TrainingReport, in order
    "variant",
    "config",
    "training",
    "num_params",
    "train_dataset",
    "validation_dataset",
    "steps_completed",
    "initial_train",
    "initial_validation",
    "final_train",
    "final_validation",
    "best_validation",
    "initial_train_spectral",
    "initial_validation_spectral",
    "final_train_spectral",
    "final_validation_spectral",
    "best_validation_spectral",
    "best_validation_step",
    "history",
]
STEP_FIELDS = ["step", "learning_rate", "train", "validation", "train_spectral", "validation_spectral"]
COMPARISON_FIELDS = [
    "train_dataset",
    "validation_dataset",
    "training",
    "reports",
    "final_train_loss_ranking",
    "best_final_train_variant",
    "final_validation_loss_ranking",
    "best_final_validation_variant",
]


WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "pack",
    "my",
    "box",
    "with",
    "five",
    "dozen",
    "liquor",
    "jugs",
    "and",
    "then",
    "a",
    "cat",
    "sat",
    "on",
    "mat",
]


def make_text(seed: int, n_words: int = 600, words=None) -> str:
    rng = np.random.default_rng(seed)
    words = words or WORDS
    out = []
    for i in range(n_words):
        out.append(words[int(rng.integers(len(words)))])
        if i % 11 == 10:
            out.append(".\n")
    return " ".join(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("data") / "corpus.txt"
    p.write_text(make_text(0))  # ~3.4 KB
    return p


def datasets(spec, val_fraction=0.2, **kw):
    return load_datasets(
        str(spec),
        tokenizer=ByteTokenizer(),
        seq_len=16,
        batch_size=2,
        val_fraction=val_fraction,
        vocab_size=256,
        seed=0,
        **kw,
    )


@pytest.fixture(scope="module")
def data(corpus):
    return datasets(corpus)


WGPU = RunOptions(backend="wgpu")
REF = RunOptions(backend="ref")


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """One uninterrupted 6-step wgpu run with validation: (report, out_dir)."""
    trn, val = data
    out = tmp_path_factory.mktemp("straight")
    rep = train_variant(CFG, BASELINE, trn, val, TCFG, out, WGPU)
    return rep, out


def losses(rep):
    return [h["train"]["loss"] for h in rep["history"]]


def without_run_stats(rep):
    """A report without what legitimately differs between processes (timing, final status)."""
    r = copy.deepcopy(rep)
    r.pop("throughput", None)
    r.pop("status", None)
    return r


# ---------------------------------------------------------------------------------------------------------
# configuration


def test_defaults_are_the_seeds():
    c = TrainingConfig()
    assert (c.max_steps, c.eval_interval, c.learning_rate, c.min_learning_rate, c.warmup_steps) == (
        32,
        4,
        1e-3,
        0.0,
        0,
    )
    assert (c.weight_decay, c.beta1, c.beta2, c.epsilon, c.grad_clip) == (0.1, 0.9, 0.95, 1e-5, 1.0)
    c.validate()
    assert TrainingConfig.from_dict(c.to_dict()) == c


NAN, INF = float("nan"), float("inf")
RULES = [
    (dict(max_steps=0), "max_steps must be greater than zero"),
    (dict(eval_interval=0), "eval_interval must be greater than zero"),
    (dict(learning_rate=0.0), "learning_rate must be finite and positive"),
    (dict(learning_rate=-1e-3), "learning_rate must be finite and positive"),
    (dict(learning_rate=NAN), "learning_rate must be finite and positive"),
    (dict(learning_rate=INF), "learning_rate must be finite and positive"),
    (dict(min_learning_rate=-1e-4), "min_learning_rate must be finite and non-negative"),
    (dict(min_learning_rate=NAN), "min_learning_rate must be finite and non-negative"),
    (dict(min_learning_rate=2e-3), "min_learning_rate cannot exceed learning_rate"),
    (dict(warmup_steps=33), "warmup_steps cannot exceed max_steps"),
    (dict(weight_decay=-0.1), "weight_decay must be finite and non-negative"),
    (dict(weight_decay=INF), "weight_decay must be finite and non-negative"),
    (dict(beta1=1.0), "beta1 must be in [0, 1)"),
    (dict(beta1=-0.1), "beta1 must be in [0, 1)"),
    (dict(beta1=NAN), "beta1 must be in [0, 1)"),
    (dict(beta2=1.0), "beta2 must be in [0, 1)"),
    (dict(beta2=-0.5), "beta2 must be in [0, 1)"),
    (dict(epsilon=0.0), "epsilon must be finite and positive"),
    (dict(epsilon=NAN), "epsilon must be finite and positive"),
    (dict(grad_clip=0.0), "grad_clip must be finite and positive"),
    (dict(grad_clip=INF), "grad_clip must be finite and positive"),
    # the fields the reference trainer kept elsewhere
    (dict(batch_size=0), "batch_size must be greater than zero"),
    (dict(seq_len=1), "seq_len must be at least 2"),
    (dict(max_steps=-1), "max_steps must be a non-negative integer"),
    (dict(eval_batches=1.5), "eval_batches must be a non-negative integer"),
]


@pytest.mark.parametrize("over,message", RULES, ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_each_validation_rule_has_the_seeds_message(over, message):
    with pytest.raises(
        TrainingError, match="^" + re.escape(f"invalid training configuration: {message}") + "$"
    ):
        TrainingConfig(**over).validate()


def test_validation_boundaries_are_accepted():
    for over in [
        dict(beta1=0.0, beta2=0.0),
        dict(min_learning_rate=1e-3),
        dict(warmup_steps=32),
        dict(weight_decay=0.0),
        dict(eval_batches=0),
    ]:
        TrainingConfig(**over).validate()


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(
        TrainingError, match=r"invalid training configuration: unknown field\(s\) \['bogus'\]"
    ):
        TrainingConfig.from_dict({**TrainingConfig().to_dict(), "bogus": 1})


def test_training_validates_before_anything(data):
    trn, val = data
    bad = TrainingConfig(max_steps=0, batch_size=2, seq_len=16)
    msg = "invalid training configuration: max_steps must be greater than zero"
    with pytest.raises(TrainingError, match=msg):
        train_variant(CFG, BASELINE, trn, val, bad, None, REF)
    with pytest.raises(TrainingError, match=msg):
        train_variants(CFG, [BASELINE], trn, val, bad, None, REF)


# ---------------------------------------------------------------------------------------------------------
# schedule


def test_cosine_schedule_is_the_seeds():
    s = CosineWarmupSchedule(1.0, 0.1, 2, 6)  # the reference trainer's own unit test
    lrs = [s.learning_rate(i) for i in range(6)]
    assert lrs[0] == 0.5 and lrs[1] == 1.0 and lrs[2] <= 1.0 and lrs[3] < lrs[2] and lrs[5] == 0.1
    # every value by the reference trainer's formula: progress = (step - warmup) / (total - warmup - 1)
    for i in range(2, 6):
        expect = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (i - 2) / 3))
        assert lrs[i] == pytest.approx(expect, rel=1e-15)
    assert s.learning_rate(100) == lrs[5]  # clamped past the end
    # no warm-up: starts at base; one cosine step: base; warm-up over every step: a linear ramp
    assert CosineWarmupSchedule(1e-3, 0.0, 0, 5).learning_rate(0) == 1e-3
    assert CosineWarmupSchedule(1e-3, 0.0, 0, 5).learning_rate(4) == 0.0
    assert CosineWarmupSchedule(1e-3, 1e-4, 0, 1).learning_rate(0) == 1e-3
    assert [CosineWarmupSchedule(1.0, 0.0, 4, 4).learning_rate(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert [CosineWarmupSchedule(1.0, 0.0, 3, 4).learning_rate(i) for i in range(4)] == [
        1 / 3,
        2 / 3,
        1.0,
        1.0,
    ]


@pytest.mark.parametrize(
    "args,message",
    [
        ((1.0, 0.0, 0, 0), "total_steps must be greater than zero"),
        ((1.0, 0.0, 5, 4), "warmup_steps cannot exceed total_steps"),
        ((1.0, 2.0, 0, 4), "min_learning_rate cannot exceed base_learning_rate"),
    ],
)
def test_schedule_errors(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CosineWarmupSchedule(*args)


def test_phase_schedule_is_the_seeds():
    tcfg = TrainingConfig(max_steps=5, learning_rate=1e-2, min_learning_rate=1e-4, warmup_steps=2)
    first = schedule_for_phase(tcfg, None)  # warm-up to learning_rate
    assert (first.base_lr, first.min_lr, first.warmup_steps, first.total_steps) == (1e-2, 1e-4, 2, 5)
    for prev, base in [(5e-3, 5e-3), (1.0, 1e-2), (1e-6, 1e-4), (1e-4, 1e-4)]:  # clamped, no warm-up
        s = schedule_for_phase(tcfg, prev)
        assert (s.base_lr, s.min_lr, s.warmup_steps, s.total_steps) == (base, 1e-4, 0, 5)
        assert s.learning_rate(0) == base and s.learning_rate(4) == 1e-4


# ---------------------------------------------------------------------------------------------------------
# one run: history, evaluation, best validation, report


def test_loss_perplexity_and_learning_rate_every_step(straight):
    rep, _ = straight
    sched = CosineWarmupSchedule(
        TCFG.learning_rate, TCFG.min_learning_rate, TCFG.warmup_steps, TCFG.max_steps
    )
    assert [h["step"] for h in rep["history"]] == [1, 2, 3, 4, 5, 6]
    assert [h["learning_rate"] for h in rep["history"]] == [sched.learning_rate(i) for i in range(6)]
    assert rep["history"][0]["learning_rate"] == 5e-3 and rep["history"][-1]["learning_rate"] == 1e-3
    for h in rep["history"]:
        assert math.isfinite(h["train"]["loss"]) and 0 < h["train"]["loss"] < 10
        assert h["train"]["perplexity"] == pytest.approx(math.exp(h["train"]["loss"]), rel=1e-12)
        assert math.isfinite(h["grad_norm"]) and h["grad_norm"] > 0
    assert losses(rep)[-1] < rep["initial_train"]["loss"]  # it learns


def test_initial_evaluation_is_of_the_initial_model(straight, data):
    rep, _ = straight
    trn, val = data
    net = make_net(BASELINE.resolve_config(CFG), init_params(CFG, TCFG.seed), "wgpu", None)
    assert rep["initial_train"] == evaluate(net, trn, TCFG.eval_batches)["metrics"]
    assert rep["initial_validation"] == evaluate(net, val, TCFG.eval_batches)["metrics"]


def test_report_has_the_seeds_fields(straight, data):
    rep, out = straight
    trn, val = data
    assert list(rep)[: len(REPORT_FIELDS)] == REPORT_FIELDS
    for h in rep["history"]:
        assert list(h)[: len(STEP_FIELDS)] == STEP_FIELDS
    assert rep["variant"] == "baseline" and rep["status"] == "completed"
    assert rep["config"] == BASELINE.resolve_config(CFG).to_dict()
    assert rep["training"] == TCFG.to_dict()
    assert rep["num_params"] == sum(s.numel for s in param_table(CFG))
    assert rep["train_dataset"] == trn.summary() and rep["validation_dataset"] == val.summary()
    assert rep["steps_completed"] == len(rep["history"]) == TCFG.max_steps
    for key in ("initial_train", "initial_validation", "final_train", "final_validation", "best_validation"):
        assert set(rep[key]) == {"loss", "perplexity"}
        assert rep[key]["perplexity"] == pytest.approx(math.exp(rep[key]["loss"]), rel=1e-12)
    for (
        key
    ) in REPORT_FIELDS:  # a baseline model has no spectral telemetry (the reference trainer's default: None)
        if key.endswith("_spectral"):
            assert rep[key] is None
    on_disk = json.loads((out / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(rep))


def test_throughput_separates_the_steps_from_the_whole_run(straight):
    """The whole run's time holds the steps' time and the evaluations': steps-only tokens/s is the larger."""
    tp = straight[0]["throughput"]
    tokens = TCFG.max_steps * TCFG.batch_size * TCFG.seq_len
    assert tp["steps"] == TCFG.max_steps
    assert 0.0 < tp["step_seconds"] < tp["seconds"]
    assert tp["tokens_per_s"] == pytest.approx(tokens / tp["seconds"])
    assert tp["step_tokens_per_s"] == pytest.approx(tokens / tp["step_seconds"])


def test_evaluation_steps_are_the_seeds(data, monkeypatch):
    """Validation and spectral telemetry on (step+1) % eval_interval == 0 and on the last step; train
    telemetry on the same steps; initial and final snapshots. A stand-in `spectral` on the ref backend
    makes a baseline model report telemetry, so the steps are visible."""
    from ddl_wgpu.engine.refnet import RefWork

    calls = []

    def fake_spectral(self, ids, lengths):
        calls.append(int(np.asarray(lengths).sum()))
        return {
            "beta_per_layer": [1.0, 0.25],
            "k_eigenvalue_per_layer": [0.0, 0.75],
            "spatial_determinant_per_layer": [0.0, 0.75],
            "lifted_determinant_per_layer": [0.0, 0.75],
            "k_coherence_per_layer": [0.5, 0.5],
            "correction_norm_per_layer": [0.1, 0.2],
            "regime_per_layer": ["projection", "identity"],
            "beta_histogram": {},
        }

    monkeypatch.setattr(RefWork, "spectral", fake_spectral, raising=False)
    trn, val = data
    tcfg = TrainingConfig(max_steps=7, eval_interval=3, batch_size=2, seq_len=16, eval_batches=2)
    rep = train_variant(CFG, BASELINE, trn, val, tcfg, None, REF)
    eval_steps = [h["step"] for h in rep["history"] if h["validation"] is not None]
    assert eval_steps == [3, 6, 7]
    assert [h["step"] for h in rep["history"] if h["validation_spectral"] is not None] == [3, 6, 7]
    assert [h["step"] for h in rep["history"] if h["train_spectral"] is not None] == [3, 6, 7]
    for key in (
        "initial_train_spectral",
        "initial_validation_spectral",
        "final_train_spectral",
        "final_validation_spectral",
        "best_validation_spectral",
    ):
        snap = rep[key]
        assert snap["beta_per_layer"] == pytest.approx([1.0, 0.25])
        assert snap["regime_per_layer"] == ["projection", "identity"]
    # no validation set: no validation anywhere, train telemetry on the same steps
    rep = train_variant(CFG, BASELINE, trn, None, tcfg, None, REF)
    assert all(h["validation"] is None and h["validation_spectral"] is None for h in rep["history"])
    assert [h["step"] for h in rep["history"] if h["train_spectral"] is not None] == [3, 6, 7]
    for key in (
        "initial_validation",
        "final_validation",
        "best_validation",
        "best_validation_step",
        "validation_dataset",
        "best_validation_spectral",
    ):
        assert rep[key] is None
    assert rep["final_train"] is not None


def expected_best(rep):
    """The reference trainer's rule: initial evaluation at step 0, then every evaluation, then the final one; a later
    candidate replaces the best only when strictly lower."""
    cands = [(0, rep["initial_validation"])]
    cands += [(h["step"], h["validation"]) for h in rep["history"] if h["validation"] is not None]
    cands.append((rep["steps_completed"], rep["final_validation"]))
    best = cands[0]
    for c in cands[1:]:
        if c[1]["loss"] < best[1]["loss"]:
            best = c
    return best


def test_best_validation_tracking_and_best_model_kept(straight, data):
    rep, out = straight
    trn, val = data
    step, metrics = expected_best(rep)
    assert rep["best_validation_step"] == step and rep["best_validation"] == metrics
    ck = load_checkpoint(out / "checkpoint.ddlw")
    assert ck["best"] is not None
    best_net = make_net(ck["cfg"], ck["best"], "wgpu", None)
    assert evaluate(best_net, val, TCFG.eval_batches)["metrics"] == rep["best_validation"]


def test_initial_evaluation_can_be_the_best(tmp_path):
    """Train on 'ab' repeated, validate on other letters: validation only gets worse, so the best is the
    initial evaluation (step 0) and the best model kept is the initial model."""
    (tmp_path / "train.txt").write_text("ab" * 1200)
    (tmp_path / "val.txt").write_text(make_text(3, 120, ["xyz", "qwv", "kjm"]))
    trn, val = load_datasets(
        str(tmp_path / "train.txt"),
        tokenizer=ByteTokenizer(),
        seq_len=16,
        batch_size=2,
        val_spec=str(tmp_path / "val.txt"),
        vocab_size=256,
    )
    tcfg = TrainingConfig(
        max_steps=6, eval_interval=2, learning_rate=3e-2, batch_size=2, seq_len=16, eval_batches=2
    )
    rep = train_variant(CFG, BASELINE, trn, val, tcfg, tmp_path / "out", WGPU)
    assert rep["best_validation_step"] == 0
    assert rep["best_validation"] == rep["initial_validation"]
    assert rep["final_validation"]["loss"] > rep["initial_validation"]["loss"]
    ck = load_checkpoint(tmp_path / "out" / "checkpoint.ddlw")
    init = init_params(CFG, tcfg.seed)
    assert set(ck["best"]) == set(init)
    for n, a in init.items():
        np.testing.assert_array_equal(ck["best"][n], a.astype(np.float32))


# ---------------------------------------------------------------------------------------------------------
# sweeps and ranking


def test_sweep_writes_the_comparison_report(data, tmp_path):
    trn, val = data
    comp = train_variants(CFG, [BASELINE], trn, val, TCFG, tmp_path, WGPU)
    assert list(comp) == COMPARISON_FIELDS
    assert comp["train_dataset"] == trn.summary() and comp["validation_dataset"] == val.summary()
    assert comp["training"] == TCFG.to_dict()
    assert comp["final_train_loss_ranking"] == ["baseline"] and comp["best_final_train_variant"] == "baseline"
    assert comp["final_validation_loss_ranking"] == ["baseline"]
    assert comp["best_final_validation_variant"] == "baseline"
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk == json.loads(json.dumps(comp))
    assert on_disk["reports"][0] == json.loads((tmp_path / "baseline" / "report.json").read_text())
    assert (tmp_path / "baseline" / "checkpoint.ddlw").is_file()


def fake_report(variant, train_loss, val_loss):
    return {
        "variant": variant,
        "final_train": {"loss": train_loss, "perplexity": math.exp(train_loss)},
        "final_validation": None
        if val_loss is None
        else {"loss": val_loss, "perplexity": math.exp(val_loss)},
    }


def test_ranking_is_the_seeds(data):
    trn, val = data
    reps = [fake_report("ddl-cc", 3.0, 2.5), fake_report("baseline", 2.0, 2.7), fake_report("ddl", 2.5, 2.1)]
    comp = T.comparison_report(reps, trn, val, TCFG)
    assert comp["final_train_loss_ranking"] == ["baseline", "ddl", "ddl-cc"]
    assert comp["best_final_train_variant"] == "baseline"
    assert comp["final_validation_loss_ranking"] == ["ddl", "ddl-cc", "baseline"]
    assert comp["best_final_validation_variant"] == "ddl"
    # ties keep the sweep's order (the reference trainer's stable sort), NaN ranks last (f32::total_cmp)
    reps = [fake_report("ddl-tc", 2.0, NAN), fake_report("baseline", 2.0, 1.0), fake_report("ddl", 1.0, 1.0)]
    comp = T.comparison_report(reps, trn, val, TCFG)
    assert comp["final_train_loss_ranking"] == ["ddl", "ddl-tc", "baseline"]
    assert comp["final_validation_loss_ranking"] == ["baseline", "ddl", "ddl-tc"]
    # a variant without validation: no validation ranking at all
    reps = [fake_report("baseline", 2.0, 1.0), fake_report("ddl", 1.0, None)]
    comp = T.comparison_report(reps, trn, None, TCFG)
    assert comp["final_validation_loss_ranking"] is None and comp["best_final_validation_variant"] is None


def test_ref_ddl_sweep_smoke(data, tmp_path):
    """DDL variants train on --backend ref; the sweep ranks both by their final losses."""
    trn, val = data
    tcfg = TrainingConfig(max_steps=3, eval_interval=2, batch_size=2, seq_len=16, eval_batches=2)
    comp = train_variants(CFG, [BASELINE, ModelVariant("ddl")], trn, val, tcfg, tmp_path, REF)
    by = {r["variant"]: r for r in comp["reports"]}
    assert list(by) == ["baseline", "ddl"]
    assert (
        by["ddl"]["config"]["residual"] == "delta" and by["ddl"]["num_params"] > by["baseline"]["num_params"]
    )
    assert comp["final_train_loss_ranking"] == sorted(by, key=lambda v: by[v]["final_train"]["loss"])
    assert comp["final_validation_loss_ranking"] == sorted(
        by, key=lambda v: by[v]["final_validation"]["loss"]
    )
    assert all(math.isfinite(h["train"]["loss"]) for r in by.values() for h in r["history"])


# ---------------------------------------------------------------------------------------------------------
# the reference trainer's errors


def test_the_seeds_errors(data):
    trn, val = data
    empty = TokenDataset([], batch_size=2, seq_len=16)
    with pytest.raises(TrainingError, match="^training dataset does not contain any batches$"):
        train_variant(CFG, BASELINE, empty, val, TCFG, None, REF)
    with pytest.raises(TrainingError, match="^validation dataset does not contain any batches$"):
        train_variant(CFG, BASELINE, trn, empty, TCFG, None, REF)
    with pytest.raises(TrainingError, match="^training dataset does not contain any batches$"):
        train_variants(CFG, [BASELINE], empty, None, TCFG, None, REF)
    with pytest.raises(TrainingError, match="^validation dataset does not contain any batches$"):
        train_variants(CFG, [BASELINE], trn, empty, TCFG, None, REF)
    with pytest.raises(TrainingError, match="^at least one model variant is required$"):
        train_variants(CFG, [], trn, val, TCFG, None, REF)


# ---------------------------------------------------------------------------------------------------------
# checkpoints and resume


def test_checkpoint_artifact(straight, data):
    rep, out = straight
    trn, _ = data
    ck = load_checkpoint(out / "checkpoint.ddlw")
    assert set(ck) == {"cfg", "params", "best", "m", "v", "report", "position", "data", "sweep", "backend"}
    assert ck["cfg"] == BASELINE.resolve_config(CFG)
    names = [s.name for s in param_table(ck["cfg"])]
    for key in ("params", "best", "m", "v"):
        assert sorted(ck[key]) == sorted(names), key
    assert any(np.abs(a).max() > 0 for a in ck["v"].values())  # real optimizer state
    assert ck["report"] == json.loads(json.dumps(rep))
    assert ck["position"] == {
        "phase": {"start_step": 0, "training": TCFG.to_dict(), "previous_lr": None},
        "steps_completed": 6,
    }
    # the model saved is the final model: it reproduces the final train evaluation exactly
    net = make_net(ck["cfg"], ck["params"], "wgpu", None)
    assert evaluate(net, trn, TCFG.eval_batches)["metrics"] == rep["final_train"]


def test_interrupted_run_resumes_bit_for_bit(straight, data, tmp_path):
    """--max-steps 6 straight == --stop-after 3 + resume (and 2+2+2): the same history to the bit."""
    full, full_out = straight
    trn, val = data
    stopped = train_variant(
        CFG, BASELINE, trn, val, TCFG, tmp_path / "a", RunOptions(backend="wgpu", stop_after=3)
    )
    assert (
        stopped["status"] == "stopped" and stopped["steps_completed"] == 3 and stopped["final_train"] is None
    )
    ck = load_checkpoint(tmp_path / "a" / "checkpoint.ddlw")
    assert ck["position"]["steps_completed"] == 3 and len(ck["report"]["history"]) == 3
    done = resume(tmp_path / "a" / "checkpoint.ddlw", trn, val, WGPU)
    assert done["status"] == "completed"
    assert losses(done) == losses(full)
    assert without_run_stats(done) == without_run_stats(full)
    a, b = load_checkpoint(tmp_path / "a" / "checkpoint.ddlw"), load_checkpoint(full_out / "checkpoint.ddlw")
    for key in ("params", "best", "m", "v"):
        for n in a[key]:
            np.testing.assert_array_equal(a[key][n], b[key][n], err_msg=f"{key}.{n}")
    # three pieces
    train_variant(CFG, BASELINE, trn, val, TCFG, tmp_path / "b", RunOptions(backend="wgpu", stop_after=2))
    mid = resume(tmp_path / "b" / "checkpoint.ddlw", trn, val, RunOptions(backend="wgpu", stop_after=2))
    assert mid["status"] == "stopped" and mid["steps_completed"] == 4
    done = resume(tmp_path / "b" / "checkpoint.ddlw", trn, val, WGPU)
    assert without_run_stats(done) == without_run_stats(full)


def test_new_phase_follows_the_seed(straight, data, tmp_path):
    """resume --steps 4: cosine from the last learning rate (clamped), no warm-up, steps 7..10, data order
    continuing (global step s reads batch s % num_batches), AdamW's step count continuing."""
    _, full_out = straight
    trn, val = data
    src = tmp_path / "phase1.ddlw"
    src.write_bytes((full_out / "checkpoint.ddlw").read_bytes())
    ck1 = load_checkpoint(src)
    rep = resume(src, trn, val, WGPU, out_dir=tmp_path / "p2", steps=4, overrides={"min_learning_rate": 1e-4})
    hist = rep["history"]
    assert hist[:6] == ck1["report"]["history"]
    assert [h["step"] for h in hist] == list(range(1, 11)) and rep["steps_completed"] == 10
    prev = ck1["report"]["history"][-1]["learning_rate"]
    assert prev == TCFG.min_learning_rate
    sched = CosineWarmupSchedule(min(max(prev, 1e-4), TCFG.learning_rate), 1e-4, 0, 4)
    assert [h["learning_rate"] for h in hist[6:]] == [sched.learning_rate(i) for i in range(4)]
    assert hist[6]["learning_rate"] == prev and hist[9]["learning_rate"] == 1e-4
    assert [h["step"] for h in hist[6:] if h["validation"] is not None] == [8, 10]  # in-phase eval steps
    assert rep["training"]["max_steps"] == 4 and rep["training"]["min_learning_rate"] == 1e-4
    ck2 = load_checkpoint(tmp_path / "p2" / "checkpoint.ddlw")
    assert ck2["position"]["phase"] == {"start_step": 6, "training": rep["training"], "previous_lr": prev}
    # replay the phase by hand on the same device: same batches, same rates, same AdamW step count
    net = make_net(ck1["cfg"], ck1["params"], "wgpu", None)
    net.load_moments(ck1["m"], ck1["v"])
    work = net.work(2, 16)
    for i in range(4):
        gs = 6 + i
        b = trn.batch(gs % trn.num_batches)
        res = work.step(
            b.ids,
            b.lengths,
            update=AdamW(
                lr=sched.learning_rate(i),
                step=gs + 1,
                beta1=TCFG.beta1,
                beta2=TCFG.beta2,
                eps=TCFG.epsilon,
                weight_decay=TCFG.weight_decay,
                grad_clip=TCFG.grad_clip,
                grad_clip_mode=TCFG.grad_clip_mode,
            ),
        )
        assert res.loss == hist[gs]["train"]["loss"], f"step {gs + 1}"
    # a learning rate override below the last rate clamps the new phase's start to it
    rep3 = resume(
        tmp_path / "p2" / "checkpoint.ddlw",
        trn,
        val,
        REF,
        out_dir=tmp_path / "p3",
        steps=2,
        overrides={"learning_rate": 5e-5, "min_learning_rate": 1e-5},
    )
    assert [h["learning_rate"] for h in rep3["history"][10:]] == [5e-5, 1e-5]
    assert [h["step"] for h in rep3["history"]] == list(range(1, 13))


def test_resume_refuses_the_wrong_kind(straight, data, tmp_path):
    _, full_out = straight
    trn, val = data
    with pytest.raises(
        TrainingError, match=r"^invalid resume state: the run already completed its 6 steps$"
    ) as e:
        resume(full_out / "checkpoint.ddlw", trn, val, WGPU, out_dir=tmp_path / "x")
    assert e.value.kind == "run_completed"  # the CLI says how to go on: a new phase with --steps N
    train_variant(CFG, BASELINE, trn, val, TCFG, tmp_path / "s", RunOptions(backend="ref", stop_after=3))
    with pytest.raises(TrainingError, match=r"^invalid resume state: the run stopped at step 3 of its phase"):
        resume(tmp_path / "s" / "checkpoint.ddlw", trn, val, REF, steps=2)
    with pytest.raises(
        TrainingError, match=r"^invalid training configuration: training options can only change"
    ):
        resume(tmp_path / "s" / "checkpoint.ddlw", trn, val, REF, overrides={"learning_rate": 1e-4})
    with pytest.raises(
        TrainingError, match=r"^invalid training configuration: max_steps must be greater than zero$"
    ):
        resume(full_out / "checkpoint.ddlw", trn, val, REF, out_dir=tmp_path / "y", steps=0)


def test_each_resume_check_rejects_its_mismatch(straight, data, tmp_path, corpus):
    _, full_out = straight
    trn, val = data
    ck = load_checkpoint(full_out / "checkpoint.ddlw")
    check_resume(ck, trn, val)  # the right data passes

    other_trn, other_val = datasets(corpus, val_fraction=0.3)
    with pytest.raises(
        TrainingError,
        match=r"^invalid resume state: training dataset summary .* does not match saved artifact",
    ):
        check_resume(ck, other_trn, val)
    with pytest.raises(
        TrainingError,
        match=r"^invalid resume state: validation dataset summary None does not match saved artifact",
    ):
        check_resume(ck, trn, None)
    with pytest.raises(
        TrainingError,
        match=r"^invalid resume state: validation dataset summary .* does not match saved artifact",
    ):
        check_resume(ck, trn, other_val)
    bad = copy.deepcopy(ck)
    bad["report"]["steps_completed"] = 5
    with pytest.raises(
        TrainingError,
        match=r"^invalid resume state: saved report recorded 5 completed steps but 6 history entries$",
    ):
        check_resume(bad, trn, val)
    bad = copy.deepcopy(ck)
    bad["m"], bad["v"] = {}, {}
    with pytest.raises(
        TrainingError, match=r"^invalid resume state: saved training artifact is missing optimizer state$"
    ):
        check_resume(bad, trn, val)
    bad["report"]["steps_completed"], bad["report"]["history"] = 0, []
    check_resume(bad, trn, val)  # before step 1 no optimizer state is needed
    bad = copy.deepcopy(ck)
    bad["report"]["variant"] = "ddl"
    with pytest.raises(
        TrainingError,
        match=r"^invalid resume state: saved report expects variant ddl but checkpoint contains a baseline model$",
    ):
        check_resume(bad, trn, val)
    bad = copy.deepcopy(ck)
    bad["cfg"] = ModelVariant("ddl").resolve_config(CFG)
    with pytest.raises(
        TrainingError,
        match=r"^invalid resume state: saved report expects variant baseline but checkpoint contains a DDL model$",
    ):
        check_resume(bad, trn, val)
    # through `resume`: the check runs before anything is trained or written
    with pytest.raises(TrainingError, match=r"^invalid resume state: training dataset summary"):
        resume(full_out / "checkpoint.ddlw", other_trn, val, REF, out_dir=tmp_path / "z", steps=2)
    assert not (tmp_path / "z").exists()


def test_sigkill_leaves_a_resumable_checkpoint(corpus, tmp_path):
    """A training process killed with SIGKILL between (or during) saves leaves the last checkpoint, which
    opens and finishes the run; the finished history equals an uninterrupted run's, bit for bit."""
    args = [
        "--data",
        str(corpus),
        "--variants",
        "baseline",
        "--max-steps",
        "40",
        "--eval-interval",
        "1",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--eval-batches",
        "2",
        "--no-plots",
        "--learning-rate",
        "1e-2",
        *CLI_MODEL_ARGS,
    ]
    cli = [sys.executable, "-m", "ddl_wgpu.cli"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ckpt = tmp_path / "killed" / "baseline" / "checkpoint.ddlw"
    proc = subprocess.Popen(
        [*cli, "train", "--out", str(tmp_path / "killed"), "--save-interval", "2", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not ckpt.exists():
            assert proc.poll() is None, "training ended before its first checkpoint"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.005)
        time.sleep(0.05)  # land somewhere in the next steps (or in a save)
        assert proc.poll() is None, "training finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    ck = load_checkpoint(ckpt)
    done = ck["report"]["steps_completed"]
    assert 2 <= done < 40 and done % 2 == 0 and len(ck["report"]["history"]) == done
    r = subprocess.run(
        [*cli, "resume", str(ckpt), "--data", str(corpus)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    resumed = json.loads((ckpt.parent / "report.json").read_text())
    assert resumed["status"] == "completed" and resumed["steps_completed"] == 40
    r = subprocess.run(
        [*cli, "train", "--out", str(tmp_path / "whole"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    whole = json.loads((tmp_path / "whole" / "baseline" / "report.json").read_text())
    print(f"\nkilled after step {done}; resumed to 40")
    assert without_run_stats(resumed) == without_run_stats(whole)


# ---------------------------------------------------------------------------------------------------------
# backends


def test_ref_and_wgpu_histories_agree(straight, data):
    wg, _ = straight
    trn, val = data
    ref = train_variant(CFG, BASELINE, trn, val, TCFG, None, REF)
    assert [h["step"] for h in ref["history"]] == [h["step"] for h in wg["history"]]
    assert [h["learning_rate"] for h in ref["history"]] == [h["learning_rate"] for h in wg["history"]]
    np.testing.assert_allclose(losses(ref), losses(wg), rtol=1e-4)
    np.testing.assert_allclose(
        [h["grad_norm"] for h in ref["history"]], [h["grad_norm"] for h in wg["history"]], rtol=1e-3
    )
    vr = [h["validation"]["loss"] for h in ref["history"] if h["validation"]]
    vw = [h["validation"]["loss"] for h in wg["history"] if h["validation"]]
    assert len(vr) == len(vw) == 3
    np.testing.assert_allclose(vr, vw, rtol=1e-4)
    for key in ("initial_train", "initial_validation", "final_train", "final_validation", "best_validation"):
        np.testing.assert_allclose(ref[key]["loss"], wg[key]["loss"], rtol=1e-4, err_msg=key)
    assert ref["best_validation_step"] == wg["best_validation_step"]
    print(f"\nref  {losses(ref)}\nwgpu {losses(wg)}")
