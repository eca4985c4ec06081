"""Launchers for `shaders/attn_gate.wgsl`: gated full attention's q_proj split and output gate
(`ModelConfig.attn_output_gate`, Qwen3.5), forward and backward.

Kernel path: `shaders/attn_gate.wgsl` -> `ddl_wgpu/ops/attn_gate.py` -> reference
`ddl_ref.ops.sigmoid_gate_forward`, `ddl_ref.ops.sigmoid_gate_backward` (and numpy's reshape for the split) ->
test `tests/test_kernel_attn_gate.py`.

The q_proj output `qg` is (N, H, 2D), per head [query; gate] (the weight's row layout, kept as Hugging Face
stores it). The forward splits it into planar query and gate (N, H, D); the backward writes both halves of
its gradient back in the interleaved layout (the gate half in `gate_backward`, the query half in
`join_query`), so q_proj's own backward stays one GEMM over the whole (N, 2HD) gradient.
"""

from __future__ import annotations

from ddl_wgpu.ops import need_all as _need
from ddl_wgpu.runtime.gpu import Call, Gpu, Uniform

FILE = "attn_gate.wgsl"
WG = 256
PARAMS = Uniform("Params", ("n", "u32", "items: rows * D"), ("D", "u32", "head_dim"))


def _launch(gpu: Gpu, entry: str, sig: str, resources: list, n: int, D: int) -> Call:
    k = gpu.kernel(FILE, entry, sig, workgroup=(WG, 1, 1), uniforms=(PARAMS,))
    u = gpu.uniform(PARAMS, n=int(n), D=int(D), label=entry)
    return Call([(k, gpu.bind(k, *resources, u), max(1, -(-int(n) // WG)))], [u])


def split_heads(gpu: Gpu, q, gate, qg, rows: int, D: int) -> Call:
    """q, gate (rows, D) from qg (rows, 2D) = [query; gate] per row (rows = N * H)."""
    n = rows * D
    _need("split_heads", q=(q, n), gate=(gate, n), qg=(qg, 2 * n))
    return _launch(gpu, "split_heads", "rwwu", [qg, q, gate], n, D)


def gate_forward(gpu: Gpu, out, a, gate, n: int) -> Call:
    """out (n,) = a * sigmoid(gate)."""
    _need("gate_forward", out=(out, n), a=(a, n), gate=(gate, n))
    return _launch(gpu, "gate_forward", "rrwu", [a, gate, out], n, 1)


def gate_backward(gpu: Gpu, da, dqg, dout, a, gate, rows: int, D: int) -> Call:
    """da (rows, D) = dout * sigmoid(gate); the gate half of dqg (rows, 2D) = dout * a * sigmoid'(gate)."""
    n = rows * D
    _need("gate_backward", da=(da, n), dqg=(dqg, 2 * n), dout=(dout, n), a=(a, n), gate=(gate, n))
    return _launch(gpu, "gate_backward", "rrrwwu", [dout, a, gate, da, dqg], n, D)


def join_query(gpu: Gpu, dqg, dq, rows: int, D: int) -> Call:
    """The query half of dqg (rows, 2D) = dq (rows, D)."""
    n = rows * D
    _need("join_query", dqg=(dqg, 2 * n), dq=(dq, n))
    return _launch(gpu, "join_query", "rwu", [dq, dqg], n, D)
