"""Gated attention's kernels (`shaders/attn_gate.wgsl`, `ddl_wgpu/ops/attn_gate.py`) against
`ddl_ref.ops.sigmoid_gate_forward` / `sigmoid_gate_backward` and numpy's view of q_proj's [query; gate] rows."""

import numpy as np

from ddl_ref import ops as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import attn_gate as ag

f32 = np.float32


def test_split_gate_and_join(gpu, rng):
    N, H, D = 13, 3, 5
    rows = N * H
    qg = rng.standard_normal((N, H, 2 * D)).astype(f32) * 4  # |gate| large too: the stable sigmoid
    q, gate = gpu.buffer(4 * rows * D), gpu.buffer(4 * rows * D)
    bqg = gpu.upload(qg)
    ag.split_heads(gpu, q, gate, bqg, rows, D).run(gpu)
    assert np.array_equal(gpu.read(q, (N, H, D)), qg[..., :D])
    assert np.array_equal(gpu.read(gate, (N, H, D)), qg[..., D:])
    a = rng.standard_normal((N, H, D)).astype(f32)
    out = gpu.buffer(4 * rows * D)
    ag.gate_forward(gpu, out, gpu.upload(a), gate, rows * D).run(gpu)
    check("gated output", gpu.read(out, (N, H, D)), ref.sigmoid_gate_forward(f64(a), f64(qg[..., D:])))
    dout = rng.standard_normal((N, H, D)).astype(f32)
    da, dqg = gpu.buffer(4 * rows * D), gpu.buffer(4 * 2 * rows * D)
    ag.gate_backward(gpu, da, dqg, gpu.upload(dout), gpu.upload(a), gate, rows, D).run(gpu)
    dq = rng.standard_normal((N, H, D)).astype(f32)
    ag.join_query(gpu, dqg, gpu.upload(dq), rows, D).run(gpu)
    da_ref, dgate_ref = ref.sigmoid_gate_backward(f64(dout), f64(a), f64(qg[..., D:]))
    check("da", gpu.read(da, (N, H, D)), da_ref)
    got = gpu.read(dqg, (N, H, 2 * D))
    check("dgate (interleaved)", got[..., D:], dgate_ref)
    assert np.array_equal(got[..., :D], dq), "join_query: the query half"
