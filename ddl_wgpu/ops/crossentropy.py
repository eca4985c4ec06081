"""Cross-entropy over rows of logits (`shaders/crossentropy.wgsl`), fused with its gradient, in place.

Kernel path: `shaders/crossentropy.wgsl` -> `ddl_wgpu/ops/crossentropy.py` -> reference
`ddl_ref.ops.cross_entropy_rows` -> test `tests/test_kernel_crossentropy.py`.

The engine computes the LM head in row chunks into one (rows, V) logits buffer; for each chunk it records
`cross_entropy`, which overwrites the logits with dlogits = (softmax(z) - onehot(t)) * weight * scale and
writes the chunk's per-row losses; the head's backward then reads the dlogits. Full logits for the whole
batch never exist.

Indexing across chunks: `targets` (u32), `weights` (f32) AND `row_loss` (f32) are the per-step, whole-batch
buffers of N rows, indexed at `row_offset + r` (r < rows, the chunk's row); `logits` is the chunk buffer,
indexed at r. So one row_loss buffer collects every chunk and one `reduce.sum_rows` turns it into the batch
loss sum. `scale_buf` is a small f32 storage buffer (or view) whose element 0 the kernel reads: the engine
writes 1 / (number of valid predictions) there once per step and every chunk's Call picks it up.

What this does not do: build the logits (matmul), reduce row_loss (reduce.sum_rows), or divide the loss.
"""

from __future__ import annotations

from ddl_wgpu.ops import need_bytes as _need
from ddl_wgpu.runtime.gpu import Call, Uniform

FILE = "crossentropy.wgsl"
WG = 256
PARAMS = Uniform("Params", ("rows", "u32"), ("V", "u32"), ("row_offset", "u32"), ("_pad", "pad"))


def _check(rows: int, V: int, row_offset: int, logits, targets, weights, row_loss):
    if rows < 1 or V < 1:
        raise ValueError(f"cross_entropy: rows={rows}, V={V} must be positive")
    _need("logits", logits, rows * V * 4)
    n = (row_offset + rows) * 4  # per-step buffers are indexed at row_offset + r
    _need("targets", targets, n)
    _need("weights", weights, n)
    _need("row_loss (whole-batch buffer, indexed at row_offset + r)", row_loss, n)


def cross_entropy(
    gpu, row_loss, logits, targets, weights, rows: int, V: int, scale_buf, row_offset: int = 0
) -> Call:
    """Loss and gradient for `rows` rows of `logits` (rows, V), in place.

    logits (rows, V) f32, read_write: becomes (softmax - onehot(target)) * weight * scale_buf[0].
    row_loss[row_offset + r] = weight * (logsumexp - z_target), unscaled.
    targets (N,) u32 and weights (N,) f32 are read at row_offset + r; a target >= V is clipped to V - 1
    (only meaningful on weight-0 rows). Build one Call per chunk, once; record it every step.
    """
    _check(rows, V, row_offset, logits, targets, weights, row_loss)
    _need("scale_buf", scale_buf, 4)
    k = gpu.kernel(FILE, "cross_entropy", "rrrwwu", workgroup=(WG, 1, 1), uniforms=(PARAMS,))
    u = gpu.uniform(PARAMS, rows=rows, V=V, row_offset=row_offset, label="cross_entropy")
    bg = gpu.bind(k, targets, weights, scale_buf, logits, row_loss, u)
    return Call([(k, bg, rows)], [u])


def cross_entropy_eval(
    gpu, row_loss, logits, targets, weights, rows: int, V: int, row_offset: int = 0
) -> Call:
    """Loss only (evaluation): row_loss[row_offset + r] = weight * (logsumexp - z_target); logits untouched."""
    _check(rows, V, row_offset, logits, targets, weights, row_loss)
    k = gpu.kernel(FILE, "cross_entropy_eval", "rrrwu", workgroup=(WG, 1, 1), uniforms=(PARAMS,))
    u = gpu.uniform(PARAMS, rows=rows, V=V, row_offset=row_offset, label="cross_entropy_eval")
    bg = gpu.bind(k, logits, targets, weights, row_loss, u)
    return Call([(k, bg, rows)], [u])
