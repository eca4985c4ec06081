"""The chained draft's runtime attention (docs/heal.md#chain-attention-per-step-or-stacked):
`ddl_ref.ops.chain_mask/chain_positions`, `attention_masked_forward/backward` (finite differences), the
stacked draft forward against an incremental causal run of the same anchor, and the `attention_masked_*` WGSL
kernels against the reference."""

import numpy as np
import pytest
from helpers import tiny_cfg

from ddl_ref import mtp as ref_mtp
from ddl_ref import ops
from ddl_ref.check import assert_fd_grad, check
from ddl_ref.config import MtpConfig
from ddl_ref.params import init_params
from ddl_wgpu.backend import open_gpu
from ddl_wgpu.engine.heal_gpu import WgpuDraft
from ddl_wgpu.engine.refnet import RefDraft, ref_runner
from ddl_wgpu.ops.attention import attention_masked_backward, attention_masked_forward


def test_chain_mask_and_positions():
    m = ops.chain_mask(3, 4)
    for rq in range(12):
        for rk in range(12):
            sq, pq, sk, pk = rq // 4 + 1, rq % 4, rk // 4 + 1, rk % 4
            assert m[rq, rk] == ((sk == 1 and pk <= pq) or (2 <= sk <= sq and pk == pq))
    np.testing.assert_array_equal(ops.chain_positions(3, 4), [0, 1, 2, 3, 1, 2, 3, 4, 2, 3, 4, 5])
    np.testing.assert_array_equal(ops.chain_mask(1, 5), np.tril(np.ones((5, 5), bool)))


def test_attention_masked_finite_differences(rng):
    B, W, C, H, K, D = 2, 3, 3, 4, 2, 4
    T = C * W
    q, k, v, dout = (rng.standard_normal(s) for s in ((B, T, H, D), (B, T, K, D), (B, T, K, D), (B, T, H, D)))
    mask = ops.chain_mask(C, W)
    out, cache = ops.attention_masked_forward(q, k, v, mask)
    dq, dk, dv = ops.attention_masked_backward(dout, cache)
    for x, g in ((q, dq), (k, dk), (v, dv)):
        f = lambda: float(np.sum(ops.attention_masked_forward(q, k, v, mask)[0] * dout))  # noqa: E731
        assert_fd_grad("dx", g, f, x, rtol=1e-7, magnitude=float(np.sum(np.abs(out * dout))))
    # a causal mask reproduces the causal attention
    out_c, _ = ops.attention_forward(q, k, v)
    np.testing.assert_allclose(
        ops.attention_masked_forward(q, k, v, np.tril(np.ones((T, T), bool)))[0], out_c
    )


def test_stacked_draft_matches_incremental_causal(rng):
    """Row (j, p) of the stacked forward = the last row of a causal run over [x1[0..p], x2[p], .., xj[p]]."""
    cfg = tiny_cfg(vocab_size=48, n_layers=1, max_seq_len=16, mtp=MtpConfig())
    params = {n: a.astype(np.float64) for n, a in init_params(cfg, seed=3).items()}
    W, j = 5, 3
    xs = rng.standard_normal((1, j * W, cfg.d_model))
    pre, _post, _ = ref_mtp.draft_forward(params, cfg, xs, chain=j)
    for s in range(1, j + 1):
        for p in range(W):
            seq = np.concatenate(
                [xs[:, : p + 1]] + [xs[:, (i - 1) * W + p][:, None] for i in range(2, s + 1)], 1
            )
            want, _, _ = ref_mtp.draft_forward(params, cfg, seq)
            np.testing.assert_allclose(pre[0, (s - 1) * W + p], want[0, -1], rtol=1e-10, atol=1e-12)


MASKED_SHAPES = [(1, 1, 1, 1, 1, 4), (2, 5, 3, 4, 2, 6), (1, 7, 2, 2, 2, 16)]
# Grouped heads, D 128, W 80: heal's default mode on a Qwen-like draft. The plain-loop ('flash') dk/dv came out
# wrong there on lavapipe (rel. error 0.23 on the early key rows, correct on the small shapes above), so the
# launchers send this to the scores path, which is what runs it.
QWEN_LIKE = (1, 80, 2, 4, 2, 128)


@pytest.mark.parametrize(
    "shape,impl",
    [(s, i) for s in MASKED_SHAPES for i in ("flash", "scores")] + [(QWEN_LIKE, None)],
    ids=lambda x: "B{}W{}C{}H{}K{}D{}".format(*x) if isinstance(x, tuple) else str(x),
)
def test_masked_kernels_match_reference(gpu, shape, impl):
    B, W, C, H, K, D = shape
    T = C * W
    rng = np.random.default_rng(1)
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32)
                     for s in ((B, T, H, D), (B, T, K, D), (B, T, K, D), (B, T, H, D)))  # fmt: skip
    out, cache = ops.attention_masked_forward(
        *(a.astype(np.float64) for a in (q, k, v)), ops.chain_mask(C, W)
    )
    dq, dk, dv = ops.attention_masked_backward(dout.astype(np.float64), cache)
    bq, bk, bv, bdo = (gpu.upload(a) for a in (q, k, v, dout))
    bo, bl = gpu.buffer(q.nbytes), gpu.buffer(B * H * T * 4)
    gq, gk, gv = gpu.buffer(q.nbytes), gpu.buffer(k.nbytes), gpu.buffer(v.nbytes)
    attention_masked_forward(gpu, bo, bl, bq, bk, bv, B, T, H, K, D, W, impl=impl).run(gpu)
    attention_masked_backward(gpu, gq, gk, gv, bdo, bo, bl, bq, bk, bv, B, T, H, K, D, W, impl=impl).run(gpu)
    got = {n: gpu.download(b, count=a.size).reshape(a.shape)
           for n, b, a in (("out", bo, q), ("dq", gq, q), ("dk", gk, k), ("dv", gv, v))}  # fmt: skip
    check("masked out", got["out"], out, "attention")
    check("masked lse", gpu.download(bl, count=B * H * T).reshape(B, H, T), cache[4], "attention")
    check("masked dq", got["dq"], dq, "attention")
    check("masked dk", got["dk"], dk, "attention")
    check("masked dv", got["dv"], dv, "attention")


def _masked_gpu(gpu, shape, q, k, v, dout, W, rows=None):
    """Forward and backward on the GPU (default implementation choice), outputs in buffers that start out
    holding 5.0 (so a value left unwritten shows)."""
    B, T, H, K, D = shape
    bq, bk, bv, bdo = (gpu.upload(a) for a in (q, k, v, dout))
    junk = lambda n: gpu.upload(np.full(n, 5.0, np.float32))  # noqa: E731
    bo, bl = junk(q.size), junk(B * H * T)
    gq, gk, gv = junk(q.size), junk(k.size), junk(v.size)
    attention_masked_forward(gpu, bo, bl, bq, bk, bv, B, T, H, K, D, W, rows=rows).run(gpu)
    attention_masked_backward(gpu, gq, gk, gv, bdo, bo, bl, bq, bk, bv, B, T, H, K, D, W, rows=rows).run(gpu)
    got = {n: gpu.download(b, count=a.size).reshape(a.shape)
           for n, b, a in (("out", bo, q), ("dq", gq, q), ("dk", gk, k), ("dv", gv, v))}  # fmt: skip
    got["lse"] = gpu.download(bl, count=B * H * T).reshape(B, H, T)
    return got


def test_masked_scores_in_row_blocks(gpu, monkeypatch):
    """The chain mask on the scores path in blocks of query rows: one kv head's scores over all T = 3 * 7
    rows do not fit the (patched) scratch limit, 5 rows' do; blocks cross the window boundaries, the last is
    a single row; grouped heads (G = 2), two batches. Against the float64 reference and the whole-head
    scores path; same bits twice; `choose_impl` ('auto') picks the row blocks."""
    from ddl_wgpu.ops import attention, attention_scores

    B, W, C, H, K, D, R = 2, 7, 3, 4, 2, 8, 5
    T = C * W
    shape = (B, T, H, K, D)
    rng = np.random.default_rng(2)
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32)
                     for s in ((B, T, H, D), (B, T, K, D), (B, T, K, D), (B, T, H, D)))  # fmt: skip
    out, cache = ops.attention_masked_forward(
        *(a.astype(np.float64) for a in (q, k, v)), ops.chain_mask(C, W)
    )
    dq, dk, dv = ops.attention_masked_backward(dout.astype(np.float64), cache)
    want = {"out": out, "lse": cache[4], "dq": dq, "dk": dk, "dv": dv}
    monkeypatch.delenv(attention.ENV_IMPL, raising=False)
    whole = _masked_gpu(gpu, shape, q, k, v, dout, W)
    G = H // K
    monkeypatch.setattr(attention_scores, "SCORE_BYTES", G * T * 4 * (R + 1) - 4)
    assert not attention_scores.fits(gpu, H, K, T) and attention_scores.row_block(gpu, H, K, T) == R
    assert attention.choose_impl(gpu, H, K, T, masked=True) == "scores"
    chunks, _ = attention_scores.plan(gpu, B, H, K, T)
    assert [(c.r0, c.nr) for c in chunks[:5]] == [(20, 1), (15, 5), (10, 5), (5, 5), (0, 5)]
    got = _masked_gpu(gpu, shape, q, k, v, dout, W)
    for name in want:
        check(f"row blocks {name}", got[name], want[name], "attention")
        check(f"row blocks vs whole {name}", got[name], whole[name].astype(np.float64), "attention")
    again = _masked_gpu(gpu, shape, q, k, v, dout, W)
    for name in got:
        assert np.array_equal(got[name], again[name]), f"{name} differs between two identical runs"


@pytest.mark.parametrize("blocks", [False, True], ids=["whole", "row_blocks"])
@pytest.mark.parametrize("step", [0, 1, 2])
def test_masked_scores_row_range(gpu, monkeypatch, step, blocks):
    """`rows` = step s's rows [s*W, (s+1)*W) of a 3-step stack, q and dout zero elsewhere (as the EAGLE-3
    draft holds them): out, lse, dq of those rows and all of dk, dv match the float64 reference and are the
    bits of the call without `rows` (dk and dv: with whole heads; in row blocks they are summed block by
    block, so only to rounding); dk and dv past (s+1)*W are written (zeros); out past the range is not."""
    from ddl_wgpu.ops import attention, attention_scores

    B, W, C, H, K, D = 2, 7, 3, 4, 2, 8
    T = C * W
    lo, hi = step * W, (step + 1) * W
    shape = (B, T, H, K, D)
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal(s).astype(np.float32)
                     for s in ((B, T, H, D), (B, T, K, D), (B, T, K, D), (B, T, H, D)))  # fmt: skip
    for a in (q, dout):
        a[:, :lo] = 0.0
        a[:, hi:] = 0.0
    out, cache = ops.attention_masked_forward(
        *(a.astype(np.float64) for a in (q, k, v)), ops.chain_mask(C, W)
    )
    dq, dk, dv = ops.attention_masked_backward(dout.astype(np.float64), cache)
    monkeypatch.delenv(attention.ENV_IMPL, raising=False)
    full = _masked_gpu(gpu, shape, q, k, v, dout, W)
    if blocks:  # one row of all T keys fits: blocks of R rows of the range, R = 3 (step 0) or 1
        G = H // K
        monkeypatch.setattr(attention_scores, "SCORE_BYTES", G * T * 4)
        R = G * T * 4 // (G * hi * 4)
        chunks, _ = attention_scores.plan(gpu, B, H, K, T, (lo, hi))
        starts = list(range(lo + (W - 1) // R * R, lo - 1, -R))
        assert [(c.r0, c.nr) for c in chunks] == [
            (r0, min(R, hi - r0)) for b in range(B) for j in range(K) for r0 in starts
        ]
    assert attention.choose_impl(gpu, H, K, T, masked=True) == "scores"
    got = _masked_gpu(gpu, shape, q, k, v, dout, W, rows=(lo, hi))
    for name, want, part in (("out", out, np.s_[:, lo:hi]), ("lse", cache[4], np.s_[..., lo:hi]),
                             ("dq", dq, np.s_[:, lo:hi]), ("dk", dk, np.s_[:]), ("dv", dv, np.s_[:])):  # fmt: skip
        check(f"rows {name}", got[name][part], want[part], "attention")
        if blocks and name in ("dk", "dv"):  # summed block by block: the whole call's sums, another order
            check(f"rows {name} vs whole call", got[name], full[name].astype(np.float64), "attention")
        else:
            assert np.array_equal(got[name][part], full[name][part]), (
                f"{name}: not the bits of the whole call"
            )
    assert np.all(got["dk"][:, hi:] == 0) and np.all(got["dv"][:, hi:] == 0)
    assert np.all(got["out"][:, hi:] == 5.0)  # rows past the range are not visited


# ----------------------------------------------------------------------------------------------------------
# the draft trainers and heal in "stacked" chain attention


@pytest.mark.parametrize("qk", ["pre_rope", "none"])
def test_runtime_draft_step_matches_refdraft(gpu, qk, heal_kit):
    h = heal_kit
    cfg = h.tiny_cfg(qk_norm=qk)
    p = h.perturbed(cfg)
    rng = np.random.default_rng(5)
    B, W, j, k = 2, 7, 3, 8
    T = j * W
    x = rng.standard_normal((B, T, cfg.d_model)).astype(np.float32)
    tid = rng.integers(0, 256, (B, T, k))
    tp = rng.random((B, T, k)).astype(np.float32)
    w = np.zeros((B, T), np.float32)
    w[:, -W:] = (rng.random((B, W)) < 0.8).astype(np.float32)  # the step-j rows only
    ref, gd = RefDraft(p, cfg), WgpuDraft(open_gpu(), p, cfg, batch=B)
    want = ref.loss_sum(x, tid, tp, w, chain=j)
    # the mask matters (by ~5e-4 relative: the full-vocabulary KL is dominated by the draft's mass off the
    # random top-k, which the mask barely moves)
    assert want != pytest.approx(ref.loss_sum(x, tid, tp, w), rel=1e-4)
    assert gd.loss_sum(x, tid, tp, w, chain=j) == pytest.approx(want, rel=1e-5)
    p64 = {n: a.astype(np.float64) for n, a in p.items()}
    kl, cache = ref_mtp.draft_kl_forward(p64, cfg, x.astype(np.float64), tid, tp, w, chain=j)
    _dx, rgrads = ref_mtp.draft_kl_backward(p64, cfg, cache, 1.0 / w.sum())
    rl, rn, rf = ref.step(x, tid, tp, w, 1e-2, 1, 4096.0, chain=j)
    gl, gn, gf = gd.step(x, tid, tp, w, 1e-2, 1, 4096.0, chain=j)
    assert rf and gf and gl == pytest.approx(rl, rel=1e-4) and gn == pytest.approx(rn, rel=1e-4)
    assert gl == pytest.approx(kl / w.sum(), rel=1e-5)
    got = gd.grads()
    for n, g in rgrads.items():
        scale = max(np.abs(g).max(), 1e-4)
        np.testing.assert_allclose(got[n] / scale, g / scale, atol=2e-5, err_msg=n)
    pre, post = gd.hidden_out(x[:1], chain=j)
    rpre, rpost = ref.hidden_out(x[:1], chain=j)
    np.testing.assert_allclose(pre, rpre, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(post, rpost, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [None, 12, 8, 4])
def test_stacked_head_on_the_last_rows_in_any_chunking(gpu, chunk, heal_kit):
    """A stacked step's head runs on step j's rows alone, gathered: the 21 rows (3 windows of 7) in one chunk
    of logits (None), or chunks of 12, 8 or 4 rows, each cutting windows apart (multiples of 4 rows keep the
    chunks' bindings 256-byte aligned at this width). Loss and gradients as `RefDraft`'s on all rows; rows
    before step j weighted non-zero are refused."""
    from ddl_wgpu.engine.draft import DraftWork

    h = heal_kit
    cfg = h.tiny_cfg(qk_norm="pre_rope")
    p = h.perturbed(cfg)
    rng = np.random.default_rng(7)
    B, W, j, k = 3, 7, 3, 8
    T = j * W
    assert chunk is None or chunk * cfg.d_model * 4 % 256 == 0
    x = rng.standard_normal((B, T, cfg.d_model)).astype(np.float32)
    tid = rng.integers(0, 256, (B, T, k))
    tp = rng.random((B, T, k)).astype(np.float32)
    w = np.zeros((B, T), np.float32)
    w[:, -W:] = (rng.random((B, W)) < 0.8).astype(np.float32)
    ref, gd = RefDraft(p, cfg), WgpuDraft(open_gpu(), p, cfg, batch=B)
    work = DraftWork(gd.net, B, T, k, chain=j, chunk_rows=chunk)
    assert work.last == W
    assert work.loss_sum_rows(x, tid, tp, w) == pytest.approx(ref.loss_sum(x, tid, tp, w, chain=j), rel=1e-5)
    r = work.step_rows(x, tid, tp, w)
    p64 = {n: a.astype(np.float64) for n, a in p.items()}
    kl, cache = ref_mtp.draft_kl_forward(p64, cfg, x.astype(np.float64), tid, tp, w, chain=j)
    _dx, rgrads = ref_mtp.draft_kl_backward(p64, cfg, cache, 1.0 / w.sum())
    assert r.loss == pytest.approx(kl / w.sum(), rel=1e-5)
    got = gd.grads()
    for n, g in rgrads.items():
        scale = max(np.abs(g).max(), 1e-4)
        np.testing.assert_allclose(got[n] / scale, g / scale, atol=2e-5, err_msg=n)
    w[0, 0] = 1.0
    with pytest.raises(Exception, match="weighted 0"):
        work.loss_sum_rows(x, tid, tp, w)


def test_stacked_tail_gives_what_every_row_gives(gpu, heal_kit):
    """A stacked step's MLP and final norm on step j's rows alone (`DraftWork`'s tail, the default) against the
    same work on every row (`tail=False`): the step-j output rows where `out_rows` says they lie, the loss sum,
    every gradient; the tail's MLP activations hold step j's rows alone, and it refuses every-row reads."""
    from ddl_wgpu.engine.draft import DraftWork
    from ddl_wgpu.runtime.gpu import GpuError

    h = heal_kit
    cfg = h.tiny_cfg(qk_norm="pre_rope")
    p = h.perturbed(cfg)
    rng = np.random.default_rng(11)
    B, W, j, k = 2, 8, 3, 8
    T, C = j * W, cfg.d_model
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    tid, tp = rng.integers(0, 256, (B, T, k)), rng.random((B, T, k)).astype(np.float32)
    w = np.zeros((B, T), np.float32)
    w[:, -W:] = (rng.random((B, W)) < 0.8).astype(np.float32)
    g = WgpuDraft(open_gpu(), p, cfg, batch=B)
    tail, full = (DraftWork(g.net, B, T, k, chain=j, tail=t) for t in (True, False))
    assert tail.tail and not full.tail
    assert tail.L[0]["gate"].size == B * W * cfg.ffn_hidden * 4 < full.L[0]["gate"].size
    for which in ("pre_norm", "post_norm"):
        got = []
        for work in (tail, full):
            work.forward(x)
            buf, stride, first = work.out_rows(which)
            rows = work.gpu.download(buf, np.float32, B * stride * C).reshape(B, stride, C)
            got.append(rows[:, first : first + W])
        np.testing.assert_allclose(got[0], got[1], rtol=1e-5, atol=1e-6, err_msg=which)
    assert tail.loss_sum_rows(x, tid, tp, w) == pytest.approx(full.loss_sum_rows(x, tid, tp, w), rel=1e-5)
    grads = []
    for work in (tail, full):
        r = work.step_rows(x, tid, tp, w)
        assert r.finite
        grads.append(g.grads())
    for n, want in grads[1].items():
        scale = max(np.abs(want).max(), 1e-4)
        np.testing.assert_allclose(grads[0][n] / scale, want / scale, atol=2e-6, err_msg=n)
    with pytest.raises(GpuError, match="tail=False"):
        tail.forward_rows(x)


def test_runtime_heal_both_backends(gpu, tmp_path, heal_kit):
    from dataclasses import replace

    from ddl_wgpu.files.modelfile import load_model
    from ddl_wgpu.jobs import heal

    h = heal_kit
    model = h.make_model(tmp_path / "m.ddlw", cfg=h.tiny_cfg(mtp=MtpConfig(chain_hidden="post_norm")))
    data = str(h.make_text(tmp_path / "t.txt"))
    cfg = replace(h.SMALL, chain=3, chain_attention="stacked")
    r = heal.heal(model, data, tmp_path / "r.ddlw", cfg, backend="ref")
    g = heal.heal(model, data, tmp_path / "g.ddlw", cfg, backend="wgpu")
    s = heal.heal(model, data, tmp_path / "s.ddlw", replace(cfg, chain_attention="per-step"), backend="ref")
    assert r["chain_attention"] == g["chain_attention"] == "stacked"
    for key in ("acceptance_before", "acceptance_after"):  # measured with the heal's own chain attention
        assert r[key]["chain_attention"] == g[key]["chain_attention"] == "stacked"
        assert s[key]["chain_attention"] == "per-step"
        np.testing.assert_allclose(g[key]["prefix_acceptance"], r[key]["prefix_acceptance"], atol=0.02)
    assert r["acceptance_before"]["prefix_acceptance"][0] == s["acceptance_before"]["prefix_acceptance"][0]
    assert r["steps"] == g["steps"] >= 8 and len(r["history"]) == len(g["history"]) >= 3
    for hr, hg in zip(r["history"], g["history"], strict=True):
        assert hr["step"] == hg["step"]
        np.testing.assert_allclose(hg["heldout_kl"], hr["heldout_kl"], atol=1e-4, rtol=0)
    # step 1 is the same in both modes; the chained steps are measured differently
    assert s["history"][0]["heldout_kl"][0] == pytest.approx(r["history"][0]["heldout_kl"][0], rel=1e-6)
    assert abs(s["history"][0]["heldout_kl"][2] - r["history"][0]["heldout_kl"][2]) > 1e-6
    a, b = load_model(tmp_path / "r.ddlw").params, load_model(tmp_path / "g.ddlw").params
    for n in ref_mtp.trained_names(a):
        np.testing.assert_allclose(b[n], a[n], rtol=1e-2, atol=2e-4, err_msg=n)


def test_chain_attention_config():
    from ddl_wgpu.jobs import heal

    assert heal.HealConfig().chain_attention is None  # the draft's layout's (tests/test_served_draft.py)
    with pytest.raises(heal.HealError, match="chain attention"):
        heal.HealConfig(chain_attention="diagonal")


# ----------------------------------------------------------------------------------------------------------
# acceptance in "stacked" chain attention


def _incremental_runtime_preds(params, cfg, tb, depth: int, b: int, p: int) -> list[int]:
    """The runtime's greedy drafts at anchor p of window b, one KV-cache step at a time: the verified step-1
    rows 0..p, then each drafted step's row appended (a causal run at positions 0..p+σ−1)."""
    mtp = cfg.mtp
    T = tb.ids.shape[1]
    hid = ref_mtp.pick_hidden(tb.pre, tb.post, mtp.trunk_hidden)
    valid = ref_mtp.step_valid(tb.lengths, T, 1)
    rows = ref_mtp.step_input(params, cfg, ref_mtp.shifted(tb.ids, 1), hid, valid)[b : b + 1, : p + 1]
    out = []
    for _j in range(depth):
        pre, post, _ = ref_mtp.draft_forward(params, cfg, rows)
        d = int(np.argmax(ref_mtp.draft_logits(params, cfg, post[:, -1:]), axis=-1)[0, 0])
        out.append(d)
        h = ref_mtp.pick_hidden(pre, post, mtp.chain_hidden)[:, -1:]
        x = ref_mtp.step_input(params, cfg, np.array([[d]]), h, np.ones((1, 1), bool))
        rows = np.concatenate([rows, x], axis=1)
    return out


def test_runtime_acceptance_is_the_incremental_runtime(tmp_path, heal_kit):
    from ddl_wgpu.files.modelfile import load_model
    from ddl_wgpu.jobs import accept

    h = heal_kit
    conv = MtpConfig(trunk_hidden="post_norm", chain_hidden="pre_norm")
    m = load_model(h.make_model(tmp_path / "m.ddlw", cfg=h.tiny_cfg(mtp=conv), seed=2))
    rng = np.random.default_rng(3)
    windows = [rng.integers(0, 256, n) for n in (12, 9)]
    tb = accept.trunk_batches(m, windows, batch=2)[0]
    depth = 3
    preds = accept.greedy_chain(m.params, m.cfg, tb, depth, ref_runner(m.params, m.cfg), "stacked")
    per_step = accept.greedy_chain(m.params, m.cfg, tb, depth, ref_runner(m.params, m.cfg), "per-step")
    differs = False
    for b, n in enumerate((12, 9)):
        for p in range(n - depth):
            want = _incremental_runtime_preds(m.params, m.cfg, tb, depth, b, p)
            assert list(preds[b, :, p]) == want, (b, p)
            assert preds[b, 0, p] == per_step[b, 0, p]  # step 1 is the same
            differs |= list(per_step[b, :, p]) != want
    assert differs  # the attention of the chained steps matters on this draft


def test_runtime_acceptance_gpu_matches_reference(gpu, tmp_path, heal_kit):
    from ddl_wgpu.files.modelfile import load_model
    from ddl_wgpu.jobs import accept

    h = heal_kit
    conv = MtpConfig(concat="emb_first", trunk_hidden="pre_norm", chain_hidden="post_norm")
    m = load_model(h.make_model(tmp_path / "m.ddlw", cfg=h.tiny_cfg(mtp=conv), seed=4))
    rng = np.random.default_rng(2)
    windows = [rng.integers(0, 256, n) for n in (20, 16, 24, 9, 30)]
    kw = dict(depth=3, batch=2, probe_conventions=True, chain_attention="stacked")
    r = accept.acceptance(m, windows, **kw)
    g = accept.acceptance(m, windows, backend="wgpu", **kw)
    assert list(g) == list(r) and tuple(k for k in r if k != "probe") == accept.KEYS
    assert r["chain_attention"] == g["chain_attention"] == "stacked"
    for key in accept.KEYS:
        assert g[key] == r[key], key
    assert [p["prefix_acceptance"] for p in g["probe"]] == [p["prefix_acceptance"] for p in r["probe"]]
    s = accept.acceptance(m, windows, depth=3, batch=2, chain_attention="per-step")
    assert s["chain_attention"] == "per-step" and s["prefix_acceptance"][0] == r["prefix_acceptance"][0]


@pytest.mark.parametrize("backend", ["ref", "wgpu"])
def test_runtime_acceptance_depth_one_is_seed(backend, tmp_path, heal_kit):
    from ddl_wgpu.jobs import accept

    h = heal_kit
    model = h.make_model(tmp_path / "m.ddlw", seed=1)
    data = str(h.make_text(tmp_path / "t.txt", words=60))
    s = accept.accept_file(model, data, depth=1, window=24, backend=backend, chain_attention="per-step")
    r = accept.accept_file(model, data, depth=1, window=24, backend=backend, chain_attention="stacked")
    assert list(r) == list(s) and r["chain_attention"] == "stacked" and s["chain_attention"] == "per-step"
    mode = (
        "chain_attention",
        "plan",
    )  # the memory plan counts the stacked chain's buffers (kept even at depth 1)
    assert {k: v for k, v in r.items() if k not in mode} == {k: v for k, v in s.items() if k not in mode}
    with pytest.raises(accept.AcceptError, match="chain attention"):
        accept.accept_file(model, data, depth=1, window=24, backend=backend, chain_attention="diagonal")
