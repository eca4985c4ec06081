"""The GPU decoding engine (`ddl_wgpu.engine.decode.WgpuEngine`) on hybrid (Qwen3.5) trunks, on the test adapter:
Gated DeltaNet layers (their conv window and recurrent state in the cache) mixed with gated full attention and
partial RoPE, offset norms, pre-RoPE q/k norm. Logits equal a float64 full forward's at every position, fed
in pieces (a prompt, single tokens, rows after a roll-back to a short pass's start and inside it, to a long
pass's start, after a reset); the roll-backs the cache cannot serve are refused; greedy text equals the
trunk's argmax chain (a full forward per token) with and without
speculation, rejections included; seeded speculative sampling repeats; the state after a partial acceptance
is bit for bit a plain decode's; the Qwen3.5-form draft (gated, partial RoPE) proposes `accept`'s greedy
stacked chain; a greedy step run ahead, taken and forgotten; an f16 trunk's stacked and fused products.

Shapes: Dk 6 and Dv 5 (the rule pads both), Hv = 2·Hk, a conv of 4 taps (a window of 3, longer than a
one- or two-row pass), a head of 8 with 4 dims rotated.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from helpers import hybrid_cfg, random_model

from ddl_ref import model as ref_model
from ddl_ref.check import check
from ddl_ref.config import MtpConfig
from ddl_wgpu.data import ByteTokenizer
from ddl_wgpu.engine.decode import WgpuEngine
from ddl_wgpu.engine.layout import is_f16_matrix
from ddl_wgpu.engine.refnet import ref_runner
from ddl_wgpu.jobs import accept
from ddl_wgpu.jobs.generate import Sampling, run
from ddl_wgpu.runtime.gpu import GpuError

SHAPE = dict(rotary_dim=4, linear_k_dim=6, linear_v_dim=5, linear_conv_kernel=4)  # the docstring's shapes
GDN_LAYERS = (0, 2)


def hybrid(variant="baseline", seed=5, **overrides):
    return random_model(hybrid_cfg("decode", variant, **{**SHAPE, **overrides}), seed, variant)


def forward64(model, ids) -> np.ndarray:
    p64 = {k: v.astype(np.float64) for k, v in model.params.items()}
    return ref_model.forward(p64, model.cfg, np.asarray(ids)[None])[0][0]


def argmax_chain(model, prompt, n: int) -> list[int]:
    """The trunk's greedy continuation, one float64 full forward per token (no cache involved)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(np.argmax(forward64(model, seq)[-1])))
    return seq[len(prompt) :]


@pytest.mark.parametrize("variant", ["baseline", "ddl-tc"])  # ddl-tc: per-layer activations, TC histories
def test_hybrid_decode_logits_equal_forward(gpu, variant):
    model = hybrid(variant)
    ids = np.random.default_rng(4).integers(0, model.cfg.vocab_size, 14)
    want = forward64(model, ids)
    engine = WgpuEngine(gpu, model)  # keeps every row's state for passes of up to 3 rows (the window)

    def feed(start, stop):
        assert engine.length == start
        check(f"{variant} rows {start}..{stop - 1}", engine.feed(ids[start:stop], "logits"), want[start:stop],
              "model")  # fmt: skip

    feed(0, 6)  # a prefill longer than that: its start and end only
    feed(6, 7)
    feed(7, 8)
    engine.feed(np.array([1, 2, 3]), "logits")  # rejected rows at 8..10
    engine.rollback(8)  # to the pass's start
    feed(8, 11)
    engine.rollback(9)  # inside the pass: its row 0 kept, rows 1.. forgotten
    feed(9, 11)
    engine.feed([ids[11], (ids[12] + 1) % 19], "argmax")
    engine.rollback(12)  # the pass was 11..12: keeps its first row, forgets a wrong second
    feed(12, 14)
    assert engine.length == 14
    engine.rollback(13)
    assert list(engine.feed(ids[13:], "argmax")) == [int(np.argmax(want[13]))]

    with pytest.raises(GpuError, match="last pass only"):
        engine.rollback(12)  # before the last pass (13..13)
    engine.rollback(0)  # a reset: zero window and state
    assert list(engine.feed(ids[:5], "argmax", last_only=True)) == [int(np.argmax(want[4]))]
    with pytest.raises(GpuError, match="start and end only"):
        engine.rollback(3)  # inside a pass of 5 rows (more than 3)
    engine.rollback(5)  # its end: nothing to do
    feed(5, 7)
    engine.feed(np.array([4, 3, 2, 1]), "argmax")  # a long pass (4 rows) away from 0, rejected
    engine.rollback(7)  # its start: the state before it, the window before it
    feed(7, 11)


def _greedy(model, engine, depth, prompt, n):
    return run(engine, ByteTokenizer(), prompt, model.cfg.max_seq_len, n, depth=depth)


def test_hybrid_greedy_same_with_and_without_speculation(gpu):
    """A random draft over 5 tokens is wrong on purpose most of the time: the rounds both keep and reject (a
    round after a rejection runs from its recording made while the rejected one ran, its token copied on the
    GPU, after the Gated DeltaNet layers' roll-back)."""
    model = hybrid(seed=1, vocab_size=5, mtp=MtpConfig())
    prompt, n = [1, 2, 3], 16
    want = argmax_chain(model, prompt, n)
    assert _greedy(model, WgpuEngine(gpu, model), 0, prompt, n)["token_ids"] == want
    for depth in (2, 3):
        engine = WgpuEngine(gpu, model, depth)
        out = _greedy(model, engine, depth, prompt, n)
        assert out["token_ids"] == want, depth
        acc = out["acceptance_per_depth"]
        assert 0 < acc[0] < 1, acc  # some rounds keep a draft, some reject the first
        assert 0 < out["mean_accepted"] < depth
        assert engine.rounds_ahead > 0  # rounds after a rejection ran from their recording made ahead


@pytest.mark.parametrize("top_k", [6, 0])  # k ids and probabilities read back / the logits
def test_hybrid_speculative_sampling_reproducible(gpu, top_k):
    """Sampling drafts (`draft`), verifies them in a `feed` and rolls back: the same seed, the same text."""
    model = hybrid(seed=3, vocab_size=7, mtp=MtpConfig())
    s = Sampling(temperature=1.0, top_k=top_k, seed=11)
    a, b = (run(WgpuEngine(gpu, model, 2), ByteTokenizer(), [1, 2], 24, 10, s, depth=2) for _ in range(2))
    assert a["token_ids"] == b["token_ids"] and a["rounds"] > 0


def test_state_after_partial_acceptance_is_a_plain_decodes(gpu):
    """A speculative round (one submit: draft chain + verify of K + 1 rows) rolled back to each acceptance
    length leaves the Gated DeltaNet windows and states that feeding the accepted tokens one by one leaves,
    bit for bit, and the next token's logits with them."""
    model = hybrid(seed=2, vocab_size=7, mtp=MtpConfig())
    prompt, token, depth = [3, 1, 4, 1, 5], 2, 3
    spec = WgpuEngine(gpu, model, depth)
    spec.feed(prompt, "argmax", last_only=True)
    drafts, _ = spec.round(token, depth)
    plain = WgpuEngine(gpu, model)
    plain.feed(prompt, "argmax", last_only=True)
    snaps = []  # after prompt + token + m drafts
    for t in [token, *drafts]:
        logits = plain.feed([t], "logits")
        snaps.append(([plain.trunk.recurrent(i) for i in GDN_LAYERS], logits))
    n = len(prompt)
    for m in reversed(range(depth + 1)):  # every length inside the verify pass, latest first
        spec.rollback(n + 1 + m)
        for i, (win, state) in zip(GDN_LAYERS, snaps[m][0], strict=True):
            got_win, got_state = spec.trunk.recurrent(i)
            assert np.array_equal(got_win, win) and np.array_equal(got_state, state), (m, i)
    # the plain engine at length n + 1 + m for m = 0: the next row from the rolled-back cache is its row
    rows = spec.feed([drafts[0]], "logits")
    assert np.array_equal(rows, snaps[1][1])
    assert spec.trunk.recurrent(0)[1].any()  # a zero state would compare equal to anything zeroed


def test_qwen35_draft_proposes_the_stacked_chain(gpu):
    """The hybrid's draft (a gated full-attention block with partial RoPE and offset norms) on the GPU
    proposes what `accept`'s greedy stacked chain (numpy, whole windows) does, at several anchors."""
    model = hybrid(seed=11, vocab_size=13, max_seq_len=16, mtp=MtpConfig())
    ids = np.random.default_rng(3).integers(0, 13, 12)
    (tb,) = accept.trunk_batches(model, [ids])
    depth = 3
    preds = accept.greedy_chain(model.params, model.cfg, tb, depth, ref_runner(model.params, model.cfg),
                                "stacked")  # fmt: skip
    engine = WgpuEngine(gpu, model, depth)
    engine.feed(ids[:1], "argmax")
    for p in (0, 4, 7):  # the draft catches up the anchors in between
        if p:
            engine.feed(ids[engine.length : p + 1], "argmax")
        tokens, _ = engine.draft(int(ids[p + 1]), depth, "argmax", None)
        assert tokens == [int(t) for t in preds[0, :, p]], p
        assert engine.dcache.length == p + 1


def test_greedy_step_run_ahead(gpu):
    """`feed(..., ahead=True)` runs the next token on the GPU before the host asks (its input the argmax, copied
    on the GPU). Taken (the argmax fed back), the logits and the Gated DeltaNet states are bit for bit those
    of plain one-token feeds; not taken (another token fed, or a roll-back), it is forgotten: the state goes
    back to before it, and only a roll-back into the token that ran it ahead is refused."""
    model = hybrid(seed=6, vocab_size=11)
    prompt = [3, 1, 4, 1]
    fast, plain = WgpuEngine(gpu, model), WgpuEngine(gpu, model)
    tok = [int(e.feed(prompt, "argmax", last_only=True)[0]) for e in (fast, plain)][0]
    for _ in range(4):  # taken: each argmax fed back
        got = int(fast.feed([tok], "argmax", ahead=True)[0])
        assert got == int(plain.feed([tok], "argmax")[0])
        tok = got
    other = (tok + 1) % 11  # not taken: another token
    assert np.array_equal(fast.feed([other], "logits"), plain.feed([other], "logits"))
    for i in GDN_LAYERS:
        for a, b in zip(fast.trunk.recurrent(i), plain.trunk.recurrent(i), strict=True):
            assert np.array_equal(a, b), i
    fast.feed([other], "argmax", ahead=True)  # runs ahead at the next position
    plain.feed([other], "argmax")
    n = fast.length
    fast.rollback(n)  # a roll-back to the length: the token run ahead is forgotten
    for i in GDN_LAYERS:
        for a, b in zip(fast.trunk.recurrent(i), plain.trunk.recurrent(i), strict=True):
            assert np.array_equal(a, b), i
    with pytest.raises(GpuError, match="last pass only"):
        fast.rollback(n - 1)  # into the token that ran ahead: its state before is gone
    fast.rollback(0)  # a reset is always exact
    assert fast.length == 0


def test_f16_trunk_decode_logits(gpu):
    """`--trunk-dtype f16`: the decode passes' stacked and fused f16 products (q|gate / k / v, a Gated DeltaNet's
    four projections, gate/up/SwiGLU) give a float64 forward's logits over the f16-rounded weights, fed in
    pieces."""
    if "shader-f16" not in gpu.features:
        pytest.skip("the adapter has no shader-f16")
    model = hybrid(seed=8, ffn_hidden=24)
    rounded = {k: v.astype(np.float16).astype(np.float32) if is_f16_matrix(k, v.shape) else v
               for k, v in model.params.items()}  # fmt: skip
    ids = np.random.default_rng(9).integers(0, model.cfg.vocab_size, 10)
    want = forward64(dataclasses.replace(model, params=rounded), ids)
    engine = WgpuEngine(gpu, model, dtype="f16")
    got = [engine.feed(ids[:4], "logits")] + [engine.feed(ids[t : t + 1], "logits") for t in range(4, 7)]
    got.append(engine.feed(ids[7:], "logits"))
    check("f16 decode logits", np.concatenate(got), want, "model")
