"""Behaviours that follow the reference trainer and the reference heal tool (docs/reference-tools.md)."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import cli_sizes, tiny_cfg

from ddl_ref.config import ModelVariant
from ddl_ref.params import init_params
from ddl_wgpu.backend import make_net
from ddl_wgpu.data import ByteTokenizer, load_datasets
from ddl_wgpu.engine.refnet import RefWork
from ddl_wgpu.files.container import open_checkpoint, save
from ddl_wgpu.files.hf.convert import export_raw, import_hf
from ddl_wgpu.files.modelfile import Model, load_model
from ddl_wgpu.jobs import accept, compress, heal, heal_files
from ddl_wgpu.jobs import train as T


def test_on_policy_acceptance_is_measured_on_one_anchor_set():
    # depth 2, anchors p = 0, 1, 2. The data follows the trunk's greedy path for both steps at p = 0 only
    # (p = 1: ids[3] = 9 != greedy[2] = 3; p = 2: ids[3] != greedy[2]). The draft is right at p = 0 for both
    # steps and wrong at p = 1. Per-depth anchor sets ({0, 1} at depth 1, {0} at depth 2) would report
    # A = [0.5, 1.0], rising with depth, and a conditional of 2.0.
    ids = np.array([0, 1, 2, 9, 9])
    greedy = np.array([1, 2, 3, 4, 5])
    preds = np.array([[2, 0, 0, 0, 0], [3, 0, 0, 0, 0]])
    t = accept.Tally(2)
    t.add(preds, greedy, ids, 5)
    op = t.result()["on_policy"]
    assert op["anchors"] == 1
    assert op["prefix_acceptance"] == pytest.approx([1.0, 1.0])
    assert op["conditional_acceptance"] == pytest.approx([1.0, 1.0])


def test_on_policy_prefix_never_rises_on_random_data():
    rng = np.random.default_rng(0)
    t = accept.Tally(4)
    for _ in range(50):
        greedy = rng.integers(0, 3, 40)
        ids = np.where(rng.random(40) < 0.8, np.roll(greedy, 1), rng.integers(0, 3, 40))
        preds = np.stack([np.where(rng.random(40) < 0.7, np.roll(greedy, -j), 0) for j in range(1, 5)])
        t.add(preds, greedy, ids, 40)
    op = t.result()["on_policy"]
    assert op["anchors"] > 0
    A = op["prefix_acceptance"]
    assert all(b <= a for a, b in zip(A, A[1:], strict=False))
    assert all(0.0 <= c <= 1.0 for c in op["conditional_acceptance"])


# ----------------------------------------------------------------------------------------------------------
# heal: job order, windows, trunk pass, provenance


def test_xorshift_job_shuffle_pins_the_reference_sequence():
    rng = heal.XorShift64()
    # x ^= x << 13; x ^= x >> 7; x ^= x << 17 (mod 2^64) from 0x9e3779b97f4a7c15
    assert rng.next() == 0xDC1B77AE0BF34DAD
    assert rng.next() == 0x64F0EEB9026E6076
    # Fisher-Yates over [0..4] from i = 4 down: r1 % 5 = 4 (no swap), r2 % 4 = 2 (0x...76: low bits 0110),
    # then r3 % 3 = 0 and r4 % 2 = 0 -> [1, 3, 0, 2, 4]
    order = list(range(5))
    heal.XorShift64().shuffle(order)
    assert order == [1, 3, 0, 2, 4]


def test_job_order_reshuffles_the_same_array_each_pass():
    job = heal._HealJob.__new__(heal._HealJob)
    job.jobs = list("abcde")
    gen = job._job_order(heal.XorShift64(0))
    got = [next(gen) for _ in range(15)]
    # pass 2 shuffles pass 1's order [1, 3, 0, 2, 4], not the identity; pass 3 shuffles pass 2's
    assert "".join(got) == "bdace" + "abedc" + "adbce"


def test_heal_windows_keep_short_last_windows_and_cut_at_the_budget():
    r = np.arange(68, dtype=np.uint32)  # chunks of 24: 24, 24, 20 (>= 16 + 2: kept)
    assert [w.size for w in heal.heal_windows([r], 24, 2, 10_000)] == [24, 24, 20]
    assert [w.size for w in heal.heal_windows([r[:50]], 24, 2, 10_000)] == [
        24,
        24,
    ]  # a 2-token chunk: skipped
    # the window that reaches the budget is cut to fit, however short, and is the last
    assert [w.size for w in heal.heal_windows([r, r], 24, 2, 30)] == [24, 6]


def test_heal_reads_records_until_the_token_budget_is_met(tmp_path):
    import json

    short = [json.dumps({"text": "x" * 10}) for _ in range(100)]  # 1000 tokens, every record too short
    long = [json.dumps({"text": "y" * 30}) for _ in range(40)]  # a 24-token window each (the rest skipped)
    spec = tmp_path / "d.jsonl"
    spec.write_text("\n".join(short + long) + "\n")
    model = SimpleNamespace(tokenizer=None, cfg=SimpleNamespace(vocab_size=256))
    wins = heal._windows(model, str(spec), heal.HealConfig(window=24, chain=2, tokens=480, batch=1))
    assert len(wins) == 20 and sum(w.size for w in wins) == 480


def test_trunk_pass_keeps_f32_heldout_rows_and_pads_with_the_first_eos(heal_kit):
    cfg = heal_kit.tiny_cfg()
    assert heal.pad_id(SimpleNamespace(metadata={"hf.eos_token_id": 7})) == 7
    assert heal.pad_id(SimpleNamespace(metadata={"hf.eos_token_id": [9, 3]})) == 9
    assert heal.pad_id(SimpleNamespace(metadata={})) == 0

    class Teacher:  # the step-1 rows are built by the teacher (from its float32 hidden rows)
        def topk_rows(self, ids, lengths, k):
            B, T = ids.shape
            x = np.full((B, T, cfg.d_model), 1 / 3, np.float32)  # not an f16 value
            return np.zeros((B, T, k), np.int32), np.ones((B, T, k), np.float32), x

    wins = [np.arange(5, dtype=np.uint32), np.arange(3, dtype=np.uint32)]
    cache = heal._trunk_pass(Teacher(), wins, cfg, 2, 2, lambda *a, **k: None, pad=7, keep=[1])
    # the held-out windows' step-1 rows stay float32 for the acceptance; the training rows are float16
    assert cache.heldout_x.dtype == np.float32 and cache.heldout_x[0, 0, 0] == np.float32(1 / 3)
    assert cache.heldout_x.shape == (1, 5, cfg.d_model) and cache.x[1].dtype == np.float16
    assert cache.ids[1].tolist() == [0, 1, 2, 7, 7]


def test_heal_writes_the_reference_provenance_key_and_reads_the_old_one(tmp_path, heal_kit):
    model = heal_kit.make_model(tmp_path / "m.ddlw")
    text = heal_kit.make_text(tmp_path / "t.txt", 300)
    heal.heal(model, str(text), tmp_path / "h.ddlw", heal_kit.SMALL)
    prov = load_model(tmp_path / "h.ddlw").provenance
    assert "mtp_heal" in prov and "heal_mtp" not in prov
    assert heal_files.heal_record(prov) is prov["mtp_heal"]
    assert heal_files.heal_record({"heal_mtp": {"steps": 3}}) == {"steps": 3}


def heal_cli_args(heal_kit, tmp_path) -> list:
    run = heal_kit.SMALL
    model = heal_kit.make_model(tmp_path / "m.ddlw")
    return [model, "--data", heal_kit.make_text(tmp_path / "t.txt"), "--chain", run.chain, "--window", run.window,
            "--tokens", run.tokens, "--batch", run.batch, "--eval-every", run.eval_every, "--epochs", run.epochs,
            "--lr", run.lr, "--backend", "ref", "--json"]  # fmt: skip


def test_heal_refresh_0_never_refreshes(tmp_path, heal_kit, cli, ok):
    """`--refresh 0` is the reference heal tool's (and `HealConfig`'s) "never refresh": chain step 2's rows are
    built once, from the starting draft, and never again."""
    args = heal_cli_args(heal_kit, tmp_path)
    runs = {}
    for refresh in (0, 3):
        r = ok(cli("heal", *args, "--refresh", refresh, "--out", tmp_path / f"h{refresh}.ddlw"))
        events = [json.loads(ln) for ln in r.stderr.splitlines() if ln.startswith("{")]
        runs[refresh] = json.loads(r.stdout), [e["step"] for e in events if e["event"] == "refresh"]
    (report, refreshed), (_, every3) = runs[0], runs[3]
    assert report["config"]["refresh"] == 0 and report["steps"] > 6
    assert refreshed == [0] and every3[:3] == [0, 3, 6]


def test_heal_init_reads_only_the_draft_block(tmp_path, heal_kit):
    """The reference heal tool reads only the draft's block from `--init`: a file holding just the block and
    the final norm (no input projection, no trunk, no config) heals exactly as the whole source model does,
    and the input projection (eh_proj, enorm, hnorm) stays the healed model's own."""
    model = heal_kit.make_model(tmp_path / "m.ddlw")
    data = str(heal_kit.make_text(tmp_path / "t.txt"))
    source = heal_kit.make_model(tmp_path / "src.ddlw", seed=5)  # another draft (and trunk)
    block = tmp_path / "block.ddlw"
    with open_checkpoint(source) as ck:
        kept = [n for n in ck.names() if n.startswith("model.mtp.layers.0.") or n == "model.mtp.norm.weight"]
        save(block, [(n, ck.tensor(n)) for n in kept])
    a = heal.heal(model, data, tmp_path / "a.ddlw", heal_kit.SMALL, init_path=source)
    b = heal.heal(model, data, tmp_path / "b.ddlw", heal_kit.SMALL, init_path=block)
    assert a["history"] == b["history"] and a["acceptance_after"] == b["acceptance_after"]
    pa, pb, pm = (load_model(p).params for p in (tmp_path / "a.ddlw", tmp_path / "b.ddlw", model))
    assert all(np.array_equal(pa[n], pb[n]) for n in pa)
    for n in ("model.mtp.eh_proj.weight", "model.mtp.enorm.weight", "model.mtp.hnorm.weight"):
        assert np.array_equal(pb[n], pm[n]), n
    with open_checkpoint(source) as ck:  # without the block there is nothing to start from
        save(tmp_path / "proj.ddlw", [(n, ck.tensor(n)) for n in ck.names() if n not in kept])
    with pytest.raises(heal.HealError, match="no MTP draft .missing tensor model.mtp.layers.0.self_attn"):
        heal.heal(model, data, tmp_path / "c.ddlw", heal_kit.SMALL, init_path=tmp_path / "proj.ddlw")


# ----------------------------------------------------------------------------------------------------------
# train: evaluation, failed variants, phases, checkpoint errors

REF = T.RunOptions(backend="ref")


@pytest.fixture(scope="module")
def tdata(tmp_path_factory):
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog"]
    p = tmp_path_factory.mktemp("data") / "c.txt"
    p.write_text(" ".join(words[int(i)] for i in rng.integers(0, len(words), 500)))
    return load_datasets(str(p), tokenizer=ByteTokenizer(), seq_len=16, batch_size=2, val_fraction=0.2,
                         vocab_size=256, seed=0)  # fmt: skip


def tcfg(**kw):
    base = dict(
        max_steps=4, eval_interval=2, learning_rate=1e-2, min_learning_rate=1e-3, batch_size=2, seq_len=16
    )
    return T.TrainingConfig(**{**base, **kw})


def test_evaluation_covers_the_whole_split_by_default(tdata, tmp_path):
    trn, val = tdata
    assert T.TrainingConfig().eval_batches == 0 and trn.num_batches > 16
    rep = T.train_variant(tiny_cfg(n_layers=1), ModelVariant("baseline"), trn, val, tcfg(max_steps=1), None,
                          REF)  # fmt: skip
    net = make_net(ModelVariant("baseline").resolve_config(tiny_cfg(n_layers=1)), None, "ref", None, 0)
    assert rep["initial_train"] == T.evaluate(net, trn, 0)["metrics"]
    assert rep["initial_train"] != T.evaluate(net, trn, 16)["metrics"]


def test_a_non_finite_variant_fails_and_the_sweep_goes_on(tdata, tmp_path, monkeypatch):
    trn, val = tdata
    real_step, calls = RefWork.step, []

    def step(self, *a, **k):  # the ddl variant's second step is non-finite
        res = real_step(self, *a, **k)
        if self.net.cfg.residual == "delta":
            calls.append(1)
            return dataclasses.replace(res, finite=False) if len(calls) == 2 else res
        return res

    monkeypatch.setattr(RefWork, "step", step)
    vs = [ModelVariant.parse("ddl"), ModelVariant("baseline")]
    comp = T.train_variants(tiny_cfg(n_layers=1), vs, trn, val, tcfg(), tmp_path, REF)
    ddl, base = comp["reports"]
    assert (
        ddl["status"] == "failed" and ddl["failure"]["step"] == 2 and "non-finite" in ddl["failure"]["reason"]
    )
    assert base["status"] == "completed" and base["steps_completed"] == 4
    assert comp["final_train_loss_ranking"] == ["baseline", "ddl"]
    assert comp["final_validation_loss_ranking"] == ["baseline", "ddl"]
    assert json.loads((tmp_path / "report.json").read_text())["final_train_loss_ranking"] == [
        "baseline",
        "ddl",
    ]
    assert json.loads((tmp_path / "ddl" / "report.json").read_text())["status"] == "failed"
    assert T.load_checkpoint(tmp_path / "ddl" / "checkpoint.ddlw")["report"]["steps_completed"] == 1


def test_a_new_phase_after_a_warm_up_run_takes_every_training_option(tdata, tmp_path):
    trn, val = tdata
    cfg = tiny_cfg(n_layers=1)
    T.train_variant(cfg, ModelVariant("baseline"), trn, val, tcfg(warmup_steps=3), tmp_path / "a", REF)
    over = {"beta1": 0.8, "beta2": 0.99, "epsilon": 1e-6, "eval_batches": 2, "weight_decay": 0.0}
    rep = T.resume(
        tmp_path / "a" / T.CHECKPOINT, trn, val, REF, out_dir=tmp_path / "b", steps=2, overrides=over
    )
    assert rep["status"] == "completed" and rep["steps_completed"] == 6
    phase = T.load_checkpoint(tmp_path / "b" / T.CHECKPOINT)["position"]["phase"]
    assert phase["training"] == {**tcfg().to_dict(), **over, "max_steps": 2, "warmup_steps": 0}
    with pytest.raises(T.TrainingError, match="seq_len cannot change in a new phase"):
        T.resume(tmp_path / "b" / T.CHECKPOINT, trn, val, REF, out_dir=tmp_path / "c", steps=2,
                 overrides={"seq_len": 8})  # fmt: skip


class Steps:
    """The batch index of every training step taken on the numpy backend (a run's data order), read off the
    ids each step trains on."""

    def __init__(self, monkeypatch, dataset):
        self.seen, step = [], RefWork.step
        ids = [dataset.batch(i).ids for i in range(dataset.num_batches)]
        assert len({x.tobytes() for x in ids}) == len(ids)  # every batch recognisable

        def record(work, batch_ids, *args, **kw):
            self.seen.append(next(i for i, x in enumerate(ids) if np.array_equal(x, batch_ids)))
            return step(work, batch_ids, *args, **kw)

        monkeypatch.setattr(RefWork, "step", record)


def test_a_new_phase_continues_the_data_order_or_restarts_it(tdata, tmp_path, monkeypatch):
    """`resume --steps N` continues the data order (batch of step s: s mod batches); `--restart-data` starts the
    new phase at batch 0, as the reference trainer's phases do, and an interrupted restarted phase resumes in
    its own order."""
    trn, val = tdata
    cfg = tiny_cfg(n_layers=1)
    T.train_variant(cfg, ModelVariant("baseline"), trn, val, tcfg(), tmp_path / "a", REF)
    ck = tmp_path / "a" / T.CHECKPOINT
    order = {}
    for restart in (False, True):
        steps = Steps(monkeypatch, trn)
        T.resume(ck, trn, val, REF, tmp_path / f"r{restart}", steps=3, restart_data=restart)
        order[restart] = list(steps.seen)  # (a later Steps wraps this one, which keeps counting)
    n = trn.num_batches
    assert order[False] == [4 % n, 5 % n, 6 % n] and order[True] == [0, 1, 2]
    stopped = tmp_path / "s"
    T.resume(ck, trn, val, T.RunOptions(backend="ref", stop_after=1), stopped, steps=3, restart_data=True)
    assert T.load_checkpoint(stopped / T.CHECKPOINT)["position"]["phase"]["data_start"] == 4
    steps = Steps(monkeypatch, trn)
    rep = T.resume(stopped / T.CHECKPOINT, trn, val, REF)
    assert steps.seen == [1, 2] and rep["steps_completed"] == 7
    assert rep["history"] == T.load_checkpoint(tmp_path / "rTrue" / T.CHECKPOINT)["report"]["history"]
    with pytest.raises(T.TrainingError, match="the data order can only restart in a new phase"):
        T.resume(stopped / T.CHECKPOINT, trn, val, REF, restart_data=True)


def test_restart_data_on_the_command_line(tdata, tmp_path, cli, ok, user_error):
    trn, val = tdata
    T.train_variant(tiny_cfg(n_layers=1), ModelVariant("baseline"), trn, val, tcfg(), tmp_path / "a", REF)
    ck = tmp_path / "a" / T.CHECKPOINT
    user_error(cli("resume", ck, "--restart-data"), "--restart-data", "pass --steps N")
    r = ok(cli("resume", ck, "--steps", 2, "--restart-data", "--data", trn.source, "--val-fraction", 0.2,
               "--backend", "ref", "--out", tmp_path / "b"))  # fmt: skip
    assert "new phase: 2 steps, data order from its first batch (--restart-data)" in r.stdout
    assert T.load_checkpoint(tmp_path / "b" / T.CHECKPOINT)["position"]["phase"]["data_start"] == 4


def test_a_damaged_checkpoint_is_refused_by_the_container_first(tdata, tmp_path, cli, user_error):
    """What a user sees (docs/reference-tools.md): a checkpoint missing an optimizer moment, or holding a
    best-validation model of the other kind, fails the container's checks before the reference trainer's
    optimizer-state and best-model checks (`train.check_resume`) could run."""
    trn, val = tdata
    T.train_variant(tiny_cfg(n_layers=1), ModelVariant("baseline"), trn, val, tcfg(), tmp_path / "a", REF)
    src = tmp_path / "a" / T.CHECKPOINT
    ddl = init_params(ModelVariant.parse("ddl").resolve_config(tiny_cfg(n_layers=1)), 0)

    def damaged(name: str, keep, extra=()) -> str:
        with open_checkpoint(src) as ck:
            tensors = [(n, ck.tensor(n), ck.info(n).dtype) for n in ck.names() if keep(n)]
            save(tmp_path / name, [*tensors, *extra], config=ck.config, metadata=ck.metadata,
                 provenance=ck.provenance)  # fmt: skip
        return str(tmp_path / name)

    path = damaged("moment.ddlw", lambda n: n != "optim.v.model.norm.weight")
    user_error(cli("resume", path), f"error: {path}: missing optimizer tensor optim.v.model.norm.weight")
    best = [("best." + n, a) for n, a in ddl.items()]
    path = damaged("best.ddlw", lambda n: not n.startswith("best."), best)
    line = user_error(cli("resume", path))
    assert re.fullmatch(rf"error: {re.escape(path)}: tensor best\.model\.layers\.0\.ddl_attn\.\S+ is not a "
                        r"parameter of the model's config", line), line  # fmt: skip


def test_import_hf_takes_the_variant_from_the_config(tmp_path):
    """A raw export of a DDL model imports as that variant (it was labelled `baseline`), so `eval --json`,
    `inspect` and a later `export-hf` name it rightly."""
    for slug in ("ddl-cc", "ddl", "baseline"):
        cfg = ModelVariant.parse(slug).resolve_config(tiny_cfg(n_layers=1))
        export_raw(Model(cfg, init_params(cfg, 0), variant=slug), tmp_path / slug)
        assert import_hf(tmp_path / slug).variant == slug
        assert ModelVariant.of_config(cfg).slug == slug


def test_resume_checks_optimizer_state_and_the_best_model_kind(tdata, tmp_path):
    trn, val = tdata
    cfg = tiny_cfg(n_layers=1)
    T.train_variant(cfg, ModelVariant("baseline"), trn, val, tcfg(), tmp_path / "a", REF)
    ck = T.load_checkpoint(tmp_path / "a" / T.CHECKPOINT)
    T.check_resume(ck, trn, val)
    bad = copy.deepcopy(ck)
    del bad["v"]["model.norm.weight"]
    with pytest.raises(T.TrainingError, match=r"^optimizer state serialization failed: tensor "
                                              r"optim\.v\.model\.norm\.weight is missing"):  # fmt: skip
        T.check_resume(bad, trn, val)
    bad = copy.deepcopy(ck)
    bad["best"] = init_params(ModelVariant.parse("ddl").resolve_config(cfg), 0)
    with pytest.raises(T.TrainingError, match=r"^invalid resume state: best-validation checkpoint kind does "
                                              r"not match the baseline artifact$"):  # fmt: skip
        T.check_resume(bad, trn, val)
    bad = copy.deepcopy(ck)
    bad["cfg"] = ModelVariant.parse("ddl").resolve_config(cfg)
    bad["report"]["variant"] = "ddl"
    with pytest.raises(T.TrainingError, match=r"^invalid resume state: best-validation checkpoint kind does "
                                              r"not match the DDL artifact$"):  # fmt: skip
        T.check_resume(bad, trn, val)


# ----------------------------------------------------------------------------------------------------------
# the draft's FFN width: compress leaves it, heal takes it from the init model


def test_compress_ffn_keep_leaves_the_draft_and_heal_init_source_works(tmp_path, heal_kit):
    src = heal_kit.make_model(tmp_path / "m.ddlw")
    compress.compress_file(src, tmp_path / "c.ddlw", keep=0.5)
    c, m = load_model(tmp_path / "c.ddlw"), load_model(src)
    assert c.cfg.ffn_hidden == 12 and c.cfg.mtp.ffn_hidden == 24
    for n in m.params:
        if n.startswith("model.mtp."):
            np.testing.assert_array_equal(c.params[n], m.params[n])
    text = heal_kit.make_text(tmp_path / "t.txt", 300)
    heal.heal(tmp_path / "c.ddlw", str(text), tmp_path / "h.ddlw", heal_kit.SMALL, init_path=src)
    h = load_model(tmp_path / "h.ddlw")
    assert h.cfg.ffn_hidden == 12 and h.cfg.mtp.ffn_hidden == 24
    assert h.params["model.mtp.layers.0.mlp.gate_proj.weight"].shape == (24, h.cfg.d_model)


def test_heal_takes_the_draft_width_from_the_init_model(tmp_path, heal_kit):
    # a model whose draft was narrowed with its trunk (12 channels), healed from a source whose draft has 24
    narrow = heal_kit.make_model(tmp_path / "n.ddlw", heal_kit.tiny_cfg(ffn_hidden=12))
    src = heal_kit.make_model(tmp_path / "s.ddlw", heal_kit.tiny_cfg(ffn_hidden=24))
    text = heal_kit.make_text(tmp_path / "t.txt", 300)
    heal.heal(narrow, str(text), tmp_path / "h.ddlw", heal_kit.SMALL, init_path=src)
    h = load_model(tmp_path / "h.ddlw")
    assert h.cfg.ffn_hidden == 12 and h.cfg.mtp.ffn_hidden == 24
    assert h.params["model.mtp.layers.0.mlp.down_proj.weight"].shape == (h.cfg.d_model, 24)
    np.testing.assert_array_equal(h.params["model.layers.0.mlp.gate_proj.weight"],
                                  load_model(narrow).params["model.layers.0.mlp.gate_proj.weight"])  # fmt: skip


def test_train_cli_writes_every_report_and_exits_non_zero_when_a_variant_fails(tmp_path, cli):
    text = tmp_path / "c.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 40))
    # a learning rate of 1e30 makes the weights overflow after the first step: the second is non-finite
    r = cli("train", "--data", text, "--out", tmp_path / "o", "--variants", "baseline", "--max-steps", "3",
            "--eval-interval", "1", "--batch-size", "2", "--seq-len", "16", "--learning-rate", "1e30",
            "--backend", "ref", "--no-plots", "--preset", "tiny", *cli_sizes(n_layers=1))  # fmt: skip
    assert r.returncode == 2, r.stderr  # a user error: the run itself went wrong, not the tool
    assert "error: 1 of 1 variants failed: baseline" in r.stderr
    assert re.search(r"^1    baseline      failed at step 2: non-finite", r.stdout, re.M), r.stdout
    comp = json.loads((tmp_path / "o" / "report.json").read_text())
    assert comp["final_train_loss_ranking"] == ["baseline"] and comp["reports"][0]["status"] == "failed"
