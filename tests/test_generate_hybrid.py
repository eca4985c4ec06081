"""Tests of incremental and speculative decoding of hybrid trunks (Gated DeltaNet + gated full attention) on
the numpy backend (`ddl_ref.decode`, `ddl_wgpu.engine.refnet.RefEngine`, `ddl_wgpu.jobs.generate.run`).

The cache fed in pieces (prompt, single tokens, rows after a roll-back inside the last pass) gives a full
forward's logits at every position; a verify pass rolled back to its accepted rows leaves, bit for bit, the
cache of a plain decode of those tokens; greedy speculative decoding equals plain decoding with a draft that
is mostly wrong; speculative sampling keeps the trunk's distribution.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_speculative_sampling, hybrid_cfg, random_model, tiny_cfg

from ddl_ref import decode
from ddl_ref import model as ref_model
from ddl_ref.check import random_params
from ddl_ref.config import ModelVariant, MtpConfig
from ddl_wgpu.data import ByteTokenizer
from ddl_wgpu.engine.refnet import RefEngine
from ddl_wgpu.jobs.generate import Sampling, run

VARIANTS = list(ModelVariant)


def params_of(cfg, seed, dtype=np.float64):
    return {n: a.astype(dtype) for n, a in random_params(cfg, seed=seed).items()}


def cache_arrays(cache: decode.TrunkCache) -> dict:
    """Everything the cache holds for positions 0..length−1, by name."""
    n = cache.length
    out = {}
    for i in range(cache.cfg.n_layers):
        if cache.recurrent[i] is not None:
            out[f"window{i}"] = cache.recurrent[i].window
            out[f"state{i}"] = cache.recurrent[i].state
        else:
            out[f"k{i}"], out[f"v{i}"] = cache.k[i][:n], cache.v[i][:n]
    if cache.conv is not None:
        out["tc"] = cache.conv[:, :n]
    if cache.embed is not None:
        out["ec"] = cache.embed[:n]
    return out


# ----------------------------------------------------------------------------------------------------------
# the cache against a full forward


@pytest.mark.parametrize("variant", VARIANTS)
def test_hybrid_cached_trunk_equals_forward(variant):
    cfg = hybrid_cfg("generate", variant, mtp=MtpConfig() if variant in ("baseline", "ddl-tc") else None)
    params = params_of(cfg, 3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 11)
    want, _, _ = ref_model.forward(params, cfg, ids[None])
    pre_want, _ = ref_model.hidden_states(params, cfg, ids[None])
    for cuts in ([5, 6, 7, 8, 9, 10], [1, 2, 3], [4], [2, 3, 7]):  # prompt + tokens, tiny prompt, chunks
        cache = decode.TrunkCache(cfg, dtype=np.float64)
        pres, logits = [], []
        for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True):
            pre, _post, lg = decode.trunk_step(params, cfg, cache, ids[a:b])
            pres.append(pre)
            logits.append(lg)
        np.testing.assert_allclose(np.concatenate(logits), want[0], rtol=0, atol=1e-10)
        np.testing.assert_allclose(np.concatenate(pres), pre_want[0], rtol=0, atol=1e-10)
    # Roll-backs inside the last pass: a 5-row pass of which the first row is right, then a roll-back to the
    # pass's start, then the right rows in two passes with a roll-back of a wrong tail in between.
    rng = np.random.default_rng(1)
    cache = decode.TrunkCache(cfg, dtype=np.float64)
    decode.trunk_step(params, cfg, cache, ids[:4])
    decode.trunk_step(params, cfg, cache, [ids[4], *rng.integers(0, cfg.vocab_size, 4)])
    cache.rollback(6)  # inside the pass (row 5 is a wrong one) ...
    cache.rollback(5)  # ... and again inside the same pass: only row 4 kept
    _, _, got = decode.trunk_step(params, cfg, cache, [*ids[5:8], *rng.integers(0, cfg.vocab_size, 2)])
    np.testing.assert_allclose(got[:3], want[0, 5:8], rtol=0, atol=1e-10)
    cache.rollback(8)
    _, _, got = decode.trunk_step(params, cfg, cache, ids[8:])
    np.testing.assert_allclose(got, want[0, 8:], rtol=0, atol=1e-10)


def test_hybrid_rollback_outside_the_last_pass_is_refused():
    cfg = hybrid_cfg("generate", "baseline")
    params = params_of(cfg, 4)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, 9)
    cache = decode.TrunkCache(cfg, dtype=np.float64)
    decode.trunk_step(params, cfg, cache, ids[:6])
    decode.trunk_step(params, cfg, cache, ids[6:8])
    assert cache.floor == 6
    with pytest.raises(ValueError, match="only inside the last pass .positions 6..8. or at 0"):
        cache.rollback(5)
    assert cache.length == 8  # the refusal changed nothing
    with pytest.raises(ValueError, match="holds 8 positions"):
        cache.rollback(9)
    cache.rollback(0)  # always exact: the empty state
    assert cache.floor == 0
    _, _, got = decode.trunk_step(params, cfg, cache, ids)
    want, _, _ = ref_model.forward(params, cfg, ids[None])
    np.testing.assert_allclose(got, want[0], rtol=0, atol=1e-10)
    # A full-attention trunk's cache rolls back anywhere, as before.
    full = tiny_cfg("generate", "baseline")
    fc = decode.TrunkCache(full)
    decode.trunk_step(params_of(full, 4, np.float32), full, fc, ids[:6])
    decode.trunk_step(params_of(full, 4, np.float32), full, fc, ids[6:8])
    assert fc.floor == 0
    fc.rollback(3)


# ----------------------------------------------------------------------------------------------------------
# a verify pass rolled back equals a plain decode, bit for bit


def test_one_row_products_do_not_depend_on_the_pass():
    """What the cache's bit-exactness rests on (`ddl_ref.decode`'s rows apart): numpy's product of rows
    carried as (n, 1, C) gives each row the bits of that row's product alone."""
    rng = np.random.default_rng(0)
    for dtype in (np.float64, np.float32):
        w = rng.standard_normal((40, 16)).astype(dtype)
        for n in (2, 4, 9):
            x = rng.standard_normal((n, 1, 16)).astype(dtype)
            rows = x @ w.T
            for i in range(n):
                np.testing.assert_array_equal(rows[i : i + 1], x[i : i + 1] @ w.T)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("variant", ["baseline", "ddl", "ddl-tc", "ddl-cc"])
def test_verify_then_rollback_equals_plain_decode_bit_for_bit(variant, dtype):
    cfg = hybrid_cfg("generate", variant)
    params = params_of(cfg, 5, dtype)
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, cfg.vocab_size, 5)
    accepted = rng.integers(0, cfg.vocab_size, 4)  # x_n and the drafts the trunk would keep
    wrong = (accepted + 1 + rng.integers(0, cfg.vocab_size - 1, 4)) % cfg.vocab_size  # drafts it rejects
    K = 3
    for m in range(K + 1):  # m drafts kept
        spec = decode.TrunkCache(cfg, dtype=dtype)
        decode.trunk_step(params, cfg, spec, prompt)
        verify = [*accepted[: m + 1], *wrong[m + 1 :]]  # [x_n, d_1..d_K]: the first m drafts right
        _, _, vlogits = decode.trunk_step(params, cfg, spec, verify)
        after_all = {n: a.copy() for n, a in cache_arrays(spec).items()}
        spec.rollback(len(prompt) + 1 + m)
        plain = decode.TrunkCache(cfg, dtype=dtype)
        decode.trunk_step(params, cfg, plain, prompt)
        plogits = [decode.trunk_step(params, cfg, plain, [t])[2][0] for t in accepted[: m + 1]]
        got, want = cache_arrays(spec), cache_arrays(plain)
        assert spec.length == plain.length and got.keys() == want.keys()
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{name}, {m} kept")
        np.testing.assert_array_equal(vlogits[: m + 1], np.stack(plogits))
        if m < K:  # the test can fail: the state after the whole verify pass is another one
            assert not np.array_equal(after_all["state2"], want["state2"])
        # and both continue alike
        nxt = [int(wrong[0])]
        np.testing.assert_array_equal(decode.trunk_step(params, cfg, spec, nxt)[2],
                                      decode.trunk_step(params, cfg, plain, nxt)[2])  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# generation


def gen(model, prompt, depth=0, sampling=Sampling(), max_new=20):
    engine = RefEngine(model, depth)
    return run(engine, ByteTokenizer(), prompt, model.cfg.max_seq_len, max_new, sampling, (), None, depth)


@pytest.mark.parametrize("variant", ["baseline", "ddl", "ddl-tc"])
def test_hybrid_greedy_speculative_equals_plain(variant):
    """Random draft weights: a draft that is wrong most of the time, right by chance on a vocabulary of 4."""
    kept = rejected = 0
    for seed in range(3):
        cfg = hybrid_cfg("generate", variant, vocab_size=4, max_seq_len=24, mtp=MtpConfig())
        model = random_model(cfg, seed, variant)
        plain = gen(model, [1, 2, 3], max_new=18)
        assert plain["new_tokens"] == 18 and plain["finish_reason"] == "length"
        for depth in (1, 2, 3):
            spec = gen(model, [1, 2, 3], depth=depth, max_new=18)
            assert spec["token_ids"] == plain["token_ids"], (seed, depth)
            kept += round(spec["mean_accepted"] * spec["rounds"])
            rejected += spec["rounds"] - round(spec["acceptance_per_depth"][-1] * spec["rounds"])
    assert kept > 0 and rejected > 0  # both the accept and the reject paths ran


def test_hybrid_speculative_sampling_preserves_trunk_distribution():
    """helpers.check_speculative_sampling on a two-block hybrid (a Gated DeltaNet, then gated attention): a
    rejection at depth 1 or 2 rolls the recurrent state back inside the verify pass."""
    cfg = hybrid_cfg("generate", "baseline", vocab_size=3, max_seq_len=8, n_layers=2,
                     layer_types=("linear_attention", "full_attention"), mtp=MtpConfig())  # fmt: skip
    check_speculative_sampling(random_model(cfg, 2), gen, 3000)
