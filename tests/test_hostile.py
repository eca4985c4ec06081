"""A hostile but realistic user of the command line (issue "nothing lost, nothing torn, no traceback"): every
refusal is one `error: ...` line, exit 2, before any work, naming the flag that helps.

- outputs: a folder that holds a run (--overwrite), two runs on one --out (the lock, stale after kill -9),
  an output that is an input, an output that is a folder or a file, a full disk;
- option ranges: integers beyond int64, absurd batch sizes and model sizes, negative intervals;
- resume of malformed training metadata: one precise error for each;
- data: `.txt` read only up to --max-tokens, FIFOs and devices refused;
- a sweep whose interrupted variant is resumed writes the sweep's ranked report;
- --no-verify (the tensor hash check skipped for trusted input) and export-hf --force.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_sizes

from ddl_wgpu.cli import checks as cli_checks
from ddl_wgpu.data import DataError, load_records
from ddl_wgpu.files.container import CheckpointError, open_checkpoint, save
from ddl_wgpu.jobs import train as T

MODEL_ARGS = cli_sizes()
TRAIN_ARGS = ["--variants", "baseline", "--max-steps", "4", "--eval-interval", "2", "--batch-size", "2",
              "--seq-len", "16", "--eval-batches", "1", "--backend", "ref", "--no-plots", *MODEL_ARGS]  # fmt: skip
BIG = str(1 << 64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, corpus_words) -> Path:
    rng = np.random.default_rng(0)
    p = tmp_path_factory.mktemp("hostile") / "corpus.txt"
    p.write_text(" ".join(corpus_words[int(i)] for i in rng.integers(0, len(corpus_words), 400)))
    return p


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus, cli, ok) -> Path:
    """A finished one-variant run: its folder."""
    out = tmp_path_factory.mktemp("hostile_run") / "run"
    ok(cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory, cli, ok) -> Path:
    p = tmp_path_factory.mktemp("hostile_model") / "m.ddlw"
    ok(cli("init", "--out", p, "--mtp", *MODEL_ARGS))
    return p


# ---------------------------------------------------------------------------------------------------------
# outputs


def test_train_into_a_folder_that_holds_a_run(run, corpus, tmp_path, cli, ok, user_error):
    before = (run / T.REPORT).read_text()
    user_error(cli("train", "--data", corpus, "--out", run, *TRAIN_ARGS), "already holds a training run",
               "--overwrite", "resume")  # fmt: skip
    assert (run / T.REPORT).read_text() == before
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / T.REPORT).write_text(before)
    ok(cli("train", "--data", corpus, "--out", copy, "--overwrite", *TRAIN_ARGS, "--seed", "7"))
    assert json.loads((copy / T.REPORT).read_text())["training"]["seed"] == 7


def test_two_runs_on_one_out_and_a_stale_lock(corpus, tmp_path, cli, ok, user_error):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text(str(os.getpid()))  # a live process holds it
    user_error(cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS), "in use by another run", "--out")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / ".lock").write_text(str(dead.pid))  # its process is gone (as after kill -9)
    ok(cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS))
    assert not (out / ".lock").exists()


def test_outputs_that_are_inputs(model, corpus, tmp_path, cli, user_error):
    before = model.read_bytes()
    user_error(cli("compress", model, "--out", model, "--drop-layers", "1"), "is the input")
    user_error(cli("heal", model, "--data", corpus, "--out", model), "is the input")
    ck = tmp_path / "ck.ddlw"
    ck.write_bytes(before)
    user_error(cli("heal", model, "--data", corpus, "--init", ck, "--out", ck), "is the input")
    assert model.read_bytes() == before and ck.read_bytes() == before


def test_outputs_that_cannot_be_written(model, corpus, tmp_path, cli, user_error):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    user_error(cli("train", "--data", corpus, "--out", a_file, *TRAIN_ARGS), "is a file", "--out")
    user_error(cli("init", "--out", tmp_path, *MODEL_ARGS), "is a folder", "--out")
    user_error(cli("init", "--out", a_file / "m.ddlw", *MODEL_ARGS), "--out")
    user_error(cli("compress", model, "--out", a_file / "c.ddlw", "--drop-layers", "1"), "--out")


def test_a_full_disk_is_one_line():
    e = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "out/checkpoint.ddlw.partial")
    assert cli_checks.is_user_error(e)
    line = cli_checks.error_line(e)
    assert line.startswith("error: out/checkpoint.ddlw.partial: no space left") and "\n" not in line


# ---------------------------------------------------------------------------------------------------------
# option ranges


def test_integers_beyond_int64_are_refused_before_any_work(model, corpus, tmp_path, cli, user_error):
    out = tmp_path / "out"
    for flag in ("--seed", "--eval-interval", "--eval-batches"):
        user_error(cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS, flag, BIG), flag.lstrip("-"))
    assert not out.exists()
    user_error(cli("init", "--out", tmp_path / "m.ddlw", "--seed", BIG), "--seed")
    for flag in ("--seed", "--refresh", "--topk", "--eval-every", "--patience"):
        user_error(cli("heal", model, "--data", corpus, "--out", tmp_path / "h.ddlw", flag, BIG), flag)
    user_error(
        cli("heal", model, "--data", corpus, "--out", tmp_path / "h.ddlw", "--epochs", "1e300"), "--epochs"
    )
    user_error(cli("heal", model, "--data", corpus, "--out", tmp_path / "h.ddlw", "--chain", str(10**20)),
               "--chain")  # fmt: skip
    assert not (tmp_path / "h.ddlw").exists()


def test_absurd_sizes_and_negative_intervals(model, corpus, tmp_path, cli, user_error):
    out = tmp_path / "out"
    user_error(cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS, "--batch-size", str(10**20)),
               "--batch-size")  # fmt: skip
    user_error(
        cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS, "--stop-after", "-1"), "--stop-after"
    )
    user_error(cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS, "--save-interval", "-1"),
               "--save-interval")  # fmt: skip
    user_error(cli("eval", model, "--data", corpus, "--batch", str(10**20)), "--batch")
    user_error(cli("accept", model, "--data", corpus, "--window", "0"), "--window")
    user_error(cli("train", "--data", corpus, "--out", out, *TRAIN_ARGS, "--d-model", str(10**9)), "memory")
    user_error(cli("init", "--out", tmp_path / "m.ddlw", "--n-layers", str(10**9)), "memory")
    user_error(
        cli("compress", model, "--out", tmp_path / "c.ddlw", "--drop-layers", "0-99999999999"), "layer"
    )
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------
# resume of malformed training metadata


def _rewrite(src: Path, dst: Path, config="keep", meta=None, drop=(), rename=None, transpose=None) -> Path:
    """A copy of checkpoint `src` with its config, metadata or tensors changed."""
    with open_checkpoint(src) as ck:
        cfg = dict(ck.config) if config == "keep" else config
        md = {**dict(ck.metadata), **(meta or {})}
        md = {k: v for k, v in md.items() if v is not DROP}
        tensors = []
        for n in ck.names():
            if n in drop:
                continue
            a = np.array(ck.tensor_f32(n))
            if n == transpose:
                a = np.ascontiguousarray(a.T)
            tensors.append(((rename or {}).get(n, n), a))
    save(dst, tensors, config=cfg, metadata=md, provenance={})
    return dst


DROP = object()
EMBED = "model.embed_tokens.weight"
Q = "model.layers.0.mlp.gate_proj.weight"  # (24, 16): transposed, the same size


def test_resume_of_malformed_metadata_is_one_precise_error(run, tmp_path):
    ck = run / "baseline" / T.CHECKPOINT
    with open_checkpoint(ck) as c:
        cfg = dict(c.config)
    cases = [
        (dict(config={**cfg, "vocab_size": 10**12}), "memory"),
        (dict(transpose=Q), "shape"),
        (dict(config=None), "no model config"),
        (dict(config={}), "no model config"),
        (dict(drop=("optim.v." + EMBED,)), "missing optimizer tensor optim.v." + EMBED),
        (dict(rename={"optim.m." + EMBED: "optim.m.model.embed_token.weight"}), "not a parameter"),
        (dict(meta={"train.report": "{not json"}), "invalid JSON"),
        (dict(meta={"train.report": 7}), "train.report is int"),
        (dict(meta={"train.report": "{}"}), "train.report field 'variant'"),
        (dict(meta={"train.report": "[" * 100000 + "]" * 100000}), "nests deeper"),
        (dict(meta={"train.position": DROP}), "train.position is missing"),
        (dict(meta={"train.position": {"phase": {}, "steps_completed": 4}}), "has no phase"),
    ]
    for i, (change, fragment) in enumerate(cases):
        bad = _rewrite(ck, tmp_path / f"bad{i}.ddlw", **change)
        with pytest.raises((T.TrainingError, CheckpointError)) as e:
            T.load_checkpoint(bad)
        msg = str(e.value)
        assert fragment in msg and "\n" not in msg, (change, msg)


def test_resume_cli_malformed_is_one_line(run, tmp_path, cli, user_error):
    bad = _rewrite(run / "baseline" / T.CHECKPOINT, tmp_path / "bad.ddlw", meta={"train.report": "[]"})
    user_error(cli("resume", bad), "train.report is a JSON list")


def test_resume_reads_no_extra_tensor(run, tmp_path, monkeypatch):
    ck = run / "baseline" / T.CHECKPOINT
    with open_checkpoint(ck) as c:
        tensors = [(n, np.array(c.tensor_f32(n))) for n in c.names()] + [("junk", np.zeros(1000, np.float32))]
        cfg, md = dict(c.config), dict(c.metadata)
    extra = tmp_path / "extra.ddlw"
    save(extra, tensors, config=cfg, metadata=md)
    from ddl_wgpu.files import container_read

    read = []
    real = container_read.Checkpoint.tensor_f32
    monkeypatch.setattr(
        container_read.Checkpoint, "tensor_f32", lambda self, n: read.append(n) or real(self, n)
    )
    T.load_checkpoint(extra)
    assert read and "junk" not in read


# ---------------------------------------------------------------------------------------------------------
# data


def test_txt_is_read_only_up_to_the_token_budget(tmp_path, monkeypatch):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(1 << 40)  # 1 TiB, sparse: reading it whole would never end
    recs = load_records(big, max_tokens=100)
    assert sum(r.size for r in recs) == 100


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_fifo_and_device_data_are_refused(tmp_path, corpus, cli, user_error):
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="FIFO"):
        load_records(fifo)
    zero = tmp_path / "zero.txt"
    zero.symlink_to("/dev/zero")
    with pytest.raises(DataError, match="device"):
        load_records(zero)
    jl = tmp_path / "zero.jsonl"
    jl.symlink_to("/dev/zero")
    with pytest.raises(DataError, match="device"):
        load_records(jl)
    user_error(cli("train", "--data", fifo, "--out", tmp_path / "o", *TRAIN_ARGS, timeout=60), "FIFO")


# ---------------------------------------------------------------------------------------------------------
# a resumed sweep writes its ranked report


def test_resume_of_a_stopped_sweep_finishes_it_and_writes_its_report(corpus, tmp_path, cli, ok):
    out = tmp_path / "sweep"
    args = [a if a != "baseline" else "baseline,ddl" for a in TRAIN_ARGS]
    r = ok(cli("train", "--data", corpus, "--out", out, "--stop-after", "2", *args))
    assert "stopped after step 2" in r.stdout and not (out / T.REPORT).exists()
    r = ok(cli("resume", out / "baseline" / T.CHECKPOINT))
    assert f"sweep report: {out / T.REPORT}" in r.stdout
    comp = json.loads((out / T.REPORT).read_text())
    assert [x["variant"] for x in comp["reports"]] == ["baseline", "ddl"]
    straight = tmp_path / "straight"
    ok(cli("train", "--data", corpus, "--out", straight, *args))
    want = json.loads((straight / T.REPORT).read_text())
    assert comp["final_validation_loss_ranking"] == want["final_validation_loss_ranking"]
    for a, b in zip(comp["reports"], want["reports"], strict=True):
        assert a["history"] == b["history"]


# ---------------------------------------------------------------------------------------------------------
# --no-verify and export-hf --force


def test_no_verify_skips_the_hash_check(model, corpus, tmp_path, cli, ok, user_error):
    data = bytearray(model.read_bytes())
    data[-9] ^= 0x01  # inside the last tensor's data: 1.0 becomes 0.25 (0x40 made it inf, which is refused)
    flipped = tmp_path / "flipped.ddlw"
    flipped.write_bytes(bytes(data))
    args = ["--data", corpus, "--seq-len", "16", "--batch", "2", "--backend", "ref"]
    user_error(cli("eval", flipped, *args), "hash")
    ok(cli("eval", flipped, *args, "--no-verify"))
    user_error(cli("compress", flipped, "--out", tmp_path / "c.ddlw", "--drop-layers", "1"), "hash")
    ok(cli("compress", flipped, "--out", tmp_path / "c.ddlw", "--drop-layers", "1", "--no-verify"))


def test_export_hf_force(model, tmp_path, cli, ok, user_error):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    user_error(cli("export-hf", model, folder, "--raw"), "--force")
    ok(cli("export-hf", model, folder, "--force", "--raw"))
    assert (folder / "config.json").exists()
