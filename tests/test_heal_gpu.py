"""The GPU heal and accept backends (`heal_gpu.WgpuTeacher`, `heal_gpu.WgpuDraft`, `accept(backend="wgpu")`) against
the numpy ones on a tiny model: the trunk's top-k and hidden rows, one draft step's loss and every gradient,
a short heal (held-out KL per chain step at every evaluation, acceptance before and after), and acceptance."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from helpers import check_acceptance_backends, check_draft_step

from ddl_ref import mtp as ref_mtp
from ddl_ref.config import MtpConfig
from ddl_wgpu import backend
from ddl_wgpu.engine import heal_gpu
from ddl_wgpu.engine.heal_gpu import WgpuDraft
from ddl_wgpu.engine.net import Net
from ddl_wgpu.engine.refnet import RefDraft, RefTeacher
from ddl_wgpu.files.modelfile import Model, load_model
from ddl_wgpu.jobs import accept, heal
from ddl_wgpu.runtime.gpu import GpuError


def test_teacher_topk_and_hidden_match_reference(gpu, heal_kit):
    cfg = heal_kit.tiny_cfg(residual="delta", ddl_dv=4, ddl_compressor="cc", ddl_expand_embed=True)
    m = Model(cfg, heal_kit.perturbed(cfg))
    ids = np.random.default_rng(0).integers(0, 256, (3, 20))
    t = backend.make_teacher("wgpu", m, batch=4)  # a partial batch: padded rows
    ti, tp, pre, post = t.topk_hidden(ids, 8)
    ri, rp, rpre, rpost = RefTeacher(m.params, m.cfg).topk_hidden(ids, 8)
    np.testing.assert_allclose(pre, rpre, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(post, rpost, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(tp, rp, rtol=1e-4, atol=1e-6)
    assert (ti[..., 0] == ri[..., 0]).mean() > 0.99  # argmax (near-ties aside)


@pytest.mark.parametrize("tie", [True, False])
def test_draft_step_loss_and_gradients_match_refdraft(gpu, tie, heal_kit):
    cfg = heal_kit.tiny_cfg(tie_embeddings=tie)
    check_draft_step(heal_kit.perturbed(cfg), cfg, batch=2, window=12)


@pytest.mark.parametrize("tie", [True, False])
def test_draft_keeps_no_state_for_frozen_tensors(gpu, tie, heal_kit):
    """The draft's Net holds gradients and moments for its trained tensors only (they lead the arenas) and
    trains bit for bit like a Net that keeps state for every tensor."""
    from ddl_wgpu.engine.net import Net
    from ddl_wgpu.runtime.gpu import GpuError

    cfg = heal_kit.tiny_cfg(tie_embeddings=tie)
    p = heal_kit.perturbed(cfg)
    lean = WgpuDraft(backend.open_gpu(), p, cfg, batch=2)
    full = WgpuDraft(backend.open_gpu(), p, cfg, batch=2)
    net = lean.net
    full.net = Net(net.gpu, net.cfg, net.export(), trainable=list(lean.names))  # state for every tensor
    trained = sum(-(-net.slots[n].nbytes // 256) * 256 for n in net.trainable)
    assert sum(b.size for b in net.g) == trained < sum(b.size for b in full.net.g)
    assert net.head_name not in net.has_state
    with pytest.raises(GpuError, match="frozen"):
        net.view(net.head_name, "g")
    rng = np.random.default_rng(4)
    B, T, k = 2, 12, 8
    x = rng.standard_normal((B, T, cfg.d_model)).astype(np.float32)
    tid, tp = rng.integers(0, 256, (B, T, k)), rng.random((B, T, k)).astype(np.float32)
    w = np.ones((B, T), np.float32)
    for step in (1, 2):
        assert lean.step(x, tid, tp, w, 1e-2, step, 4096.0) == full.step(x, tid, tp, w, 1e-2, step, 4096.0)
    a, b = lean.export(), full.export()
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert set(lean.net.grads()) == set(lean.names)  # gradients exist for the trained tensors only


def test_gpu_heal_matches_reference_heal(gpu, tmp_path, heal_kit):
    conv = MtpConfig(trunk_hidden="post_norm", chain_hidden="pre_norm")
    model = heal_kit.make_model(tmp_path / "m.ddlw", cfg=heal_kit.tiny_cfg(mtp=conv))
    data = str(heal_kit.make_text(tmp_path / "t.txt"))
    r = heal.heal(model, data, tmp_path / "r.ddlw", heal_kit.SMALL, backend="ref")
    g = heal.heal(model, data, tmp_path / "g.ddlw", heal_kit.SMALL, backend="wgpu")
    assert r["steps"] == g["steps"] >= 8 and len(r["history"]) == len(g["history"]) >= 3
    for hr, hg in zip(r["history"], g["history"], strict=True):
        assert hr["step"] == hg["step"]
        np.testing.assert_allclose(hg["heldout_kl"], hr["heldout_kl"], atol=1e-4, rtol=0)
    assert g["backend"] == "wgpu" and g["best_step"] == r["best_step"]
    for key in ("acceptance_before", "acceptance_after"):
        assert set(g[key]) == set(r[key])
        np.testing.assert_allclose(g[key]["prefix_acceptance"], r[key]["prefix_acceptance"], atol=0.02)
    a, b = load_model(tmp_path / "r.ddlw").params, load_model(tmp_path / "g.ddlw").params
    # atol lr: Adam moves an element whose gradient is ~0 by up to lr a step on the sign of float noise
    for n in ref_mtp.trained_names(a):
        np.testing.assert_allclose(b[n], a[n], rtol=1e-2, atol=heal_kit.SMALL.lr, err_msg=n)


@pytest.mark.parametrize("mode", ["per-step", "stacked"])
def test_gpu_acceptance_matches_reference(gpu, tmp_path, heal_kit, mode):
    conv = MtpConfig(concat="emb_first", trunk_hidden="pre_norm", chain_hidden="post_norm")
    m = load_model(heal_kit.make_model(tmp_path / "m.ddlw", cfg=heal_kit.tiny_cfg(mtp=conv), seed=4))
    rng = np.random.default_rng(2)
    windows = [rng.integers(0, 256, n) for n in (20, 16, 24, 9, 30)]
    check_acceptance_backends(m, windows, mode)


def test_accept_file_wgpu_same_json(tmp_path, heal_kit):
    model = heal_kit.make_model(tmp_path / "m.ddlw")
    data = str(heal_kit.make_text(tmp_path / "t.txt", words=60))
    r = accept.accept_file(model, data, depth=2, window=24)
    g = accept.accept_file(model, data, depth=2, window=24, backend="wgpu")
    assert list(g) == list(r) and g["backend"] == "wgpu"
    assert g["prefix_acceptance"] == r["prefix_acceptance"]


def test_gpu_heal_with_f16_trunk_close_to_f32(gpu, tmp_path, heal_kit):
    """`--trunk-dtype f16`: the teacher's big matrices in f16 (inference Net, ~2 bytes per parameter). The
    trunk's top-k distributions and hidden rows move by the f16 rounding of its weights only, so the held-out
    KLs of a short heal stay close to the f32 trunk's; the provenance records the trunk dtype."""
    model = heal_kit.make_model(tmp_path / "m.ddlw")
    data = str(heal_kit.make_text(tmp_path / "t.txt"))
    a = heal.heal(model, data, tmp_path / "a.ddlw", heal_kit.SMALL, backend="wgpu")
    h = heal.heal(
        model, data, tmp_path / "h.ddlw", replace(heal_kit.SMALL, trunk_dtype="f16"), backend="wgpu"
    )
    assert a["trunk_dtype"] == "f32" and h["trunk_dtype"] == "f16" and h["config"]["trunk_dtype"] == "f16"
    assert load_model(tmp_path / "h.ddlw").provenance["mtp_heal"]["trunk_dtype"] == "f16"
    assert a["steps"] == h["steps"] and len(a["history"]) == len(h["history"]) >= 3
    for ha, hh in zip(a["history"], h["history"], strict=True):
        # observed: ~2e-3 relative (KLs ~4e-3); f16 rounding of the teacher's weights is the only difference
        np.testing.assert_allclose(hh["heldout_kl"], ha["heldout_kl"], rtol=1e-2, atol=1e-6)


def test_f16_teacher_matches_f32_teacher_and_needs_shader_f16(gpu, monkeypatch, heal_kit):
    m = Model(heal_kit.tiny_cfg(), heal_kit.perturbed(heal_kit.tiny_cfg()))
    x = np.random.default_rng(5).integers(0, 256, (2, 20))
    # each teacher runs before the next is made: the products' switch is the device's (`trunk_products`), and
    # a teacher's works are built at its first pass
    t32 = backend.make_teacher("wgpu", m, batch=2, trunk_dtype="f32")
    i32, p32, _, post32 = t32.topk_hidden(x, 8)
    t16 = backend.make_teacher("wgpu", m, batch=2, trunk_dtype="f16")
    i16, p16, _, post16 = t16.topk_hidden(x, 8)
    assert (
        t32.net.inference and not t32.net.g and t16.net.wdtype("model.layers.0.mlp.up_proj.weight") == "f16"
    )
    if t16.gpu.products == "matrix":  # the f16 trunk's products on the matrix units: activations f16 too
        tol_post, tol_p = dict(rtol=2e-2, atol=1e-2), dict(rtol=3e-2, atol=1e-5)
    else:  # observed on lavapipe: the f16 rounding of the weights alone
        tol_post, tol_p = dict(rtol=2e-2, atol=2e-3), dict(rtol=1e-2, atol=1e-6)
    np.testing.assert_allclose(post16, post32, **tol_post)
    np.testing.assert_allclose(p16, p32, **tol_p)
    assert (i16[..., 0] == i32[..., 0]).mean() > 0.95
    monkeypatch.setattr(backend.open_gpu(None), "features", set())
    with pytest.raises(backend.BackendError, match="shader-f16") as e:
        backend.make_teacher("wgpu", m, batch=2, trunk_dtype="f16")
    assert "\n" not in str(e.value)
    with pytest.raises(heal.HealError, match="trunk_dtype"):
        heal.HealConfig(trunk_dtype="bf16")


def test_accept_file_wgpu_f16_trunk(tmp_path, heal_kit):
    model = heal_kit.make_model(tmp_path / "m.ddlw")
    data = str(heal_kit.make_text(tmp_path / "t.txt", words=60))
    a = accept.accept_file(model, data, depth=2, window=24, backend="wgpu")
    h = accept.accept_file(model, data, depth=2, window=24, backend="wgpu", trunk_dtype="f16")
    assert list(h) == list(a) and a["trunk_dtype"] == "f32" and h["trunk_dtype"] == "f16"
    np.testing.assert_allclose(h["prefix_acceptance"], a["prefix_acceptance"], atol=0.05)
    with pytest.raises(backend.BackendError, match="wgpu"):
        accept.accept_file(model, data, depth=2, window=24, trunk_dtype="f16")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_gpu_step_rows_match_reference_and_share_the_embedding(gpu, heal_kit, dtype):
    """heal's block input rows built on the GPU (`WgpuTeacher.topk_rows`, `WgpuDraft.next_rows`, per-step and
    stacked) against the numpy path (`RefTeacher.topk_rows`, `RefDraft.next_rows`: `ddl_ref.mtp.step_input`);
    the draft given the teacher reads the trunk's embedding (no copy: fewer bytes allocated, same export)."""
    conv = MtpConfig(concat="hidden_first", trunk_hidden="post_norm", chain_hidden="pre_norm")
    cfg = heal_kit.tiny_cfg(mtp=conv)
    m = Model(cfg, heal_kit.perturbed(cfg))
    B, T = 3, 10
    ids = np.random.default_rng(6).integers(0, 256, (B, T))
    lengths = np.array([10, 7, 3])
    g = backend.open_gpu()
    teacher = backend.make_teacher("wgpu", m, batch=4, trunk_dtype=dtype)
    a0 = g.allocated
    draft = backend.make_draft("wgpu", m, batch=4, teacher=teacher)
    shared_bytes = g.allocated - a0
    a1 = g.allocated
    backend.make_draft("wgpu", m, batch=4)
    emb = m.params["model.embed_tokens.weight"]
    assert (g.allocated - a1) - shared_bytes >= emb.nbytes  # its own copy of the f32 embedding
    assert draft.net.slots["model.embed_tokens.weight"].dtype == dtype
    np.testing.assert_array_equal(draft.net.export()["model.embed_tokens.weight"],
                                  emb.astype(np.float16 if dtype == "f16" else np.float32))  # fmt: skip
    # the numpy twins on the weights as the GPU holds them (f16: the trunk's rounded matrices)
    p = {n: a.astype(np.float16).astype(np.float32) if dtype == "f16" and teacher.net.slots.get(n) is not None
         and teacher.net.wdtype(n) == "f16" else a for n, a in m.params.items()}  # fmt: skip
    ref_t, ref_d = RefTeacher(p, cfg), RefDraft(p, cfg)
    ti, tp, x1 = teacher.topk_rows(ids, lengths, 8)
    ri, rp, rx1 = ref_t.topk_rows(ids, lengths, 8)
    # an f16 trunk on a GPU with matrix units runs the products there (f16 activations too); f32: SIMT products
    tol = dict(rtol=2e-2, atol=1e-2) if g.products == "matrix" else dict(rtol=1e-4, atol=1e-5)
    assert dtype == "f16" or g.products == "simt"
    np.testing.assert_allclose(x1, rx1, **tol)
    assert not x1[1, 6:].any() and not x1[2, 2:].any()  # rows p + 1 >= length are zero
    tok2, val2 = ref_mtp.shifted(ids, 2), ref_mtp.step_valid(lengths, T, 2)
    x2 = draft.next_rows(rx1, tok2, val2)  # per-step: the draft's output rows on step 1's
    np.testing.assert_allclose(x2, ref_d.next_rows(rx1, tok2, val2), **tol)
    tok3, val3 = ref_mtp.shifted(ids, 3), ref_mtp.step_valid(lengths, T, 3)
    stacked = np.concatenate([rx1, x2], axis=1)  # stacked: the last T rows of a chain-2 forward
    x3 = draft.next_rows(stacked, tok3, val3, chain=2)
    np.testing.assert_allclose(x3, ref_d.next_rows(stacked, tok3, val3, chain=2), **tol)


@pytest.mark.parametrize("mode", ["per-step", "stacked"])
def test_gpu_loss_chain_is_the_host_rows_path(gpu, heal_kit, monkeypatch, mode):
    """heal's evaluation right after a refresh, its rows kept on the GPU (`WgpuDraft.loss_chain`, fewer windows
    than the draft's batch) gives the bits of the host path on the same draft (`RefDraft.loss_chain`'s steps:
    `loss_sum_next`, the rows rounded to float16 on the host as heal's cache holds them, `loss_sum`) and
    downloads nothing but the loss sums, once; a series of batches (`loss_chains`) gives each one's; without the rounding the later steps' sums are not the same."""
    conv = MtpConfig(concat="hidden_first", trunk_hidden="post_norm", chain_hidden="pre_norm")
    cfg = heal_kit.tiny_cfg(mtp=conv)
    m = Model(cfg, heal_kit.perturbed(cfg, seed=3))
    T, depth, stacked = 10, 3, mode == "stacked"
    ids, lengths = np.random.default_rng(4).integers(0, 256, (3, T)), np.array([10, 7, 4])
    top_ids, top_probs, x1 = RefTeacher(m.params, cfg).topk_rows(ids, lengths, 8)
    steps = []
    for j in range(1, depth + 1):  # as heal's `_Chain._targets` gives them
        tid, tp = ref_mtp.shifted(top_ids, j), ref_mtp.shifted(top_probs, j, fill=1.0)
        w = ref_mtp.step_valid(lengths, T, j).astype(np.float32)
        if stacked and j > 1:
            pad = ((0, 0), ((j - 1) * T, 0))
            tid, tp, w = (
                np.pad(tid, (*pad, (0, 0))),
                np.pad(tp, (*pad, (0, 0)), constant_values=1.0),
                np.pad(w, pad),
            )
        nxt = (ref_mtp.shifted(ids, j + 1), ref_mtp.step_valid(lengths, T, j + 1)) if j < depth else None
        steps.append((tid, tp, w, nxt))
    draft = backend.make_draft("wgpu", m, batch=4)
    want = RefDraft.loss_chain(draft, x1, steps, stacked)  # the host path's steps, run by the GPU draft
    g, sizes, download = draft.net.gpu, [], draft.net.gpu.download

    def counted(buf, dtype=np.float32, count=None, offset=0):
        sizes.append(count)
        return download(buf, dtype, count, offset)

    monkeypatch.setattr(g, "download", counted)
    got = draft.loss_chain(x1, steps, stacked)
    assert got == want and sizes == [depth]  # one download: the loss sums
    # a series (heal's evaluation: the host runs ahead of the GPU), its sums down every CHAIN_FLUSH batches
    other = RefDraft.loss_chain(draft, x1 * 0.5, steps, stacked)
    monkeypatch.setattr(heal_gpu, "CHAIN_FLUSH", 2)
    sizes.clear()
    assert draft.loss_chains(iter([(x1, steps), (x1 * 0.5, steps), (x1, steps)]), stacked) == [
        got,
        other,
        got,
    ]
    assert sizes == [2 * depth, depth] and other != got
    monkeypatch.setattr(np, "float16", np.float32)  # the host path without the rounding
    unrounded = RefDraft.loss_chain(draft, x1, steps, stacked)
    assert unrounded[0] == got[0] and unrounded[1:] != got[1:]


def test_net_refuses_a_trainable_or_misshapen_shared_tensor(heal_kit):
    cfg = heal_kit.tiny_cfg()
    m = Model(cfg, heal_kit.perturbed(cfg))
    teacher = backend.make_teacher("wgpu", m, batch=2)
    dcfg, g = ref_mtp.draft_config(cfg), teacher.net.gpu
    with pytest.raises(GpuError, match="frozen"):
        Net(
            g,
            dcfg,
            trainable=["model.embed_tokens.weight"],
            shared={"model.embed_tokens.weight": teacher.net},
        )
    small = heal_kit.tiny_cfg(vocab_size=128)
    other = backend.make_teacher("wgpu", Model(small, heal_kit.perturbed(small)), batch=2)
    with pytest.raises(GpuError, match="shape"):
        Net(g, dcfg, shared={"model.embed_tokens.weight": other.net})


@pytest.mark.parametrize("mode", ["per-step", "stacked"])
def test_gpu_lazy_refresh_gives_the_eager_results_bit_for_bit(gpu, tmp_path, heal_kit, eager_refresh, heal_count,
                                                             mode):  # fmt: skip
    """On the GPU the lazy refresh's rows come from the kept weights copied into the draft's buffers for the
    forwards (`WgpuDraft.using`), batched as the eager refresh batches them (training and held-out windows
    apart), or, for an evaluation right after a refresh, from the evaluation's own forwards: the same bits."""
    model = heal_kit.make_model(tmp_path / "m.ddlw")
    data = str(heal_kit.make_text(tmp_path / "t.txt"))
    run = replace(heal_kit.SMALL, chain=3, refresh=3, chain_attention=mode)
    got = {}
    for lazy in (False, True):
        eager_refresh(not lazy)
        r = heal.heal(model, data, tmp_path / f"{lazy}.ddlw", run, backend="wgpu")
        p = load_model(tmp_path / f"{lazy}.ddlw").params
        got[lazy] = r, {n: p[n] for n in ref_mtp.trained_names(p)}
    (eager, te), (lazy, tl) = got[False], got[True]
    assert eager["steps"] > 2 * run.refresh and len(eager["history"]) >= 3
    assert lazy["history"] == eager["history"]
    assert all(np.array_equal(tl[n], te[n]) for n in te)
    assert 0 < lazy["refresh_forwards"] < eager["refresh_forwards"]
    count = heal_count.refresh_forwards(lazy["windows"], run)  # the count bench/heal.py uses is the GPU run's
    assert count["forwards"] == lazy["refresh_forwards"]
    assert count["refreshes"] * (run.chain - 1) * count["batches"] == eager["refresh_forwards"]
    # evaluations right after a refresh built held-out rows on the GPU from their own forwards (`loss_chains`,
    # rounded to float16 there), and the history above is still the eager one's, bit for bit
    assert lazy["eval_built_rows"] == count["eval_built"] > 0


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("mode", ["per-step", "stacked"])
def test_gpu_greedy_chain_matches_the_host_rows_path(gpu, heal_kit, monkeypatch, dtype, mode):
    """accept's chain with every row on the GPU (`WgpuTeacher.greedy_hidden`, `WgpuDraft.greedy_chain`)
    against the host-rows path on the same GPU trunk and draft (`accept.greedy_chain`: the downloaded hidden
    rows, `ddl_ref.mtp.step_input`, `WgpuDraft.greedy`): the same argmax ids at every step (the rows differ by
    float rounding only, and this model has no near-tie there). The GPU path never builds rows on the host
    and downloads nothing larger than one step's token ids."""
    conv = MtpConfig(concat="hidden_first", trunk_hidden="post_norm", chain_hidden="pre_norm")
    cfg = heal_kit.tiny_cfg(mtp=conv)
    m = Model(cfg, heal_kit.perturbed(cfg, seed=2))
    B, T, depth = 3, 12, 3
    rng = np.random.default_rng(8)
    ids, lengths = rng.integers(0, 256, (B, T)), np.array([12, 9, 5])
    teacher, draft = backend.make_accept_backend("wgpu", m, batch=4, trunk_dtype=dtype)
    # the host path: the trunk's hidden rows downloaded, the rows built in numpy, one draft step at a time
    top, _p, pre, post = teacher.topk_hidden(ids, 1)
    tb = accept.TrunkBatch(ids, lengths, top[..., 0], pre, post)
    host = accept.greedy_chain(m.params, cfg, tb, depth, draft.greedy, mode)
    g = draft.net.gpu
    sizes, download = [], g.download

    def counted(buf, dtype=np.float32, count=None, offset=0):
        sizes.append(count)
        return download(buf, dtype, count, offset)

    monkeypatch.setattr(g, "download", counted)
    monkeypatch.setattr(ref_mtp, "step_input", lambda *a: pytest.fail("rows built on the host"))
    greedy, hidden = teacher.greedy_hidden(ids, conv.trunk_hidden)
    tok, valid = ref_mtp.shifted(ids, 1), ref_mtp.step_valid(lengths, T, 1)
    preds = draft.greedy_chain(hidden, tok, valid, depth, stacked=mode == "stacked")
    assert preds.shape == (B, depth, T) and np.array_equal(greedy, top[..., 0])
    np.testing.assert_array_equal(preds, host)
    stacked_rows = depth if mode == "stacked" else 1  # the chain-σ work's ids: σ·T rows per window
    assert len(sizes) == depth + 1 and max(sizes) <= 4 * T * stacked_rows  # ids only (batch 4)
    # the steps really chain: with another chain_hidden the later steps' predictions change
    other = draft.greedy_chain(
        hidden, tok, valid, depth, mode == "stacked", replace(conv, chain_hidden="post_norm")
    )
    assert np.array_equal(other[:, 0], preds[:, 0]) and not np.array_equal(other[:, 1:], preds[:, 1:])


@pytest.mark.parametrize("mode", ["per-step", "stacked"])
def test_heldout_acceptance_from_step1_rows_on_the_gpu(gpu, heal_kit, monkeypatch, mode):
    """heal's held-out acceptance starts from the windows' step-1 rows (`accept.acceptance_from_rows`): on
    the GPU (`WgpuDraft.greedy_chain(rows=...)`, more windows than the draft's batch) it equals the host-rows
    chain on the same draft (`WgpuDraft.greedy` runner, later rows by `ddl_ref.mtp.step_input`) and the numpy
    chain, and builds no row on the host."""
    cfg = heal_kit.tiny_cfg(mtp=MtpConfig(trunk_hidden="post_norm", chain_hidden="pre_norm"))
    m = Model(cfg, heal_kit.perturbed(cfg, seed=5))
    rng = np.random.default_rng(9)
    ids, lengths = rng.integers(0, 256, (5, 14)), np.array([14, 11, 6, 14, 9])
    ti, _tp, x1 = RefTeacher(m.params, cfg).topk_rows(ids, lengths, 1)
    tb = accept.TrunkBatch(ids, lengths, ti[..., 0], None, None, x1)
    draft = backend.make_draft("wgpu", m, batch=2)
    # a tiny untrained draft agrees with no trunk: make the "trunk" agree with the draft's step j at position
    # q when q % 3 == j − 1, so anchors are accepted to different depths and every step's ids matter
    preds = accept.greedy_chain(m.params, cfg, tb, 3, draft.greedy, mode)
    for q in range(1, ids.shape[1]):
        j = min(q % 3 + 1, q)
        tb.greedy[:, q] = preds[:, j - 1, q - j]
    host = accept.acceptance_from_trunk(m.params, cfg, [tb], 3, draft.greedy, mode)
    numpy = accept.acceptance_from_rows(m.params, cfg, tb, 3, None, mode)
    monkeypatch.setattr(ref_mtp, "step_input", lambda *a: pytest.fail("rows built on the host"))
    got = accept.acceptance_from_rows(m.params, cfg, tb, 3, draft, mode)
    assert got == host == numpy and got["anchors"] == int((lengths - 3).sum())
    assert all(a > 0 for a in got["prefix_acceptance"])  # accepted to every depth: the comparison has teeth
