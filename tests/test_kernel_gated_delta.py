"""The gated delta rule (`shaders/gated_delta.wgsl`, `ddl_wgpu/ops/gated_delta.py`), both forms, against
`ddl_ref.gdn` (float64 reference of the float32 inputs).

The per-token forward (decoding) against `gated_delta_forward`: outputs, the saved r = v − u, the saved states
and the final state; a start state; a state interval that does not divide T; determinism. Shapes are off the thread grid: Dk 5 / 6 / 20 and Dv 3 / 7 / 24 pad rows and columns,
20 x 24 gives each thread two rows and two columns; Hv = 2·Hk shares a key head between two value heads.

The chunked kernels (training and whole-sequence forwards) against `gated_delta_chunked_forward` (outputs, Δ,
the checkpoints, the final state, the prep's P, W = Tm diag(βΓ) K and U = Tm diag(β) V) and the recurrence's
backward (every gradient), under several plans: a chunk that does not divide T, several column blocks, a
column block as wide as Dv padded, one 4 x 4 block per thread or several, threads idle in small products, Tm
solved in one block or in two and four, slabs of one row up to the whole chunk, batch rows split over calls
where a binding is small. Every plan fits WebGPU's default limits, so the `DDL_WGPU_LIMITS=webgpu` run
repeats them all.
"""

import numpy as np
import pytest

from ddl_ref import gdn as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import gated_delta as kg
from ddl_wgpu.ops.codegen import gdn_plan
from ddl_wgpu.ops.gdn_inputs import align_floats, qk_floats
from ddl_wgpu.runtime.gpu import GpuError

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
    return dict(qkgb=qkgb, o=o, r=r, states=states, stride=stride, v_pad=v_pad)


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


def test_same_bits_every_run(gpu):
    B, T, Hk, Hv, Dk, Dv, tc = SHAPES[2]
    rng = np.random.default_rng(9)
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    runs = []
    for _ in range(2):
        d = _forward(gpu, *x, tc=tc)
        runs.append([gpu.download(d[n], np.uint32) for n in ("o", "r", "states")])
    for a, b in zip(*runs, strict=True):
        assert np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# the chunked form

CHUNKED = [  # (B, T, Hk, Hv, Dk, Dv), plan
    ((2, 7, 1, 2, 5, 3), kg.ChunkPlan(chunk=4, bv=4, threads=16, bk=2, tb=4, pthreads=32)),
    ((1, 9, 2, 4, 6, 7), kg.ChunkPlan(chunk=4, bv=8, threads=32, bk=4, tb=2, pthreads=16)),
    ((2, 6, 1, 1, 20, 24), kg.ChunkPlan(chunk=8, bv=8, threads=64, bk=8, tb=2, pthreads=64)),
    ((1, 20, 1, 3, 16, 16), kg.ChunkPlan(chunk=16, bv=8, threads=32, bk=1, tb=4, pthreads=64)),
]


def _chunked(gpu, x, plan, state=None, v_pad=2, save_final=True):
    """The chunked forward of inputs x = (q, k, v, g, beta) -> its buffers (and the scratch the backward
    uses)."""
    q, k, v, g, beta = x
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    N = B * T
    qkgb, vb, stride = _upload(gpu, q, k, v, g, beta, v_pad)
    o, d = gpu.buffer(4 * N * Hv * Dv), gpu.buffer(4 * N * Hv * Dv)
    states = gpu.buffer(4 * kg.states_floats(B, Hv, Dk, Dv, T, plan.chunk))
    scr = gpu.buffer(4 * kg.chunk_scratch_floats(gpu, B, T, Hv, Dk, Dv, True, plan))
    s_in = gpu.upload(state) if state is not None else None
    kg.chunk_forward(gpu, o, d, states, scr, qkgb, vb, B, T, Hk, Hv, Dk, Dv, plan=plan, v_off=v_pad, v_stride=stride,
                     state_in=s_in, save_final=save_final).run(gpu)  # fmt: skip
    return dict(qkgb=qkgb, v=vb, o=o, delta=d, states=states, scr=scr, stride=stride, v_pad=v_pad)


@pytest.mark.parametrize("shape, plan", CHUNKED)
def test_chunked_forward_matches_reference(gpu, shape, plan):
    B, T, Hk, Hv, Dk, Dv = shape
    C, nck = plan.chunk, kg.n_chunks(T, plan.chunk)
    rng = np.random.default_rng(sum(shape))
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    s0 = (0.5 * rng.standard_normal((B, Hv, Dk, Dv))).astype(f32)
    o_ref, S_ref, cache = ref.gated_delta_chunked_forward(*(f64(a) for a in x), f64(s0), chunk=C)
    d = _chunked(gpu, x, plan, state=s0)
    check("o", gpu.read(d["o"], (B, T, Hv, Dv)), o_ref, "norm")
    delta = np.concatenate(cache["deltas"], axis=2).transpose(0, 2, 1, 3)
    check("delta", gpu.read(d["delta"], (B, T, Hv, Dv)), delta, "norm")
    states = gpu.read(d["states"], (B, Hv, nck + 1, Dk, Dv))
    for c in range(nck):
        check(f"checkpoint {c}", states[:, :, c], cache["starts"][c], "norm")
    check("final state", states[:, :, nck], S_ref, "norm")
    # the recurrence agrees (the chunked reference equals it to rounding)
    check("o vs the recurrence", gpu.read(d["o"], (B, T, Hv, Dv)),
          ref.gated_delta_forward(*(f64(a) for a in x), f64(s0))[0], "norm")  # fmt: skip
    # the prep's block of the last chunk (tp: [W | P | U] per (row, head, chunk), W and U padded to Dk and Dv
    # rounded up to powers of two)
    cdk, cdv = plan.dims(Dk, Dv)
    tpb = gdn_plan.tp_block(plan, Dk, Dv)
    tp = gpu.download(d["scr"], f32)[: B * Hv * nck * tpb].reshape(B, Hv, nck, tpb)[:, :, -1]
    sl = slice((nck - 1) * C, T)
    n = T - (nck - 1) * C
    G = Hv // Hk
    K, Q = (np.repeat(a, G, axis=2).transpose(0, 2, 1, 3)[:, :, sl] for a in (x[1], x[0]))
    beta = x[4].transpose(0, 2, 1)[:, :, sl]
    gam, _, _, _, Tm, P = ref.chunk_matrices(
        f64(K), f64(Q), f64(x[3].transpose(0, 2, 1)[:, :, sl]), f64(beta)
    )
    W = Tm @ ((beta * np.exp(gam))[..., None] * K)
    U = Tm @ (beta[..., None] * x[2].transpose(0, 2, 1, 3)[:, :, sl])
    check("W", tp[..., : C * cdk].reshape(B, Hv, C, cdk)[:, :, :n, :Dk], W, "norm")
    check("P", tp[..., C * cdk : C * cdk + C * C].reshape(B, Hv, C, C)[:, :, :n, :n], P, "norm")
    check("U", tp[..., C * cdk + C * C :][..., : C * cdv].reshape(B, Hv, C, cdv)[:, :, :n, :Dv], U, "norm")


@pytest.mark.parametrize("shape, plan", CHUNKED)
def test_chunked_backward_matches_reference(gpu, shape, plan):
    B, T, Hk, Hv, Dk, Dv = shape
    N, G = B * T, Hv // Hk
    rng = np.random.default_rng(200 + sum(shape))
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    do = rng.standard_normal((B, T, Hv, Dv)).astype(f32)
    _, _, cache = ref.gated_delta_forward(*(f64(a) for a in x))
    dq, dk, dv, dg, dbeta, _ = ref.gated_delta_backward(f64(do), cache)
    d = _chunked(gpu, x, plan, v_pad=3, save_final=False)
    dqk = gpu.buffer(4 * qk_floats(N, Hv, Dk))
    dvb = gpu.upload(np.full((N, d["stride"]), 7.0, f32))  # v's columns are written, the others kept
    kg.chunk_backward(gpu, dqk, dvb, d["scr"], d["states"], d["delta"], d["qkgb"], d["v"], gpu.upload(do), B, T, Hk,
                      Hv, Dk, Dv, plan=plan, v_off=3, v_stride=d["stride"]).run(gpu)  # fmt: skip
    got = gpu.download(dqk, f32)
    half = N * Hv * Dk
    check("dq", got[:half].reshape(B, T, Hk, G, Dk).sum(3), dq, "attention")
    check("dk", got[align_floats(half) :][:half].reshape(B, T, Hk, G, Dk).sum(3), dk, "attention")
    dv_rows = gpu.read(dvb, (N, d["stride"]))
    check("dv", dv_rows[:, 3:].reshape(B, T, Hv, Dv), dv, "attention")
    assert (dv_rows[:, :3] == 7.0).all(), "dv wrote outside v's columns"
    buf, off, _ = kg.chunk_dg_view(gpu, d["scr"], B, T, Hv, Dk, Dv, plan)
    gb = gpu.download(buf, f32)[off // 4 :][: 2 * N * Hv].reshape(B, T, Hv, 2)
    check("dg", gb[..., 0], dg, "attention")
    check("dbeta", gb[..., 1], dbeta, "attention")


def test_chunked_calls_split_over_batch_rows(gpu, monkeypatch):
    """Where one call's buffers would exceed a storage binding, the launchers run groups of batch rows (the
    checkpoints and the start state bound at row offsets): the results equal one call's."""
    shape, plan = (5, 16, 1, 2, 8, 8), kg.ChunkPlan(chunk=4, bv=4, threads=16, bk=2, pthreads=16)
    B, T, Hk, Hv, Dk, Dv = shape
    N = B * T
    rng = np.random.default_rng(5)
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    s0 = rng.standard_normal((B, Hv, Dk, Dv)).astype(f32)
    do = rng.standard_normal((B, T, Hv, Dv)).astype(f32)
    out = []
    for binding in (None, 16000):
        dev = gpu
        if binding:  # the same device believing its bindings small
            monkeypatch.setattr(gpu, "max_binding", binding)
            assert kg.chunk_rows(gpu, B, T, Hv, Dk, Dv, plan, True) == 2  # three calls: 2, 2 and 1 rows
        d = _chunked(dev, x, plan, state=s0, v_pad=0)
        dqk, dvb = dev.buffer(4 * qk_floats(N, Hv, Dk)), dev.buffer(4 * N * Hv * Dv)
        kg.chunk_backward(dev, dqk, dvb, d["scr"], d["states"], d["delta"], d["qkgb"], d["v"], dev.upload(do), B, T,
                          Hk, Hv, Dk, Dv, plan=plan).run(dev)  # fmt: skip
        buf, off, n = kg.chunk_dg_view(dev, d["scr"], B, T, Hv, Dk, Dv, plan)
        dg = dev.download(buf, f32)[off // 4 :][: n // 4]
        out.append([dev.download(b, f32) for b in (d["o"], d["delta"], d["states"], dqk, dvb)] + [dg])
    for name, a, b in zip(("o", "delta", "states", "dqk", "dv", "dg"), *out, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_chunked_same_bits_every_run(gpu):
    shape, plan = CHUNKED[2]
    B, T, Hk, Hv, Dk, Dv = shape
    N = B * T
    rng = np.random.default_rng(11)
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    do = gpu.upload(rng.standard_normal((B, T, Hv, Dv)).astype(f32))
    runs = []
    for _ in range(2):
        d = _chunked(gpu, x, plan, v_pad=0)
        dqk, dvb = gpu.buffer(4 * qk_floats(N, Hv, Dk)), gpu.buffer(4 * N * Hv * Dv)
        kg.chunk_backward(gpu, dqk, dvb, d["scr"], d["states"], d["delta"], d["qkgb"], d["v"], do, B, T, Hk, Hv, Dk,
                          Dv, plan=plan).run(gpu)  # fmt: skip
        runs.append([gpu.download(b, np.uint32) for b in (d["o"], d["states"], dqk, dvb, d["scr"])])
    for a, b in zip(*runs, strict=True):
        assert np.array_equal(a, b)


def test_chunked_bits_do_not_depend_on_the_sequential_kernels_tunables(gpu):
    """bv, threads and bk change which thread adds what, never the order of a sum: every output has the same
    bits under each (so a plan chosen for speed changes no result)."""
    shape = (1, 20, 1, 2, 8, 8)
    B, T, Hk, Hv, Dk, Dv = shape
    N = B * T
    rng = np.random.default_rng(12)
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    do = gpu.upload(rng.standard_normal((B, T, Hv, Dv)).astype(f32))
    runs = []
    for plan in (kg.ChunkPlan(8, 8, 16, 4, pthreads=16), kg.ChunkPlan(8, 4, 32, 2, pthreads=16),
                 kg.ChunkPlan(8, 4, 8, 8, pthreads=16)):  # fmt: skip
        d = _chunked(gpu, x, plan, v_pad=0)
        dqk, dvb = gpu.buffer(4 * qk_floats(N, Hv, Dk)), gpu.buffer(4 * N * Hv * Dv)
        kg.chunk_backward(gpu, dqk, dvb, d["scr"], d["states"], d["delta"], d["qkgb"], d["v"], do, B, T, Hk, Hv, Dk,
                          Dv, plan=plan).run(gpu)  # fmt: skip
        buf, off, n = kg.chunk_dg_view(gpu, d["scr"], B, T, Hv, Dk, Dv, plan)
        dg = gpu.download(buf, np.uint32)[off // 4 :][: n // 4]
        runs.append([gpu.download(b, np.uint32) for b in (d["o"], d["delta"], d["states"], dqk, dvb)] + [dg])
    for other in runs[1:]:
        for name, a, b in zip(("o", "delta", "states", "dqk", "dv", "dg"), runs[0], other, strict=True):
            assert np.array_equal(a, b), name


def test_chunk_plans():
    """The default plan is the first of PLANS that fits; a plan that does not fit, or is malformed, is one
    clear error; DDL_WGPU_GDN_PLAN parses."""

    class Limits:
        def __init__(self, shared, threads):
            self.limits = {
                "max-compute-workgroup-storage-size": shared,
                "max-compute-invocations-per-workgroup": threads,
            }

    assert kg.chunk_plan(Limits(48 << 10, 1024), 128, 128) == kg.PLANS[0]
    webgpu = kg.chunk_plan(Limits(16 << 10, 256), 128, 128)
    assert max(webgpu.shared_bytes(128, 128, 16 << 10).values()) <= 16 << 10
    assert kg.chunk_plan(Limits(16 << 10, 256), 8, 4).bv <= 4  # never wider than Dv padded
    with pytest.raises(GpuError, match="workgroup memory"):
        kg.chunk_plan(Limits(16 << 10, 256), 128, 128, kg.ChunkPlan(chunk=64, bv=64))
    with pytest.raises(GpuError, match="powers of two"):
        kg.ChunkPlan(chunk=48).check(Limits(48 << 10, 1024), 128, 128)
    assert kg.parse_plan("chunk=32, bv=16,bk=8") == kg.ChunkPlan(chunk=32, bv=16, bk=8)
    assert kg.parse_plan(kg.PLANS[1].text()) == kg.PLANS[1]
    with pytest.raises(GpuError, match="name=integer"):
        kg.parse_plan("chunks=32")


def test_per_token_rule_choice(monkeypatch):
    """An inference forward runs per token in short rows and in models of many value heads, never by how many
    rows a pass holds (a streamed trunk's blocks and a resident trunk's batches run the same kernels)."""
    monkeypatch.delenv(kg.ENV_PER_TOKEN, raising=False)
    assert kg.per_token(64, 6) and not kg.per_token(65, 6)  # the small hybrid: chunked past 64 tokens
    assert kg.per_token(1024, 48) and kg.per_token(4096, kg.PER_TOKEN_MIN_HEADS)  # the 27B: per token
    monkeypatch.setenv(kg.ENV_PER_TOKEN, "0")
    assert not kg.per_token(8, 48)  # 0: always chunked
