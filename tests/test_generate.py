"""Tests of incremental decoding (`ddl_ref.decode`) and generation (`ddl_wgpu.generate`) on the numpy backend.

The cache: for all six variants, with and without a draft, the trunk fed in pieces (prompt, single tokens,
rows again after a roll-back) gives a full forward's logits at every position; the draft's cached rows give
`ddl_ref.mtp.draft_forward`'s step-1 rows and its stacked chain rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddl_ref import decode, mtp
from ddl_ref import model as ref_model
from ddl_ref.config import ModelConfig, ModelVariant, MtpConfig

try:
    from gradcheck import random_params
except ImportError:  # tests/ imported as a package
    from tests.gradcheck import random_params

VARIANTS = list(ModelVariant)


def tiny_cfg(variant=ModelVariant.BASELINE, **kw) -> ModelConfig:
    base = dict(vocab_size=13, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=6, ffn_hidden=10,
                max_seq_len=12, ddl_conv_kernel=3)  # fmt: skip
    base.update(kw)
    return ModelVariant(variant).resolve_config(ModelConfig(**base))


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
    cfg = tiny_cfg(variant, qk_norm=qk_norm, tie_embeddings=variant != "ddl")
    params = random_params(cfg, seed=3)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 11)
    want, _, _ = ref_model.forward(params, cfg, ids[None])
    pre_want, _ = ref_model.hidden_states(params, cfg, ids[None])
    for cuts in ([5, 6, 7, 8, 9, 10], [1, 2, 3], [4]):  # prompt + single tokens, tiny prompt, two chunks
        pre, got = pieces_logits(params, cfg, ids, cuts)
        np.testing.assert_allclose(got, want[0], rtol=0, atol=1e-10)
        np.testing.assert_allclose(pre, pre_want[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("variant", VARIANTS)
def test_rollback_then_other_tokens(variant):
    cfg = tiny_cfg(variant)
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
    cfg = tiny_cfg()
    cache = decode.TrunkCache(cfg, capacity=4)
    with pytest.raises(ValueError, match="capacity"):
        decode.trunk_step(random_params(cfg), cfg, cache, np.arange(5))


@pytest.mark.parametrize("variant", ["baseline", "ddl-tc"])
@pytest.mark.parametrize(
    "conv", [("emb_first", "pre_norm", "pre_norm"), ("hidden_first", "post_norm", "post_norm")]
)
def test_draft_rows_equal_draft_forward(variant, conv):
    concat, th, ch = conv
    cfg = tiny_cfg(variant, mtp=MtpConfig(concat=concat, trunk_hidden=th, chain_hidden=ch))
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
