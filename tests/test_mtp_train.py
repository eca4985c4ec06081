"""Joint MTP training (`train --mtp`): the reference's combined loss against finite differences in float64,
the GPU engine against the reference (both losses and every gradient, the trunk's included), AdamW steps of
the joint model on both backends, and `train --mtp` end to end."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import check_grads, cli_sizes, tiny_cfg

from ddl_ref import model as rm
from ddl_ref.check import assert_fd_grad, check, random_params
from ddl_ref.config import MtpConfig
from ddl_ref.params import init_params


@pytest.mark.parametrize(
    "conv,tie",
    [
        (MtpConfig(), True),
        (MtpConfig(concat="hidden_first", trunk_hidden="post_norm"), False),
    ],
    ids=["emb_first-pre-tied", "hidden_first-post-untied"],
)
def test_joint_loss_gradients_finite_differences(conv, tie):
    cfg = tiny_cfg("mtp", n_layers=1, mtp=conv, tie_embeddings=tie, qk_norm="pre_rope")
    p = random_params(cfg, 1)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 6))
    lengths = np.array([6, 4])
    w = 0.3

    def loss():
        return rm.forward(p, cfg, ids, lengths, mtp_weight=w)[1]

    _logits, total, cache = rm.forward(p, cfg, ids, lengths, mtp_weight=w)
    assert total == pytest.approx(cache["loss_main"] + w * cache["loss_mtp"])
    assert cache["mtp"]["count"] == 4 + 2  # p < length - 2
    grads = rm.backward(p, cfg, cache)
    assert set(grads) == set(p)  # every tensor, the draft's and the trunk's
    for name in grads:
        assert_fd_grad(name, grads[name], loss, p[name])


def test_without_weight_the_draft_is_ignored():
    cfg = tiny_cfg("mtp", n_layers=1)
    p = random_params(cfg)
    ids = np.random.default_rng(0).integers(0, 13, (2, 6))
    a = rm.forward(p, cfg, ids)[1]
    b = rm.forward(p, tiny_cfg("mtp", n_layers=1, mtp=None), ids)[1]
    _, c, cache = rm.forward(p, cfg, ids, mtp_weight=0.0)
    assert a == b == c == cache["loss_main"] and cache["loss_mtp"] > 0


# ----------------------------------------------------------------------------------------------------------
# the engine


B, T = 3, 11
LENGTHS = np.array([11, 7, 2])  # a full row, a padded row, a row the draft cannot use


CASES = [
    dict(qk_norm="post_rope", tie_embeddings=True),
    dict(
        qk_norm="pre_rope",
        tie_embeddings=False,
        mtp=MtpConfig(concat="hidden_first", trunk_hidden="post_norm"),
    ),
    dict(residual="delta", ddl_dv=4, ddl_compressor="cc", ddl_expand_embed=True, norm_style="offset"),
]


@pytest.mark.parametrize("kw", CASES, ids=["baseline-tied", "hidden_first-post-untied", "ddl-cc-offset"])
def test_engine_joint_step_matches_reference(gpu, kw):
    from ddl_wgpu.engine.net import Net
    from ddl_wgpu.engine.trunk import TrunkWork

    cfg = tiny_cfg("engine", **{"mtp": MtpConfig(), **kw})
    p = init_params(cfg, 3)
    rng = np.random.default_rng(5)  # non-trivial draft norms and projection
    p = {
        n: (a + 0.1 * rng.standard_normal(a.shape).astype(np.float32)) if "mtp" in n else a
        for n, a in p.items()
    }
    net = Net(gpu, cfg, p, mtp_weight=0.3, work_class=TrunkWork)
    work = net.work(B, T)
    ids = np.random.default_rng(0).integers(0, 61, (B, T))
    res = work.step(ids, LENGTHS)
    p64 = {n: a.astype(np.float64) for n, a in p.items()}
    _logits, loss, cache = rm.forward(p64, cfg, ids, LENGTHS, mtp_weight=0.3)
    grads = rm.backward(p64, cfg, cache)
    assert res.count == 10 + 6 + 1
    check("loss", np.float64(res.loss), np.float64(loss), "model")
    check("loss_main", np.float64(res.loss_main), np.float64(cache["loss_main"]), "model")
    check("loss_mtp", np.float64(res.loss_mtp), np.float64(cache["loss_mtp"]), "model")
    got = net.grads()
    check_grads(got, grads)
    # evaluation reports the trunk's loss
    s, c = work.loss_sum(ids, LENGTHS)
    check("eval", np.float64(s / c), np.float64(cache["loss_main"]), "model")


def test_engine_refuses_joint_training_of_a_draft_of_its_own_width(gpu):
    """After `compress --ffn-keep` the draft keeps its SwiGLU width; the joint step sizes the draft block as
    a trunk block, so it says so instead of reading the draft's weights at the wrong shape."""
    from ddl_wgpu.engine.net import Net
    from ddl_wgpu.engine.trunk import TrunkWork
    from ddl_wgpu.runtime.gpu import GpuError

    cfg = tiny_cfg("engine", mtp=MtpConfig(ffn_hidden=56))
    net = Net(gpu, cfg, init_params(cfg, 3), mtp_weight=0.3, work_class=TrunkWork)
    with pytest.raises(GpuError, match=r"draft's SwiGLU width \(56\) to equal the trunk's"):
        net.work(B, T)


def test_engine_and_refnet_joint_adamw_steps_agree(gpu):
    from ddl_wgpu.engine.net import Net
    from ddl_wgpu.engine.refnet import RefNet
    from ddl_wgpu.engine.step import AdamW
    from ddl_wgpu.engine.trunk import TrunkWork

    cfg = tiny_cfg("engine", mtp=MtpConfig())
    p0 = init_params(cfg, 7)
    nets = [Net(gpu, cfg, p0, mtp_weight=0.5, work_class=TrunkWork), RefNet(cfg, p0, mtp_weight=0.5)]
    out = [[], []]
    for s in range(3):
        ids = np.random.default_rng(s).integers(0, 61, (B, T))
        for i, net in enumerate(nets):
            r = net.work(B, T).step(ids, LENGTHS, update=AdamW(lr=1e-2, step=s + 1))
            out[i].append((r.loss, r.loss_main, r.loss_mtp))
    np.testing.assert_allclose(np.array(out[0]), np.array(out[1]), rtol=2e-4)
    a, b = nets[0].export(), nets[1].export()
    for n in a:
        np.testing.assert_allclose(a[n], b[n], rtol=1e-3, atol=2e-5, err_msg=n)


# ----------------------------------------------------------------------------------------------------------
# the command line: train --mtp, then the heal story on the GPU backend


def test_cli_train_mtp_compress_accept_heal(tmp_path, cli, ok):
    import json

    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    corpus = tmp_path / "c.txt"
    corpus.write_text(" ".join(np.random.default_rng(0).choice(words, 1500)))
    model_args = [*cli_sizes("train", n_layers=2), "--backend", "wgpu"]
    train = ["--variants", "baseline", "--max-steps", "6", "--eval-interval", "3", "--batch-size", "2",
             "--seq-len", "16", "--eval-batches", "2", "--learning-rate", "1e-2", "--no-plots", *model_args]  # fmt: skip
    out = tmp_path / "run"
    r = ok(cli("train", "--data", corpus, "--out", out, "--mtp", "--mtp-weight", "0.5", *train))
    rep = json.loads((out / "baseline" / "report.json").read_text())
    assert rep["config"]["mtp"] == MtpConfig().to_dict() and rep["training"]["mtp_weight"] == 0.5
    for h in rep["history"]:  # the combined loss and both parts
        assert h["train"]["loss"] == pytest.approx(h["train_loss_main"] + 0.5 * h["train_loss_mtp"], rel=1e-5)
    assert rep["history"][-1]["train_loss_mtp"] < rep["history"][0]["train_loss_mtp"]
    ck = out / "baseline" / "checkpoint.ddlw"
    ev = json.loads(ok(cli("eval", ck, "--data", corpus, "--seq-len", "16", "--batch", "2", "--json",
                           "--backend", "wgpu")).stdout)  # fmt: skip
    assert ev["loss"] == pytest.approx(rep["final_train"]["loss"], rel=0.2)  # the trunk's loss
    small = tmp_path / "small.ddlw"
    ok(cli("compress", ck, "--out", small, "--drop-layers", "1"))
    acc = [
        json.loads(
            ok(
                cli(
                    "accept",
                    small,
                    "--data",
                    corpus,
                    "--window",
                    "16",
                    "--tokens",
                    "800",
                    "--depth",
                    "2",
                    "--json",
                    "--backend",
                    b,
                )
            ).stdout
        )  # fmt: skip
        for b in ("ref", "wgpu")
    ]
    assert acc[0]["prefix_acceptance"] == acc[1]["prefix_acceptance"] and acc[1]["backend"] == "wgpu"
    assert acc[0]["chain_attention"] == acc[1]["chain_attention"] == "per-step"  # the CLI's default
    healed = tmp_path / "healed.ddlw"
    r = ok(cli("heal", small, "--data", corpus, "--out", healed, "--init", ck, "--window", "32", "--tokens", "1600",
               "--chain", "2", "--batch", "2", "--epochs", "0.2", "--lr", "1e-3", "--eval-every", "5", "--json",
               "--backend", "wgpu"))  # fmt: skip
    h = json.loads(r.stdout)
    assert h["backend"] == "wgpu" and h["heldout_kl_best"] <= h["heldout_kl_start"]
    assert h["chain_attention"] == h["acceptance_after"]["chain_attention"] == "per-step"
