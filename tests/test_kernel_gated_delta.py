"""The gated delta rule (`shaders/gated_delta.wgsl`, `ddl_wgpu/ops/gated_delta.py`) against
`ddl_ref.gdn.gated_delta_forward` / `gated_delta_backward` (float64 reference of the float32 inputs): outputs,
the saved r = v − u, checkpoints and the final state; every gradient; a start state; a chunk length that
does not divide T; determinism.

Shapes are off the thread grid: Dk 5 / 6 / 20 and Dv 3 / 7 / 24 pad rows and columns, 20 x 24 gives each thread
two rows and two columns; Hv = 2·Hk shares a key head between two value heads.
"""

import numpy as np
import pytest

from ddl_ref import gdn as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import gated_delta as kg
from ddl_wgpu.ops.gdn_inputs import align_floats, qk_floats

f32 = np.float32


def _inputs(rng, B, T, Hk, Hv, Dk, Dv):
    q = rng.standard_normal((B, T, Hk, Dk))
    k = rng.standard_normal((B, T, Hk, Dk))
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(Dk)  # normalised and scaled, as the layer gives
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, Hv, Dv))
    g = -rng.uniform(0.02, 1.5, (B, T, Hv))  # log decays
    beta = rng.uniform(0.05, 0.95, (B, T, Hv))
    return [a.astype(f32) for a in (q, k, v, g, beta)]


def _upload(gpu, q, k, v, g, beta, v_pad=0):
    """GPU buffers in the kernel's layouts: qkgb = [q; k; (g, beta) per (row, head)] at aligned offsets, v
    inside rows of width Hv·Dv + v_pad (like the conv output's v columns)."""
    B, T, Hv, Dv = v.shape
    N, Hk, Dk = B * T, q.shape[2], q.shape[3]
    vrow = np.zeros((N, v_pad + Hv * Dv), f32)
    vrow[:, v_pad:] = v.reshape(N, Hv * Dv)
    k_off, gb_off = kg.qkgb_offsets(N, Hk, Dk)
    qkgb = np.zeros(kg.qkgb_floats(N, Hk, Hv, Dk), f32)
    qkgb[: q.size], qkgb[k_off : k_off + k.size] = q.reshape(-1), k.reshape(-1)
    qkgb[gb_off:] = np.stack([g.reshape(N, Hv), beta.reshape(N, Hv)], axis=-1).reshape(-1)
    return gpu.upload(qkgb), gpu.upload(vrow), v_pad + Hv * Dv


def _forward(gpu, q, k, v, g, beta, tc, state=None, v_pad=0, save_final=True):
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    N = B * T
    qkgb, vb, stride = _upload(gpu, q, k, v, g, beta, v_pad)
    o, r = gpu.buffer(4 * N * Hv * Dv), gpu.buffer(4 * N * Hv * Dv)
    states = gpu.buffer(4 * kg.states_floats(B, Hv, Dk, Dv, T, tc))
    s_in = gpu.upload(state) if state is not None else None
    kg.gated_delta_forward(gpu, o, r, states, qkgb, vb, B, T, Hk, Hv, Dk, Dv, tc=tc, v_off=v_pad, v_stride=stride,
                           state_in=s_in, save_final=save_final).run(gpu)  # fmt: skip
    scratch = gpu.buffer(4 * kg.scratch_floats(B, Hv, Dk, Dv, tc))
    return dict(qkgb=qkgb, o=o, r=r, states=states, scratch=scratch, stride=stride, v_pad=v_pad)


SHAPES = [  # B, T, Hk, Hv, Dk, Dv, tc
    (2, 7, 1, 2, 5, 3, 3),
    (1, 9, 2, 4, 6, 7, 4),
    (2, 6, 1, 1, 20, 24, 6),
    (1, 3, 1, 1, 128, 128, 2),  # Qwen3.5's heads: 8 x 8 state elements per thread
]


def _r_reference(cache):
    """r = v − u of every token from the reference's states (kept before every token: checkpoint 1)."""
    S_prev = np.stack(cache["kept"], axis=1)  # (B, T, Hv, Dk, Dv): the state before token t
    u = np.einsum("bthkv,bthk->bthv", S_prev * cache["a"][..., None, None], cache["ke"])
    return cache["v"] - u


@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference(gpu, shape):
    B, T, Hk, Hv, Dk, Dv, tc = shape
    rng = np.random.default_rng(sum(shape))
    q, k, v, g, beta = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    o_ref, S_ref, cache = ref.gated_delta_forward(*(f64(a) for a in (q, k, v, g, beta)), checkpoint=1)
    d = _forward(gpu, q, k, v, g, beta, tc, v_pad=5)
    check("o", gpu.read(d["o"], (B, T, Hv, Dv)), o_ref, "norm")
    check("r = v - u", gpu.read(d["r"], (B, T, Hv, Dv)), _r_reference(cache), "norm")
    nck = kg.n_chunks(T, tc)
    states = gpu.read(d["states"], (B, Hv, nck + 1, Dk, Dv))
    for c in range(nck):
        check(f"checkpoint {c}", states[:, :, c], cache["kept"][c * tc], "norm")
    check("final state", states[:, :, nck], S_ref, "norm")


def test_forward_from_a_state_equals_the_whole_sequence(gpu):
    """Two halves, the second started from the first's final state, give the whole sequence's outputs (the
    decoding cache's contract)."""
    B, T, Hk, Hv, Dk, Dv = 1, 8, 1, 2, 6, 5
    rng = np.random.default_rng(3)
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    whole = _forward(gpu, *x, tc=T)
    first = _forward(gpu, *(a[:, :5] for a in x), tc=5)
    S1 = gpu.read(first["states"], (B, Hv, 2, Dk, Dv))[:, :, 1].copy()
    second = _forward(gpu, *(a[:, 5:] for a in x), tc=3, state=S1)
    o = gpu.read(whole["o"], (B, T, Hv, Dv))
    check("o first", gpu.read(first["o"], (B, 5, Hv, Dv)), o[:, :5], "norm")
    check("o second", gpu.read(second["o"], (B, 3, Hv, Dv)), o[:, 5:], "norm")
    _, S_ref, _ = ref.gated_delta_forward(*(f64(a) for a in x))
    check("final state", gpu.read(second["states"], (B, Hv, 2, Dk, Dv))[:, :, 1], S_ref, "norm")


@pytest.mark.parametrize("shape", SHAPES)
def test_backward_matches_reference(gpu, shape):
    B, T, Hk, Hv, Dk, Dv, tc = shape
    N = B * T
    rng = np.random.default_rng(100 + sum(shape))
    q, k, v, g, beta = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    do = rng.standard_normal((B, T, Hv, Dv)).astype(f32)
    _, _, cache = ref.gated_delta_forward(*(f64(a) for a in (q, k, v, g, beta)))
    dq, dk, dv, dg, dbeta, _ = ref.gated_delta_backward(f64(do), cache)
    d = _forward(gpu, q, k, v, g, beta, tc, v_pad=3)
    dqk = gpu.buffer(4 * qk_floats(N, Hv, Dk))
    dvb = gpu.upload(np.full((N, d["stride"]), 7.0, f32))  # v's columns are written, the others kept
    dgb = gpu.buffer(4 * 2 * N * Hv * Dv)
    kg.gated_delta_backward(gpu, dqk, dvb, dgb, d["scratch"], d["states"], d["qkgb"], d["r"], gpu.upload(do), B, T,
                            Hk, Hv, Dk, Dv, tc=tc, v_off=3, v_stride=d["stride"]).run(gpu)  # fmt: skip
    got = gpu.download(dqk, f32)
    half = N * Hv * Dk
    G = Hv // Hk
    # per value head: the sum over a key head's value heads is its gradient
    check("dq", got[:half].reshape(B, T, Hk, G, Dk).sum(3), dq, "attention")
    dk_got = got[align_floats(half) :][:half]
    check("dk", dk_got.reshape(B, T, Hk, G, Dk).sum(3), dk, "attention")
    dv_rows = gpu.read(dvb, (N, d["stride"]))
    check("dv", dv_rows[:, 3:].reshape(B, T, Hv, Dv), dv, "attention")
    assert (dv_rows[:, :3] == 7.0).all(), "dv wrote outside v's columns"
    parts = gpu.read(dgb, (B, T, Hv, 2, Dv))
    check("dg", parts[..., 0, :].sum(-1), dg, "attention")
    check("dbeta", parts[..., 1, :].sum(-1), dbeta, "attention")


def test_same_bits_every_run(gpu):
    B, T, Hk, Hv, Dk, Dv, tc = SHAPES[2]
    N = B * T
    rng = np.random.default_rng(9)
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    do = gpu.upload(rng.standard_normal((B, T, Hv, Dv)).astype(f32))
    runs = []
    for _ in range(2):
        d = _forward(gpu, *x, tc=tc)
        dqk, dvb = gpu.buffer(4 * qk_floats(N, Hv, Dk)), gpu.buffer(4 * N * Hv * Dv)
        dgb = gpu.buffer(8 * N * Hv * Dv)
        kg.gated_delta_backward(gpu, dqk, dvb, dgb, d["scratch"], d["states"], d["qkgb"], d["r"], do, B, T, Hk, Hv,
                                Dk, Dv, tc=tc).run(gpu)  # fmt: skip
        runs.append([gpu.download(b, np.uint32) for b in (d["o"], dqk, dvb, dgb)])
    for a, b in zip(*runs, strict=True):
        assert np.array_equal(a, b)
