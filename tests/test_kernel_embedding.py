"""The embedding gather and its bucketed backward (`shaders/embedding.wgsl`, `ddl_wgpu/ops/embedding.py`)
against `ddl_ref.ops.embedding_forward` / `embedding_backward`.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import embedding

f32 = np.float32


def test_embedding_buckets():
    ids = np.array([[3, 1, 3], [0, 3, 1]])
    order, starts = embedding.embedding_buckets(ids, 5)
    assert order.dtype == np.uint32 and starts.dtype == np.uint32
    assert order.tolist() == [3, 1, 5, 0, 2, 4]  # stable: equal ids keep position order
    assert starts.tolist() == [0, 1, 3, 3, 6, 6]
    with pytest.raises(ValueError):
        embedding.embedding_buckets(ids, 3)


@pytest.mark.parametrize("C", [33, 32])  # the f32 and the vec4 path
def test_embedding(gpu, rng, C):
    B, T, V = 3, 11, 29
    ids = rng.integers(0, 12, size=(B, T))  # repeats, and ids 12..27 unseen
    ids[0, :4] = 28
    ids[1, :7] = 5  # a long bucket: the shader's 4-way interleaved sum plus a remainder
    wte = rng.standard_normal((V, C)).astype(f32)
    dout = rng.standard_normal((B, T, C)).astype(f32)
    n = B * T
    bids = gpu.upload(ids.astype(np.uint32))
    out = gpu.buffer(4 * n * C)
    embedding.embedding_forward(gpu, out, bids, gpu.upload(wte), n, C).run(gpu)
    assert np.array_equal(gpu.read(out, (B, T, C)), ref.embedding_forward(ids, wte))

    order, starts = embedding.embedding_buckets(ids, V)
    bo, bs, bd = gpu.upload(order), gpu.upload(starts), gpu.upload(dout)
    ref_dwte = ref.embedding_backward(f64(dout), ids, V)
    dwte0 = rng.standard_normal((V, C)).astype(f32)
    dwte = gpu.upload(dwte0)
    embedding.embedding_backward(gpu, dwte, bd, bo, bs, V, C).run(gpu)  # accumulate is the default
    check("dwte (accumulated)", gpu.read(dwte, (V, C)), f64(dwte0) + ref_dwte)

    got = []
    for _ in range(2):
        dwte = gpu.upload(dwte0)
        embedding.embedding_backward(gpu, dwte, bd, bo, bs, V, C, accumulate=False).run(gpu)
        got.append(gpu.read(dwte, (V, C)))
    check("dwte", got[0], ref_dwte)
    assert np.array_equal(got[0], got[1])
