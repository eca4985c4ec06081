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
