"""The draft job's GPU memory plan (`engine.eagle3_plan.plan_eagle3`, docs/eagle3.md#the-gpu-memory-plan): its count,
taken on a `gpumem.DryGpu` from the job's own constructors, against what the real objects allocate on lavapipe
(buffer by buffer and the engine's peak, `Gpu.peak`) through a training step, an evaluation and the greedy
chain; and `ddl-wgpu draft` / `heal --draft` printing it or refusing a budget it does not fit in one line."""

from __future__ import annotations

import collections
import gc

import numpy as np
import pytest
from helpers import make_text, random_model, tiny_cfg

from ddl_ref import eagle3 as e3
from ddl_wgpu.engine import eagle3 as ge3
from ddl_wgpu.engine import eagle3_plan as e3plan
from ddl_wgpu.engine import gpumem
from ddl_wgpu.files.modelfile import save_model

AUX = (1, 2, 3)


def _ecfg(cfg, ttt: int, Vd: int = 24) -> e3.Eagle3Config:
    return e3.Eagle3Config(hidden=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                           intermediate=cfg.ffn_hidden, vocab=cfg.vocab_size, draft_vocab=Vd, aux_layers=AUX,
                           rope_theta=float(cfg.rope_theta), rms_eps=float(cfg.rms_eps), ttt=ttt)  # fmt: skip


@pytest.mark.parametrize("streamed, ttt", [(False, 3), (True, 3), (False, 2)],
                         ids=["resident", "streamed", "chain"])  # fmt: skip
def test_the_plan_counts_what_the_draft_job_allocates(gpu, monkeypatch, streamed, ttt):
    """The real target and draft, run as the job runs them (the teacher, a training step, the held-out losses,
    the acceptance's greedy chain 3 deep: on the training work, or past a 2-step unroll its own): every buffer
    they create is one the dry build counts (same sizes, same number), and the engine's peak (`Gpu.peak`) is
    the plan's total (within 1 % where the chain's work grows the attention scratch, below)."""
    m = random_model(tiny_cfg("default", n_layers=4), 3)
    cfg, B, T, k = m.cfg, 2, 8, 4
    ecfg = _ecfg(cfg, ttt=ttt)
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, cfg.vocab_size)
    d2t, t2d = e3.draft_vocab(counts, ecfg.draft_vocab)
    made: list = []
    create = type(gpu)._create

    def counted(g, size, *a, **kw):
        made.append(size)
        return create(g, size, *a, **kw)

    gpu.drop_scratch()  # the device-wide scratch of earlier tests: this job's own is part of its count
    gc.collect()
    live0 = gpu.live
    gpu.reset_peak()
    monkeypatch.setattr(type(gpu), "_create", counted)
    target = ge3.WgpuEagle3Target(gpu, m.params, cfg, AUX, d2t, k, B, "f32", streamed)
    draft = ge3.WgpuEagle3Draft(target, e3.init_eagle3(ecfg, 0), ecfg, d2t, t2d, B, k)
    ids = rng.integers(0, cfg.vocab_size, (B, T))
    mask = e3.loss_mask_from_lengths(np.full(B, T), T)
    batch = target(ids)
    loss, _norm, finite = draft.step(batch, ids, mask, 1e-3, 1)
    draft.losses(batch, ids, mask)
    draft.greedy_chain(batch, ids, 3)
    assert finite and np.isfinite(loss)
    peak = gpu.peak - live0
    monkeypatch.undo()

    class Counting(gpumem.DryGpu):
        def buffer(self, nbytes, label="", usage=None):
            b = super().buffer(nbytes, label)
            self.sizes.append(b.size)
            return b

    dry = Counting(gpu)
    dry.sizes = []
    e3plan.eagle3_build(dry, cfg, ecfg, B, T, k, "f32", streamed, chain=3)
    assert collections.Counter(dry.sizes) == collections.Counter(made)
    plan = e3plan.eagle3_count(gpu, cfg, ecfg, B, T, k, "f32", streamed, chain=3)
    assert plan.streamed == streamed and plan.peak_bytes == dry.peak
    if ttt >= 3:
        assert plan.peak_bytes == peak and plan.chain == 0
    else:  # the count never lets a buffer go; the engine's count would let go of an attention scratch the chain's
        # work replaced by a larger one once Python does (the training work's bind groups still hold it)
        assert peak <= plan.peak_bytes <= peak + peak // 100 and plan.chain == 3, (peak, plan.peak_bytes)
    assert plan.target_bytes + plan.draft_bytes == dry.live
    # the draft's parameters: its table's tensors (256-byte aligned) four times over (p, g, m, v) and the scalars
    n = sum(int(np.prod(s)) for s, _ in e3.eagle3_params(ecfg).values())
    assert 4 * n * 4 <= plan.draft_param_bytes <= 4 * n * 4 + 64 * 1024


def test_a_budget_too_small_is_refused_naming_a_size_the_plan_takes(gpu):
    cfg = tiny_cfg("default", n_layers=4)
    ecfg = _ecfg(cfg, ttt=3)
    free = e3plan.plan_eagle3(gpu, cfg, ecfg, 2, 8, 4, None)
    with pytest.raises(gpumem.GpuBudgetError, match="cannot hold this run: draft .* lower --ttt") as e:
        e3plan.plan_eagle3(gpu, cfg, ecfg, 2, 8, 4, free.peak_bytes // 2, lower="--ttt")
    line = str(e.value)
    assert "\n" not in line
    least = gpumem.parse_size(line.split("needs at least --gpu-memory ")[1].split(",")[0])
    plan = e3plan.plan_eagle3(gpu, cfg, ecfg, 2, 8, 4, least)
    assert plan.budget_bytes == least and plan.peak_bytes <= least
    # resident when it fits, else streamed (the streamed target's resident part is smaller at this shape)
    assert not plan.streamed or e3plan.plan_eagle3(gpu, cfg, ecfg, 2, 8, 4, None).peak_bytes > least


# ----------------------------------------------------------------------------------------------------------
# the commands


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle3_mem")
    save_model(d / "t.ddlw", random_model(tiny_cfg("default", n_layers=4), 0))
    make_text(d / "text.txt", words=400)
    return d


ARGS = ["--tokens", "600", "--seq-len", "12", "--ttt", "3", "--batch-size", "2", "--draft-vocab", "200",
        "--teacher-k", "4", "--eval-windows", "2", "--epochs", "0.3", "--aux-layers", "1,2,3"]  # fmt: skip


def test_draft_refuses_a_budget_it_does_not_fit_in_one_line(job, cli, user_error):
    out = job / "small.ddlw"
    line = user_error(cli("draft", job / "t.ddlw", "--data", job / "text.txt", "--out", out, *ARGS, "--backend",
                          "wgpu", "--gpu-memory", "64KB"),
                      "--gpu-memory 64.0 KiB cannot hold this run", "needs at least --gpu-memory",
                      "or lower one of --seq-len 12, --batch-size 2, --ttt 3, --draft-vocab 200")  # fmt: skip
    assert not out.exists(), line


def test_draft_prints_the_plan_and_runs_within_it(job, cli, ok):
    out = job / "fits.ddlw"
    r = ok(cli("draft", job / "t.ddlw", "--data", job / "text.txt", "--out", out, *ARGS, "--backend", "wgpu",
               "--gpu-memory", "1GB"))  # fmt: skip
    plan = [x for x in r.stdout.splitlines() if "gpu memory plan:" in x]
    assert len(plan) == 1 and "target resident" in plan[0] and plan[0].endswith("of 1.00 GiB"), r.stdout
    assert out.exists()


def test_heal_draft_refuses_naming_its_own_options(job, cli, user_error):
    """heal --draft runs the same job from a draft file: its refusal names heal's options (--window, --batch,
    --chain) and not the draft vocabulary, which is the start's."""
    from ddl_wgpu.files import eagle3file as ef
    from ddl_wgpu.files.modelfile import load_model

    cfg = load_model(job / "t.ddlw").cfg
    ecfg = _ecfg(cfg, ttt=3, Vd=40)
    counts = np.arange(cfg.vocab_size)
    d2t, t2d = e3.draft_vocab(counts, 40)
    ef.save_draft(job / "start.ddlw", ef.Eagle3Draft(ecfg, e3.init_eagle3(ecfg, 0), d2t, t2d,
                                                     ef.target_identity(job / "t.ddlw"), cfg.max_seq_len))  # fmt: skip
    out = job / "healed.ddlw"
    line = user_error(cli("heal", job / "t.ddlw", "--draft", job / "start.ddlw", "--data", job / "text.txt", "--out",
                          out, "--window", "12", "--batch", "2", "--chain", "2", "--tokens", "600", "--backend",
                          "wgpu", "--gpu-memory", "64KB"),
                      "cannot hold this run", "or lower one of --window 12, --batch 2, --chain 2")  # fmt: skip
    assert "--draft-vocab" not in line and "draft vocabulary 40" not in line and not out.exists()
