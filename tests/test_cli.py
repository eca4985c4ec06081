"""The `ddl-wgpu` command line, run as a user runs it (the `cli` fixture: a subprocess of `python -m
ddl_wgpu.cli`, which goes through `main()`): devices, check, init + inspect, eval on both backends, train end to end, the one-line
`error: ...` + exit 2 of every user error, and stop/resume through the CLI."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_sizes

from ddl_ref.config import ModelVariant

MODEL_ARGS = cli_sizes("train")
TRAIN_ARGS = [
    "--variants",
    "baseline",
    "--max-steps",
    "6",
    "--eval-interval",
    "2",
    "--batch-size",
    "2",
    "--seq-len",
    "16",
    "--eval-batches",
    "2",
    "--learning-rate",
    "1e-2",
    "--warmup-steps",
    "2",
    "--min-learning-rate",
    "1e-3",
    "--backend",  # the engine, also where auto would choose numpy (a CPU-only adapter such as lavapipe)
    "wgpu",
    *MODEL_ARGS,
]
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpus_words) -> Path:
    rng = np.random.default_rng(0)
    text = " ".join(
        corpus_words[int(i)] + (".\n" if k % 11 == 10 else "")
        for k, i in enumerate(rng.integers(0, len(corpus_words), 600))
    )
    p = tmp_path_factory.mktemp("cli_data") / "corpus.txt"
    p.write_text(text)
    return p


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, cli, ok) -> Path:
    out = tmp_path_factory.mktemp("cli_model") / "tiny.ddlw"
    r = ok(cli("init", "--preset", "tiny", "--out", out, "--seed", "3", *MODEL_ARGS))
    assert "variant baseline: 14,448 parameters" in r.stdout and f"wrote {out}" in r.stdout
    return out


# ---------------------------------------------------------------------------------------------------------
# devices, check, init, inspect


def test_devices_text_and_json(cli, ok):
    text = ok(cli("devices")).stdout
    assert text.startswith("[0] ") and "backend=" in text and "default adapter: " in text
    adapters = json.loads(ok(cli("devices", "--json")).stdout)
    assert isinstance(adapters, list) and adapters
    a = adapters[0]
    assert a["index"] == 0 and a["name"] and a["backend"] and isinstance(a["features"], list)
    assert isinstance(a["limits"], dict) and a["limits"]
    assert a["name"] in text


def test_check(cli, ok):
    out = ok(cli("check")).stdout
    assert out.startswith("adapter: ") and out.strip().splitlines()[-1].startswith("ok (")


def test_init_then_inspect(model_file, cli, ok):
    text = ok(cli("inspect", model_file)).stdout
    assert "ddlw v2" in text and re.search(r"^tensors\s+13\b", text, re.M) and "14448" in text
    desc = json.loads(ok(cli("inspect", model_file, "--json")).stdout)
    assert desc["num_tensors"] == 13 and desc["total_params"] == 14448
    assert desc["config"]["d_model"] == 32 and desc["config"]["residual"] == "add"
    assert {t["name"] for t in desc["tensors"]} >= {"model.embed_tokens.weight", "model.norm.weight"}
    verified = json.loads(ok(cli("inspect", model_file, "--json", "--verify")).stdout)
    assert verified["verified"] is True
    ok(cli("inspect", model_file, "--verify"))


def test_init_ddl_variant(tmp_path, cli, ok):
    r = ok(cli("init", "--variant", "ddl", "--out", tmp_path / "d.ddlw", *MODEL_ARGS))
    assert r.stdout.startswith("variant ddl: ") and "over baseline" in r.stdout
    assert (
        json.loads(ok(cli("inspect", tmp_path / "d.ddlw", "--json")).stdout)["config"]["residual"] == "delta"
    )


def damage_magic(p: Path):
    b = bytearray(p.read_bytes())
    b[0] ^= 0xFF
    p.write_bytes(bytes(b))


def truncate_header(p: Path):
    p.write_bytes(p.read_bytes()[:100])


def truncate_tensors(p: Path):
    b = p.read_bytes()
    p.write_bytes(b[: len(b) // 2])


def flip_tensor_byte(p: Path):
    b = bytearray(p.read_bytes())
    b[-9] ^= 0x40  # inside the last tensor's data
    p.write_bytes(bytes(b))


@pytest.mark.parametrize(
    "damage,verify",
    [(damage_magic, False), (truncate_header, False), (truncate_tensors, False), (flip_tensor_byte, True)],
    ids=["magic", "header", "tensors", "hash"],
)
def test_inspect_damaged_file_is_one_line(model_file, tmp_path, damage, verify, cli, user_error):
    bad = tmp_path / "bad.ddlw"
    bad.write_bytes(model_file.read_bytes())
    damage(bad)
    r = cli("inspect", bad, *(["--verify"] if verify else []))
    line = user_error(r)
    print(f"\n{damage.__name__}: {line}")


def test_inspect_missing_file(tmp_path, cli, user_error):
    user_error(cli("inspect", tmp_path / "nope.ddlw"), "nope.ddlw")


# ---------------------------------------------------------------------------------------------------------
# eval


def test_eval_wgpu_and_ref_agree(model_file, corpus, cli, ok):
    args = ["eval", model_file, "--data", corpus, "--seq-len", "16", "--batch", "4", "--json"]
    w = json.loads(ok(cli(*args, "--backend", "wgpu")).stdout)
    r = json.loads(ok(cli(*args, "--backend", "ref")).stdout)
    print(
        f"\neval loss: wgpu {w['loss']:.9f}  ref {r['loss']:.9f}  (|diff| {abs(w['loss'] - r['loss']):.2e})"
    )
    assert (w["backend"], r["backend"]) == ("wgpu", "ref")
    for k in ("tokens", "predictions", "windows", "variant"):
        assert w[k] == r[k], k
    assert w["predictions"] == w["tokens"] - w["windows"]
    assert 4.5 < w["loss"] < 6.5  # about ln 256 for a fresh model
    assert w["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert w["perplexity"] == pytest.approx(math.exp(w["loss"]), rel=1e-9)
    text = ok(
        cli("eval", model_file, "--data", corpus, "--seq-len", "16", "--batch", "4", "--backend", "ref")
    ).stdout
    assert "loss " in text and "perplexity " in text and "(ref," in text


def test_eval_user_errors(model_file, tmp_path, cli, user_error):
    user_error(cli("eval", model_file, "--data", tmp_path / "missing.txt", "--backend", "ref"), "missing.txt")
    user_error(cli("eval", tmp_path / "nope.ddlw", "--data", "x.txt"))
    (tmp_path / "c.txt").write_text("hello world, some text")
    user_error(cli("eval", model_file, "--data", tmp_path / "c.txt", "--backend", "cuda"), "unknown backend")


# ---------------------------------------------------------------------------------------------------------
# train


def test_train_user_errors(corpus, tmp_path, cli, user_error):
    out = tmp_path / "o"
    line = user_error(
        cli("train", "--data", corpus, "--out", out, "--variants", "nope"), "unknown variant 'nope'"
    )
    for v in ModelVariant:
        assert repr(v.value) in line
    user_error(
        cli("train", "--data", corpus, "--out", out, "--max-steps", "0"),
        "invalid training configuration: max_steps must be greater than zero",
    )
    assert (
        user_error(cli("train", "--data", corpus, "--out", out, "--beta1", "1.0"))
        == "error: invalid training configuration: beta1 must be in [0, 1) (--beta1)"
    )
    user_error(
        cli("train", "--data", corpus, "--out", out, "--min-learning-rate", "1", "--learning-rate", "0.1"),
        "invalid training configuration: min_learning_rate cannot exceed learning_rate",
    )
    user_error(
        cli("train", "--data", tmp_path / "missing.txt", "--out", out, "--variants", "baseline"),
        "missing.txt",
    )
    user_error(
        cli("train", "--data", corpus, "--out", out, "--seq-len", "64", "--max-seq-len", "32"),
        "exceeds the model's max_seq_len",
    )
    user_error(cli("train", "--data", corpus, "--out", out, "--preset", "huge"), "unknown preset")
    user_error(
        cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS, "--backend", "cuda"), "unknown backend"
    )
    assert not (out / "report.json").exists()


def test_train_end_to_end(corpus, tmp_path, cli, ok, user_error):
    out = tmp_path / "run"
    r = ok(cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS))
    assert "resolved configuration:" in r.stdout and "report: " in r.stdout
    comp = json.loads((out / "report.json").read_text())
    assert comp["final_train_loss_ranking"] == ["baseline"] and comp["best_final_train_variant"] == "baseline"
    assert comp["best_final_validation_variant"] == "baseline"  # --val-fraction 0.05 by default
    rep = json.loads((out / "baseline" / "report.json").read_text())
    assert rep == comp["reports"][0]
    assert rep["steps_completed"] == 6 and [h["step"] for h in rep["history"]] == list(range(1, 7))
    assert rep["training"]["max_steps"] == 6 and rep["training"]["warmup_steps"] == 2
    assert rep["final_train"]["loss"] < rep["initial_train"]["loss"]
    ck = out / "baseline" / "checkpoint.ddlw"
    assert ck.is_file()
    if HAS_MPL:
        assert (out / "loss.png").is_file() and (out / "loss.png").stat().st_size > 1000
    # the checkpoint reads like a model file
    desc = json.loads(ok(cli("inspect", ck, "--json", "--verify")).stdout)
    assert desc["metadata"]["model.variant"] == "baseline"
    ev = json.loads(
        ok(
            cli("eval", ck, "--data", corpus, "--seq-len", "16", "--batch", "2", "--backend", "ref", "--json")
        ).stdout
    )
    assert math.isfinite(ev["loss"])
    # a finished run is not continued; a new phase needs --steps
    user_error(
        cli("resume", ck, "--data", corpus),
        "invalid resume state: the run already completed its 6 steps",
        "--steps N",
    )
    r = ok(cli("resume", ck, "--data", corpus, "--steps", "2", "--min-learning-rate", "1e-4"))
    assert "baseline: 8 steps, status completed" in r.stdout
    rep2 = json.loads((out / "baseline" / "report.json").read_text())
    assert rep2["history"][:6] == rep["history"]
    assert [h["learning_rate"] for h in rep2["history"][6:]] == [1e-3, 1e-4]  # cosine from the last rate
    assert [h["step"] for h in rep2["history"]] == list(range(1, 9))
    # resume with other data: the reference trainer's check, one line
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text()[::-1])
    user_error(
        cli("resume", ck, "--data", other, "--steps", "2"), "invalid resume state: training dataset summary"
    )


def test_stop_after_and_resume_match_a_straight_run(corpus, tmp_path, cli, ok):
    """--max-steps 6 straight and --max-steps 6 --stop-after 3 + resume: identical histories, bit for bit."""
    ok(cli("train", "--data", corpus, "--out", tmp_path / "a", "--no-plots", *TRAIN_ARGS))
    r = ok(
        cli(
            "train", "--data", corpus, "--out", tmp_path / "b", "--no-plots", "--stop-after", "3", *TRAIN_ARGS
        )
    )
    assert "stopped after step 3" in r.stdout
    assert not (tmp_path / "b" / "report.json").exists()
    ck = tmp_path / "b" / "baseline" / "checkpoint.ddlw"
    ok(cli("resume", ck, "--data", corpus, "--backend", "wgpu"))
    a = json.loads((tmp_path / "a" / "baseline" / "report.json").read_text())
    b = json.loads((tmp_path / "b" / "baseline" / "report.json").read_text())
    la, lb = [h["train"]["loss"] for h in a["history"]], [h["train"]["loss"] for h in b["history"]]
    print(f"\nstraight {la}\nresumed  {lb}")
    assert la == lb
    for r_ in (a, b):
        r_.pop("throughput")
    assert a == b


def test_draft_commands_on_a_model_without_a_draft(model_file, corpus, tmp_path, cli, user_error):
    """accept / heal / compress on bad input: one line, exit 2 (a model with no MTP draft, bad layer lists)."""
    user_error(cli("accept", str(model_file), "--data", str(corpus)), "no MTP draft")
    user_error(
        cli("heal", str(model_file), "--data", str(corpus), "--out", str(tmp_path / "h.ddlw")), "no MTP draft"
    )
    assert not (tmp_path / "h.ddlw").exists()
    user_error(
        cli(
            "heal",
            str(model_file),
            "--data",
            str(corpus),
            "--out",
            str(tmp_path / "h.ddlw"),
            "--trunk-dtype",
            "bf16",
        ),
        "trunk_dtype must be one of",
        "(--trunk-dtype)",
    )
    out = str(tmp_path / "c.ddlw")
    user_error(cli("compress", str(model_file), "--out", out, "--drop-layers", "7"), "out of range")
    user_error(cli("compress", str(model_file), "--out", out), "exactly one of")
    assert not (tmp_path / "c.ddlw").exists()


def test_new_phase_after_decay_to_zero_is_refused(corpus, tmp_path, cli, ok, user_error):
    """A first phase with the reference trainer's default floor (min_learning_rate 0) ends at lr 0; the reference trainer's phase schedule
    would run the next phase at lr 0, silently training nothing: the CLI says so and exits 2."""
    out = tmp_path / "run"
    ok(cli("train", "--data", str(corpus), "--variants", "baseline", "--out", str(out), "--max-steps", "2",
           "--eval-interval", "2", "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--no-plots",
           *MODEL_ARGS))  # fmt: skip
    ck = str(out / "baseline" / "checkpoint.ddlw")
    user_error(
        cli("resume", ck, "--data", str(corpus), "--steps", "2"), "learning rate 0", "--min-learning-rate"
    )
    ok(cli("resume", ck, "--data", str(corpus), "--steps", "2", "--min-learning-rate", "1e-4"))


# ---------------------------------------------------------------------------------------------------------
# backend choice, readable output, usage errors, resume from the checkpoint alone

REF_TRAIN_ARGS = [*TRAIN_ARGS, "--backend", "ref", "--no-plots"]  # the last --backend wins


def test_auto_backend_says_what_it_chose_and_why(model_file, corpus, cli, ok):
    """--backend auto (the default) names the backend it chose and the reason, in the resolved configuration
    and in eval's JSON; the chosen backend is one of the two that run a model."""
    r = ok(cli("eval", model_file, "--data", corpus, "--seq-len", "16", "--batch", "4", "--json"))
    ev = json.loads(r.stdout)
    assert ev["backend"] in ("wgpu", "ref") and ev["backend_reason"]
    line = r.stderr.strip().splitlines()[0]
    assert line == f"backend: {ev['backend']} ({ev['backend_reason']})"


def test_train_auto_backend_in_resolved_configuration(corpus, tmp_path, cli, ok):
    args = [a for a in TRAIN_ARGS if a not in ("--backend", "wgpu")]
    r = ok(cli("train", "--data", corpus, "--out", tmp_path / "o", "--no-plots", *args))
    assert re.search(r"^  backend: (wgpu|ref) \(.+\)$", r.stdout, re.M), r.stdout


def test_progress_lines_keep_the_variant_name_off_a_terminal(corpus, tmp_path, cli, ok):
    """Without a terminal (here a pipe), train's progress is plain lines that name the variant."""
    r = ok(cli("train", "--data", corpus, "--out", tmp_path / "o", *REF_TRAIN_ARGS))
    steps = [ln for ln in r.stderr.splitlines() if " step " in ln and "loss " in ln]
    assert steps and all(ln.strip().startswith("baseline step ") for ln in steps), r.stderr
    assert any("baseline step 6/6" in ln for ln in steps)
    assert "…" not in r.stderr


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["train", "--data", "x"], "Missing option '--out'"),
        (["train", "--data", "x", "--out", "y", "--max-steps", "nan"], "--max-steps"),
        (["no-such-command"], "No such command"),
        (["heal", "m.ddlw", "--data", "x", "--out", "y", "--chain-attention", "seed"], "per-step, stacked"),
    ],
    ids=["missing-option", "nan-integer", "unknown-command", "old-chain-attention"],
)
def test_usage_errors_are_one_line(args, fragment, cli, user_error):
    user_error(cli(*args), fragment)


@pytest.fixture(scope="module")
def draft_model(tmp_path_factory, cli, ok) -> Path:
    out = tmp_path_factory.mktemp("cli_draft") / "draft.ddlw"
    ok(cli("init", "--out", out, "--mtp", *MODEL_ARGS))
    return out


HEAL_ARGS = ["--window", "32", "--tokens", "1600", "--chain", "2", "--batch", "2", "--epochs", "0.3",
             "--eval-every", "5", "--backend", "ref"]  # fmt: skip


def test_heal_prints_readable_progress_and_json_only_when_asked(draft_model, corpus, tmp_path, cli, ok):
    r = ok(cli("heal", draft_model, "--data", corpus, "--out", tmp_path / "h.ddlw", *HEAL_ARGS))
    text = r.stdout + r.stderr
    assert "{" not in text, text  # no JSON anywhere
    assert "held-out KL to the trunk before training, per chain step: " in r.stderr
    assert re.search(r"^  step 5: held-out KL \d", r.stderr, re.M), r.stderr
    assert "chain_attention=per-step" in r.stdout  # the default, in the resolved configuration
    j = ok(cli("heal", draft_model, "--data", corpus, "--out", tmp_path / "j.ddlw", *HEAL_ARGS, "--json"))
    report = json.loads(j.stdout)
    assert report["chain_attention"] == "per-step"  # the default, the reference heal tool's
    events = [json.loads(ln) for ln in j.stderr.splitlines() if ln.startswith("{")]
    assert {e["event"] for e in events} >= {"windows", "trunk", "eval", "step", "written"}
    assert all(e["job"] == "heal" for e in events)


def test_heal_says_when_patience_stops_it(draft_model, corpus, tmp_path, cli, ok):
    """The reference heal tool's line when `patience` evaluations bring no new best."""
    r = ok(cli("heal", draft_model, "--data", corpus, "--out", tmp_path / "h.ddlw", *HEAL_ARGS[:-6],
               "--batch", "2", "--epochs", "4", "--eval-every", "1", "--patience", "1", "--lr", "1",
               "--backend", "ref"))  # fmt: skip
    assert re.search(r"^  no new best in 1 evaluations: stopping at step \d+ of \d+$", r.stderr, re.M), (
        r.stderr
    )


def test_resume_with_the_checkpoint_alone(corpus, tmp_path, cli, ok):
    """`resume CHECKPOINT` from another folder: the data spec, token cap and split are the run's own, and the
    result is the straight run's, bit for bit."""
    ok(cli("train", "--data", corpus, "--out", tmp_path / "a", *REF_TRAIN_ARGS))
    ok(cli("train", "--data", corpus, "--out", tmp_path / "b", "--stop-after", "3", *REF_TRAIN_ARGS))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = ok(cli("resume", tmp_path / "b" / "baseline" / "checkpoint.ddlw", "--backend", "ref", cwd=elsewhere))
    assert "status completed" in r.stdout
    a = json.loads((tmp_path / "a" / "baseline" / "report.json").read_text())
    b = json.loads((tmp_path / "b" / "baseline" / "report.json").read_text())
    for rep in (a, b):
        rep.pop("throughput")
    assert a == b


def test_accept_table(draft_model, corpus, tmp_path, cli, ok, user_error):
    r = ok(cli("accept", draft_model, "--data", corpus, "--depth", "2", "--tokens", "2000", "--backend", "ref",
               "--json"))  # fmt: skip
    (tmp_path / "a.json").write_text(r.stdout)
    acc = json.loads(r.stdout)
    assert acc["chain_attention"] == "per-step"
    t = ok(cli("accept-table", f"before={tmp_path / 'a.json'}", f"again={tmp_path / 'a.json'}")).stdout
    lines = t.strip().splitlines()
    assert lines[0].split() == ["A_1", "A_2", "tau", "anchors"] and len(lines) == 3
    assert lines[1].split()[0] == "before" and lines[1].split()[1:] == lines[2].split()[1:]
    user_error(cli("accept-table", "no-equals-sign"), "LABEL=FILE.json")


def test_export_hf_refusal_names_the_raw_flag(model_file, tmp_path, cli, ok, user_error):
    """A model Qwen3 cannot hold (post-RoPE q/k norm, the presets' default): the error names `export-hf --raw`,
    which exports it."""
    user_error(cli("export-hf", model_file, tmp_path / "hf"), "export-hf --raw")
    r = ok(cli("export-hf", model_file, tmp_path / "raw", "--raw"))
    assert "raw: True" in r.stdout and "{" not in r.stdout
