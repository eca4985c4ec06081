"""Mixed-precision training (`TrunkWork(precision="f16")`, `train --precision f16`) against `ddl_ref`.

Tolerances are derived from the chunk length: one f16-product GEMM is off by at most EPS relative to the sum
of its |products| (`ops.matmul.f16_rel_bound` at F16_CHUNK). First-order, each GEMM on the
path from the embedding to the logits adds at most EPS (the residual stream adds errors rather than
compounding them; the norms and the softmax are taken as not amplifying), so the logits are within
FWD_DEPTH·EPS (normwise) and every gradient, whose path runs back through the same GEMMs, within
2·FWD_DEPTH·EPS. FWD_DEPTH per block: q/k/v projection, QKᵀ, PV, o projection, gate/up, down (6), plus the
LM head. The f32 path is covered (bit-exact to before) by tests/test_engine.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import tiny_cfg

from ddl_ref import model as rm
from ddl_ref.params import init_params
from ddl_wgpu.net import Net
from ddl_wgpu.ops.matmul import F16_CHUNK, f16_rel_bound
from ddl_wgpu.step import AdamW
from ddl_wgpu.trunk import LossScale, TrunkWork

B, T = 3, 11  # test_engine's shapes
LENGTHS = np.array([11, 7, 1])  # a full row, a padded row, a row that predicts nothing


def batch(seed=0, V=61):
    return np.random.default_rng(seed).integers(0, V, (B, T))


EPS = f16_rel_bound(1024, F16_CHUNK)  # 1.8 % at chunk 16; K barely matters (f32 across chunks)


def fwd_depth(cfg) -> int:
    return 6 * cfg.n_layers + 1


def normwise(got, ref) -> float:
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("attention", ["auto", "scores"])
def test_f16_step_loss_logits_and_gradients_within_derived_tolerance(gpu, attention, monkeypatch):
    monkeypatch.setenv("DDL_WGPU_ATTENTION", attention)  # scores: attention's products in f16 too
    cfg = tiny_cfg("engine", qk_norm="post_rope", tie_embeddings=True)
    p = init_params(cfg, 3)
    p64 = {n: a.astype(np.float64) for n, a in p.items()}
    ids = batch()
    logits, loss, cache = rm.forward(p64, cfg, ids, LENGTHS)
    grads = rm.backward(p64, cfg, cache)
    net = Net(gpu, cfg, p)
    work = TrunkWork(net, B, T, precision="f16")
    res = work.step(ids, LENGTHS)
    fwd_tol = fwd_depth(cfg) * EPS
    got_logits = work.logits(ids)
    assert normwise(got_logits, logits) <= fwd_tol
    assert abs(res.loss - loss) <= 2 * fwd_tol * np.abs(logits).max()
    got = net.grads()
    worst = {name: normwise(got[name], g) for name, g in grads.items()}
    assert max(worst.values()) <= 2 * fwd_tol, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    # and the f16 products were really used: the errors are well above the f32 engine's (~1e-6)
    assert max(worst.values()) > 1e-4


def test_loss_scaling_skips_a_non_finite_step(gpu):
    cfg = tiny_cfg("engine")
    p = init_params(cfg, 7)
    ids = batch(1)
    hyper = AdamW(lr=1e-2, step=1)
    net = Net(gpu, cfg, p)
    work = TrunkWork(net, B, T, precision="f16")
    work.loss_scale.scale = 2.0**30  # the logits' gradient alone (2^30 / 16) overflows f16
    res = work.step(ids, LENGTHS, update=hyper)
    ls = work.loss_scale
    assert res.finite and np.isfinite(res.loss)
    assert ls.skipped >= 1 and ls.scale == 2.0**30 / 2**ls.skipped and ls.good == 1
    # the skipped attempts left no trace: the same step run directly at the final scale gives the same bits
    net2 = Net(gpu, cfg, p)
    work2 = TrunkWork(net2, B, T, precision="f16")
    work2.loss_scale.scale = ls.scale
    res2 = work2.step(ids, LENGTHS, update=hyper)
    assert work2.loss_scale.skipped == 0 and res2.loss == res.loss
    for name, a in net.export().items():
        np.testing.assert_array_equal(a, net2.export()[name], err_msg=name)
    for m1, m2 in zip(net.moments(), net2.moments(), strict=True):
        for name in m1:
            np.testing.assert_array_equal(m1[name], m2[name], err_msg=name)
    # the step did update: parameters moved from p
    assert any(not np.array_equal(a, p[n]) for n, a in net.export().items())


def test_f16_adamw_steps_track_f32(gpu):
    # three optimizer steps: f16 losses stay within the forward's tolerance of the f32 engine's
    cfg = tiny_cfg("engine")
    p = init_params(cfg, 11)
    losses = {}
    for prec in ("f32", "f16"):
        net = Net(gpu, cfg, p)
        work = TrunkWork(net, B, T, precision=prec)
        losses[prec] = [
            work.step(batch(s), LENGTHS, update=AdamW(lr=3e-3, step=s + 1)).loss for s in range(3)
        ]
    tol = 2 * fwd_depth(cfg) * EPS * 10.0  # 10: a generous bound on |logits| of this tiny model
    assert np.allclose(losses["f16"], losses["f32"], rtol=0, atol=tol)
    assert losses["f16"] != losses["f32"]


def test_loss_scale_rule():
    ls = LossScale(scale=8.0, growth_interval=3, min_scale=2.0, max_scale=16.0)
    for finite, scale in [(True, 8), (True, 8), (True, 16), (True, 16), (True, 16), (True, 16), (False, 8),
                          (False, 4), (False, 2), (False, 2), (True, 2)]:  # fmt: skip
        ls.update(finite)
        assert ls.scale == scale
    assert ls.skipped == 4 and ls.good == 1


def test_precision_is_checked(gpu):
    with pytest.raises(Exception, match="precision"):
        TrunkWork(Net(gpu, tiny_cfg("engine"), init_params(tiny_cfg("engine"), 0)), B, T, precision="bf16")


def test_train_runs_f16_through_make_net(gpu):
    # `train --precision f16` builds its net through make_net: f16 works carry a loss scale; the numpy
    # backend refuses
    from ddl_wgpu.backend import BackendError, make_net

    cfg = tiny_cfg("engine")
    net = make_net(cfg, None, "wgpu", None, precision="f16")
    assert net.work(B, T).loss_scale is not None and net.work(B, T).precision == "f16"
    assert make_net(cfg, None, "wgpu", None).work(B, T).loss_scale is None
    with pytest.raises(BackendError, match="wgpu backend only"):
        make_net(cfg, None, "ref", None, precision="f16")
