"""Tests of the reference MTP draft (`ddl_ref.mtp`) and its parameter-table entries.

Finite differences in float64 for the block input, the draft block with its final norm, and the top-k KL through
the whole draft (input rows and every trained tensor); the concat-order switch; the pre/post-norm hidden choices
of a chain.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import tiny_cfg

from ddl_ref import model as ref_model
from ddl_ref import mtp, ops
from ddl_ref.check import assert_fd_grad, check_grad, fakeloss, random_params
from ddl_ref.config import MtpConfig
from ddl_ref.params import init_params, param_table

# ----------------------------------------------------------------------------------------------------------
# parameter table


@pytest.mark.parametrize("qk_norm", ["none", "pre_rope"])
def test_param_table_mtp_entries(qk_norm):
    cfg = tiny_cfg("mtp", qk_norm=qk_norm, norm_style="offset")
    table = {s.name: s for s in param_table(cfg)}
    base = [s.name for s in param_table(tiny_cfg("mtp", qk_norm=qk_norm, norm_style="offset", mtp=None))]
    names = list(table)
    assert names[: len(base)] == base  # the trunk's layout never moves
    extra = names[len(base) :]
    C = cfg.d_model
    assert extra[:3] == ["model.mtp.enorm.weight", "model.mtp.hnorm.weight", "model.mtp.eh_proj.weight"]
    assert extra[-1] == "model.mtp.norm.weight"
    block = [n[len("model.mtp.layers.0.") :] for n in extra[3:-1]]
    trunk0 = [
        s.name[len("model.layers.0.") :] for s in param_table(cfg) if s.name.startswith("model.layers.0.")
    ]
    assert block == trunk0
    assert ("self_attn.q_norm.weight" in block) == (qk_norm != "none")
    assert table["model.mtp.eh_proj.weight"].shape == (C, 2 * C)
    assert table["model.mtp.eh_proj.weight"].init == f"normal:{0.5 / math.sqrt(2 * C)!r}"
    assert table["model.mtp.enorm.weight"].init == "zeros"  # offset style: (1 + w) with w = 0
    p = init_params(cfg, 0)
    assert set(p) == set(table)


# ----------------------------------------------------------------------------------------------------------
# gradient checks


@pytest.mark.parametrize("concat", ["emb_first", "hidden_first"])
@pytest.mark.parametrize("norm_style", ["standard", "offset"])
def test_draft_input_grad(concat, norm_style):
    cfg = tiny_cfg("mtp", mtp=MtpConfig(concat=concat), norm_style=norm_style)
    rng = np.random.default_rng(1)
    C = cfg.d_model
    inputs = [rng.standard_normal((2, 3, C)), rng.standard_normal((2, 3, C)), rng.standard_normal(C),
              rng.standard_normal(C), rng.standard_normal((C, 2 * C)) * 0.5]  # fmt: skip

    def fwd(e, h, we, wh, weh):
        return mtp.draft_input_forward(e, h, we, wh, weh, cfg)[0]

    def bwd(_out, dout, e, h, we, wh, weh):
        return mtp.draft_input_backward(dout, mtp.draft_input_forward(e, h, we, wh, weh, cfg)[1])

    check_grad(fwd, bwd, inputs, rtol=1e-6)


@pytest.mark.parametrize("qk_norm", ["none", "pre_rope", "post_rope"])
def test_draft_block_grad(qk_norm):
    # A DDL trunk: the draft block must still be a baseline block.
    cfg = tiny_cfg(
        "mtp",
        qk_norm=qk_norm,
        residual="delta",
        norm_style="offset" if qk_norm == "none" else "standard",
    )
    params = random_params(cfg, 2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, cfg.d_model))
    dpre = rng.standard_normal(x.shape)
    dpost = rng.standard_normal(x.shape)

    def loss():
        pre, post, _ = mtp.draft_forward(params, cfg, x)
        return fakeloss((pre, post), (dpre, dpost))

    _pre, _post, cache = mtp.draft_forward(params, cfg, x)
    dx, grads = mtp.draft_backward(params, cfg, cache, dpost, dpre)
    assert set(grads) == set(mtp.trained_names(params))
    magnitude = fakeloss((np.abs(_pre), np.abs(_post)), (np.abs(dpre), np.abs(dpost)))  # the terms cancel
    assert_fd_grad("x", dx, loss, x, magnitude=magnitude)
    for name, g in grads.items():
        assert_fd_grad(name, g, loss, params[name], magnitude=magnitude)


@pytest.mark.parametrize("form", ["full", "topk"])
@pytest.mark.parametrize("tie", [True, False])
def test_topk_kl_through_draft_grad(tie, form):
    cfg = tiny_cfg("mtp", tie_embeddings=tie, qk_norm="pre_rope")
    params = random_params(cfg, 4)
    rng = np.random.default_rng(5)
    B, T, k = 2, 6, 4
    x = rng.standard_normal((B, T, cfg.d_model))
    tid = np.stack([rng.permutation(cfg.vocab_size)[:k] for _ in range(B * T)]).reshape(B, T, k)
    tp = rng.uniform(0.01, 1.0, (B, T, k))
    w = (rng.uniform(size=(B, T)) > 0.3).astype(np.float64)

    def loss():
        return mtp.draft_kl_forward(params, cfg, x, tid, tp, w, form=form)[0]

    _kl, cache = mtp.draft_kl_forward(params, cfg, x, tid, tp, w, form=form)
    dx, grads = mtp.draft_kl_backward(params, cfg, cache)
    assert_fd_grad("x", dx, loss, x)
    for name, g in grads.items():
        assert_fd_grad(name, g, loss, params[name])
    # dloss scales linearly (the loss scale of heal)
    dx2, grads2 = mtp.draft_kl_backward(params, cfg, cache, dloss=4.0)
    assert np.allclose(dx2, 4.0 * dx)


def test_stacked_chain_kl_grad_and_head_on_the_last_step():
    """Stacked chain steps: the KL reads step `chain`'s rows alone (a weight given to an earlier step's row
    changes nothing), and its backward, through the chain-masked attention into every row, matches finite
    differences in float64."""
    cfg = tiny_cfg("mtp", qk_norm="pre_rope")
    params = random_params(cfg, 4)
    rng = np.random.default_rng(6)
    B, W, j, k = 2, 4, 3, 4
    T = j * W
    x = rng.standard_normal((B, T, cfg.d_model))
    tid = np.stack([rng.permutation(cfg.vocab_size)[:k] for _ in range(B * T)]).reshape(B, T, k)
    tp = rng.uniform(0.01, 1.0, (B, T, k))
    w = np.zeros((B, T))
    w[:, -W:] = (rng.uniform(size=(B, W)) > 0.3).astype(np.float64)

    def loss():
        return mtp.draft_kl_forward(params, cfg, x, tid, tp, w, chain=j)[0]

    kl, cache = mtp.draft_kl_forward(params, cfg, x, tid, tp, w, chain=j)
    # the same sum as the KL over every row with the earlier steps' rows weighted 0, and weights on those
    # rows are ignored
    pre, post, _ = mtp.draft_forward(params, cfg, x, chain=j)
    full, _ = ops.topk_kl_forward(mtp.draft_logits(params, cfg, post).reshape(B * T, -1), tid.reshape(B * T, k),
                                  tp.reshape(B * T, k), w.reshape(B * T), "full")  # fmt: skip
    assert kl == pytest.approx(full, rel=1e-12)
    w_early = w.copy()
    w_early[:, : T - W] = 1.0
    assert mtp.draft_kl_forward(params, cfg, x, tid, tp, w_early, chain=j)[0] == kl
    dx, grads = mtp.draft_kl_backward(params, cfg, cache)
    assert np.abs(dx[:, : T - W]).max() > 0  # the earlier steps' rows feed step j through the attention
    assert_fd_grad("x", dx, loss, x)
    for name, g in grads.items():
        assert_fd_grad(name, g, loss, params[name])


# ----------------------------------------------------------------------------------------------------------
# conventions


def test_concat_order_switch():
    cfg_e = tiny_cfg("mtp", mtp=MtpConfig(concat="emb_first"))
    cfg_h = tiny_cfg("mtp", mtp=MtpConfig(concat="hidden_first"))
    rng = np.random.default_rng(6)
    C = cfg_e.d_model
    e, h = rng.standard_normal((3, C)), rng.standard_normal((3, C))
    we, wh, weh = rng.standard_normal(C), rng.standard_normal(C), rng.standard_normal((C, 2 * C))
    x_e = mtp.draft_input_forward(e, h, we, wh, weh, cfg_e)[0]
    swapped = np.concatenate([weh[:, C:], weh[:, :C]], axis=1)
    x_h = mtp.draft_input_forward(e, h, we, wh, swapped, cfg_h)[0]
    assert np.allclose(x_e, x_h)
    # columns [:C] multiply the embedding for emb_first
    en = ops.rmsnorm_forward(e, we, cfg_e.rms_eps)[0]
    hn = ops.rmsnorm_forward(h, wh, cfg_e.rms_eps)[0]
    assert np.allclose(x_e, en @ weh[:, :C].T + hn @ weh[:, C:].T)
    assert not np.allclose(x_e, mtp.draft_input_forward(e, h, we, wh, weh, cfg_h)[0])


@pytest.mark.parametrize("trunk_hidden", ["pre_norm", "post_norm"])
@pytest.mark.parametrize("chain_hidden", ["pre_norm", "post_norm"])
def test_hidden_choices_in_chain(trunk_hidden, chain_hidden):
    cfg = tiny_cfg("mtp", mtp=MtpConfig(trunk_hidden=trunk_hidden, chain_hidden=chain_hidden))
    params = random_params(cfg, 7)
    rng = np.random.default_rng(8)
    ids = rng.integers(0, cfg.vocab_size, (2, 7))
    lengths = np.array([7, 5])
    tpre, tpost = ref_model.hidden_states(params, cfg, ids)
    logits = mtp.draft_chain(params, cfg, ids, lengths, tpre, tpost, 2, tokens="greedy")
    # by hand
    hid = tpre if trunk_hidden == "pre_norm" else tpost
    valid = np.arange(7)[None] + 1 < lengths[:, None]
    e = params["model.embed_tokens.weight"][mtp.shifted(ids, 1)]
    x, _ = mtp.draft_input_forward(e, hid, params[mtp.ENORM], params[mtp.HNORM], params[mtp.EH_PROJ], cfg)
    x = np.where(valid[..., None], x, 0.0)
    pre, post, _ = mtp.draft_forward(params, cfg, x)
    l1 = post @ params["model.embed_tokens.weight"].T
    assert np.allclose(logits[0], l1)
    hid2 = pre if chain_hidden == "pre_norm" else post
    e2 = params["model.embed_tokens.weight"][np.argmax(l1, axis=-1)]
    x2, _ = mtp.draft_input_forward(e2, hid2, params[mtp.ENORM], params[mtp.HNORM], params[mtp.EH_PROJ], cfg)
    x2 = np.where(valid[..., None], x2, 0.0)
    assert np.allclose(
        logits[1], mtp.draft_forward(params, cfg, x2)[1] @ params["model.embed_tokens.weight"].T
    )
    # the other trunk convention gives a different first step
    other = MtpConfig(trunk_hidden="post_norm" if trunk_hidden == "pre_norm" else "pre_norm")
    cfg2 = tiny_cfg("mtp", mtp=other)
    assert not np.allclose(mtp.draft_chain(params, cfg2, ids, lengths, tpre, tpost, 1)[0], l1)


def test_draft_rows_are_causal_and_padding_free():
    cfg = tiny_cfg("mtp")
    params = random_params(cfg, 9)
    rng = np.random.default_rng(10)
    x = rng.standard_normal((1, 6, cfg.d_model))
    y = x.copy()
    y[:, 4:] = 0.0  # rows past a window's end
    a = mtp.draft_forward(params, cfg, x)[1]
    b = mtp.draft_forward(params, cfg, y)[1]
    assert np.allclose(a[:, :4], b[:, :4])
