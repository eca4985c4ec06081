"""EAGLE-3 drafts on the GPU engine (`ddl_wgpu.engine.eagle3`, docs/eagle3.md#the-gpu-engine) against the
numpy reference, on lavapipe at tiny shapes: the teacher (aux rows, the top-k over the draft vocabulary, the
full argmax), one training step of the draft (loss, every gradient, the AdamW update), greedy drafting, and
the `draft` job on --backend wgpu against --backend ref step by step, with a bit-exact resume."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_text, random_model, tiny_cfg

from ddl_ref import eagle3 as e3
from ddl_ref.optim import adamw_step, clip_multiplier, global_grad_norm
from ddl_wgpu.engine import eagle3 as ge3
from ddl_wgpu.engine.refnet import RefEagle3Target
from ddl_wgpu.engine.step import Eagle3Batch
from ddl_wgpu.files import eagle3file as ef
from ddl_wgpu.files.modelfile import save_model
from ddl_wgpu.jobs import draft as dj

AUX = (1, 2, 3)
K = 4


@pytest.fixture(scope="module")
def kit():
    """A 4-layer 16-wide target, a draft vocabulary of 24 of its 256 tokens (most of the target's argmaxes on
    the batch, some not), a batch of 2 windows of 8."""
    m = random_model(tiny_cfg("default", n_layers=4), 3)
    rng = np.random.default_rng(5)
    V = m.cfg.vocab_size
    ids = rng.integers(0, V, size=(2, 8))
    greedy = RefEagle3Target(m, AUX)(ids).greedy
    counts = np.bincount(greedy[:, 1:6].reshape(-1), minlength=V) * 100 + rng.integers(0, 3, size=V)
    d2t, t2d = e3.draft_vocab(counts, 24)
    cfg = e3.Eagle3Config(hidden=m.cfg.d_model, n_heads=m.cfg.n_heads, n_kv_heads=m.cfg.n_kv_heads,
                          head_dim=m.cfg.head_dim, intermediate=m.cfg.ffn_hidden, vocab=V, draft_vocab=24,
                          aux_layers=AUX, rope_theta=float(m.cfg.rope_theta), rms_eps=float(m.cfg.rms_eps),
                          ttt=3)  # fmt: skip
    return m, d2t, t2d, ids, cfg


def test_teacher_matches_the_reference(gpu, kit):
    m, d2t, t2d, ids, _cfg = kit
    tgt = ge3.WgpuEagle3Target(gpu, m.params, m.cfg, AUX, d2t, K, batch=2)
    got = tgt(ids)
    want = RefEagle3Target(m, AUX, d2t, t2d, K)(ids)
    aux = np.concatenate([gpu.download(b, np.float32, ids.size * m.cfg.d_model).reshape(2, 8, -1)
                          for b in got.aux.bufs], axis=-1)  # fmt: skip
    np.testing.assert_allclose(aux, want.aux, rtol=1e-4, atol=1e-5)
    assert np.array_equal(got.greedy, want.greedy)
    assert np.array_equal(got.top_ids, want.top_ids)
    np.testing.assert_allclose(got.top_probs, want.top_probs, rtol=1e-4, atol=1e-6)
    assert np.array_equal(got.in_draft, want.in_draft)
    assert got.in_draft.any() and not got.in_draft.all()  # both kinds of rows are checked
    # a batch of fewer windows is padded, its rows the same
    one = tgt(ids[:1])
    assert np.array_equal(one.top_ids, want.top_ids[:1]) and one.greedy.shape == (1, 8)


def _host_draft(gpu, m, d2t, t2d, params, cfg, k=K):
    tgt = ge3.WgpuEagle3Target(gpu, m.params, m.cfg, AUX, d2t, k, batch=2)
    return tgt, ge3.WgpuEagle3Draft(tgt, params, cfg, d2t, t2d, batch=2, k=k, clip=0.5)


@pytest.mark.parametrize("nbr", [False, True])
def test_one_step_matches_ttt_forward_backward_and_adamw(gpu, kit, nbr):
    m, d2t, t2d, ids, cfg = kit
    cfg = e3.Eagle3Config(**{**cfg.__dict__, "norm_before_residual": nbr})
    params = e3.init_eagle3(cfg, 1)
    embed = m.params["model.embed_tokens.weight"]
    batch = RefEagle3Target(m, AUX, d2t, t2d, K)(ids)
    mask = e3.loss_mask_from_lengths(np.array([8, 6]), 8)
    loss, cache = e3.ttt_forward(params, cfg, batch.aux, ids, embed, None, d2t, t2d, loss_mask=mask,
                                 teacher=batch.teacher)  # fmt: skip
    grads = e3.ttt_backward(params, cfg, cache)
    _tgt, d = _host_draft(gpu, m, d2t, t2d, params, cfg)
    got_loss, per = d.losses(batch, ids, mask)  # host aux rows: uploaded
    assert got_loss == pytest.approx(loss, rel=1e-5)
    np.testing.assert_allclose(per, cache["step_losses"], rtol=1e-5)
    lr = 1e-2
    gl, gnorm, finite = d.step(batch, ids, mask, lr, 1)
    assert finite and gl == pytest.approx(loss, rel=1e-5)
    assert gnorm == pytest.approx(global_grad_norm(grads), rel=1e-4)
    g = d.grads()
    for name, want in grads.items():
        scale = np.abs(want).max()
        assert scale > 0, name
        np.testing.assert_allclose(g[name], want, rtol=1e-3, atol=1e-4 * scale, err_msg=name)
    ref = {n: p.copy() for n, p in params.items()}
    adamw_step(ref, grads, {}, lr, 1, 0.9, 0.999, 1e-8, 0.0, grad_multiplier=clip_multiplier(gnorm, 0.5))
    out = d.export()
    for name in ref:
        np.testing.assert_allclose(out[name], ref[name], rtol=1e-4, atol=1e-6, err_msg=name)
        assert not np.array_equal(out[name], params[name]), name  # every tensor moved


def test_gpu_aux_rows_give_the_same_step_as_host_rows(gpu, kit):
    """The teacher's aux rows read where they are (GpuAux) against the same rows uploaded from the host."""
    m, d2t, t2d, ids, cfg = kit
    params = e3.init_eagle3(cfg, 2)
    mask = e3.loss_mask_from_lengths(np.array([8, 8]), 8)
    tgt, d = _host_draft(gpu, m, d2t, t2d, params, cfg)
    batch = tgt(ids)
    on_gpu = d.losses(batch, ids, mask)
    host = np.concatenate([gpu.download(b, np.float32, ids.size * cfg.hidden).reshape(2, 8, -1)
                           for b in batch.aux.bufs], axis=-1)  # fmt: skip
    up = Eagle3Batch(host, batch.greedy, None, batch.top_ids, batch.top_probs, batch.in_draft)
    assert d.losses(up, ids, mask) == on_gpu


def test_greedy_chain_matches_ttt_greedy(gpu, kit):
    m, d2t, t2d, ids, cfg = kit
    params = e3.init_eagle3(cfg, 4)
    params[e3.HEAD] = e3.head_from_target(m.params["lm_head.weight"] if "lm_head.weight" in m.params
                                          else m.params["model.embed_tokens.weight"], d2t)  # fmt: skip
    batch = RefEagle3Target(m, AUX, d2t, t2d, K)(ids)
    want = e3.ttt_greedy(params, cfg, batch.aux, ids, m.params["model.embed_tokens.weight"], d2t, 4)
    _tgt, d = _host_draft(gpu, m, d2t, t2d, params, cfg)
    got = d.greedy_chain(batch, ids, 4)  # deeper than the training unroll (3)
    assert got.shape == want.shape and np.mean(got == want) > 0.95  # float32 against float64 argmaxes
    assert np.array_equal(got[:, 0], want[:, 0])


# ----------------------------------------------------------------------------------------------------------
# the job on both backends


SMALL = dict(tokens=600, seq_len=12, ttt=3, batch_size=2, learning_rate=3e-3, eval_interval=4, draft_vocab=200,
             teacher_k=K, eval_windows=2, epochs=0.5)  # fmt: skip


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    d = tmp_path_factory.mktemp("eagle3_gpu")
    save_model(d / "t.ddlw", random_model(tiny_cfg("default", n_layers=4), 0))
    make_text(d / "text.txt", words=400)
    return d


def _train(d, out, backend, **kw):
    events = []
    cfg = dj.DraftConfig(**{**SMALL, "aux_layers": AUX})
    try:
        rep = dj.train_draft(d / "t.ddlw", str(d / "text.txt"), out, cfg, backend=backend, progress=events.append,
                             **kw)  # fmt: skip
    except dj.DraftInterrupted as e:
        return e, events
    return rep, events


def test_draft_job_on_wgpu_matches_ref_step_by_step(job):
    ref, ev_ref = _train(job, job / "ref.ddlw", "ref")
    gpu, ev_gpu = _train(job, job / "gpu.ddlw", "wgpu")
    steps = lambda evs: [(e["step"], e["loss"], e["grad_norm"]) for e in evs if e["event"] == "step"]  # noqa: E731
    a, b = steps(ev_ref), steps(ev_gpu)
    assert len(a) == len(b) >= 4 and all(loss > 0 for _, loss, _ in a)
    for (s1, l1, n1), (s2, l2, n2) in zip(a, b, strict=True):
        assert s1 == s2 and l2 == pytest.approx(l1, rel=2e-4) and n2 == pytest.approx(n1, rel=2e-3)
    assert gpu["heldout_loss_end"] == pytest.approx(ref["heldout_loss_end"], rel=2e-4)
    assert gpu["backend"] == "wgpu" and gpu["heldout_loss_end"] < gpu["heldout_loss_start"]
    pr, pg = ef.load_draft(job / "ref.ddlw").params, ef.load_draft(job / "gpu.ddlw").params
    for n in pr:
        np.testing.assert_allclose(pg[n], pr[n], rtol=1e-3, atol=1e-4, err_msg=n)


def test_draft_job_resume_on_wgpu_is_bit_exact(job):
    whole, _ = _train(job, job / "whole.ddlw", "wgpu")
    stopped, _ = _train(job, job / "part.ddlw", "wgpu", stop_after=3)
    assert isinstance(stopped, dj.DraftInterrupted) and stopped.step == 3
    dj.resume(stopped.run_file)
    a, b = ef.load_draft(job / "whole.ddlw").params, ef.load_draft(job / "part.ddlw").params
    for n in a:
        assert np.array_equal(a[n], b[n]), n


def test_gpu_teacher_k_out_of_range_is_one_line(job):
    cfg = dj.DraftConfig(**{**SMALL, "aux_layers": AUX, "teacher_k": 0})
    with pytest.raises(dj.DraftError, match="top-k of 1..64"):
        dj.train_draft(job / "t.ddlw", str(job / "text.txt"), job / "x.ddlw", cfg, backend="wgpu")
