"""Mixed precision (docs/precision.md): the loss scaler's rules (PyTorch GradScaler's), what `--precision`
resolves to, and the engine's loss scaling on both backends.

The key property: every loss scale is a power of two, so the scaled gradient, its norm and the unscaled clip
multiplier are exact in f32, and a `mixed` step whose products stay f32 (lavapipe has no matrix units; numpy
never has) gives the bits of the `f32` step, whatever the scale, as long as nothing overflows. An overflow
skips the step (weights and moments untouched) and halves the scale; both backends decide alike.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import cli_sizes, tiny_cfg

from ddl_ref.config import ModelVariant, MtpConfig
from ddl_ref.params import init_params
from ddl_wgpu import backend as B
from ddl_wgpu.data import ByteTokenizer, load_datasets
from ddl_wgpu.engine import step as S
from ddl_wgpu.engine.refnet import RefNet, RefWork
from ddl_wgpu.engine.step import AdamW, LossScaler, StepResult
from ddl_wgpu.jobs import train as T
from ddl_wgpu.jobs.train import RunOptions, TrainingConfig, TrainingError

BASELINE = ModelVariant("baseline")
CFG = tiny_cfg("train")
BASE = dict(max_steps=10, eval_interval=5, learning_rate=1e-2, batch_size=2, seq_len=16, eval_batches=2)
# scaler settings that make the tiny run overflow, back off, grow and overflow again within 10 steps: its
# gradient's sum of squares leaves f32 near a scale of 2^63
SWINGING = dict(precision="mixed", loss_scale=2.0**64, loss_scale_interval=2)


# -- the scaler's rules ------------------------------------------------------------------------------------


def test_scaler_defaults_are_gradscalers():
    """torch.amp.GradScaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)."""
    assert (S.LOSS_SCALE_INIT, S.LOSS_SCALE_GROWTH, S.LOSS_SCALE_BACKOFF, S.LOSS_SCALE_INTERVAL) == (
        65536.0,
        2.0,
        0.5,
        2000,
    )
    sc = LossScaler()
    assert (sc.scale, sc.interval, sc.good, sc.skipped) == (65536.0, 2000, 0, 0)
    assert TrainingConfig().precision == "f32"  # the library's default: its callers' bits
    assert (TrainingConfig().loss_scale, TrainingConfig().loss_scale_interval) == (65536.0, 2000)


def test_scaler_grows_backs_off_and_fails_below_the_floor():
    sc = LossScaler(8.0, interval=3)
    assert [sc.update(True) for _ in range(2)] == [True, True] and sc.scale == 8.0 and sc.good == 2
    assert sc.update(True) and (sc.scale, sc.good) == (16.0, 0)  # the 3rd good step in a row doubles it
    sc.update(True)
    assert not sc.update(False) and (sc.scale, sc.good, sc.skipped) == (8.0, 0, 1)  # halved, count restarted
    assert [sc.update(True) for _ in range(3)] == [True] * 3 and sc.scale == 16.0
    top = LossScaler(S.LOSS_SCALE_MAX, interval=1)
    assert top.update(True) and top.scale == S.LOSS_SCALE_MAX and top.good == 0  # never past f32's range
    low = LossScaler(S.LOSS_SCALE_MIN, interval=5)
    assert not low.failed
    low.update(False)
    assert low.failed and low.scale == S.LOSS_SCALE_MIN / 2
    state = sc.state()
    assert state == {"scale": 16.0, "good_steps": 0, "skipped_steps": 1}
    back = LossScaler.from_state(json.loads(json.dumps(state)), 3)
    assert back.state() == state and back.interval == 3


@pytest.mark.parametrize(
    "over,message",
    [
        (dict(precision="bf16"), "precision must be one of auto, f32, mixed"),
        (dict(loss_scale=3.0), "loss_scale must be a power of two"),
        (dict(loss_scale=2.0**-15), "loss_scale must be a power of two"),
        (dict(loss_scale=math.inf), "loss_scale must be a power of two"),
        (dict(loss_scale_interval=0), "loss_scale_interval must be greater than zero"),
        (dict(loss_scale_interval=1.5), "loss_scale_interval must be a non-negative integer"),
    ],
)
def test_precision_settings_are_validated(over, message):
    with pytest.raises(TrainingError, match=message):
        TrainingConfig(**over).validate()
    TrainingConfig(precision="auto", loss_scale=2.0**-14, loss_scale_interval=1).validate()


# -- what --precision resolves to --------------------------------------------------------------------------


def test_auto_is_mixed_only_where_a_matrix_configuration_exists(monkeypatch):
    assert B.apply_precision("auto", "ref").name == "f32"
    assert B.apply_precision("mixed", "ref") == B.PrecisionChoice(
        "mixed", "numpy", "float32 numpy, dynamic loss scaling as on the GPU"
    )
    with_tc = SimpleNamespace(products="simt", matrix_configs=[(16, 16, 16, "f16", "f32")])
    # a runtime that lists none (wgpu-native), or only configurations the kernels do not take (NVIDIA without
    # Dawn's f16 toggle lists int8 ones alone)
    without = SimpleNamespace(products="simt", matrix_configs=[(16, 16, 32, "u8", "u32")])
    monkeypatch.setitem(B._GPU, "tc", with_tc)
    monkeypatch.setitem(B._GPU, "simt", without)
    # the fake devices' names match no adapter: under DDL_WGPU_RUNTIME=dawn the runtime's resolution would look
    # for one (the GPU machine's run of this file); what is tested here is the choice of products
    monkeypatch.setattr(B, "_runtime", lambda device: ("native", "the test's fake device"))
    got = B.apply_precision("auto", "wgpu", "tc")
    assert (got.name, got.products, with_tc.products) == ("mixed", "matrix", "matrix")
    got = B.apply_precision("f32", "wgpu", "tc")  # always available, and it puts the products back
    assert (got.name, with_tc.products) == ("f32", "simt")
    assert B.apply_precision("auto", "wgpu", "simt").name == "f32" and without.products == "simt"
    got = B.apply_precision("mixed", "wgpu", "simt")  # allowed: loss scaling, products on the SIMT cores
    assert (got.name, without.products) == ("mixed", "simt") and "no subgroup matrix" in got.reason
    with pytest.raises(B.BackendError, match="unknown precision 'half'"):
        B.apply_precision("half", "ref")


# -- the engine: a scaled step is the unscaled step -------------------------------------------------------


def _nets(backend, gpu, cfg, n):
    from ddl_wgpu.engine.net import Net
    from ddl_wgpu.engine.trunk import TrunkWork

    p = init_params(cfg, 5)
    if backend == "ref":
        return [RefNet(cfg, p, mtp_weight=0.3) for _ in range(n)]
    return [Net(gpu, cfg, p, mtp_weight=0.3, work_class=TrunkWork) for _ in range(n)]


def _state(net):
    m, v = net.moments()
    return net.export(), m, v


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        assert sorted(x) == sorted(y)
        for n in x:
            np.testing.assert_array_equal(x[n], y[n], err_msg=n)


@pytest.mark.parametrize("backend", ["wgpu", "ref"])
@pytest.mark.parametrize("clip_mode", ["per-tensor", "global"])
def test_scaled_steps_give_the_unscaled_bits(gpu, backend, clip_mode):
    """Three AdamW steps of a model with a joint MTP draft (both losses scaled) at loss scales 2^16, 2^-3 and
    2^40 against the same steps at scale 1: the same loss, gradient norm, weights and moments, bit for bit."""
    cfg = tiny_cfg("mtp", n_layers=1, mtp=MtpConfig(), qk_norm="pre_rope")
    plain, scaled = _nets(backend, gpu, cfg, 2)
    rng = np.random.default_rng(3)
    for step, scale in enumerate((2.0**16, 2.0**-3, 2.0**40), start=1):
        ids = rng.integers(0, cfg.vocab_size, (2, 8))
        lengths = np.array([8, 6])
        hyper = AdamW(lr=1e-2, step=step, grad_clip=0.5, grad_clip_mode=clip_mode)
        a = plain.work(2, 8).step(ids, lengths, update=hyper)
        b = scaled.work(2, 8).step(ids, lengths, update=replace(hyper, loss_scale=scale))
        assert b.finite and (a.loss, a.grad_norm, a.loss_mtp) == (b.loss, b.grad_norm, b.loss_mtp)
        _same(_state(plain), _state(scaled))
    trained, p0 = _state(plain)[0], init_params(cfg, 5)
    assert any(not np.array_equal(trained[n], p0[n]) for n in p0)


@pytest.mark.parametrize("backend", ["wgpu", "ref"])
def test_an_overflowing_step_is_skipped(gpu, backend):
    """At 2^127 the scaled gradient overflows: the step reports a finite loss and a non-finite gradient, and
    leaves weights and moments as they were; the next step at a sane scale trains."""
    cfg = tiny_cfg("train")
    (net,) = _nets(backend, gpu, cfg, 1)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 16))
    net.work(2, 16).step(ids, None, update=AdamW(lr=1e-2, step=1))
    before = _state(net)
    res = net.work(2, 16).step(ids, None, update=AdamW(lr=1e-2, step=2, loss_scale=2.0**127))
    assert not res.finite and math.isfinite(res.loss)
    _same(_state(net), before)
    assert net.work(2, 16).step(ids, None, update=AdamW(lr=1e-2, step=2, loss_scale=2.0**16)).finite
    after = _state(net)[0]
    assert any(not np.array_equal(after[n], before[0][n]) for n in after)


# -- the train job -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory, corpus_words):
    rng = np.random.default_rng(0)
    text = " ".join(corpus_words[int(i)] + (".\n" if k % 11 == 10 else "")
                    for k, i in enumerate(rng.integers(0, len(corpus_words), 600)))  # fmt: skip
    p = tmp_path_factory.mktemp("precision") / "corpus.txt"
    p.write_text(text)
    return load_datasets(str(p), tokenizer=ByteTokenizer(), seq_len=16, batch_size=2, val_fraction=0.2,
                         vocab_size=256, seed=0)  # fmt: skip


def _run(data, out, backend, stop_after=0, **training):
    trn, val = data
    tcfg = TrainingConfig(**{**BASE, **training})
    return T.train_variant(
        CFG, BASELINE, trn, val, tcfg, out, RunOptions(backend=backend, stop_after=stop_after)
    )


def _scales(rep):
    return [(h["loss_scale"], h["skipped"]) for h in rep["history"]]


def _without_scaler(rep):
    """The report's history and metrics, without mixed precision's own fields and the run's timings."""
    keep = ("history", "final_train", "final_validation", "best_validation", "best_validation_step")
    out = {k: rep[k] for k in keep}
    out["history"] = [
        {k: v for k, v in h.items() if k not in ("loss_scale", "skipped")} for h in rep["history"]
    ]
    return json.dumps(out, sort_keys=True)


@pytest.fixture
def scaler_only(monkeypatch):
    """`mixed` with its products kept f32 on the SIMT cores, as on a GPU without matrix units (lavapipe): what
    these tests compare is the loss scaling's bookkeeping, bit for bit against f32 and numpy. On a GPU with
    matrix units `mixed` runs f16 products, whose bits differ from f32's and whose overflows numpy does not
    have (the H100 through Dawn skipped a step numpy kept); those products are checked by
    `tests/test_kernel_matmul_tc.py` and the 300-step sweep (BENCHMARKS.md)."""
    monkeypatch.setattr(B, "_matrix_units", lambda gpu: ())


@pytest.mark.parametrize("backend", ["wgpu", "ref"])
def test_a_mixed_run_without_overflow_is_the_f32_run(data, tmp_path, backend, scaler_only):
    f32 = _run(data, tmp_path / "f32", backend, max_steps=4)
    mixed = _run(data, tmp_path / "mixed", backend, max_steps=4, precision="mixed")
    assert f32["training"]["precision"] == "f32" and mixed["training"]["precision"] == "mixed"
    assert "loss_scale" not in f32["history"][0]  # an f32 report keeps the reference trainer's fields
    assert _scales(mixed) == [(65536.0, False)] * 4
    assert _without_scaler(mixed) == _without_scaler(f32)
    a, b = (
        T.load_checkpoint(tmp_path / "f32" / T.CHECKPOINT),
        T.load_checkpoint(tmp_path / "mixed" / T.CHECKPOINT),
    )
    for key in ("params", "m", "v", "best"):
        for n in a[key]:
            np.testing.assert_array_equal(a[key][n], b[key][n], err_msg=f"{key}.{n}")
    assert "scaler" not in a["position"]
    assert b["position"]["scaler"] == {"scale": 65536.0, "good_steps": 4, "skipped_steps": 0}
    assert b["position"]["phase"]["training"]["precision"] == "mixed"


def test_the_scalers_decisions_agree_across_backends(data, scaler_only):
    """Overflow, back-off, growth after `interval` good steps and overflow again: the same steps skipped at the
    same scales on numpy and on the GPU; a skipped step is recorded, counts as a step, and is no failure."""
    ref = _run(data, None, "ref", **SWINGING)
    wg = _run(data, None, "wgpu", **SWINGING)
    assert _scales(ref) == _scales(wg)
    skipped = [s for s, k in _scales(ref) if k]
    assert skipped and len(skipped) < 10 and wg["status"] == ref["status"] == "completed"
    scales = [s for s, _ in _scales(ref)]
    moves = [b / a for a, b in zip(scales[:-1], scales[1:], strict=True)]
    assert 2.0 in moves and 0.5 in moves  # grown after 2 good steps, halved after an overflow
    assert all(h["grad_norm"] is None for h in ref["history"] if h["skipped"])
    np.testing.assert_allclose([h["train"]["loss"] for h in ref["history"]],
                               [h["train"]["loss"] for h in wg["history"]], rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("backend", ["ref", "wgpu"])
def test_mixed_resume_is_bit_exact(data, tmp_path, backend):
    """Stopped twice and resumed, through skipped steps and a growth count in flight: the straight run's
    report, weights and moments, bit for bit (the scaler's state round-trips the checkpoint)."""
    straight = _run(data, tmp_path / "straight", backend, **SWINGING)
    stopped = _run(data, tmp_path / "pieces", backend, stop_after=3, **SWINGING)
    ck = T.load_checkpoint(tmp_path / "pieces" / T.CHECKPOINT)
    assert stopped["status"] == "stopped" and ck["position"]["scaler"]["skipped_steps"] >= 1
    T.resume(tmp_path / "pieces" / T.CHECKPOINT, *data, RunOptions(backend=backend, stop_after=4))
    done = T.resume(tmp_path / "pieces" / T.CHECKPOINT, *data, RunOptions(backend=backend))
    assert done["status"] == "completed" and _scales(done) == _scales(straight)
    assert _without_scaler(done) == _without_scaler(straight)
    a, b = (
        T.load_checkpoint(tmp_path / "pieces" / T.CHECKPOINT),
        T.load_checkpoint(tmp_path / "straight" / T.CHECKPOINT),
    )
    assert a["position"]["scaler"] == b["position"]["scaler"]
    for key in ("params", "m", "v"):
        for n in a[key]:
            np.testing.assert_array_equal(a[key][n], b[key][n], err_msg=f"{key}.{n}")


def test_only_a_scale_below_the_floor_or_a_non_finite_loss_fails(data, monkeypatch):
    """A gradient that stays non-finite at a finite loss is skipped until the scale falls below 2^-14, then the
    run fails as non-finite; a non-finite loss fails at once (no scale explains it)."""
    real = RefWork.step

    def bad_gradient(self, ids, lengths=None, update=None):
        res = real(self, ids, lengths, update)
        return StepResult(loss=res.loss, count=res.count, grad_norm=math.inf, finite=False)

    monkeypatch.setattr(RefWork, "step", bad_gradient)
    rep = _run(data, None, "ref", precision="mixed", loss_scale=2.0**-12)
    assert rep["status"] == "failed" and rep["failure"]["step"] == 3, rep.get("failure")
    assert "every loss scale" in rep["failure"]["reason"] and _scales(rep) == [
        (2.0**-12, True),
        (2.0**-13, True),
    ]

    def bad_loss(self, ids, lengths=None, update=None):
        res = real(self, ids, lengths, update)
        return StepResult(loss=math.nan, count=res.count, grad_norm=res.grad_norm, finite=False)

    monkeypatch.setattr(RefWork, "step", bad_loss)
    rep = _run(data, None, "ref", precision="mixed")
    assert (
        rep["status"] == "failed"
        and rep["failure"]["step"] == 1
        and "non-finite loss" in rep["failure"]["reason"]
    )


def test_a_checkpoint_from_before_precision_resumes_f32(data, tmp_path):
    from ddl_wgpu.jobs.checkpoint import save_checkpoint

    _run(data, tmp_path / "a", "ref", max_steps=4, stop_after=2)
    ck = T.load_checkpoint(tmp_path / "a" / T.CHECKPOINT)
    for training in (ck["report"]["training"], ck["position"]["phase"]["training"]):
        del training["precision"]  # as written before the field existed
    net = RefNet(ck["cfg"], ck["params"])
    save_checkpoint(tmp_path / "old.ddlw", net, ck["report"], None, ck["position"], ck["data"])
    old = T.load_checkpoint(tmp_path / "old.ddlw")
    assert (
        old["position"]["phase"]["training"]["precision"] == "f32" == old["report"]["training"]["precision"]
    )


# -- the command line --------------------------------------------------------------------------------------


def test_cli_precision(cli, ok, corpus_words, tmp_path):
    from conftest import user_error

    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(corpus_words * 30))
    args = ["--variants", "baseline", "--max-steps", "2", "--eval-interval", "2", "--batch-size", "2",
            "--seq-len", "16", "--eval-batches", "1", "--no-plots", *cli_sizes("train")]  # fmt: skip
    line = user_error(cli("train", "--data", corpus, "--out", tmp_path / "x", "--precision", "bogus", *args))
    assert "precision" in line and "bogus" in line
    assert not (tmp_path / "x").exists()
    user_error(
        cli("train", "--data", corpus, "--out", tmp_path / "y", "--loss-scale", "3", *args), "loss_scale"
    )
    r = ok(cli("train", "--data", corpus, "--out", tmp_path / "m", "--precision", "mixed", "--backend", "ref",
               "--loss-scale-interval", "1", *args))  # fmt: skip
    assert "precision: mixed (float32 numpy, dynamic loss scaling as on the GPU)" in r.stdout
    rep = json.loads((tmp_path / "m" / "baseline" / "report.json").read_text())
    assert rep["training"]["precision"] == "mixed" and [h["loss_scale"] for h in rep["history"]] == [
        2.0**16,
        2.0**17,
    ]
    ck = T.load_checkpoint(tmp_path / "m" / "baseline" / T.CHECKPOINT)
    assert ck["position"]["scaler"] == {"scale": 2.0**18, "good_steps": 0, "skipped_steps": 0}
    r = ok(cli("train", "--data", corpus, "--out", tmp_path / "a", "--backend", "ref", *args))
    assert "precision: f32" in r.stdout
    assert json.loads((tmp_path / "a" / "report.json").read_text())["training"]["precision"] == "f32"
    r = ok(cli("resume", tmp_path / "m" / "baseline" / T.CHECKPOINT, "--steps", "1", "--min-learning-rate",
               "1e-4", "--learning-rate", "1e-3"))  # fmt: skip
    assert "precision: mixed (the run's)" in r.stdout
    rep = json.loads((tmp_path / "m" / "baseline" / "report.json").read_text())
    assert rep["history"][-1]["loss_scale"] == 2.0**18  # the new phase continues the run's scaler


def test_a_sweep_resolves_auto_per_job_and_resumes(cli, ok, corpus_words, tmp_path):
    """A sweep's record keeps `auto`; each job records what it resolved to, and resuming the sweep holds the
    two to be the same options."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(corpus_words * 30))
    args = ["--variants", "baseline", "--max-steps", "2", "--eval-interval", "2", "--batch-size", "2",
            "--seq-len", "16", "--eval-batches", "1", "--no-plots", "--backend", "ref", *cli_sizes("train")]  # fmt: skip
    ok(cli("train", "--data", corpus, "--out", tmp_path / "s", "--seeds", "0,1", "--stop-after", "1", *args))
    rep = json.loads((tmp_path / "s" / "baseline" / "seed-0" / "report.json").read_text())
    assert rep["training"]["precision"] == "f32"
    ok(cli("resume", tmp_path / "s"))
    comp = json.loads((tmp_path / "s" / "report.json").read_text())
    assert [r["steps_completed"] for r in comp["reports"]] == [2, 2]
