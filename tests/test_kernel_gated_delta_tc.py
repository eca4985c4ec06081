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

TOL = 2e-2  # of the largest |value|: the products' operands are rounded to f16 (the state too, for X)

# the chunk plan of test_kernel_gated_delta.py's last case: its chunk_prep and chunk_output are compiled once
PLAN = kg.ChunkPlan(chunk=16, bv=8, threads=32, bk=1, tb=4, pthreads=64)
CASES = [  # (B, T, Hk, Hv, Dk, Dv), matrix-unit plan
    ((2, 37, 1, 2, 20, 24), gtc.TcPlan(16, 2, 16, 16)),
    ((1, 40, 2, 2, 32, 32), gtc.TcPlan(16, 1, 16, 16)),
]


def _check_forward(g, shape, tcp, monkeypatch, plan=PLAN):
    B, T, Hk, Hv, Dk, Dv = shape
    monkeypatch.setenv(gtc.ENV, tcp.name())
    assert gtc.plan_for(g, plan, Dk, Dv) == tcp
    rng = np.random.default_rng(sum(shape))
    x = _inputs(rng, B, T, Hk, Hv, Dk, Dv)
    s0 = (0.5 * rng.standard_normal((B, Hv, Dk, Dv))).astype(np.float32)
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
    for name, (got, ref_) in want.items():
        err = np.abs(got - ref_).max() / np.abs(ref_).max()
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
    _check_forward(mgpu, shape, tcp, monkeypatch)


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

    def kernel(g, p, plan, Dk, Dv, params):
        key = (id(g.device), p, plan, Dk, Dv)
        if key not in _KERNELS:
            t = gtc.templates(p, plan, Dk, Dv, 32)
            src = emulated(shader_source(gtc.FILE, {**t, "struct Params": params.wgsl()}), EMULATION)
            bgl, layout = g._layout("rrrwwwu")
            pipe = g.device.create_compute_pipeline(
                layout=layout, compute={"module": g._create_module(src, "chunk_forward_tc (emulated)"),
                                        "entry_point": "chunk_forward_tc"})  # fmt: skip
            _KERNELS[key] = Kernel(name="chunk_forward_tc (emulated)", sig="rrrwwwu",
                                   workgroup=(int(t["NT"]), 1, 1), pipeline=pipe, layout=bgl)  # fmt: skip
        launched.append(p)
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
    _check_forward(emulating, shape, tcp, monkeypatch)
    assert emulating.tc_launched == [tcp]  # the matrix-unit kernel ran, not the SIMT one


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
    assert gtc.workgroup_bytes(gtc.PLANS[0], 64, 128) <= 49152
    G.limits = {**G.limits, "max-compute-workgroup-storage-size": 16384}
    assert gtc.plan_for(G(), plan, 128, 128) is None  # nothing fits 16 KiB at this shape
    assert gtc.plan_for(G(), kg.ChunkPlan(chunk=16, bv=16), 32, 32) == gtc.PLANS[2]
    monkeypatch.setenv(gtc.ENV, "0")
    assert gtc.plan_for(G(), kg.ChunkPlan(chunk=16, bv=16), 32, 32) is None
    monkeypatch.setenv(gtc.ENV, "bv=16,subgroups=1,kt=16")
    assert gtc.plan_for(G(), kg.ChunkPlan(chunk=16, bv=16), 32, 32) == gtc.TcPlan(16, 1, 32, 16)
    monkeypatch.setenv(gtc.ENV, "bv=16,warps=2")
    with pytest.raises(ValueError, match="warps"):
        gtc.plan_for(G(), kg.ChunkPlan(chunk=16, bv=16), 32, 32)
    monkeypatch.delenv(gtc.ENV)
    G.products = "simt"
    assert gtc.plan_for(G(), plan, 128, 128) is None
    G.products, G.matrix_configs = "matrix", [(16, 8, 16, "f16", "f32")]
    assert gtc.plan_for(G(), plan, 128, 128) is None
