"""The chunked gated delta rule's sequential forward on the matrix units (`shaders/gated_delta_tc.wgsl`,
`ddl_wgpu/ops/gated_delta_tc.py`) against `ddl_ref.gdn.gated_delta_chunked_forward` at f16 tolerance: the
outputs, Δ, every checkpoint and the final state, from a start state, through `ops.gated_delta.chunk_forward`
(which must have launched `chunk_forward_tc`). On a GPU whose runtime lists an f16 -> f32 configuration
(`make test-gpu`), and everywhere Dawn runs, with the matrices emulated in plain WGSL (`emulated_matrices`).

Shapes: a chunk that does not divide T, Dk and Dv padded (20 -> 32, 24 -> 32), two value heads per key head,
one and several column blocks, one and two result matrices per subgroup."""

from __future__ import annotations

import numpy as np
import pytest
from emulated_matrices import emulated, emulation
from test_kernel_gated_delta import _chunked, _inputs

from ddl_ref import gdn as ref
from ddl_ref.check import f64
from ddl_wgpu.ops import gated_delta as kg
from ddl_wgpu.ops import gated_delta_tc as gtc
from ddl_wgpu.ops import matmul_tc
from ddl_wgpu.ops.gdn_inputs import align_floats, qk_floats

# of the largest |value|: the products' operands are rounded to f16 (the state too, for X); the kernels measured
# 1e-4 .. 6.5e-4 here (f16's unit roundoff is 4.9e-4), a wrong sign of W in the backward 3.8e-2
TOL = 3e-3

# the chunk plan of test_kernel_gated_delta.py's last case: its chunk_prep and chunk_output are compiled once
PLAN = kg.ChunkPlan(chunk=16, bv=8, threads=32, bk=1, tb=4, pthreads=64)
CASES = [  # (B, T, Hk, Hv, Dk, Dv), matrix-unit plan
    ((2, 37, 1, 2, 20, 24), gtc.TcPlan(16, 1, 16, 16)),
    ((1, 40, 2, 2, 32, 32), gtc.TcPlan(16, 1, 16, 16)),
]


def _check(g, shape, tcp, monkeypatch, plan=PLAN):
    """The chunked forward from a start state (o, Δ, the checkpoints, the final state) and the backward (every
    gradient) with both sequential kernels on the matrix units, against float64."""
    B, T, Hk, Hv, Dk, Dv = shape
    N, G = B * T, Hv // Hk
    monkeypatch.setenv(gtc.ENV, tcp.name())
    assert all(gtc.plan_for(g, plan, Dk, Dv, e) == tcp for e in gtc.ENTRIES)
    rng = np.random.default_rng(sum(shape))
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    s0 = (0.5 * rng.standard_normal((B, Hv, Dk, Dv))).astype(np.float32)
    do = rng.standard_normal((B, T, Hv, Dv)).astype(np.float32)
    o_ref, S_ref, cache = ref.gated_delta_chunked_forward(*(f64(a) for a in x), f64(s0), chunk=plan.chunk)
    d = _chunked(g, x, plan, state=s0)
    nck = kg.n_chunks(T, plan.chunk)
    states = g.read(d["states"], (B, Hv, nck + 1, Dk, Dv))
    want = {
        "o": (g.read(d["o"], (B, T, Hv, Dv)), o_ref),
        "delta": (g.read(d["delta"], (B, T, Hv, Dv)),
                  np.concatenate(cache["deltas"], axis=2).transpose(0, 2, 1, 3)),
        **{f"checkpoint {c}": (states[:, :, c], cache["starts"][c]) for c in range(nck)},
        "final state": (states[:, :, nck], S_ref),
    }  # fmt: skip
    # the backward from the forward's own checkpoints and Δ; the reference's from the recurrence
    _, _, rc = ref.gated_delta_forward(*(f64(a) for a in x), f64(s0))
    dq, dk, dv, dg, dbeta, _ = ref.gated_delta_backward(f64(do), rc)
    dqk, dvb = g.buffer(4 * qk_floats(N, Hv, Dk)), g.buffer(4 * N * d["stride"])
    kg.chunk_backward(g, dqk, dvb, d["scr"], d["states"], d["delta"], d["qkgb"], d["v"], g.upload(do), B, T, Hk, Hv,
                      Dk, Dv, plan=plan, v_off=d["v_pad"], v_stride=d["stride"]).run(g)  # fmt: skip
    got, half = g.download(dqk, np.float32), N * Hv * Dk
    buf, off, _ = kg.chunk_dg_view(g, d["scr"], B, T, Hv, Dk, Dv, plan)
    gb = g.download(buf, np.float32)[off // 4 :][: 2 * N * Hv].reshape(B, T, Hv, 2)
    want |= {
        "dq": (got[:half].reshape(B, T, Hk, G, Dk).sum(3), dq),
        "dk": (got[align_floats(half) :][:half].reshape(B, T, Hk, G, Dk).sum(3), dk),
        "dv": (g.read(dvb, (N, d["stride"]))[:, d["v_pad"] :].reshape(B, T, Hv, Dv), dv),
        "dg": (gb[..., 0], dg),
        "dbeta": (gb[..., 1], dbeta),
    }
    for name, (got_, ref_) in want.items():
        err = np.abs(got_ - ref_).max() / np.abs(ref_).max()
        assert err < TOL, (name, err)


@pytest.fixture(scope="module")
def mgpu(gpu):
    """The session's Gpu with its products on the matrix units (skips where it lists no f16 -> f32
    configuration), restored after."""
    if not [c for c in getattr(gpu, "matrix_configs", ()) if tuple(c[3:5]) == ("f16", "f32")]:
        pytest.skip(f"{gpu.name} ({getattr(gpu, 'runtime_name', 'native')}) lists no f16 -> f32 subgroup-matrix "
                    "configuration: the matrix units run only on a GPU through Dawn (make test-gpu)")  # fmt: skip
    before = getattr(gpu, "products", "simt")
    gpu.products = "matrix"
    yield gpu
    gpu.products = before


@pytest.mark.parametrize("shape, tcp", CASES)
def test_chunk_forward_on_the_matrix_units(mgpu, monkeypatch, shape, tcp):
    _check(mgpu, shape, tcp, monkeypatch)


EMULATION = emulation("Ah", "Bh", ("Xs", "Ss"), ("Ss",))
_KERNELS = {}  # compiled once per session


@pytest.fixture
def emulating(gpu, monkeypatch):
    """`chunk_forward` launching the emulated `chunk_forward_tc` (32-lane subgroups), with the Gpu pretending to
    list a 16 x 16 x 16 f16 -> f32 configuration. On Dawn only (its compiler is the kernel's)."""
    if getattr(gpu, "runtime_name", "native") != "dawn":
        pytest.skip(
            "chunk_forward_tc runs only through Dawn: its emulated form is tested in the Dawn pass (make test)"
        )
    from ddl_wgpu.runtime.gpu import Kernel
    from ddl_wgpu.runtime.shader_files import shader_source

    launched = []

    def kernel(g, p, plan, Dk, Dv, entry):
        key = (id(g.device), p, plan, Dk, Dv, entry)
        if key not in _KERNELS:
            t = gtc.templates(p, plan, Dk, Dv, 32, entry)
            src = emulated(shader_source(gtc.FILE, {**t, "struct Params": gtc.PARAMS.wgsl()}), EMULATION)
            bgl, layout = g._layout(gtc.SIGS[entry])
            pipe = g.device.create_compute_pipeline(
                layout=layout,
                compute={"module": g._create_module(src, f"{entry} (emulated)"), "entry_point": entry},
            )
            _KERNELS[key] = Kernel(name=f"{entry} (emulated)", sig=gtc.SIGS[entry], workgroup=(int(t["NT"]), 1, 1),
                                   pipeline=pipe, layout=bgl)  # fmt: skip
        launched.append((p, entry))
        return _KERNELS[key]

    monkeypatch.setattr(gtc, "kernel", kernel)
    monkeypatch.setattr(matmul_tc, "subgroup_size", lambda g: 32)
    monkeypatch.setattr(matmul_tc, "usable_config", lambda g: matmul_tc.Config(16, 16, 16))
    gpu.tc_launched = launched
    return gpu


# the first case only: lavapipe takes 10 s to compile its emulated kernel cold, the second's (two result
# matrices per subgroup) 40 s
@pytest.mark.parametrize("shape, tcp", CASES[:1])
def test_chunk_forward_with_emulated_matrices(emulating, monkeypatch, shape, tcp):
    _check(emulating, shape, tcp, monkeypatch)
    assert emulating.tc_launched == [(tcp, e) for e in gtc.ENTRIES]  # the matrix-unit kernels ran, not SIMT


def test_the_plan_is_chosen_only_where_it_runs(monkeypatch):
    """None without a 16 x 16 x 16 f16 -> f32 configuration or with DDL_WGPU_GDN_TC=0; the first plan that
    tiles the shape and fits the limits otherwise; a bad env plan is refused by name."""

    class G:
        products, matrix_configs = "matrix", [(16, 16, 16, "f16", "f32")]
        limits = {"max-compute-workgroup-storage-size": 49152, "max-compute-invocations-per-workgroup": 1024,
                  "max-subgroup-size": 32}  # fmt: skip

    plan = kg.ChunkPlan(chunk=64, bv=32, threads=128, bk=16, tb=16, pthreads=512)
    monkeypatch.delenv(gtc.ENV, raising=False)
    assert gtc.plan_for(G(), plan, 128, 128) == gtc.PLANS[0]
    assert gtc.plan_for(G(), plan, 128, 128, gtc.ENTRIES[1]) == gtc.PLANS[1]  # the first's slabs do not fit
    assert gtc.workgroup_bytes(gtc.PLANS[0], 64, 128, gtc.ENTRIES[1]) > 49152
    G.limits = {**G.limits, "max-compute-workgroup-storage-size": 16384}
    assert gtc.plan_for(G(), plan, 128, 128) is None  # nothing fits 16 KiB at this shape
    assert gtc.plan_for(G(), kg.ChunkPlan(chunk=16, bv=16), 32, 32) == gtc.PLANS[1]
    monkeypatch.setenv(gtc.ENV, "0")
    assert gtc.plan_for(G(), kg.ChunkPlan(chunk=16, bv=16), 32, 32) is None
    monkeypatch.setenv(gtc.ENV, "bv=16,subgroups=1,kx=16,kt=16")
    assert gtc.plan_for(G(), kg.ChunkPlan(chunk=16, bv=16), 32, 32) == gtc.TcPlan(16, 1, 16, 16)
    # the backward's dΔ has C / 16 x bv / 16 = 1 result matrix: two subgroups cannot share it
    monkeypatch.setenv(gtc.ENV, "bv=16,subgroups=2,kx=16,kt=16")
    assert gtc.plan_for(G(), kg.ChunkPlan(chunk=16, bv=16), 32, 32, gtc.ENTRIES[1]) is None
    monkeypatch.setenv(gtc.ENV, "bv=16,warps=2")
    with pytest.raises(ValueError, match="warps"):
        gtc.plan_for(G(), kg.ChunkPlan(chunk=16, bv=16), 32, 32)
    monkeypatch.delenv(gtc.ENV)
    G.products = "simt"
    assert gtc.plan_for(G(), plan, 128, 128) is None
    G.products, G.matrix_configs = "matrix", [(16, 8, 16, "f16", "f32")]
    assert gtc.plan_for(G(), plan, 128, 128) is None
