"""Whole-model golden tests (docs/architecture.md#tests): the GPU engine against `ddl_ref` — loss, logits and
every parameter gradient; three AdamW steps give the reference's losses; two runs are bit-identical; a frozen
subset stays frozen; snapshot/restore and export/load round-trip."""

import numpy as np
import pytest
from helpers import check_grads, tiny_cfg

from ddl_ref import model as rm
from ddl_ref.check import check
from ddl_ref.optim import adamw_step, clip_multiplier, global_grad_norm
from ddl_ref.params import init_params
from ddl_wgpu.engine.net import Net
from ddl_wgpu.engine.step import AdamW
from ddl_wgpu.engine.trunk import TrunkWork

B, T = 3, 11
LENGTHS = np.array([11, 7, 1])  # a full row, a padded row, a row that predicts nothing


def batch(seed=0, V=61):
    return np.random.default_rng(seed).integers(0, V, (B, T))


CASES = [
    dict(qk_norm="post_rope", tie_embeddings=True),
    dict(qk_norm="pre_rope", tie_embeddings=False),
    dict(qk_norm="none", tie_embeddings=True, norm_style="offset"),
]


@pytest.mark.parametrize("attention", ["auto", "scores"])
@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_loss_logits_and_every_gradient_match_reference(gpu, kw, attention, monkeypatch):
    # "auto" is the flash kernels on a CPU adapter; "scores" the attention GEMMs GPUs run by default
    monkeypatch.setenv("DDL_WGPU_ATTENTION", attention)
    cfg = tiny_cfg("engine", **kw)
    p = init_params(cfg, 3)
    if cfg.norm_style == "offset":  # non-trivial norm weights so the (1+w) path is really exercised
        rng = np.random.default_rng(5)
        p = {
            n: (a + 0.1 * rng.standard_normal(a.shape).astype(np.float32)) if "norm" in n else a
            for n, a in p.items()
        }
    net = Net(gpu, cfg, p, work_class=TrunkWork)
    work = net.work(B, T)
    ids = batch()
    res = work.step(ids, LENGTHS)
    p64 = {n: a.astype(np.float64) for n, a in p.items()}
    logits, loss, cache = rm.forward(p64, cfg, ids, LENGTHS)
    grads = rm.backward(p64, cfg, cache)
    assert res.count == 16
    check("loss", np.float64(res.loss), np.float64(loss), "model")
    check("logits", work.logits(ids), logits, "model")
    got = net.grads()
    check_grads(got, grads)


def test_adamw_steps_follow_reference_and_are_bit_identical(gpu):
    cfg = tiny_cfg("engine")
    p0 = init_params(cfg, 7)
    ids = [batch(s) for s in range(3)]

    def run():
        net = Net(gpu, cfg, p0, work_class=TrunkWork)
        work = net.work(B, T)
        out = []
        for s in range(3):
            r = work.step(ids[s], LENGTHS, AdamW(lr=1e-2, step=s + 1, grad_clip=0.5))
            out.append((r.loss, r.grad_norm))
        return out, net.export()

    (losses_a, params_a), (losses_b, params_b) = run(), run()
    assert losses_a == losses_b
    for n in params_a:
        assert np.array_equal(params_a[n], params_b[n]), f"{n} differs between two identical runs"
    # the reference, float64
    p = {n: a.astype(np.float64) for n, a in p0.items()}
    state = {
        "m": {n: np.zeros_like(a) for n, a in p.items()},
        "v": {n: np.zeros_like(a) for n, a in p.items()},
    }
    for s in range(3):
        _, loss, cache = rm.forward(p, cfg, ids[s], LENGTHS)
        g = rm.backward(p, cfg, cache)
        norm = global_grad_norm(g)
        check(f"loss step {s + 1}", np.float64(losses_a[s][0]), np.float64(loss), "model")
        check(f"grad norm step {s + 1}", np.float64(losses_a[s][1]), np.float64(norm), "model")
        adamw_step(p, g, state, 1e-2, s + 1, 0.9, 0.95, 1e-5, 0.1, clip_multiplier(norm, 0.5))
    for n in p:
        check(n, params_a[n], p[n], "model", atol=5e-4)


def test_frozen_subset_stays_frozen(gpu):
    cfg = tiny_cfg("engine")
    p0 = init_params(cfg, 1)
    only = {n for n in p0 if ".mlp." in n}
    net = Net(gpu, cfg, p0, trainable=only, work_class=TrunkWork)
    net.work(B, T).step(batch(), LENGTHS, AdamW(lr=1e-2, step=1))
    after = net.export()
    for n in p0:
        changed = not np.array_equal(after[n], p0[n])
        assert changed == (n in only), f"{n}: changed={changed}, trainable={n in only}"


def test_snapshot_restore_export_load(gpu):
    cfg = tiny_cfg("engine")
    p0 = init_params(cfg, 2)
    net = Net(gpu, cfg, p0, work_class=TrunkWork)
    snap = net.snapshot()
    net.work(B, T).step(batch(), LENGTHS, AdamW(lr=1e-1, step=1))
    assert not np.array_equal(net.export()["model.norm.weight"], p0["model.norm.weight"])
    net.restore(snap)
    for n, a in net.export().items():
        assert np.array_equal(a, p0[n])
    snap_params = net.export_snapshot(snap)
    assert all(np.array_equal(snap_params[n], p0[n]) for n in p0)


def test_eval_loss_sum_matches_train_loss(gpu):
    cfg = tiny_cfg("engine")
    net = Net(gpu, cfg, init_params(cfg, 4), work_class=TrunkWork)
    work = net.work(B, T)
    s, c = work.loss_sum(batch(), LENGTHS)
    r = work.step(batch(), LENGTHS)
    assert c == r.count == 16
    assert abs(s / c - r.loss) < 1e-6


def test_lm_head_chunks_compose(gpu):
    """Chunked LM head (64-row chunks over 128 rows) gives the same loss and gradients as one chunk."""
    cfg = tiny_cfg("engine", vocab_size=300)
    p = init_params(cfg, 9)
    ids = np.random.default_rng(3).integers(0, 300, (8, 16))
    lengths = np.full(8, 16)
    whole = Net(gpu, cfg, p, work_class=TrunkWork)
    w1 = whole.work(8, 16)
    r1 = w1.step(ids, lengths)
    chunked = Net(gpu, cfg, p)

    w2 = TrunkWork(chunked, 8, 16, chunk_rows=64)
    assert w2.chunk == 64 and w1.chunk == 128
    r2 = w2.step(ids, lengths)
    assert abs(r1.loss - r2.loss) < 1e-6
    g1, g2 = whole.grads(), chunked.grads()
    for n in g1:
        check(n, g2[n], g1[n], "model")


def test_bad_batch_shape_and_token_are_errors(gpu):
    from ddl_wgpu.runtime.gpu import GpuError

    cfg = tiny_cfg("engine")
    with pytest.raises(GpuError, match="without a work class"):
        Net(gpu, cfg, init_params(cfg, 0)).work(B, T)
    work = Net(gpu, cfg, init_params(cfg, 0), work_class=TrunkWork).work(B, T)
    with pytest.raises(GpuError, match="built for"):
        work.step(np.zeros((B, T + 1), int))
    with pytest.raises(GpuError, match="out of range"):
        work.step(np.full((B, T), 61))
