"""`generate --speculative --draft EAGLE.ddlw` on the GPU engine (`engine/decode_eagle3.py`,
docs/eagle3.md#generate-on-the-gpu), on lavapipe at tiny shapes: the draft's proposals equal the numpy engine's
(`refnet.RefEagle3Engine`) after a prompt and after rounds that kept and rejected drafts, and so do the cached
draft pass's logits at every step (within f32 rounding; a long prompt's catch-up, argmax and picked chains, a
roll-back behind the draft's cached rows); greedy text equal to plain greedy text on wgpu with a trained and a
random draft (the accept and the reject paths), seeded sampling reproducible, and the command line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import make_text, random_model, tiny_cfg

from ddl_ref import eagle3 as e3
from ddl_wgpu.engine.decode_eagle3 import WgpuEagle3Engine
from ddl_wgpu.engine.refnet import RefEagle3Engine
from ddl_wgpu.files import eagle3file as ef
from ddl_wgpu.files.modelfile import load_model, save_model
from ddl_wgpu.jobs import draft as dj
from ddl_wgpu.jobs import generate as gen

SMALL = dict(tokens=4000, seq_len=32, ttt=3, batch_size=4, learning_rate=3e-3, eval_interval=10)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """A 4-layer 16-wide target (context 32) and an EAGLE-3 draft trained on it for a few steps (numpy)."""
    d = tmp_path_factory.mktemp("eagle3_generate_gpu")
    save_model(d / "t.ddlw", random_model(tiny_cfg("default", n_layers=4), 0))
    make_text(d / "text.txt", words=3000)
    cfg = dj.DraftConfig(**{**SMALL, "learning_rate": 1e-2, "epochs": 2.0}, aux_layers=(1, 2, 3))
    rep = dj.train_draft(d / "t.ddlw", str(d / "text.txt"), d / "draft.ddlw", cfg)
    assert rep["acceptance"]["acceptance_length"] > 1.5  # a draft that is often right: the accept path runs
    return d, load_model(d / "t.ddlw"), ef.load_draft(d / "draft.ddlw")


def test_proposals_equal_the_numpy_engines(gpu, kit):
    _d, m, draft = kit
    ref, gpu_eng = RefEagle3Engine(m, draft, 3, 30), WgpuEagle3Engine(gpu, m, draft, 3, "f32", 30)
    prompt = [5, 17, 99, 3, 42, 7]
    for eng in (ref, gpu_eng):
        eng.feed(prompt, "argmax", last_only=True)
    token = 11
    for _ in range(4):  # rounds: the numpy engine's verify, rolled back by as much, on both
        want, _rows = ref.draft(token, 3, "argmax", None)
        got, rows = gpu_eng.draft(token, 3, "argmax", None)
        assert got == want, (got, want)
        assert (
            rows[0].shape == (m.cfg.vocab_size,)
            and np.isinf(rows[0]).sum() == m.cfg.vocab_size - draft.cfg.draft_vocab
        )
        verify = ref.feed([token, *want], "argmax")
        assert list(gpu_eng.feed([token, *want], "argmax")) == list(verify)
        n = ref.length - 4
        kept = next((j for j in range(3) if verify[j] != want[j]), 3)
        for eng in (ref, gpu_eng):
            eng.rollback(n + 1 + kept)
        token = int(verify[kept])


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_cached_draft_logits_equal_the_numpy_engines(gpu, kit, norm_before_residual):
    """The cached draft pass against `RefEagle3Engine`, logits of every step: a 10-token prompt (a catch-up
    longer than `GEMV_MAX_ROWS`: the GEMM path), then rounds whose drafts are all kept, some kept, none kept,
    and a roll-back behind the draft's cached anchors with other tokens fed there; chain tokens the argmax or
    a scripted pick (the same on both engines)."""
    _d, m, draft = kit
    if norm_before_residual:
        draft = dataclasses.replace(draft, cfg=dataclasses.replace(draft.cfg, norm_before_residual=True))
    ref, eng = RefEagle3Engine(m, draft, 3, 30), WgpuEagle3Engine(gpu, m, draft, 3, "f32", 30)
    tmap = e3.target_ids(draft.d2t)
    prompt = [5, 17, 99, 3, 42, 7, 64, 12, 8, 33]
    for e in (ref, eng):
        e.feed(prompt, "argmax", last_only=True)
    rng = np.random.default_rng(7)
    token, steps = 11, 0
    # (depth, drafts kept, picked): kept None = roll back behind the draft's cached rows, other tokens fed
    for depth, kept, picked in ((3, 3, False), (3, 0, True), (2, 1, False), (3, None, False), (3, 2, True),
                                (1, 0, False), (3, 0, False)):  # fmt: skip
        script = [int(t) for t in rng.choice(tmap, size=depth)]  # picked: these target ids, on both engines
        head = "top5" if picked else "argmax"
        n = ref.length
        want_t, want_rows = ref.draft(token, depth, head, (lambda _row, it=iter(script): next(it)))
        got_t, got_rows = eng.draft(token, depth, head, (lambda _row, it=iter(script): next(it)))
        assert got_t == want_t, (got_t, want_t)
        for got, want in zip(got_rows, want_rows, strict=True):
            assert np.array_equal(np.isinf(got), np.isinf(want))
            err = np.max(np.abs(got[tmap] - want[tmap]))
            assert err <= 1e-4 * np.max(np.abs(want[tmap])), (steps, err)
            steps += 1
        verify = ref.feed([token, *want_t], "argmax")
        assert list(eng.feed([token, *want_t], "argmax")) == list(verify)
        if kept is None:  # back to three positions before this round's, three other tokens fed there
            other = [(int(t) + 1) % m.cfg.vocab_size for t in ref.ids[n - 3 : n]]
            for e in (ref, eng):
                e.rollback(n - 3)
                last = e.feed(other, "argmax")[-1]
            token = int(last)
        else:
            for e in (ref, eng):
                e.rollback(n + 1 + kept)
            token = int(verify[kept])
    assert steps == 18


@pytest.mark.parametrize("trained", [True, False])
def test_speculative_greedy_text_is_plain_greedy_on_wgpu(gpu, kit, trained):
    _d, m, draft = kit
    if not trained:  # a random draft: most drafts rejected, the reject path at every depth
        draft = dataclasses.replace(draft, params=e3.init_eagle3(draft.cfg, 5))
    kept = rounds = 0
    for prompt in ("alpha beta gamma", "theta"):
        plain = gen.generate(m, prompt, max_new_tokens=16, backend="wgpu")
        for depth in (1, 3):
            spec = gen.generate(m, prompt, max_new_tokens=16, backend="wgpu", speculative=True, depth=depth,
                                draft=draft)  # fmt: skip
            assert spec["token_ids"] == plain["token_ids"] and spec["text"] == plain["text"]
            assert spec["backend"] == "wgpu" and spec["rounds"] > 0
            kept += spec["mean_accepted"] * spec["rounds"]
            rounds += spec["rounds"]
    if trained:
        assert kept > 0  # the accept path ran too
    else:
        assert kept < rounds


def test_seeded_sampling_with_the_draft_is_reproducible(gpu, kit):
    _d, m, draft = kit
    s = gen.Sampling(temperature=0.8, top_k=20, seed=3)
    a, b = (gen.generate(m, "alpha beta", max_new_tokens=12, sampling=s, backend="wgpu", speculative=True,
                         draft=draft) for _ in range(2))  # fmt: skip
    assert a["token_ids"] == b["token_ids"] and a["rounds"] > 0


def test_cli_generate_with_the_draft_on_wgpu(kit, cli, ok):
    d, _m, _draft = kit
    base = ("generate", d / "t.ddlw", "--prompt", "alpha beta", "--max-new-tokens", "12", "--backend", "wgpu")
    plain = ok(cli(*base))
    spec = ok(cli(*base, "--speculative", "--draft", d / "draft.ddlw"))
    assert spec.stdout == plain.stdout and "draft depth 3" in spec.stderr and "on wgpu" in spec.stderr
