"""Tests of incremental decoding (`ddl_ref.decode`) and generation (`ddl_wgpu.jobs.generate`) on the numpy backend.

The cache: for all six variants, with and without a draft, the trunk fed in pieces (prompt, single tokens,
rows again after a roll-back) gives a full forward's logits at every position; the draft's cached rows give
`ddl_ref.mtp.draft_forward`'s step-1 rows and its stacked chain rows.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import check_speculative_sampling, random_model, tiny_cfg

from ddl_ref import decode, mtp
from ddl_ref import model as ref_model
from ddl_ref.check import random_params
from ddl_ref.config import ModelVariant, MtpConfig
from ddl_wgpu.data import ByteTokenizer
from ddl_wgpu.engine.refnet import RefEngine, ref_runner
from ddl_wgpu.files.modelfile import save_model
from ddl_wgpu.jobs import accept
from ddl_wgpu.jobs.generate import GenerateError, Sampling, TextStream, distribution, generate, run

VARIANTS = list(ModelVariant)


def pieces_logits(params, cfg, ids, cuts):
    """The trunk over ids fed as ids[0:cuts[0]], ids[cuts[0]:cuts[1]], ... -> (pre, logits) of every row."""
    cache = decode.TrunkCache(cfg, dtype=np.float64)
    pres, outs = [], []
    for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True):
        pre, _post, logits = decode.trunk_step(params, cfg, cache, ids[a:b])
        pres.append(pre)
        outs.append(logits)
    assert cache.length == len(ids)
    return np.concatenate(pres), np.concatenate(outs)


# ----------------------------------------------------------------------------------------------------------
# the reference cache


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("qk_norm", ["post_rope", "pre_rope"])
def test_cached_trunk_equals_forward(variant, qk_norm):
    cfg = tiny_cfg("generate", variant, qk_norm=qk_norm, tie_embeddings=variant != "ddl")
    params = random_params(cfg, seed=3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 11)
    want, _, _ = ref_model.forward(params, cfg, ids[None])
    pre_want, _ = ref_model.hidden_states(params, cfg, ids[None])
    for cuts in ([5, 6, 7, 8, 9, 10], [1, 2, 3], [4]):  # prompt + single tokens, tiny prompt, two chunks
        pre, got = pieces_logits(params, cfg, ids, cuts)
        np.testing.assert_allclose(got, want[0], rtol=0, atol=1e-10)
        np.testing.assert_allclose(pre, pre_want[0], rtol=0, atol=1e-10)


# Qwen3.5's full attention: the sigmoid output gate and RoPE on 2 of the 6 dims of a head
GATED = dict(attn_output_gate=True, rotary_dim=2, norm_style="offset", qk_norm="pre_rope")


@pytest.mark.parametrize("variant", ["baseline", "ddl-tc"])
def test_cached_gated_partial_rope_trunk_equals_forward(variant):
    cfg = tiny_cfg("generate", variant, **GATED)
    params = random_params(cfg, seed=3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 11)
    want, _, _ = ref_model.forward(params, cfg, ids[None])
    for cuts in ([5, 6, 7, 8, 9, 10], [4]):
        np.testing.assert_allclose(pieces_logits(params, cfg, ids, cuts)[1], want[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rollback_then_other_tokens(variant):
    cfg = tiny_cfg("generate", variant)
    params = random_params(cfg, seed=4)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg.vocab_size, 10)
    other = rng.integers(0, cfg.vocab_size, 4)
    cache = decode.TrunkCache(cfg, dtype=np.float64)
    decode.trunk_step(params, cfg, cache, ids[:6])
    decode.trunk_step(params, cfg, cache, other)  # a rejected speculation: positions 6..9 hold other tokens
    cache.rollback(6)
    _, _, got = decode.trunk_step(params, cfg, cache, ids[6:])
    want, _, _ = ref_model.forward(params, cfg, ids[None])
    np.testing.assert_allclose(got, want[0, 6:], rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="roll back"):
        cache.rollback(11)


def test_cache_capacity_refused():
    cfg = tiny_cfg("generate", "baseline")
    cache = decode.TrunkCache(cfg, capacity=4)
    with pytest.raises(ValueError, match="capacity"):
        decode.trunk_step(random_params(cfg), cfg, cache, np.arange(5))


@pytest.mark.parametrize(
    "variant, extra", [("baseline", {}), ("ddl-tc", {}), ("baseline", GATED), ("ddl-tc", GATED)]
)
@pytest.mark.parametrize(
    "conv", [("emb_first", "pre_norm", "pre_norm"), ("hidden_first", "post_norm", "post_norm")]
)
def test_draft_rows_equal_draft_forward(variant, extra, conv):
    concat, th, ch = conv
    cfg = tiny_cfg(
        "generate", variant, mtp=MtpConfig(concat=concat, trunk_hidden=th, chain_hidden=ch), **extra
    )
    params = random_params(cfg, seed=5)
    T = 9
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, T)
    pre, post = ref_model.hidden_states(params, cfg, ids[None])
    hid = mtp.pick_hidden(pre, post, th)[0]
    # Step 1 over every anchor p < T−1 (reading x_{p+1}), as one causal pass: the cached rows, fed in pieces.
    x = mtp.step_input(params, cfg, ids[None, 1:], hid[None, :-1], np.ones((1, T - 1), bool))
    dpre, dpost, _ = mtp.draft_forward(params, cfg, x)
    want = mtp.draft_logits(params, cfg, dpost)[0]
    dc = decode.DraftCache(cfg, dtype=np.float64)
    got = []
    for a, b in ((0, 4), (4, 5), (5, 8)):
        _, _, lg = decode.draft_step(params, cfg, dc, ids[a + 1 : b + 1], hid[a:b], np.arange(a, b))
        got.append(lg)
    np.testing.assert_allclose(np.concatenate(got), want, rtol=0, atol=1e-10)
    # The stacked chain at the last anchor p: its step-σ row equals a chain row appended after the step-1
    # rows 0..p at position p + σ − 1 (ddl_ref.ops.chain_mask's layout).
    depth, p = 3, T - 2
    chain_hid = mtp.pick_hidden(dpre, dpost, ch)[0, p]
    tok = int(np.argmax(want[p]))
    rows = [x]
    for sigma in range(2, depth + 1):
        _, _, lg = decode.draft_step(params, cfg, dc, [tok], chain_hid[None], [p + sigma - 1])
        rows.append(mtp.step_input(params, cfg, np.full((1, T - 1), tok), np.broadcast_to(chain_hid, x.shape),
                                   np.ones((1, T - 1), bool)))  # fmt: skip
        spre, spost, _ = mtp.draft_forward(params, cfg, np.concatenate(rows, axis=1), chain=sigma)
        stacked = mtp.draft_logits(params, cfg, spost)[0, -(T - 1) + p]
        np.testing.assert_allclose(lg[0], stacked, rtol=0, atol=1e-10)
        chain_hid = mtp.pick_hidden(spre, spost, ch)[0, -(T - 1) + p]
        tok = int(np.argmax(stacked))
    dc.rollback(T - 1)
    assert dc.length == T - 1


# ----------------------------------------------------------------------------------------------------------
# generation on the numpy backend


def gen(model, prompt, depth=0, sampling=Sampling(), max_new=20, stops=(), on_text=None):
    engine = RefEngine(model, depth)
    return run(
        engine, ByteTokenizer(), prompt, model.cfg.max_seq_len, max_new, sampling, stops, on_text, depth
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_speculative_equals_plain(variant):
    kept = rejected = 0
    for seed in range(4):
        model = random_model(
            tiny_cfg("generate", variant, vocab_size=4, max_seq_len=24, mtp=MtpConfig()), seed, variant
        )
        plain = gen(model, [1, 2, 3], max_new=18)
        assert plain["new_tokens"] == 18 and plain["finish_reason"] == "length"
        for depth in (1, 2, 3):
            spec = gen(model, [1, 2, 3], depth=depth, max_new=18)
            assert spec["token_ids"] == plain["token_ids"], (seed, depth)
            assert spec["trunk_passes"] < plain["trunk_passes"] or spec["mean_accepted"] == 0
            kept += round(spec["mean_accepted"] * spec["rounds"])
            rejected += spec["rounds"] - round(spec["acceptance_per_depth"][-1] * spec["rounds"])
    assert kept > 0 and rejected > 0  # both the accept and the reject paths ran


def test_context_limit_stops_generation():
    model = random_model(tiny_cfg("generate", "baseline", vocab_size=5, max_seq_len=10, mtp=MtpConfig()), 7)
    for depth in (0, 3):
        out = gen(model, [1, 2, 3, 4], depth=depth, max_new=50)
        assert out["finish_reason"] == "context" and out["new_tokens"] == 6


@pytest.mark.parametrize("variant", ["baseline", "ddl-cc"])
def test_draft_proposals_equal_accept_stacked_chain(variant):
    model = random_model(tiny_cfg("generate", variant, max_seq_len=16, mtp=MtpConfig()), 11, variant)
    ids = np.random.default_rng(3).integers(0, 13, 12)
    (tb,) = accept.trunk_batches(model, [ids])
    depth = 3
    preds = accept.greedy_chain(model.params, model.cfg, tb, depth, ref_runner(model.params, model.cfg),
                                "stacked")  # fmt: skip
    for p in (0, 4, 7):
        engine = RefEngine(model, depth)
        engine.feed(ids[: p + 1], "argmax")
        tokens, _ = engine.draft(int(ids[p + 1]), depth, "argmax", None)
        assert tokens == [int(t) for t in preds[0, :, p]], p
        assert engine.dcache.length == p + 1  # chain rows rolled back, step-1 rows of anchors 0..p kept


def test_sampling_reproducible_with_seed():
    model = random_model(tiny_cfg("generate", "baseline", mtp=MtpConfig()), 7)
    for depth in (0, 2):
        a = gen(model, [1, 2], depth=depth, sampling=Sampling(temperature=1.0, top_k=8, top_p=0.9, seed=5))
        b = gen(model, [1, 2], depth=depth, sampling=Sampling(temperature=1.0, top_k=8, top_p=0.9, seed=5))
        c = gen(model, [1, 2], depth=depth, sampling=Sampling(temperature=1.0, top_k=8, top_p=0.9, seed=6))
        assert a["token_ids"] == b["token_ids"]
        assert a["token_ids"] != c["token_ids"]


def test_distribution_filters():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    np.testing.assert_allclose(distribution(logits, Sampling(1.0)), [0.1, 0.4, 0.2, 0.3])
    np.testing.assert_allclose(distribution(logits, Sampling(1.0, top_k=2)), [0, 4 / 7, 0, 3 / 7])
    np.testing.assert_allclose(distribution(logits, Sampling(1.0, top_p=0.65)), [0, 4 / 7, 0, 3 / 7])
    np.testing.assert_allclose(distribution(logits, Sampling(1.0, top_p=0.75)), [0, 4 / 9, 2 / 9, 3 / 9])
    hot = distribution(logits, Sampling(0.5))
    np.testing.assert_allclose(hot, np.array([1, 16, 4, 9]) / 30)


def test_speculative_sampling_preserves_trunk_distribution():
    """Speculative sampling keeps the trunk's distribution (helpers.check_speculative_sampling)."""
    model = random_model(tiny_cfg("generate", "baseline", vocab_size=3, max_seq_len=8, mtp=MtpConfig()), 2)
    check_speculative_sampling(model, gen, 4000)


def byte_model(tmp_path, draft=True, seed=3):
    cfg = tiny_cfg("generate", "baseline", vocab_size=256, max_seq_len=40, mtp=MtpConfig() if draft else None)
    model = random_model(cfg, seed)
    path = tmp_path / ("m.ddlw" if draft else "nodraft.ddlw")
    save_model(path, model)
    return path


@pytest.mark.parametrize("speculative", [False, True])
def test_stop_string_and_streaming(tmp_path, speculative):
    path = byte_model(tmp_path)
    s = Sampling() if speculative else Sampling(temperature=0.8, seed=3)  # speculation: greedy, same tokens
    full = generate(path, "ab", max_new_tokens=30, sampling=s, backend="ref")
    assert full["finish_reason"] == "length" and full["new_tokens"] == 30
    text = full["text"]
    firsts = [i for i in range(4, len(text) - 2) if text.find(text[i : i + 2]) == i]
    stop = text[firsts[0] : firsts[0] + 2]  # a stop string that first appears after four characters
    pieces: list[str] = []
    out = generate(path, "ab", max_new_tokens=30, sampling=s, stops=["\x00never", stop], backend="ref",
                   on_text=pieces.append, speculative=speculative, depth=2)  # fmt: skip
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[: text.find(stop)]
    assert "".join(pieces) == out["text"] and len(pieces) > 1  # streamed in pieces, nothing past the stop
    streamed: list[str] = []
    whole = generate(path, "ab", max_new_tokens=30, sampling=s, backend="ref", on_text=streamed.append,
                     speculative=speculative)  # fmt: skip
    assert "".join(streamed) == whole["text"] == text


def test_text_stream_holds_back_partial_stop_and_utf8():
    got: list[str] = []
    ts = TextStream(ByteTokenizer(), ["END"], got.append)
    for b in b"xE":
        assert not ts.add(b)
    assert "".join(got) == "x"  # "E" may start "END": held back
    for b in "é".encode():
        ts.add(b)
    assert "".join(got) == "xEé"  # never half of the two-byte "é"
    assert ts.add(ord("E")) is False and ts.add(ord("N")) is False and ts.add(ord("D")) is True
    assert ts.text == "xEé" and "".join(got) == "xEé"


def test_refusals(tmp_path):
    path = byte_model(tmp_path)
    nodraft = byte_model(tmp_path, draft=False)
    with pytest.raises(GenerateError, match="empty prompt"):
        generate(path, "", backend="ref")
    with pytest.raises(GenerateError, match="context"):
        generate(path, "x" * 40, backend="ref")
    with pytest.raises(GenerateError, match="no model.mtp"):
        generate(nodraft, "hello", speculative=True, backend="ref")
    bad = tmp_path / "notes.txt"
    bad.write_text("not a model")
    with pytest.raises(GenerateError, match="notes.txt"):
        generate(bad, "hello", backend="ref")
    with pytest.raises(GenerateError, match="temperature"):
        Sampling(temperature=-1)
    with pytest.raises(GenerateError, match="top_p"):
        Sampling(top_p=0)
    out = generate(nodraft, "x" * 39, max_new_tokens=5, backend="ref")
    assert out["finish_reason"] == "context" and out["new_tokens"] == 1


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="the hf extra is not installed")
def test_model_tokenizer_is_used(tmp_path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "foo": 3, "bar": 4}
    spec = {"version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"},
            "pre_tokenizer": {"type": "Whitespace"}}  # fmt: skip
    model = dataclasses.replace(
        random_model(tiny_cfg("generate", "baseline", vocab_size=5, mtp=MtpConfig()), 4),
        tokenizer=json.dumps(spec).encode(),
    )
    out = generate(model, "hello world", max_new_tokens=6, backend="ref")
    assert out["prompt_tokens"] == 2 and out["new_tokens"] == 6
    words = [w for w, i in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert out["text"].split() == [words[i] for i in out["token_ids"]]


# ----------------------------------------------------------------------------------------------------------
# the command line


def cli(*args, stdin=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "ddl_wgpu.cli", "generate", *map(str, args)], input=stdin,
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip


def test_cli_generate_streams_text_and_json(tmp_path):
    path = byte_model(tmp_path)
    want = generate(path, "ab", max_new_tokens=12, backend="ref")
    r = cli(path, "--prompt", "ab", "--max-new-tokens", 12, "--backend", "ref")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want["text"] + "\n"
    assert "[12 tokens (length)" in r.stderr and "tok/s" in r.stderr
    r = cli(
        path, "--max-new-tokens", 12, "--backend", "ref", "--json", "--speculative", "--depth", 2, stdin="ab"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == want["token_ids"] and out["text"] == want["text"] and out["speculative"]
    assert len(out["acceptance_per_depth"]) == 2 and out["decode_s"] >= 0
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"ab")
    r = cli(path, "--prompt-file", prompt, "--max-new-tokens", 12, "--backend", "ref", "--json",
            "--temperature", 0.9, "--top-k", 20, "--top-p", 0.9, "--seed", 4, "--stop", "never-seen")  # fmt: skip
    again = cli(path, "--prompt", "ab", "--max-new-tokens", 12, "--backend", "ref", "--json",
                "--temperature", 0.9, "--top-k", 20, "--top-p", 0.9, "--seed", 4, "--stop", "never-seen")  # fmt: skip
    assert r.returncode == 0 and json.loads(r.stdout)["token_ids"] == json.loads(again.stdout)["token_ids"]


def test_cli_generate_errors_are_one_line(tmp_path):
    path = byte_model(tmp_path)
    nodraft = byte_model(tmp_path, draft=False)
    bad = tmp_path / "bad.ddlw"
    bad.write_bytes(b"not a model at all")
    cases = [
        ((path, "--prompt", ""), "empty prompt"),
        ((path, "--prompt", "x" * 40), "context"),
        ((nodraft, "--prompt", "hi", "--speculative"), "MTP draft"),
        ((bad, "--prompt", "hi"), "bad.ddlw"),
        ((path, "--prompt", "hi", "--temperature", -1), "temperature"),
        ((path, "--prompt", "hi", "--backend", "tpu"), "backend"),
        ((path, "--prompt", "hi", "--prompt-file", bad), "not both"),
    ]
    for args, words in cases:
        r = cli(*args, "--backend", "ref") if "--backend" not in args else cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and words in errors[0] and "Traceback" not in r.stderr, (args, r.stderr)
