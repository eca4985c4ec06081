"""Losses, top-k, reductions and AdamW on the GPU against the float64 numpy reference (`ddl_ref`).

Shapes are small and deliberately not multiples of the 256-wide workgroups (lavapipe is slow); every
reduction also gets a bit-identical determinism check.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref import optim as ref_optim
from ddl_ref.check import check
from ddl_wgpu.ops import adamw as adamw_ops
from ddl_wgpu.ops import crossentropy as ce_ops
from ddl_wgpu.ops import reduce as red_ops
from ddl_wgpu.ops import topk_kl as tk_ops


def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def u32(a):
    return np.ascontiguousarray(a, dtype=np.uint32)


def ce_inputs(rng, N, V):
    logits = rng.normal(0.0, 3.0, size=(N, V))
    targets = rng.integers(0, V, size=N)
    weights = (rng.random(N) > 0.3).astype(np.float64)
    weights[1] = 0.0
    targets[1] = V + 7  # out of range on a weight-0 row: clipped, ignored
    weights[0] = 1.0
    return f32(logits), targets, weights


def ce_rows_ref(logits, targets, weights):
    """Per-row reference losses (float64) and the scaled-by-1 gradient."""
    x = logits.astype(np.float64)
    per_row = np.array(
        [
            ref.cross_entropy_rows(x[i : i + 1], targets[i : i + 1], weights[i : i + 1])[0]
            for i in range(len(x))
        ]
    )
    total, dlogits = ref.cross_entropy_rows(x, targets, weights)
    assert np.isclose(per_row.sum(), total)
    return per_row, dlogits


def run_ce(gpu, logits, targets, weights, scale, chunks):
    """Run cross_entropy over row chunks [(start, stop), ...] into one row_loss buffer; return (row_loss,
    dlogits) downloaded."""
    N, V = logits.shape
    t_buf, w_buf = gpu.upload(u32(np.minimum(targets, 2**32 - 1))), gpu.upload(f32(weights))
    s_buf = gpu.upload(f32([scale]))
    loss_buf = gpu.buffer(4 * N)
    grads = []
    for a, b in chunks:
        lg = gpu.upload(logits[a:b])
        ce_ops.cross_entropy(gpu, loss_buf, lg, t_buf, w_buf, b - a, V, s_buf, row_offset=a).run(gpu)
        grads.append(gpu.download(lg, np.float32, (b - a) * V).reshape(b - a, V))
    return gpu.download(loss_buf, np.float32, N), np.concatenate(grads)


@pytest.mark.parametrize("V", [37, 1000])
def test_cross_entropy_matches_reference(gpu, rng, V):
    N = 13
    logits, targets, weights = ce_inputs(rng, N, V)
    scale = 1.0 / weights.sum()
    per_row, dref = ce_rows_ref(logits, targets, weights)
    row_loss, dlogits = run_ce(gpu, logits, targets, weights, scale, [(0, N)])
    check("row_loss", row_loss, per_row, "loss")
    check("dlogits", dlogits, dref * scale, "loss")
    assert np.all(dlogits[weights == 0] == 0.0)

    # eval entry point: same losses, logits untouched
    lg = gpu.upload(logits)
    loss_buf = gpu.buffer(4 * N)
    ce_ops.cross_entropy_eval(
        gpu, loss_buf, lg, gpu.upload(u32(targets)), gpu.upload(f32(weights)), N, V
    ).run(gpu)
    check("eval row_loss", gpu.download(loss_buf, np.float32, N), per_row, "loss")
    assert np.array_equal(gpu.download(lg, np.float32, N * V).reshape(N, V), logits)


def test_cross_entropy_chunks_compose_and_deterministic(gpu, rng):
    N, V = 13, 300
    logits, targets, weights = ce_inputs(rng, N, V)
    whole = run_ce(gpu, logits, targets, weights, 0.25, [(0, N)])
    chunked = run_ce(gpu, logits, targets, weights, 0.25, [(0, 5), (5, 10), (10, 13)])
    again = run_ce(gpu, logits, targets, weights, 0.25, [(0, 5), (5, 10), (10, 13)])
    for a, b in zip(whole, chunked, strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(chunked, again, strict=True):
        assert np.array_equal(a, b)
    per_row, dref = ce_rows_ref(logits, targets, weights)
    check("chunked row_loss", chunked[0], per_row, "loss")
    check("chunked dlogits", chunked[1], dref * 0.25, "loss")


def test_cross_entropy_large_vocab(gpu, rng):
    """V = 200k: 782 elements per invocation, online max/sum across a row far wider than the workgroup."""
    N, V = 2, 200_003
    logits, targets, weights = ce_inputs(rng, N, V)
    weights[1] = 1.0
    targets[1] = V - 1
    per_row, dref = ce_rows_ref(logits, targets, weights)
    row_loss, dlogits = run_ce(gpu, logits, targets, weights, 0.5, [(0, N)])
    check("row_loss V=200k", row_loss, per_row, "loss")
    check("dlogits V=200k", dlogits, dref * 0.5, "loss")


def test_cross_entropy_scale_buffer_rewrite(gpu, rng):
    """The per-step scale is read from a storage buffer at run time: rewriting it needs no new Call."""
    N, V = 5, 40
    logits, targets, weights = ce_inputs(rng, N, V)
    _, dref = ce_rows_ref(logits, targets, weights)
    lg, s_buf, loss_buf = gpu.upload(logits), gpu.upload(f32([1.0])), gpu.buffer(4 * N)
    call = ce_ops.cross_entropy(
        gpu, loss_buf, lg, gpu.upload(u32(targets)), gpu.upload(f32(weights)), N, V, s_buf
    )
    gpu.write(s_buf, f32([0.125]))
    call.run(gpu)
    check("dlogits scaled", gpu.download(lg, np.float32, N * V).reshape(N, V), dref * 0.125, "loss")


def test_cross_entropy_rejects_short_row_loss(gpu):
    with pytest.raises(ValueError, match="row_loss"):
        ce_ops.cross_entropy(
            gpu,
            gpu.buffer(16),
            gpu.buffer(4 * 4 * 8),
            gpu.buffer(64),
            gpu.buffer(64),
            4,
            8,
            gpu.buffer(16),
            row_offset=8,
        )


# ---------------------------------------------------------------------------------------------------------
# top-k


def test_topk_kl_matches_reference(gpu, rng):
    N, V, k = 13, 50, 5
    logits = f32(rng.normal(0.0, 2.0, size=(N, V)))
    ids = np.stack([rng.choice(V, size=k, replace=False) for _ in range(N)])
    probs = rng.random((N, k)) * 0.3
    probs[2, 1] = 0.0  # 0 log 0 = 0
    ids[5, 1] = ids[5, 0]  # a repeated id accumulates (np.add.at in the reference)
    probs[4, :] = probs[4, :] / 10  # renormalised anyway
    weights = (rng.random(N) > 0.3).astype(np.float64)
    weights[0] = 1.0
    weights[2] = 1.0
    weights[3] = 0.0
    probs[3, :] = 0.0  # a zero-filled padding row: the reference gives 0/0 = NaN, the kernel exact zeros
    scale = 0.5
    with np.errstate(invalid="ignore"):
        kl_sum, cache = ref.topk_kl_forward(logits.astype(np.float64), ids, probs.astype(np.float64), weights)
        dref = ref.topk_kl_backward(cache) * scale
        per_row = np.array(
            [
                ref.topk_kl_forward(
                    logits[i : i + 1].astype(np.float64), ids[i : i + 1], probs[i : i + 1], weights[i : i + 1]
                )[0]
                for i in range(N)
            ]
        )
    assert np.isnan(per_row[3]) and np.isnan(dref[3]).any()
    per_row[3], dref[3] = 0.0, 0.0
    assert np.isnan(kl_sum)

    def run(chunks):
        id_buf, p_buf, w_buf = gpu.upload(u32(ids)), gpu.upload(f32(probs)), gpu.upload(f32(weights))
        s_buf, loss_buf = gpu.upload(f32([scale])), gpu.buffer(4 * N)
        grads = []
        for a, b in chunks:
            lg = gpu.upload(logits[a:b])
            tk_ops.topk_kl(gpu, loss_buf, lg, id_buf, p_buf, w_buf, b - a, V, k, s_buf, row_offset=a).run(gpu)
            grads.append(gpu.download(lg, np.float32, (b - a) * V).reshape(b - a, V))
        return gpu.download(loss_buf, np.float32, N), np.concatenate(grads)

    row_loss, dlogits = run([(0, N)])
    check("topk_kl row_loss", row_loss, per_row, "loss")
    check("topk_kl dlogits", dlogits, dref, "loss")
    assert row_loss[3] == 0.0 and not dlogits[3].any()
    chunked = run([(0, 6), (6, N)])
    assert np.array_equal(chunked[0], row_loss) and np.array_equal(chunked[1], dlogits)


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


# ---------------------------------------------------------------------------------------------------------
# reductions


def ranges_arena(gpu, arrays):
    """Pack flat f32 arrays into one arena at 256-byte-aligned offsets; return (arena, [(view, n)])."""
    offs, off = [], 0
    for a in arrays:
        offs.append(off)
        off += -(-a.size * 4 // 256) * 256
    arena = gpu.buffer(off)
    views = []
    for a, o in zip(arrays, offs, strict=True):
        gpu.write(arena, f32(a), o)
        views.append(((arena, o, a.size * 4), a.size))
    return arena, views


def grad_norm(gpu, arrays, clip, max_groups=red_ops.MAX_GROUPS):
    _, views = ranges_arena(gpu, arrays)
    partials = gpu.buffer(4 * red_ops.total_partials([a.size for a in arrays], max_groups))
    scalars = gpu.buffer(red_ops.SCALARS_BYTES)
    call = red_ops.grad_norm_clip(gpu, scalars, partials, views, clip, max_groups=max_groups)
    call.run(gpu)
    return call, scalars, gpu.download(scalars, np.float32, 4)


def test_grad_norm_and_clip(gpu, rng):
    arrays = [rng.normal(size=n) for n in (1001, 37, 5003)]
    norm = ref_optim.global_grad_norm({str(i): a for i, a in enumerate(arrays)})
    for clip in (0.5 * norm, 2.0 * norm):
        _, _, s = grad_norm(gpu, arrays, clip)
        check("norm", s[0], np.float64(norm), "loss")
        check("clip multiplier", s[1], np.float64(ref_optim.clip_multiplier(norm, clip)), "loss")
        assert s[2] == 1.0
        check("sum of squares", s[3], np.float64(norm**2), "loss")
    assert grad_norm(gpu, arrays, 2.0 * norm)[2][1] == 1.0
    assert grad_norm(gpu, arrays, 0.0)[2][1] == 1.0  # clip <= 0: off
    assert grad_norm(gpu, [np.zeros(77)], 1.0)[2][:3].tolist() == [0.0, 1.0, 1.0]  # zero norm: multiplier 1

    # the clip threshold is in the finalize uniform, rewritable per run
    call, scalars, _ = grad_norm(gpu, arrays, 2.0 * norm)
    gpu.write_uniform(
        call.uniforms[-1], red_ops.FINALIZE_FMT, red_ops.total_partials([1001, 37, 5003]), 0.25 * norm, 0, 0
    )
    call.run(gpu)
    check("rewritten clip", gpu.download(scalars, np.float32, 4)[1], np.float64(0.25), "loss")


def test_grad_norm_grid_stride_and_determinism(gpu, rng):
    arrays = [rng.normal(size=n) for n in (9001, 3)]
    norm = ref_optim.global_grad_norm({str(i): a for i, a in enumerate(arrays)})
    _, _, a = grad_norm(gpu, arrays, 1.0, max_groups=2)  # 9001 elements through 2 workgroups
    check("norm (grid stride)", a[0], np.float64(norm), "loss")
    _, _, b = grad_norm(gpu, arrays, 1.0, max_groups=2)
    _, _, c = grad_norm(gpu, arrays, 1.0)
    assert np.array_equal(a, b)
    check("norm (more groups)", c[0], np.float64(norm), "loss")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_grad_norm_flags_non_finite(gpu, rng, bad):
    arrays = [rng.normal(size=n) for n in (301, 37, 515)]
    arrays[2][400] = bad
    _, _, s = grad_norm(gpu, arrays, 1.0)
    assert s[2] == 0.0
    assert s[1] == 0.0


def test_sum_rows(gpu, rng):
    x = rng.normal(size=1234)
    out = gpu.buffer(16)
    call = red_ops.sum_rows(gpu, out, gpu.upload(f32(x)), x.size, index=2)
    call.run(gpu)
    got = gpu.download(out, np.float32, 4)
    check("sum", got[2], np.float64(f32(x).astype(np.float64).sum()), "loss")
    assert got[0] == 0.0 and got[1] == 0.0
    call.run(gpu)
    assert np.array_equal(gpu.download(out, np.float32, 4), got)


# ---------------------------------------------------------------------------------------------------------
# AdamW


def test_adamw_three_steps_with_clip_decay_and_skip(gpu, rng):
    n1, n2 = 1001, 77
    hp = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    lrs = [1e-2, 3e-3, 1e-3]
    clip = 1.0
    p0 = {"a": rng.normal(size=n1), "b": rng.normal(size=n2)}
    grads = [{"a": rng.normal(size=n1) * s, "b": rng.normal(size=n2) * s} for s in (3.0, 0.01, 0.02)]

    # GPU: p, m, v, g each one arena with two ranges; one shared hyper uniform
    arenas = {}
    views = {}
    for name in ("p", "g", "m", "v"):
        src = p0 if name == "p" else {"a": np.zeros(n1), "b": np.zeros(n2)}
        arenas[name], views[name] = ranges_arena(gpu, [src["a"], src["b"]])
    scalars = gpu.buffer(red_ops.SCALARS_BYTES)
    partials = gpu.buffer(4 * red_ops.total_partials([n1, n2]))
    norm_call = red_ops.grad_norm_clip(gpu, scalars, partials, views["g"], clip)
    hyper = adamw_ops.adamw_hyper(gpu, lrs[0], 1, **hp)
    step_call = norm_call
    for i in range(2):
        (pv, n), (gv, _), (mv, _), (vv, _) = (views[k][i] for k in ("p", "g", "m", "v"))
        step_call = step_call + adamw_ops.adamw(gpu, pv, gv, mv, vv, scalars, n, hyper)

    # reference (float64), fed the same float32-rounded inputs
    params = {k: f32(v).astype(np.float64) for k, v in p0.items()}
    state = {}
    for step, (lr, g) in enumerate(zip(lrs, grads, strict=True), start=1):
        g32 = {k: f32(v).astype(np.float64) for k, v in g.items()}
        mult = ref_optim.clip_multiplier(ref_optim.global_grad_norm(g32), clip)
        ref_optim.adamw_step(params, g32, state, lr, step, grad_multiplier=mult, **hp)
        gpu.write(views["g"][0][0][0], f32(g["a"]), views["g"][0][0][1])
        gpu.write(views["g"][1][0][0], f32(g["b"]), views["g"][1][0][1])
        gpu.write_uniform(hyper, adamw_ops.ADAMW_FMT, *adamw_ops.adamw_uniform_values(lr, step, **hp))
        step_call.run(gpu)
        assert (mult < 1.0) == (step == 1)  # step 1 is clipped, the others are not

    def get(name, i):
        (buf, off, nb), n = views[name][i]
        return gpu.download(buf, np.float32, n, off)

    for i, key in enumerate(("a", "b")):
        check(f"p[{key}]", get("p", i), params[key], "optimizer")
        check(f"m[{key}]", get("m", i), state["m"][key], "optimizer")
        check(f"v[{key}]", get("v", i), state["v"][key], "optimizer")

    # a non-finite gradient anywhere: p, m, v untouched everywhere
    before = [get(k, i) for k in ("p", "m", "v") for i in range(2)]
    bad = f32(grads[0]["b"])
    bad[5] = np.nan
    gpu.write(views["g"][1][0][0], bad, views["g"][1][0][1])
    gpu.write_uniform(hyper, adamw_ops.ADAMW_FMT, *adamw_ops.adamw_uniform_values(1e-2, 4, **hp))
    step_call.run(gpu)
    assert gpu.download(scalars, np.float32, 4)[2] == 0.0
    after = [get(k, i) for k in ("p", "m", "v") for i in range(2)]
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, b)


def test_adamw_owned_uniform_and_determinism(gpu, rng):
    n = 300
    p, g = f32(rng.normal(size=n)), f32(rng.normal(size=n))
    scalars = gpu.upload(f32([0.0, 0.5, 1.0, 0.0]))  # multiplier 0.5, finite
    vals = adamw_ops.adamw_uniform_values(1e-3, 1, 0.9, 0.999, 1e-8, 0.0)

    def once():
        bufs = [gpu.upload(a) for a in (p, g, np.zeros(n, np.float32), np.zeros(n, np.float32))]
        adamw_ops.adamw(gpu, bufs[0], bufs[1], bufs[2], bufs[3], scalars, n, vals).run(gpu)
        return [gpu.download(b, np.float32, n) for b in (bufs[0], bufs[2], bufs[3])]

    a, b = once(), once()
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)
    params, state = {"w": p.astype(np.float64)}, {}
    ref_optim.adamw_step(
        params, {"w": g.astype(np.float64)}, state, 1e-3, 1, 0.9, 0.999, 1e-8, 0.0, grad_multiplier=0.5
    )
    check("p", a[0], params["w"], "optimizer")
    check("v", a[2], state["v"]["w"], "optimizer")
