"""Top-k and the top-k KL loss (`shaders/topk_kl.wgsl`, `ddl_wgpu/ops/topk_kl.py`) against
`ddl_ref.ops.topk_kl_forward` / `topk_kl_backward` (float64) and a numpy top-k with ties.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check
from ddl_wgpu.ops import topk_kl as tk_ops


def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def u32(a):
    return np.ascontiguousarray(a, dtype=np.uint32)


@pytest.mark.parametrize("V", [50, 700])  # 700: several elements per invocation in the row's log-sum-exp
@pytest.mark.parametrize("form", ["full", "topk"])
def test_topk_kl_matches_reference(gpu, rng, form, V):
    N, k = 13, 5
    logits = f32(rng.normal(0.0, 2.0, size=(N, V)))
    ids = np.stack([rng.choice(V, size=k, replace=False) for _ in range(N)])
    probs = rng.random((N, k)) * 0.3
    probs[2, 1] = 0.0  # 0 log 0 = 0
    ids[5, 1] = ids[5, 0]  # a repeated id accumulates (np.add.at in the reference)
    probs[4, :] = probs[4, :] / 10  # renormalised anyway
    weights = (rng.random(N) > 0.3).astype(np.float64)
    weights[0] = 1.0
    weights[2] = 1.0
    weights[3] = 1.0
    probs[3, :] = 0.0  # a zero-filled row: no teacher mass, exact zeros (loss and gradient) even at weight 1
    scale = 0.5
    kl_sum, cache = ref.topk_kl_forward(
        logits.astype(np.float64), ids, probs.astype(np.float64), weights, form
    )
    dref = ref.topk_kl_backward(cache) * scale
    per_row = np.array(
        [
            ref.topk_kl_forward(
                logits[i : i + 1].astype(np.float64),
                ids[i : i + 1],
                probs[i : i + 1],
                weights[i : i + 1],
                form,
            )[0]
            for i in range(N)
        ]
    )
    assert per_row[3] == 0.0 and not dref[3].any()
    off = np.ones((N, V), bool)
    off[np.arange(N)[:, None], ids] = False
    # the full form's gradient reaches every logit of a weighted row, the top-k form's only the k ids
    assert (dref[0][off[0]] != 0).all() if form == "full" else not dref[off].any()

    def run(chunks, grad=True):
        id_buf, p_buf, w_buf = gpu.upload(u32(ids)), gpu.upload(f32(probs)), gpu.upload(f32(weights))
        s_buf, loss_buf = gpu.upload(f32([scale])), gpu.buffer(4 * N)
        grads = []
        for a, b in chunks:
            lg = gpu.upload(logits[a:b])
            tk_ops.topk_kl(gpu, loss_buf, lg, id_buf, p_buf, w_buf, b - a, V, k, s_buf, row_offset=a,
                           form=form, grad=grad).run(gpu)  # fmt: skip
            grads.append(gpu.download(lg, np.float32, (b - a) * V).reshape(b - a, V))
        return gpu.download(loss_buf, np.float32, N), np.concatenate(grads)

    row_loss, dlogits = run([(0, N)])
    check("topk_kl row_loss", row_loss, per_row, "loss")
    check("topk_kl dlogits", dlogits, dref, "loss")
    check("topk_kl sum", np.float64(row_loss.astype(np.float64).sum()), np.float64(kl_sum), "loss")
    assert row_loss[3] == 0.0 and not dlogits[3].any()
    chunked = run([(0, 6), (6, N)])
    assert np.array_equal(chunked[0], row_loss) and np.array_equal(chunked[1], dlogits)
    # an evaluation: the same losses, bit for bit, and the logits left as they were
    loss_only, untouched = run([(0, 6), (6, N)], grad=False)
    assert np.array_equal(loss_only, row_loss) and np.array_equal(untouched, logits)


def topk_ref(logits, k):
    x = logits.astype(np.float64)
    ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]  # stable: ties keep the lower id first
    probs = np.take_along_axis(ref.softmax(x, axis=-1), ids, axis=-1)
    return ids, probs


@pytest.mark.parametrize(("N", "V", "k"), [(7, 300, 10), (3, 20, 20), (4, 600, 64)])
def test_topk_ids_and_probs_with_ties(gpu, rng, N, V, k):
    # values on a coarse grid: many exact ties, across invocations' slices too
    logits = f32(np.round(rng.normal(0.0, 1.5, size=(N, V)) * 2.0) / 2.0)
    logits[0, :] = 1.0  # an all-tied row
    ids_ref, probs_ref = topk_ref(logits, k)
    ids_buf, probs_buf = gpu.buffer(4 * N * k), gpu.buffer(4 * N * k)
    call = tk_ops.topk(gpu, ids_buf, probs_buf, gpu.upload(logits), N, V, k)
    call.run(gpu)
    ids = gpu.download(ids_buf, np.uint32, N * k).reshape(N, k)
    probs = gpu.download(probs_buf, np.float32, N * k).reshape(N, k)
    assert np.array_equal(ids, ids_ref), (ids, ids_ref)
    check("topk probs", probs, probs_ref, "loss")
    call.run(gpu)
    assert np.array_equal(gpu.download(probs_buf, np.float32, N * k).reshape(N, k), probs)


@pytest.mark.parametrize("form", ["full", "topk"])
def test_draft_step_gradients_match_reference_in_both_forms(gpu, heal_kit, form):
    """Through the whole draft (`heal_gpu.WgpuDraft` over `draft.DraftWork`): the loss and every trained
    gradient of one step against `ddl_ref.mtp` in float64, for each KL form; the forms differ."""
    from ddl_ref import mtp as ref_mtp
    from ddl_wgpu import backend
    from ddl_wgpu.engine.heal_gpu import WgpuDraft

    cfg = heal_kit.tiny_cfg()
    p = heal_kit.perturbed(cfg)
    rng = np.random.default_rng(4)
    B, T, k = 2, 10, 6
    x = rng.standard_normal((B, T, cfg.d_model)).astype(np.float32)
    tid = rng.integers(0, cfg.vocab_size, (B, T, k))
    tp = rng.random((B, T, k)).astype(np.float32)
    w = (rng.random((B, T)) < 0.8).astype(np.float32)
    d = WgpuDraft(backend.open_gpu(), p, cfg, batch=B, kl_form=form)
    p64 = {n: a.astype(np.float64) for n, a in p.items()}
    grads = {}
    for f in ("full", "topk"):
        kl, cache = ref_mtp.draft_kl_forward(p64, cfg, x.astype(np.float64), tid, tp, w, form=f)
        grads[f] = (kl, ref_mtp.draft_kl_backward(p64, cfg, cache, 1.0 / w.sum())[1])
    kl, rgrads = grads[form]
    loss, _norm, finite = d.step(x, tid, tp, w, 1e-3, 1, 1.0)
    assert finite
    assert loss == pytest.approx(kl / w.sum(), rel=1e-5)
    got = d.grads()
    for n, g in rgrads.items():
        scale = max(np.abs(g).max(), 1e-4)
        np.testing.assert_allclose(got[n] / scale, g / scale, atol=2e-5, err_msg=n)
    other = grads["topk" if form == "full" else "full"][1]
    assert any(not np.allclose(other[n], rgrads[n], rtol=1e-3, atol=1e-6) for n in rgrads)


def test_heal_kl_form_option(heal_kit, tmp_path):
    """`HealConfig.kl_form`: both forms heal (numpy backend), differently, and the form is recorded; an unknown
    form is refused with a one-line error naming the field."""
    from dataclasses import replace

    from ddl_wgpu.files.modelfile import load_model
    from ddl_wgpu.jobs import heal

    model = heal_kit.make_model(tmp_path / "m.ddlw")
    data = str(heal_kit.make_text(tmp_path / "t.txt"))
    reps, params = {}, {}
    for form in ("full", "topk"):
        cfg = replace(heal_kit.SMALL, kl_form=form)
        reps[form] = heal.heal(model, data, tmp_path / f"{form}.ddlw", cfg, backend="ref")
        params[form] = load_model(tmp_path / f"{form}.ddlw").params
        assert reps[form]["config"]["kl_form"] == form
    # the full form's KL adds -log of the draft's mass on the teacher's ids: larger at the start
    assert reps["full"]["heldout_kl_start"] > reps["topk"]["heldout_kl_start"]
    name = "model.mtp.norm.weight"
    assert not np.array_equal(params["full"][name], params["topk"][name])
    with pytest.raises(heal.HealError, match="kl_form must be one of full, topk"):
        replace(heal_kit.SMALL, kl_form="renorm")
