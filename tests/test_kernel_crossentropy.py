"""Cross-entropy (`shaders/crossentropy.wgsl`, `ddl_wgpu/ops/crossentropy.py`) against
`ddl_ref.ops.cross_entropy_rows` (float64): chunks, large vocabularies, the scale rewrite, bounds checks.

Shapes are small and deliberately not multiples of the 256-wide workgroups (lavapipe is slow); every
reduction also gets a bit-identical determinism check.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check
from ddl_wgpu.ops import crossentropy as ce_ops


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
