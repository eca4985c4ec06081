"""The engine against `ddl_ref` for every variant: loss, logits and every parameter gradient; a few AdamW
steps; the spectral diagnostics of a DDL forward, GPU vs reference."""

import numpy as np
import pytest
from helpers import check_grads, tiny_cfg

from ddl_ref import model as rm
from ddl_ref.check import check
from ddl_ref.config import ModelVariant
from ddl_ref.params import init_params
from ddl_ref.spectral import LAYER_KEYS
from ddl_wgpu.engine.net import Net
from ddl_wgpu.engine.refnet import RefNet
from ddl_wgpu.engine.step import AdamW
from ddl_wgpu.engine.trunk import TrunkWork

B, T = 2, 9
LENGTHS = np.array([9, 5])
VARIANTS = [v for v in ModelVariant]


def perturbed(cfg, seed):
    """Init params plus noise on the DDL heads and convs, so identity-initialised pieces are exercised."""
    p = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    for n, a in p.items():
        if any(s in n for s in ("ddl_", "compress", "readout", "embed_expand")):
            p[n] = (a + 0.2 * rng.standard_normal(a.shape)).astype(np.float32)
    return p


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.slug)
def test_variant_matches_reference(gpu, variant):
    cfg = tiny_cfg("ddl", variant)
    p = perturbed(cfg, 11)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (B, T))
    net = Net(gpu, cfg, p, work_class=TrunkWork)
    work = net.work(B, T)
    res = work.step(ids, LENGTHS)
    p64 = {n: a.astype(np.float64) for n, a in p.items()}
    logits, loss, cache = rm.forward(p64, cfg, ids, LENGTHS)
    grads = rm.backward(p64, cfg, cache)
    check(f"{variant.slug} loss", np.float64(res.loss), np.float64(loss), "model")
    check(f"{variant.slug} logits", work.logits(ids), logits, "model")
    got = net.grads()
    check_grads(got, grads, f"{variant.slug} ")


@pytest.mark.parametrize("variant", [ModelVariant.DDL, ModelVariant.DDL_CC], ids=lambda v: v.slug)
def test_spectral_gpu_matches_reference(gpu, variant):
    cfg = tiny_cfg("ddl", variant)
    p = perturbed(cfg, 3)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (B, T))
    got = Net(gpu, cfg, p, work_class=TrunkWork).work(B, T).spectral(ids, LENGTHS)
    want = RefNet(cfg, p).work(B, T).spectral(ids, LENGTHS)
    assert got is not None and want is not None
    for key in LAYER_KEYS:
        assert len(got[key]) == 2 * cfg.n_layers
        check(f"spectral {key}", np.array(got[key]), np.array(want[key]), "model")
    assert got["regime_per_layer"] == want["regime_per_layer"]
    assert got["beta_histogram"] == want["beta_histogram"]


def test_baseline_has_no_spectral(gpu):
    cfg = tiny_cfg("ddl")
    assert (
        Net(gpu, cfg, init_params(cfg, 0), work_class=TrunkWork).work(B, T).spectral(np.zeros((B, T), int))
        is None
    )


@pytest.mark.parametrize("variant", [ModelVariant.DDL, ModelVariant.DDL_TC], ids=lambda v: v.slug)
def test_ddl_adamw_steps_match_ref_backend(gpu, variant):
    cfg = tiny_cfg("ddl", variant)
    p = perturbed(cfg, 5)
    gnet, rnet = Net(gpu, cfg, p, work_class=TrunkWork), RefNet(cfg, p)
    gw, rw = gnet.work(B, T), rnet.work(B, T)
    for s in range(3):
        ids = np.random.default_rng(s).integers(0, cfg.vocab_size, (B, T))
        hyper = AdamW(lr=3e-3, step=s + 1)
        a, b = gw.step(ids, LENGTHS, hyper), rw.step(ids, LENGTHS, hyper)
        check(f"loss step {s + 1}", np.float64(a.loss), np.float64(b.loss), "model")
    got, want = gnet.export(), rnet.export()
    for n in want:
        check(n, got[n], want[n], "model", atol=1e-3)
