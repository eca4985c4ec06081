"""The GPU decoding engine (`ddl_wgpu.engine.decode.WgpuEngine`) on the test adapter (lavapipe here) against the
numpy reference: logits of a prompt, single tokens and rows after a roll-back equal a full forward's for all
six variants; greedy generation equals the numpy engine's, with and without speculation; the draft's
proposals equal the numpy engine's; seeded sampling is reproducible.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import random_model, tiny_cfg

from ddl_ref import model as ref_model
from ddl_ref.check import check
from ddl_ref.config import ModelVariant, MtpConfig
from ddl_wgpu.data import ByteTokenizer
from ddl_wgpu.engine.decode import WgpuEngine
from ddl_wgpu.engine.refnet import RefEngine
from ddl_wgpu.jobs.generate import Sampling, run

VARIANTS = list(ModelVariant)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpu_decode_logits_equal_forward(gpu, variant):
    # each q/k chain a decoding pass fuses: RoPE alone (rope_store), norm then RoPE, RoPE then norm (qk_finish)
    qk = {"baseline": "none", "ddl": "pre_rope"}.get(str(variant), "post_rope")
    cfg = tiny_cfg("decode", variant, qk_norm=qk)
    model = random_model(cfg, 5, variant)
    ids = np.random.default_rng(4).integers(0, model.cfg.vocab_size, 12)
    want = ref_model.forward(
        {k: v.astype(np.float64) for k, v in model.params.items()}, model.cfg, ids[None]
    )[0][0]
    engine = WgpuEngine(gpu, model)
    got = [engine.feed(ids[:6], "logits")]
    got += [engine.feed(ids[t : t + 1], "logits") for t in range(6, 9)]
    engine.feed(np.array([1, 2, 3]), "logits")  # rejected rows at 9..11
    engine.rollback(9)
    got.append(engine.feed(ids[9:], "logits"))
    check(f"decode logits {variant}", np.concatenate(got), want, "model")
    assert engine.length == 12
    engine.rollback(10)
    assert list(engine.feed(ids[10:], "argmax")) == list(np.argmax(want[10:], axis=-1))
    fresh = WgpuEngine(gpu, model)  # a prompt's head on its last row alone
    check("last row", fresh.feed(ids[:6], "logits", last_only=True), want[5:6], "model")
    fresh.rollback(0)
    assert list(fresh.feed(ids[:7], "argmax", last_only=True)) == [int(np.argmax(want[6]))]


@pytest.mark.parametrize("variant", ["baseline", "ddl-tc", "ddl-cc-noec"])
def test_gpu_greedy_equals_numpy_with_and_without_speculation(gpu, variant):
    model = random_model(tiny_cfg("decode", variant, vocab_size=5, mtp=MtpConfig()), 1, variant)
    want = run(RefEngine(model), ByteTokenizer(), [1, 2, 3], 24, 14)["token_ids"]
    for depth in (0, 2, 3):
        engine = WgpuEngine(gpu, model, depth)
        out = run(engine, ByteTokenizer(), [1, 2, 3], 24, 14, depth=depth)
        assert out["token_ids"] == want, depth
        if depth:
            ref = run(RefEngine(model, depth), ByteTokenizer(), [1, 2, 3], 24, 14, depth=depth)
            assert out["trunk_passes"] == ref["trunk_passes"] and out["mean_accepted"] == ref["mean_accepted"]
            # rounds after one that kept no draft ran from their recording made ahead (random drafts: some),
            # and gave the same tokens
            assert 0 < engine.rounds_ahead < out["rounds"], (engine.rounds_ahead, out["rounds"])


@pytest.mark.parametrize(
    "draft_ffn", [None, 40]
)  # 40: a draft wider than its trunk (after compress --ffn-keep)
def test_gpu_draft_proposals_equal_numpy(gpu, draft_ffn):
    model = random_model(
        tiny_cfg("decode", "ddl-cc", vocab_size=13, mtp=MtpConfig(ffn_hidden=draft_ffn)), 2, "ddl-cc"
    )
    ids = np.random.default_rng(5).integers(0, 13, 10)
    for head in ("argmax", "logits"):
        engines = [RefEngine(model, 3), WgpuEngine(gpu, model, 3)]
        props = []
        for e in engines:
            e.feed(ids[:7], head)
            toks, rows = e.draft(int(ids[7]), 3, head, lambda row: int(np.argmax(row)))
            assert e.dcache.length == 7
            e.rollback(7)
            e.feed(ids[7:9], head)  # two tokens later, the draft catches up two anchors
            toks2, _ = e.draft(int(ids[9]), 2, head, lambda row: int(np.argmax(row)))
            props.append((toks, toks2, rows))
        assert props[0][:2] == props[1][:2]
        if head == "logits":
            check("draft logits", np.array(props[1][2]), np.array(props[0][2]), "model")


@pytest.mark.parametrize("top_k", [6, 0])  # k ids and probabilities read back / the logits
def test_gpu_sampling_reproducible(gpu, top_k):
    model = random_model(tiny_cfg("decode", "baseline", vocab_size=13, mtp=MtpConfig()), 3)
    s = Sampling(temperature=1.0, top_k=top_k, seed=11)
    a = run(WgpuEngine(gpu, model, 2), ByteTokenizer(), [1, 2], 24, 10, s, depth=2)
    b = run(WgpuEngine(gpu, model, 2), ByteTokenizer(), [1, 2], 24, 10, s, depth=2)
    c = run(RefEngine(model, 2), ByteTokenizer(), [1, 2], 24, 10, s, depth=2)
    assert a["token_ids"] == b["token_ids"] == c["token_ids"]
