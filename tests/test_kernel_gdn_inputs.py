"""The Gated DeltaNet's input kernels (`shaders/gdn_inputs.wgsl`, `ddl_wgpu/ops/gdn_inputs.py`) against
`ddl_ref.gdn`: the causal conv with SiLU (planar output, a decoding history), its input and weight gradients;
the L2 norm of q and k (an RMSNorm with a constant weight) and its backward with the per-key-head sum; the
decay and write gates and their gradients (`ddl_ref.gdn.gates_forward` / `gates_backward`).

Every entry point of the family is run: `conv_forward`; `conv_backward_pre`, `conv_backward_dx`,
`conv_grad_partial` and `conv_grad_reduce` (the four passes of `conv_backward`); `gates_forward`,
`gates_backward`; `head_group_sum` (inside `l2norm_backward` when G > 1).

Sizes are off the workgroup grid: 13 rows, channels 2·Hk·Dk + Hv·Dv = 2·2·5 + 4·3 = 32 and 2·1·6 + 3·7 = 33.
"""

import numpy as np
import pytest

from ddl_ref import gdn as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import gdn_inputs as gi

f32 = np.float32
SHAPES = [(1, 13, 2, 4, 5, 3, 4), (2, 7, 1, 3, 6, 7, 3)]  # B, T, Hk, Hv, Dk, Dv, conv taps


def _planar(out, rows, Hk, Hv, Dk, Dv):
    """The planar conv output as (rows, Ch) in channel order [q; k; v]."""
    k_off, v_off = gi.planar_offsets(rows, Hk, Dk)
    q = out[: rows * Hk * Dk].reshape(rows, Hk * Dk)
    k = out[k_off : k_off + rows * Hk * Dk].reshape(rows, Hk * Dk)
    v = out[v_off : v_off + rows * Hv * Dv].reshape(rows, Hv * Dv)
    return np.concatenate([q, k, v], axis=1)


def _to_planar(x, rows, Hk, Hv, Dk, Dv):
    k_off, v_off = gi.planar_offsets(rows, Hk, Dk)
    out = np.zeros(gi.planar_floats(rows, Hk, Hv, Dk, Dv), f32)
    qc = Hk * Dk
    out[: rows * qc] = x[:, :qc].reshape(-1)
    out[k_off : k_off + rows * qc] = x[:, qc : 2 * qc].reshape(-1)
    out[v_off : v_off + x[:, 2 * qc :].size] = x[:, 2 * qc :].reshape(-1)
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_conv_forward_and_backward(gpu, rng, shape):
    B, T, Hk, Hv, Dk, Dv, k = shape
    rows, Ch = B * T, 2 * Hk * Dk + Hv * Dv
    x = rng.standard_normal((B, T, Ch)).astype(f32)
    w = (rng.standard_normal((Ch, k)) * 0.5).astype(f32)
    dout = rng.standard_normal((B, T, Ch)).astype(f32)
    out_ref, cache = ref.causal_conv_forward(f64(x), f64(w))
    dx_ref, dw_ref = ref.causal_conv_backward(f64(dout), cache)
    bx, bw = gpu.upload(x), gpu.upload(w)
    out = gpu.buffer(4 * gi.planar_floats(rows, Hk, Hv, Dk, Dv))
    gi.conv_forward(gpu, out, bx, bw, B, T, Hk, Hv, Dk, Dv, k).run(gpu)
    got = _planar(gpu.download(out, f32), rows, Hk, Hv, Dk, Dv)
    check("conv out", got, out_ref.reshape(rows, Ch), "norm")
    dx = gpu.upload(np.ones((rows, Ch), f32))  # accumulated into
    dw = gpu.upload(np.full((Ch, k), 0.5, f32))
    d = gpu.upload(_to_planar(dout.reshape(rows, Ch), rows, Hk, Hv, Dk, Dv))
    gi.conv_backward(gpu, dx, dw, d, bx, bw, B, T, Hk, Hv, Dk, Dv, k, accumulate_dx=True).run(gpu)
    check("conv dx", gpu.read(dx, (rows, Ch)), dx_ref.reshape(rows, Ch) + 1.0, "norm")
    check("conv dw", gpu.read(dw, (Ch, k)), dw_ref + 0.5, "norm")


def test_conv_with_history_equals_the_longer_sequence(gpu, rng):
    """A conv over tokens 3.. with the three previous inputs as history gives the whole sequence's outputs
    there (the decoding cache's contract)."""
    B, T, Hk, Hv, Dk, Dv, k = 2, 9, 1, 2, 4, 3, 4
    Ch = 2 * Hk * Dk + Hv * Dv
    x = rng.standard_normal((B, T, Ch)).astype(f32)
    w = rng.standard_normal((Ch, k)).astype(f32)
    whole, _ = ref.causal_conv_forward(f64(x), f64(w))
    tail = x[:, 3:].copy()
    hist = gpu.upload(np.ascontiguousarray(x[:, : k - 1]))  # positions 0..2: the history of position 3
    out = gpu.buffer(4 * gi.planar_floats(B * (T - 3), Hk, Hv, Dk, Dv))
    gi.conv_forward(gpu, out, gpu.upload(tail), gpu.upload(w), B, T - 3, Hk, Hv, Dk, Dv, k, hist=hist).run(
        gpu
    )
    got = _planar(gpu.download(out, f32), B * (T - 3), Hk, Hv, Dk, Dv)
    check("conv with history", got, whole[:, 3:].reshape(-1, Ch), "norm")


@pytest.mark.parametrize("G", [1, 3])
def test_l2norm_of_q_and_k(gpu, rng, G):
    rows, Hk, Dk = 11, 2, 6
    Hv, Dv = Hk * G, 3
    x = rng.standard_normal((rows, 2 * Hk * Dk + Hv * Dv)).astype(f32) * 2
    conv_out = gpu.upload(_to_planar(x, rows, Hk, Hv, Dk, Dv))
    qk = gpu.buffer(4 * gi.qk_floats(rows, Hk, Dk))
    rstd = gpu.buffer(4 * gi.rstd_floats(rows, Hk))
    gi.l2norm_forward(gpu, qk, rstd, conv_out, rows, Hk, Dk).run(gpu)
    q = f64(x[:, : Hk * Dk].reshape(rows, Hk, Dk))
    k = f64(x[:, Hk * Dk : 2 * Hk * Dk].reshape(rows, Hk, Dk))
    qn, cq = ref.l2norm_forward(q)
    kn, ck = ref.l2norm_forward(k)
    got = gpu.download(qk, f32)
    ko = gi.align_floats(rows * Hk * Dk)
    check("q normalised and scaled", got[: q.size].reshape(q.shape), qn / np.sqrt(Dk), "norm")
    check("k normalised", got[ko : ko + k.size].reshape(k.shape), kn, "norm")
    # backward from per-value-head gradients: a key head's gradient is the sum over its G value heads
    dq_v = rng.standard_normal((rows, Hv, Dk)).astype(f32)
    dk_v = rng.standard_normal((rows, Hv, Dk)).astype(f32)
    dqk = np.zeros(gi.qk_floats(rows, Hv, Dk), f32)
    dqk[: dq_v.size] = dq_v.reshape(-1)
    dqk[gi.align_floats(dq_v.size) :][: dk_v.size] = dk_v.reshape(-1)
    dconv = gpu.upload(np.full(gi.planar_floats(rows, Hk, Hv, Dk, Dv), 9.0, f32))
    gi.l2norm_backward(gpu, dconv, gpu.upload(dqk), rstd, conv_out, rows, Hk, Dk, G=G).run(gpu)
    dq = f64(dq_v.reshape(rows, Hk, G, Dk).sum(2)) / np.sqrt(Dk)
    dk = f64(dk_v.reshape(rows, Hk, G, Dk).sum(2))
    d = _planar(gpu.download(dconv, f32), rows, Hk, Hv, Dk, Dv)
    check("dq", d[:, : Hk * Dk].reshape(q.shape), ref.l2norm_backward(dq, cq), "norm")
    check("dk", d[:, Hk * Dk : 2 * Hk * Dk].reshape(k.shape), ref.l2norm_backward(dk, ck), "norm")
    assert (d[:, 2 * Hk * Dk :] == 9.0).all(), "the L2 norm backward wrote into v's columns"


def test_gates_forward_and_backward(gpu, rng):
    rows, Hv, Dv = 13, 3, 5
    a = rng.standard_normal((rows, Hv)).astype(f32) * 3
    b = rng.standard_normal((rows, Hv)).astype(f32) * 3
    A_log = np.log(rng.uniform(0.01, 16, Hv)).astype(f32)
    dt = rng.standard_normal(Hv).astype(f32)
    g_ref, beta_ref, cache = ref.gates_forward(f64(a), f64(b), f64(A_log), f64(dt))
    ba, bb, bA, bdt = (gpu.upload(v) for v in (a, b, A_log, dt))
    gb = gpu.buffer(4 * 2 * rows * Hv)
    gi.gates_forward(gpu, gb, ba, bb, bA, bdt, rows, Hv).run(gpu)
    got = gpu.read(gb, (rows, Hv, 2))
    check("g", got[..., 0], g_ref, "norm")
    check("beta", got[..., 1], beta_ref, "norm")
    parts = rng.standard_normal((rows, Hv, 2, Dv)).astype(f32)  # the rule's per-column terms
    dg, dbeta = f64(parts[:, :, 0].sum(-1)), f64(parts[:, :, 1].sum(-1))
    da_ref, db_ref, dA_ref, ddt_ref = ref.gates_backward(dg, dbeta, cache)
    da, db = gpu.buffer(4 * rows * Hv), gpu.buffer(4 * rows * Hv)
    dA, ddt = gpu.upload(np.ones(Hv, f32)), gpu.upload(np.ones(Hv, f32))  # accumulated into
    ones = gpu.upload(np.ones(rows, f32))
    gi.gates_backward(gpu, da, db, dA, ddt, gpu.upload(parts), ba, bb, bA, bdt, ones, rows, Hv, Dv).run(gpu)
    check("da", gpu.read(da, (rows, Hv)), da_ref, "norm")
    check("db", gpu.read(db, (rows, Hv)), db_ref, "norm")
    check("dA_log", gpu.read(dA, (Hv,)), dA_ref + 1.0, "matmul")
    check("ddt_bias", gpu.read(ddt, (Hv,)), ddt_ref + 1.0, "matmul")
