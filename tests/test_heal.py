"""Tests of `heal` (MTP draft self-distillation), `accept` and `compress` on the numpy reference backend.

A tiny byte-level model with an MTP head and a few hundred words of text made in tmp_path. Training dynamics
are scripted where the test needs known answers (a `RefDraft` subclass whose held-out loss follows a table, or
whose step returns NaN), so the checks are exact: held-out split, the window-count error, the non-finite skip
and abort, patience, best restore, byte-for-byte carry-over, provenance, atomic output, acceptance maths.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from ddl_ref import mtp as ref_mtp
from ddl_ref.config import MtpConfig
from ddl_ref.params import init_params
from ddl_wgpu import backend
from ddl_wgpu.engine import refnet
from ddl_wgpu.files import container
from ddl_wgpu.files.container import open_checkpoint
from ddl_wgpu.files.modelfile import Model, load_model, save_model
from ddl_wgpu.jobs import accept, compress, heal


@pytest.fixture
def make_model(heal_kit):
    """make_model(path, cfg=None, seed=0, dtype="f32"): a model at its init weights (of heal_kit's config
    unless given), saved to `path`."""

    def make(path, cfg=None, seed=0, dtype="f32"):
        cfg = cfg or heal_kit.tiny_cfg()
        model = Model(cfg, init_params(cfg, seed), provenance={"train": {"seed": seed}})
        save_model(path, model, dtype=dtype)
        return path

    return make


@pytest.fixture
def make_text(heal_kit):
    """make_text(path, words=300, seed=0)."""
    return lambda path, words=300, seed=0: heal_kit.make_text(path, words, seed)


# chain 2, windows of 24 bytes: a 300-word text (~1.8 kB) gives ~75 windows
SMALL = heal.HealConfig(
    chain=2, window=24, tokens=5000, batch=2, eval_every=4, patience=0, lr=3e-3, epochs=1.0
)


@pytest.fixture
def files(tmp_path, make_model, make_text):
    return make_model(tmp_path / "m.ddlw"), make_text(tmp_path / "t.txt")


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if "partial" in p.name)


# ----------------------------------------------------------------------------------------------------------
# heal: output, carry-over, provenance


def test_heal_changes_only_trained_draft_tensors(files, tmp_path):
    model, data = files
    out = tmp_path / "o.ddlw"
    r = heal.heal(model, str(data), out, SMALL)
    assert r["heldout_kl_best"] < r["heldout_kl_start"]  # it learns
    trained = set(ref_mtp.trained_names(load_model(model).params))
    assert all(n.startswith("model.mtp.") for n in trained)
    with open_checkpoint(model) as a, open_checkpoint(out) as b:
        assert a.names() == b.names()
        assert b.config == a.config and b.metadata == a.metadata
        changed = set()
        for n in a.names():
            ia, ib = a.info(n), b.info(n)
            assert ia.dtype == ib.dtype and ia.shape == ib.shape
            if a.tensor(n).tobytes() != b.tensor(n).tobytes():
                changed.add(n)
        assert changed and changed <= trained  # the input projection and the trunk are byte for byte
        assert "model.mtp.eh_proj.weight" not in changed
        prov = b.provenance
    assert prov["train"] == {"seed": 0}  # earlier provenance kept
    h = prov["mtp_heal"]
    for key in ("data", "tokens", "windows", "steps", "best_step", "lr", "topk", "heldout_kl_start",
                "heldout_kl_best", "init", "acceptance_before", "acceptance_after"):  # fmt: skip
        assert key in h, key
    assert h["init"] is None and h["topk"] == 32 and h["lr"] == SMALL.lr
    assert h["steps"] == r["steps"] and set(h["acceptance_after"]) >= set(accept.KEYS)
    assert h["heldout_windows"] == h["windows"] // 10
    assert leftovers(tmp_path) == []


def test_heal_keeps_f16_storage(tmp_path, make_model, make_text):
    model = make_model(tmp_path / "m.ddlw", dtype="f16")
    out = tmp_path / "o.ddlw"
    heal.heal(model, str(make_text(tmp_path / "t.txt")), out, SMALL)
    with open_checkpoint(out) as ck:
        assert {ck.info(n).dtype for n in ck.names()} == {"f16"}


def test_heal_ddl_trunk_other_conventions_deterministic(tmp_path, heal_kit, make_model, make_text):
    conv = MtpConfig(concat="hidden_first", trunk_hidden="post_norm", chain_hidden="post_norm")
    cfg = heal_kit.tiny_cfg(residual="delta", ddl_dv=4, ddl_compressor="cc", ddl_expand_embed=True, mtp=conv)
    model = make_model(tmp_path / "m.ddlw", cfg=cfg)
    data = str(make_text(tmp_path / "t.txt"))
    run = dataclasses.replace(SMALL, chain=3, refresh=5)
    r1 = heal.heal(model, data, tmp_path / "a.ddlw", run)
    r2 = heal.heal(model, data, tmp_path / "b.ddlw", run)
    assert r2["history"] == r1["history"]
    assert r1["heldout_kl_best"] < r1["heldout_kl_start"] and r1["conventions"] == conv.to_dict()
    assert len(r1["heldout_kl_per_step_best"]) == 3 and r1["acceptance_after"]["depth"] == 3
    a, b = trained_of(tmp_path / "a.ddlw"), trained_of(tmp_path / "b.ddlw")
    assert all(np.array_equal(a[n], b[n]) for n in a)  # seeded: same run, same bits


def test_split_heldout_every_tenth():
    train, val = heal.split_heldout(25)
    assert val == [9, 19]
    assert sorted(train + val) == list(range(25))


def test_window_count_error_names_counts(tmp_path, make_model):
    model = make_model(tmp_path / "m.ddlw")
    data = tmp_path / "short.txt"
    data.write_text("x" * (24 * 7))  # 7 windows of 24 bytes
    with pytest.raises(
        heal.HealError,
        match=r"^heal: 7 windows in .*short\.txt, need 20 \(every tenth is held out; a window holds 16 \+ chain "
        r"= 18 to 24 tokens of one record\)$",
    ):
        heal.heal(model, str(data), tmp_path / "o.ddlw", SMALL)
    # windows shorter than 16 + chain are skipped: 17-byte records give none
    data.write_text("y" * 17)
    with pytest.raises(heal.HealError, match="0 windows"):
        heal.heal(model, str(data), tmp_path / "o.ddlw", SMALL)
    assert not (tmp_path / "o.ddlw").exists() and leftovers(tmp_path) == []


def test_model_without_draft_names_missing_tensor(tmp_path, heal_kit, make_model, make_text):
    model = make_model(tmp_path / "m.ddlw", cfg=heal_kit.tiny_cfg(mtp=None))
    with pytest.raises(
        heal.HealError, match=r"carries no MTP draft \(missing tensor model\.mtp\.eh_proj\.weight\)"
    ):
        heal.heal(model, str(make_text(tmp_path / "t.txt")), tmp_path / "o.ddlw", SMALL)


def test_heal_config_validation():
    with pytest.raises(heal.HealError, match="batch must be a positive integer"):
        heal.HealConfig(batch=0)
    with pytest.raises(heal.HealError, match="epochs must be a positive number"):
        heal.HealConfig(epochs=float("nan"))
    d = heal.HealConfig()
    assert (d.chain, d.refresh, d.tokens, d.window, d.epochs, d.lr, d.topk, d.batch, d.eval_every, d.patience,
            d.seed) == (3, 50, 200_000, 128, 1.0, 5e-5, 32, 4, 50, 3, 0)  # fmt: skip


def test_lr_schedule():
    assert heal.lr_multiplier(1, 100) == pytest.approx(0.1)
    assert heal.lr_multiplier(10, 100) == pytest.approx(1.0)
    assert heal.lr_multiplier(100, 100) == pytest.approx(0.1)
    assert 0.1 < heal.lr_multiplier(55, 100) < 1.0


# ----------------------------------------------------------------------------------------------------------
# scripted drafts: non-finite steps, patience, best restore, --init


class NanDraft(refnet.RefDraft):
    """Steps whose index is in `bad` (counting every call) return a non-finite loss."""

    bad: set = set()
    scales: list = []

    def step(self, x_rows, teacher_ids, teacher_probs, weights, lr, step, grad_scale, chain: int = 0):
        NanDraft.scales.append(grad_scale)
        if len(NanDraft.scales) in NanDraft.bad:
            return float("nan"), float("nan"), False
        return super().step(x_rows, teacher_ids, teacher_probs, weights, lr, step, grad_scale, chain)


def test_nonfinite_steps_skipped_then_abort(files, tmp_path, monkeypatch):
    model, data = files
    monkeypatch.setattr(refnet, "RefDraft", NanDraft)  # what backend.make_draft("ref") builds
    NanDraft.bad, NanDraft.scales = {1, 2, 3}, []
    r = heal.heal(model, str(data), tmp_path / "a.ddlw", SMALL)
    assert r["skipped_steps"] == 3 and r["steps"] == r["total_steps"]
    assert NanDraft.scales[:5] == [4096.0, 2048.0, 1024.0, 512.0, 512.0]  # halved per skip, then kept
    # every step non-finite: the 20th aborts, nothing written
    NanDraft.bad, NanDraft.scales = set(range(1, 1000)), []
    out = tmp_path / "b.ddlw"
    with pytest.raises(heal.HealError, match="heal: 20 non-finite steps"):
        heal.heal(model, str(data), out, SMALL)
    assert len(NanDraft.scales) == 20 and NanDraft.scales[-1] == 1.0  # 4096 halved 19 times, floored at 1
    assert not out.exists() and leftovers(tmp_path) == []


class ScriptedDraft(refnet.RefDraft):
    """Held-out KL follows `curve[finite steps done]`; weights after every step are recorded."""

    curve: dict = {}
    seen: dict = {}

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.done = 0
        ScriptedDraft.seen = {0: self.export()}

    def step(self, *a, **kw):
        out = super().step(*a, **kw)
        self.done += 1
        ScriptedDraft.seen[self.done] = self.export()
        return out

    def loss_sum(self, x_rows, teacher_ids, teacher_probs, weights, chain: int = 0):
        return ScriptedDraft.curve[self.done] * float(np.sum(weights))

    def loss_sum_next(self, x_rows, teacher_ids, teacher_probs, weights, next_tokens, valid, chain: int = 0):
        rows = super().loss_sum_next(x_rows, teacher_ids, teacher_probs, weights, next_tokens, valid, chain)[
            1
        ]
        return self.loss_sum(x_rows, teacher_ids, teacher_probs, weights, chain), rows


def trained_of(path):
    m = load_model(path)
    return {n: m.params[n] for n in ref_mtp.trained_names(m.params)}


def test_patience_stop_and_best_restore(files, tmp_path, monkeypatch):
    model, data = files
    monkeypatch.setattr(refnet, "RefDraft", ScriptedDraft)
    ScriptedDraft.curve = {0: 1.0, 2: 0.5, 4: 0.3, 6: 0.4, 8: 0.35, 10: 0.2}
    cfg = dataclasses.replace(SMALL, eval_every=2, patience=2, epochs=3.0)
    out = tmp_path / "o.ddlw"
    r = heal.heal(model, str(data), out, cfg)
    assert r["stopped"] == "patience" and r["steps"] == 8 and r["best_step"] == 4
    assert r["heldout_kl_start"] == pytest.approx(1.0) and r["heldout_kl_best"] == pytest.approx(0.3)
    assert [h["step"] for h in r["history"]] == [0, 2, 4, 6, 8]
    got = trained_of(out)
    for n, a in got.items():
        np.testing.assert_array_equal(a, ScriptedDraft.seen[4][n])  # the best, not the last
    assert any(not np.array_equal(ScriptedDraft.seen[8][n], got[n]) for n in got)


def test_init_weights_used(files, tmp_path, monkeypatch, make_model):
    model, data = files
    src = make_model(tmp_path / "src.ddlw", seed=5)  # a different draft (and trunk)
    monkeypatch.setattr(refnet, "RefDraft", ScriptedDraft)
    ScriptedDraft.curve = dict.fromkeys(range(0, 200, 2), 1.0)  # never better than the start
    out = tmp_path / "o.ddlw"
    cfg = dataclasses.replace(SMALL, eval_every=2, patience=1)
    r = heal.heal(model, str(data), out, cfg, init_path=src)
    assert r["best_step"] == 0 and r["init"] == str(src)
    want = trained_of(src)
    for n, a in trained_of(out).items():
        np.testing.assert_array_equal(a, want[n])
    # the input projection stays the model's own
    with open_checkpoint(model) as a, open_checkpoint(out) as b:
        assert (
            a.tensor("model.mtp.eh_proj.weight").tobytes() == b.tensor("model.mtp.eh_proj.weight").tobytes()
        )


def test_atomic_output_on_failure(files, tmp_path, monkeypatch):
    model, data = files
    out = tmp_path / "o.ddlw"
    out.write_bytes(b"previous")
    real = container.Writer.write
    calls = []

    def failing(self, name, array, dtype=None):
        calls.append(name)
        if len(calls) == 3:
            raise OSError("disk full (injected)")
        return real(self, name, array, dtype)

    monkeypatch.setattr(container.Writer, "write", failing)
    with pytest.raises(OSError, match="injected"):
        heal.heal(model, str(data), out, SMALL)
    assert out.read_bytes() == b"previous" and leftovers(tmp_path) == []
    monkeypatch.setattr(container.Writer, "write", real)
    heal.heal(model, str(data), out, SMALL)
    assert load_model(out).provenance["mtp_heal"]["steps"] > 0 and leftovers(tmp_path) == []


# ----------------------------------------------------------------------------------------------------------
# accept


def test_tally_known_answers():
    # one window of 8 tokens, depth 2 -> anchors p = 0..5
    ids = np.array([5, 1, 2, 3, 4, 9, 6, 7])
    greedy = np.array([1, 2, 3, 0, 5, 6, 7, 8])  # data follows greedy at p+1 for p = 0, 1, 4, 5, 6
    preds = np.zeros((2, 8), int)
    # step 1 at p must equal greedy[p+1]; step 2 greedy[p+2]
    preds[0] = [2, 3, 0, 9, 6, 7, 0, 0]  # right at p = 0, 1, 2, 4, 5
    preds[1] = [3, 0, 9, 9, 7, 8, 0, 0]  # right at p = 0, 1, 4 (and 5: greedy[7] = 8)
    t = accept.Tally(2)
    t.add(preds, greedy, ids, 8)
    r = t.result()
    assert r["anchors"] == 6
    assert r["prefix_acceptance"] == pytest.approx([5 / 6, 4 / 6])  # p = 0, 1, 4, 5 keep both
    assert r["conditional_acceptance"] == pytest.approx([5 / 6, 4 / 5])
    assert r["acceptance_length"] == pytest.approx(1 + 5 / 6 + 4 / 6)
    # on-policy: the data follows greedy for both steps (ids[p+1] == greedy[p], ids[p+2] == greedy[p+1]) at
    # p = 0, 1, 5 only (p = 2: ids[4] = 4 != greedy[3] = 0; p = 3, 4: ids[p+1] != greedy[p]); all accepted
    assert r["on_policy"]["anchors"] == 3
    assert r["on_policy"]["prefix_acceptance"] == pytest.approx([1.0, 1.0])
    assert tuple(r) == accept.KEYS


def perfect_chain(steps_right):
    """A fake draft_chain whose step j predicts the trunk's greedy token at p + j for j in steps_right."""

    def fake(params, cfg, ids, lengths, pre, post, depth, tokens="greedy"):
        greedy = ref_mtp.trunk_topk_hidden(params, cfg, ids, 1)[0][..., 0]
        V = cfg.vocab_size
        out = []
        for j in range(1, depth + 1):
            target = ref_mtp.shifted(greedy, j) if j in steps_right else (ref_mtp.shifted(greedy, j) + 1) % V
            out.append(np.eye(V)[target])
        return out

    return fake


def test_acceptance_end_to_end_known(tmp_path, monkeypatch, make_model):
    m = load_model(make_model(tmp_path / "m.ddlw"))
    rng = np.random.default_rng(1)
    windows = [rng.integers(0, 256, n) for n in (20, 13, 7)]
    monkeypatch.setattr(ref_mtp, "draft_chain", perfect_chain({1, 2, 3}))
    r = accept.acceptance(m, windows, depth=3)
    assert r["anchors"] == (20 - 3) + (13 - 3) + (7 - 3)
    assert r["prefix_acceptance"] == [1.0, 1.0, 1.0] and r["acceptance_length"] == 4.0
    monkeypatch.setattr(ref_mtp, "draft_chain", perfect_chain({1, 3}))  # step 2 always wrong
    r = accept.acceptance(m, windows, depth=3)
    assert r["prefix_acceptance"] == [1.0, 0.0, 0.0] and r["conditional_acceptance"] == [1.0, 0.0, 0.0]
    assert r["acceptance_length"] == 2.0


def test_acceptance_real_draft_and_probe(tmp_path, make_model):
    m = load_model(make_model(tmp_path / "m.ddlw"))
    rng = np.random.default_rng(2)
    windows = [rng.integers(0, 256, 16) for _ in range(3)]
    r = accept.acceptance(m, windows, depth=2, probe_conventions=True)
    assert tuple(k for k in r if k != "probe") == accept.KEYS
    A = r["prefix_acceptance"]
    assert 0.0 <= A[1] <= A[0] <= 1.0
    assert len(r["probe"]) == 8 and sum(p["current"] for p in r["probe"]) == 1
    cur = next(p for p in r["probe"] if p["current"])
    assert cur["acceptance_length"] == pytest.approx(r["acceptance_length"])
    with pytest.raises(backend.UnknownBackendError, match="unknown backend 'cuda'"):
        accept.acceptance(m, windows, depth=2, backend="cuda")


def test_accept_file(files):
    model, data = files
    r = accept.accept_file(model, str(data), depth=2, window=24)
    assert r["depth"] == 2 and r["anchors"] > 0 and r["data"] == str(data)


# ----------------------------------------------------------------------------------------------------------
# compress


def test_drop_layers(tmp_path, heal_kit):
    m = Model(heal_kit.tiny_cfg(n_layers=3), init_params(heal_kit.tiny_cfg(n_layers=3), 0))
    c = compress.drop_layers(m, [1])
    assert c.cfg.n_layers == 2
    np.testing.assert_array_equal(c.params["model.layers.1.mlp.up_proj.weight"],
                                  m.params["model.layers.2.mlp.up_proj.weight"])  # fmt: skip
    np.testing.assert_array_equal(c.params["model.mtp.eh_proj.weight"], m.params["model.mtp.eh_proj.weight"])
    assert c.provenance["compress"]["dropped"] == [1]
    assert compress.parse_layers("0,2-3") == [0, 2, 3]
    with pytest.raises(compress.CompressError, match="out of range"):
        compress.drop_layers(m, [3])
    with pytest.raises(compress.CompressError, match="leave no block"):
        compress.drop_layers(m, [0, 1, 2])


def test_ffn_keep_by_importance(tmp_path, heal_kit, make_model):
    cfg = heal_kit.tiny_cfg()
    params = init_params(cfg, 0)
    p = "model.layers.0."
    params[p + "mlp.down_proj.weight"][:, [3, 7, 11]] *= 100.0  # the three most important channels
    m = Model(cfg, params)
    c = compress.ffn_keep(m, 0.125)  # 24 * 0.125 = 3 channels
    assert c.cfg.ffn_hidden == 3
    np.testing.assert_array_equal(
        c.params[p + "mlp.gate_proj.weight"], params[p + "mlp.gate_proj.weight"][[3, 7, 11]]
    )
    np.testing.assert_array_equal(
        c.params[p + "mlp.down_proj.weight"], params[p + "mlp.down_proj.weight"][:, [3, 7, 11]]
    )
    assert c.params["model.mtp.layers.0.mlp.up_proj.weight"].shape == (
        24,
        cfg.d_model,
    )  # the draft stays whole
    assert c.provenance["compress"]["ffn_hidden_after"] == 3
    # written and read back; then healable
    out = tmp_path / "c.ddlw"
    rec = compress.compress_file(make_model(tmp_path / "m.ddlw"), out, keep=0.5)
    assert rec["method"] == "ffn_keep" and load_model(out).cfg.ffn_hidden == 12
    assert load_model(out).provenance["compress"]["ffn_hidden_before"] == 24
    with pytest.raises(compress.CompressError, match="exactly one"):
        compress.compress_file(out, tmp_path / "x.ddlw")


def test_chain_attention_is_named_by_what_it_does_and_the_layout_picks_it(heal_kit):
    """per-step (each chain step its own causal pass, the reference heal tool's way) or stacked; by default the
    draft's layout picks (tests/test_served_draft.py), per-step for this draft (ours, pre-norm hiddens); the old
    names are refused with a message that names the new ones."""
    assert heal.HealConfig().chain_attention is None
    assert heal.resolve(heal_kit.tiny_cfg(), heal.HealConfig())[0].chain_attention == "per-step"
    assert accept.CHAIN_ATTENTION == ("per-step", "stacked")
    for old in ("seed", "runtime"):
        with pytest.raises(heal.HealError, match="per-step, stacked") as e:
            heal.HealConfig(chain_attention=old)
        assert e.value.field == "chain_attention"
        with pytest.raises(accept.AcceptError, match="per-step, stacked"):
            accept.check_chain_attention(old)


def test_heal_progress_events_have_one_schema(files, tmp_path):
    model, data = files
    events = []
    heal.heal(model, str(data), tmp_path / "o.ddlw", SMALL, progress=events.append)
    assert events and all(e["job"] == "heal" and "event" in e and "kind" not in e for e in events)
    assert [e["event"] for e in events][:3] == ["draft", "windows", "trunk"] and events[-1][
        "event"
    ] == "written"


# ----------------------------------------------------------------------------------------------------------
# the lazy refresh: each batch of windows rebuilt from the weights kept at the refresh when first read


def heal_eager_and_lazy(eager_refresh, model, data, out_dir, run, backend_name="ref"):
    """-> {False: (report, trained, refresh events), True: ...}: one heal with the eager rebuild of every
    window at each refresh (the tests' oracle, `conftest.eager_refresh`), one with heal's lazy rebuild."""
    out = {}
    for lazy in (False, True):
        eager_refresh(not lazy)
        events = []
        path = out_dir / f"lazy{int(lazy)}.ddlw"
        r = heal.heal(model, data, path, run, backend=backend_name, progress=events.append)
        out[lazy] = (r, trained_of(path), [e for e in events if e["event"] == "refresh"])
    return out


@pytest.mark.parametrize("mode", ["per-step", "stacked"])
def test_lazy_refresh_gives_the_eager_results_bit_for_bit(files, tmp_path, eager_refresh, mode):
    model, data = files
    run = dataclasses.replace(SMALL, chain=3, refresh=3, tokens=1500, chain_attention=mode)
    runs = heal_eager_and_lazy(eager_refresh, model, str(data), tmp_path, run)
    (eager, te, _), (lazy, tl, _) = runs[False], runs[True]
    assert len(eager["history"]) >= 4 and eager["steps"] > 3 * run.refresh
    assert lazy["history"] == eager["history"]  # every held-out KL, exactly
    assert all(np.array_equal(tl[n], te[n]) for n in te)  # the final draft, bit for bit
    assert lazy["acceptance_after"] == eager["acceptance_after"]


def _skip_one_step(monkeypatch, at: int) -> list:
    """Each draft's `at`-th step non-finite (skipped, its weights untouched: its period takes one job more than
    its refresh planned) -> the count of `using` blocks (the rebuilds from the refresh's copy of the weights)."""
    step, using, used = refnet.RefDraft.step, refnet.RefDraft.using, [0]

    def flaky(self, *a, **k):
        self.calls = getattr(self, "calls", 0) + 1
        return (float("nan"), float("nan"), False) if self.calls == at else step(self, *a, **k)

    def counted(self, snap):
        used[0] += 1
        return using(self, snap)

    monkeypatch.setattr(refnet.RefDraft, "step", flaky)
    monkeypatch.setattr(refnet.RefDraft, "using", counted)
    return used


def test_a_job_past_the_refreshs_plan_is_rebuilt_from_its_weights(
    files, tmp_path, monkeypatch, eager_refresh
):
    """A refresh rebuilds what its period's jobs and evaluation read from the current weights; a job a
    non-finite step pushed past that plan is rebuilt from the weights kept at the refresh, as the eager
    oracle's rows: the same run. Without a skip nothing is rebuilt from the copy; with one, something is."""
    model, data = files
    run = dataclasses.replace(SMALL, chain=3, refresh=3, tokens=1500)
    used = _skip_one_step(monkeypatch, 0)
    plain = heal_eager_and_lazy(eager_refresh, model, str(data), tmp_path, run)
    assert used[0] == 0 and plain[True][0]["history"] == plain[False][0]["history"]
    monkeypatch.undo()
    used = _skip_one_step(monkeypatch, 5)
    runs = heal_eager_and_lazy(eager_refresh, model, str(data), tmp_path, run)
    (eager, te, _), (lazy, tl, _) = runs[False], runs[True]
    assert lazy["skipped_steps"] == eager["skipped_steps"] == 1 and used[0] > 0
    assert lazy["history"] == eager["history"] and all(np.array_equal(tl[n], te[n]) for n in te)


def test_lazy_refresh_needs_the_kept_weights(files, tmp_path, monkeypatch, eager_refresh):
    """The comparisons above can fail: rows rebuilt from the current weights instead of those kept at the
    refresh (`using` a no-op, no plan) change the held-out KL."""
    import contextlib

    model, data = files
    monkeypatch.setattr(refnet.RefDraft, "using", lambda self, snap: contextlib.nullcontext())
    monkeypatch.setattr(heal._HealJob, "plan", lambda self, n: [])
    run = dataclasses.replace(SMALL, chain=3, refresh=3, tokens=1500)
    runs = heal_eager_and_lazy(eager_refresh, model, str(data), tmp_path, run)
    assert runs[True][0]["history"] != runs[False][0]["history"]


def test_lazy_refresh_rebuilds_fewer_batches(files, tmp_path, eager_refresh, heal_count):
    model, data = files
    run = dataclasses.replace(SMALL, chain=3, refresh=3, tokens=1500)
    runs = heal_eager_and_lazy(eager_refresh, model, str(data), tmp_path, run)
    (eager, _, ev_e), (lazy, _, ev_l) = runs[False], runs[True]
    train, val = heal.split_heldout(eager["windows"])
    batches = -(-len(train) // run.batch) + -(-len(val) // run.batch)  # training and held-out ones apart
    refreshes = 1 + (eager["steps"] - 1) // run.refresh
    steps = [run.refresh * i for i in range(refreshes)]
    assert [e["step"] for e in ev_e] == [e["step"] for e in ev_l] == steps
    assert all(e["batches"] == batches and e["chain"] == 3 for e in ev_e + ev_l)
    # eager: every window's steps 2..3 at each refresh
    assert all(e["rebuilt"] == 2 * batches for e in ev_e)
    assert eager["refresh_forwards"] == refreshes * 2 * batches
    # lazy: nothing at the refresh itself; a period rebuilds what its 3 jobs and its evaluation read
    assert all(e["lazy"] for e in ev_l) and ev_l[0]["rebuilt"] == 0
    assert 0 < lazy["refresh_forwards"] < eager["refresh_forwards"] / 2
    assert all(e["rebuilt"] <= 2 * batches for e in ev_l)
    assert sum(e["rebuilt"] for e in ev_l) <= lazy["refresh_forwards"]  # the last period has no event
    # bench/heal.py's count (heal's job loop on a stand-in draft) is the real one, and so is its eager figure
    count = heal_count.refresh_forwards(lazy["windows"], run)
    assert count["forwards"] == lazy["refresh_forwards"] and count["steps"] == lazy["steps"]
    assert count["evaluations"] == len(lazy["history"])  # the estimate's evaluations are the run's
    assert count["refreshes"] == refreshes and count["batches"] == batches
    assert count["refreshes"] * 2 * count["batches"] == eager["refresh_forwards"]
    # the first period: at most one refresh batch for each of its 3 jobs (a job's batch is one); the evaluation
    # at step 0, right after the refresh, built steps 2..3 of the held-out batches from its own forwards (one
    # per evaluation batch), and so did every evaluation at a refresh (refreshing every 3 steps, evaluating
    # every 4)
    held_out = len(val) // run.batch
    assert ev_l[1]["rebuilt"] <= 2 * 3
    evals_at_refresh = len([s for s in steps if s % run.eval_every == 0])
    assert lazy["eval_built_rows"] == count["eval_built"] == evals_at_refresh * 2 * held_out > 0


class _RowDraft:
    """A draft for `_Chain` alone: next_rows gives rows of ones and counts its calls, loss_chain counts its
    batches and the steps it builds the rows of; losses 0."""

    def __init__(self):
        self.calls = self.fused = self.chained = 0

    def loss_chain(self, x1, steps, stacked):
        assert x1.shape[:2] == steps[0][2].shape and steps[-1][3] is None
        self.chained += 1
        self.fused += sum(s[3] is not None for s in steps)
        return [0.0] * len(steps)

    def loss_chains(self, batches, stacked):
        return [self.loss_chain(x1, steps, stacked) for x1, steps in batches]

    def snapshot(self):
        return None

    def using(self, snap):
        import contextlib

        return contextlib.nullcontext()

    def next_rows(self, x, tok, valid, chain=0):
        self.calls += 1
        return np.ones(x.shape, np.float32)  # per-step: (b, T, C), step j - 1's rows

    def loss_sum(self, *args, **kw):
        return 0.0


def chain_of(N, nb, chain=3, T=4, C=2):
    """A lazy `_Chain` over N windows of T rows (step 1's rows zeros) on `_RowDraft`."""
    cache = heal._Cache(np.zeros((N, T), np.int64), np.full(N, T), np.zeros((N, T, 1), np.int32),
                        np.ones((N, T, 1), np.float32), np.zeros((0, T, C), np.float32),
                        {1: np.zeros((N, T, C), np.float16)})  # fmt: skip
    model = Model(SimpleNamespace(d_model=C), {})
    cfg = dataclasses.replace(SMALL, chain=chain, batch=nb)
    return heal._Chain(model, cfg, cache, _RowDraft())


@pytest.mark.parametrize("N, nb", [(40, 2), (47, 4), (103, 4), (60, 3), (75, 8)])
def test_refresh_batches_keep_training_and_held_out_windows_apart(N, nb):
    """Refresh batches: the training windows `nb` at a time in index order, then the held-out ones; each job
    or evaluation batch is exactly one refresh batch."""
    c = chain_of(N, nb)
    train, val = heal.split_heldout(N)
    assert [list(m) for m in c.members] == [
        ws[s : s + nb] for ws in (train, val) for s in range(0, len(ws), nb)
    ]
    assert c.batches == len(c.members) == -(-len(train) // nb) + -(-len(val) // nb)
    held = set(val)
    assert all(len({w in held for w in m}) == 1 for m in c.members)  # no batch mixes the two
    assert sorted(np.concatenate(c.members).tolist()) == list(range(N))  # every window once
    assert all((c.batch_of[m] == k).all() for k, m in enumerate(c.members))
    for b in heal._batches(train, nb) + heal._batches(val, nb):
        assert len(np.unique(c.batch_of[b])) == 1 and list(c.members[c.batch_of[b[0]]]) == list(b)


def test_heldout_evaluation_after_a_refresh_rebuilds_only_held_out_batches():
    """With consecutive windows as refresh batches every held-out window lay in its own batch, so an evaluation
    rebuilt (chain - 1) x len(val) forwards, most of them training windows; now (chain - 1) x its batches."""
    N, nb = 83, 4
    c = chain_of(N, nb)
    train, val = heal.split_heldout(N)
    vb = heal._batches(val, nb)
    c.refresh()
    c.fresh = False  # a step since the refresh: the held-out rows come from the kept weights
    c.heldout_kl(vb)
    assert c.draft.calls == c.forwards == 2 * len(vb) == 2 * (len(val) // nb) and c.draft.fused == 0
    read = np.concatenate(vb)
    assert (c.cache.x[2][read] == 1).all() and (c.cache.x[3][read] == 1).all()
    unread = np.setdiff1d(np.arange(N), read)  # training windows and the short last held-out batch
    assert (c.cache.x[2][unread] == 0).all() and (c.cache.x[3][unread] == 0).all()
    assert [int(c.built[k]) for k in range(c.batches)] == [3 if k in set(c.batch_of[read]) else 1
                                                          for k in range(c.batches)]  # fmt: skip
    c.heldout_kl(vb)  # current now: nothing more
    assert c.forwards == 2 * len(vb)
    c.join(heal._batches(train, nb)[5], 2)  # a training job: its own batch, step 2 only
    assert c.forwards == 2 * len(vb) + 1


def test_an_evaluation_right_after_a_refresh_runs_its_own_chains():
    """No step since the refresh: each held-out batch runs its chain steps in turn, each on rows built from the
    forward before (`loss_chain`), so it runs no refresh forward; it keeps no rows, so the batches stay stale
    and a later evaluation of the period rebuilds them from the kept weights."""
    N, nb = 83, 4
    c = chain_of(N, nb)
    vb = heal._batches(heal.split_heldout(N)[1], nb)
    c.refresh()
    c.heldout_kl(vb)
    assert c.draft.calls == c.forwards == 0 and c.draft.chained == len(vb)
    assert c.draft.fused == c.eval_built == 2 * len(vb)
    assert not c.cache.x[2].any() and not c.cache.x[3].any() and (c.built == 1).all()
    c.heldout_kl(vb)  # still right after the refresh: chained again
    assert c.draft.chained == 2 * len(vb) and c.forwards == 0
    c.fresh = False  # a step since: the held-out rows come from the kept weights, once
    c.heldout_kl(vb)
    c.heldout_kl(vb)
    assert c.draft.chained == 2 * len(vb) and c.draft.calls == c.forwards == 2 * len(vb)
    read = np.concatenate(vb)
    assert (c.cache.x[2][read] == 1).all() and (c.cache.x[3][read] == 1).all()
