"""Gradient clipping, per tensor (the reference trainer's burn `GradientClippingConfig::Norm`: each tensor by its
own L2 norm) and global (PyTorch's `clip_grad_norm_`): the reference formulas in `ddl_ref.optim`, the GPU's
per-tensor records (`reduce.tensor_norm_clip`) against float64, and whole steps of a tiny `ddl` model on the
GPU and the numpy backend against the reference. No finite differences: after AdamW step 1 the first moment
is exactly (1 − β1)·mult·g, so the multiplier each tensor received is read back from the moments."""

import json
import math

import numpy as np
import pytest
from helpers import tiny_cfg

from ddl_ref import model as rm
from ddl_ref.check import check
from ddl_ref.optim import adamw_step, clip_multipliers, global_grad_norm, tensor_grad_norms
from ddl_ref.params import init_params
from ddl_wgpu.engine.refnet import RefNet
from ddl_wgpu.engine.step import AdamW, draft_adamw
from ddl_wgpu.ops import reduce as k_red

B, T = 2, 9
LENGTHS = np.array([9, 6])
BETA1 = 0.9
CLIP = 1.0


def ids(seed=0):
    return np.random.default_rng(seed).integers(0, 53, (B, T))


def ref_grads(cfg, p0):
    p = {n: a.astype(np.float64) for n, a in p0.items()}
    _, _, cache = rm.forward(p, cfg, ids(), LENGTHS)
    return rm.backward(p, cfg, cache)


def received_multipliers(m: dict, grads: dict) -> dict:
    """mult_t from the moments after AdamW step 1: m_t = (1 − β1)·mult_t·g_t, read on t's largest entry."""
    out = {}
    for n, g in grads.items():
        i = np.unravel_index(np.argmax(np.abs(g)), g.shape)
        out[n] = float(m[n][i]) / ((1.0 - BETA1) * float(g[i]))
    return out


# -- the reference formulas ------------------------------------------------------------------------------


def test_reference_multipliers_follow_the_formulas():
    g = {"big": np.full((2, 2), 2.5), "small": np.array([0.3]), "zero": np.zeros(3)}  # norms 5, 0.3, 0
    per = clip_multipliers(g, CLIP, "per-tensor")
    assert per == {"big": 0.2, "small": 1.0, "zero": 1.0}
    total = math.sqrt(25.0 + 0.09)
    assert clip_multipliers(g, CLIP, "global") == dict.fromkeys(g, CLIP / total)
    with pytest.raises(ValueError, match="grad_clip_mode"):
        clip_multipliers(g, CLIP, "layer")


def test_adamw_step_takes_one_multiplier_per_tensor():
    g = {"big": np.full((2, 2), 2.5), "small": np.array([0.3])}
    params = {n: np.ones_like(a) for n, a in g.items()}
    state: dict = {}
    adamw_step(params, g, state, 1e-3, 1, BETA1, 0.95, 1e-8, 0.0, clip_multipliers(g, CLIP, "per-tensor"))
    assert np.allclose(state["m"]["big"], (1 - BETA1) * 0.2 * 2.5)
    assert np.allclose(state["m"]["small"], (1 - BETA1) * 0.3)


# -- the GPU kernels ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("finite", [True, False])
def test_tensor_records_match_float64(gpu, rng, finite):
    # sizes: several partials (> 2048 elements), one partial, one element; pieces of one tensor
    sizes = [[5000], [300], [1], [2100, 700]]
    scales = (0.004, 3.0, 0.4, 1.0)  # norms about 0.3, 50, 0.4, 50
    data = [
        [rng.standard_normal(n).astype(np.float32) * s for n in ps]
        for ps, s in zip(sizes, scales, strict=True)
    ]
    data[2][0][0] = 0.4
    if not finite:
        data[1][0][17] = np.inf
    tensors = [[(gpu.upload(a), a.size) for a in ps] for ps in data]
    count = k_red.total_partials([n for ps in sizes for n in ps])
    partials = gpu.buffer(count * 4)
    scalars = gpu.buffer(k_red.SCALARS_BYTES)
    records = gpu.buffer(len(sizes) * k_red.RECORD_BYTES)
    k_red.tensor_norm_clip(gpu, scalars, records, partials, tensors, CLIP).run(gpu)
    rec = gpu.download(records, np.float32).reshape(len(sizes), -1)[:, :4]
    glob = gpu.download(scalars, np.float32, 4)
    flat = {str(t): np.concatenate(ps).astype(np.float64) for t, ps in enumerate(data)}
    if not finite:
        assert (rec[:, 1] == 0).all() and (rec[:, 2] == 0).all() and glob[2] == 0
        return
    norms = tensor_grad_norms(flat)
    mults = clip_multipliers(flat, CLIP, "per-tensor")
    assert 0 < sum(m < 1 for m in mults.values()) < len(mults)  # some clipped, some not
    for t in range(len(sizes)):
        check(f"norm {t}", rec[t, 0], np.float64(norms[str(t)]), "loss")
        check(f"mult {t}", rec[t, 1], np.float64(mults[str(t)]), "loss")
        assert rec[t, 2] == 1.0
    check("global norm", glob[0], np.float64(global_grad_norm(flat)), "loss")


def test_tensor_records_unscale(gpu, rng):
    """The records of S * g with unscale = 1 / S (mixed precision's loss scaling): each norm that of g and each
    multiplier g's divided by S, bit for bit the unscaled records for a power-of-two S."""
    data = [rng.standard_normal(n).astype(np.float32) * s for n, s in ((5000, 0.004), (300, 3.0), (7, 1.0))]
    flat = {str(t): a.astype(np.float64) for t, a in enumerate(data)}

    def records(arrays, unscale):
        tensors = [[(gpu.upload(a), a.size)] for a in arrays]
        partials = gpu.buffer(k_red.total_partials([a.size for a in arrays]) * 4)
        scalars = gpu.buffer(k_red.SCALARS_BYTES)
        recs = gpu.buffer(len(arrays) * k_red.RECORD_BYTES)
        k_red.tensor_norm_clip(gpu, scalars, recs, partials, tensors, CLIP, unscale=unscale).run(gpu)
        return gpu.download(recs, np.float32).reshape(len(arrays), -1)[:, :4], gpu.download(
            scalars, np.float32, 4
        )

    plain, plain_glob = records(data, 1.0)
    s = 2.0**16
    rec, glob = records([(a * np.float32(s)).astype(np.float32) for a in data], 1.0 / s)
    mults = clip_multipliers(flat, CLIP, "per-tensor")
    for t in range(len(data)):
        check(f"norm {t}", rec[t, 0], np.float64(tensor_grad_norms(flat)[str(t)]), "loss")
        check(f"mult {t}", rec[t, 1] * s, np.float64(mults[str(t)]), "loss")
    assert np.array_equal(rec[:, 0], plain[:, 0]) and np.array_equal(rec[:, 1], plain[:, 1] / np.float32(s))
    assert glob[0] == plain_glob[0] and glob[1] == np.float32(plain_glob[1] / s)


# -- whole steps -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["wgpu", "ref"])
def test_ddl_step_one_clips_each_tensor_by_its_own_norm(gpu, backend):
    """At step 1 of a tiny ddl model the global norm exceeds the clip, so "global" scales every tensor,
    while per tensor only the tensors whose own norm exceeds it are scaled (by clip / own norm)."""
    cfg = tiny_cfg("ddl", "ddl")
    p0 = init_params(cfg, 3)
    grads = ref_grads(cfg, p0)
    norms = tensor_grad_norms(grads)
    big = {n for n, v in norms.items() if v > CLIP}
    assert global_grad_norm(grads) > CLIP and 0 < len(big) < len(grads) // 4
    for mode in ("per-tensor", "global"):
        if backend == "wgpu":
            from ddl_wgpu.engine.net import Net
            from ddl_wgpu.engine.trunk import TrunkWork

            net = Net(gpu, cfg, p0, work_class=TrunkWork)
        else:
            net = RefNet(cfg, p0)
        r = net.work(B, T).step(ids(), LENGTHS, AdamW(lr=1e-3, step=1, grad_clip=CLIP, grad_clip_mode=mode))
        check("reported norm (global in both modes)", np.float64(r.grad_norm),
              np.float64(global_grad_norm(grads)), "model")  # fmt: skip
        got = received_multipliers(net.moments()[0], grads)
        want = clip_multipliers(grads, CLIP, mode)
        for n in grads:
            check(f"{mode} multiplier of {n}", np.float64(got[n]), np.float64(want[n]), "model", rtol=2e-3)
        if mode == "per-tensor":
            assert {n for n, v in got.items() if v < 0.999} == big
        else:
            assert all(v < 0.999 for v in got.values())


def test_per_tensor_steps_follow_reference_and_are_bit_identical(gpu):
    from ddl_wgpu.engine.net import Net
    from ddl_wgpu.engine.trunk import TrunkWork

    cfg = tiny_cfg("ddl", "ddl")
    p0 = init_params(cfg, 5)
    hyper = [AdamW(lr=1e-2, step=s + 1, grad_clip=0.5, grad_clip_mode="per-tensor") for s in range(3)]

    def run():
        net = Net(gpu, cfg, p0, work_class=TrunkWork)
        work = net.work(B, T)
        losses = [work.step(ids(s), LENGTHS, h).loss for s, h in enumerate(hyper)]
        return losses, net.export()

    (la, pa), (lb, pb) = run(), run()
    assert la == lb and all(np.array_equal(pa[n], pb[n]) for n in pa)
    p = {n: a.astype(np.float64) for n, a in p0.items()}
    state: dict = {}
    for s in range(3):
        _, loss, cache = rm.forward(p, cfg, ids(s), LENGTHS)
        g = rm.backward(p, cfg, cache)
        check(f"loss step {s + 1}", np.float64(la[s]), np.float64(loss), "model")
        adamw_step(p, g, state, 1e-2, s + 1, 0.9, 0.95, 1e-5, 0.1, clip_multipliers(g, 0.5, "per-tensor"))
    for n in p:
        check(n, pa[n], p[n], "model", atol=5e-4)


def test_heal_draft_clips_globally_as_the_reference_heal_tool():
    """The reference heal tool scales every gradient by 1 / (global norm) when that norm exceeds 1."""
    hyper = draft_adamw(1e-4, 1)
    assert (hyper.grad_clip_mode, hyper.grad_clip) == ("global", 1.0)


# -- training runs ---------------------------------------------------------------------------------------


def _train_setup(tmp_path):
    from ddl_wgpu.data import ByteTokenizer, load_datasets
    from ddl_wgpu.jobs.train import TrainingConfig

    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "a",
        "lazy",
        "dog",
        "and",
        "then",
        "the",
        "cat",
        "sat",
        "on",
        "the",
        "mat",
    ]
    rng = np.random.default_rng(0)
    (tmp_path / "c.txt").write_text(" ".join(words[int(i)] for i in rng.integers(len(words), size=500)))
    data = load_datasets(str(tmp_path / "c.txt"), tokenizer=ByteTokenizer(), seq_len=16, batch_size=2,
                         val_fraction=0.2, vocab_size=256, seed=0)  # fmt: skip
    cfg = tiny_cfg("train")
    # a clip below the norms, so the two modes differ from the first step
    tcfg = TrainingConfig(max_steps=4, eval_interval=2, learning_rate=1e-2, batch_size=2, seq_len=16,
                          eval_batches=2, grad_clip=0.05)  # fmt: skip
    return data, cfg, tcfg


def test_training_config_defaults_to_per_tensor_and_validates_the_mode():
    from ddl_wgpu.jobs.train import TrainingConfig, TrainingError

    assert TrainingConfig().grad_clip_mode == "per-tensor"
    TrainingConfig(grad_clip_mode="global").validate()
    with pytest.raises(TrainingError, match="grad_clip_mode must be one of per-tensor, global"):
        TrainingConfig(grad_clip_mode="layer").validate()


def test_a_checkpoint_without_the_mode_resumes_global_bit_for_bit(tmp_path):
    """A checkpoint written before grad_clip_mode existed (a global-clip run) resumes with global clipping,
    so it continues exactly as the global run it came from; read as per-tensor it would not."""
    from dataclasses import replace

    from ddl_ref.config import ModelVariant as MV
    from ddl_wgpu.files.container import open_checkpoint, save
    from ddl_wgpu.jobs.train import RunOptions, load_checkpoint, resume, train_variant

    (trn, val), cfg, tcfg = _train_setup(tmp_path)
    base = MV("baseline")
    ref = RunOptions(backend="ref")
    glob = replace(tcfg, grad_clip_mode="global")
    straight = train_variant(cfg, base, trn, val, glob, tmp_path / "g", ref)
    per = train_variant(cfg, base, trn, val, tcfg, tmp_path / "p", ref)
    assert (
        straight["training"]["grad_clip_mode"] == "global"
        and per["training"]["grad_clip_mode"] == "per-tensor"
    )
    losses = [[h["train"]["loss"] for h in r["history"]] for r in (straight, per)]
    assert losses[0][0] == losses[1][0] and losses[0][1:] != losses[1][1:]  # the modes differ after step 1

    train_variant(cfg, base, trn, val, glob, tmp_path / "s", RunOptions(backend="ref", stop_after=2))
    path = tmp_path / "s" / "checkpoint.ddlw"
    with open_checkpoint(path) as ck:  # rewrite it as an old checkpoint: no grad_clip_mode anywhere
        meta = dict(ck.metadata)
        tensors = [(n, ck.tensor_f32(n)) for n in ck.names()]
        config = dict(ck.config)
    report = json.loads(meta["train.report"])
    del report["training"]["grad_clip_mode"]
    position = dict(meta["train.position"])
    position["phase"] = {**position["phase"], "training": dict(position["phase"]["training"])}
    del position["phase"]["training"]["grad_clip_mode"]
    meta["train.report"] = json.dumps(report)
    meta["train.position"] = position
    save(path, tensors, config=config, metadata=meta)
    assert load_checkpoint(path)["position"]["phase"]["training"]["grad_clip_mode"] == "global"
    done = resume(path, trn, val, ref)
    assert [h["train"]["loss"] for h in done["history"]] == losses[0]
    assert done["training"]["grad_clip_mode"] == "global"
