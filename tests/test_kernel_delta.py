"""The Deep Delta update (`shaders/delta.wgsl`, `ddl_wgpu/ops/delta.py`) against `ddl_ref.delta.delta_forward` /
`delta_backward` (float64 reference of the float32 inputs): forward (X_new and the saved stats) and backward
(dX, du, dc, dx_v and the head parameters' gradients), and the spectral k-sum.

C = 10 / 37 / 64 / 300 and rows = 13 are off the workgroup grid (f32 and vec4 items, one- and two-stage row
sums; the forward both in one pass and in two).
"""

import numpy as np
import pytest

from ddl_ref import delta as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import delta as kd
from ddl_wgpu.runtime.gpu import GpuError

f32 = np.float32
K_EPS, V_SCALE = 1e-5, 4.0


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(f32)


def _delta_case(gpu, rng, rows, C, dv, fused=None, alias=False):
    """Inputs, GPU buffers, and a forward run; returns everything the tests need. `alias`: x_v is X (the
    engine's d_v = 1 call), bound as the same buffer."""
    h = dict(
        X=randn(rng, rows, C, dv), u=randn(rng, rows, C, scale=2.0), c=randn(rng, rows, C), x_v=randn(rng, rows, C),
        w_beta=randn(rng, C, scale=0.3), b_beta=randn(rng, 1, scale=0.5), W_v=randn(rng, dv, C, scale=0.3),
        b_v=randn(rng, dv, scale=0.5),
    )  # fmt: skip
    if alias:
        h["x_v"] = h["X"][..., 0].copy()
    d = {k: gpu.upload(v) for k, v in h.items()}
    if alias:
        d["x_v"] = d["X"]
    d["X_new"] = gpu.buffer(4 * rows * C * dv)
    d["stats"] = gpu.buffer(4 * rows * kd.stats_size(dv))
    kd.delta_forward(gpu, d["X_new"], d["stats"], d["X"], d["u"], d["c"], d["x_v"], d["w_beta"], d["b_beta"],
                     d["W_v"], d["b_v"], rows, C, dv, K_EPS, V_SCALE, fused=fused).run(gpu)  # fmt: skip
    names = ("X", "u", "c", "x_v", "w_beta", "b_beta", "W_v", "b_v")
    X_new, cache = ref.delta_forward(*(f64(h[n]) for n in names), K_EPS, V_SCALE)
    return h, d, X_new, cache


def _check_forward(gpu, d, X_new, cache, rows, C, dv):
    check("delta X_new", gpu.read(d["X_new"], (rows, C, dv)), X_new, "norm")
    st = gpu.read(d["stats"], (rows, kd.stats_size(dv)))
    check("stats n", st[:, kd.STAT_N], cache["n"][:, 0], "norm")
    check("stats beta", st[:, kd.STAT_BETA], cache["beta"], "norm")
    check("stats v", st[:, kd.STAT_V : kd.STAT_V + dv], cache["v"], "norm")
    p0 = kd.stat_p(dv)
    check("stats p", st[:, p0 : p0 + dv], cache["p"], "norm")


# C: 10 and 37 move f32 items, 64 and 300 vec4 ones (d_v = 1); 37 and 300 have more threads per row than the
# first stage of a row sum adds (two stages), 10 and 64 fewer; 300 spreads 13 rows over two workgroups.
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dv", [1, 4])
@pytest.mark.parametrize("C", [10, 37, 64, 300])
def test_delta_forward(gpu, rng, C, dv, fused):
    rows = 13
    if fused and not kd.fused_forward(gpu):  # WebGPU's default limits (DDL_WGPU_LIMITS=webgpu): 8 buffers
        with pytest.raises(GpuError, match="storage buffers"):
            _delta_case(gpu, rng, rows, C, dv, fused=fused)
        return
    _h, d, X_new, cache = _delta_case(gpu, rng, rows, C, dv, fused=fused)
    _check_forward(gpu, d, X_new, cache, rows, C, dv)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("C", [12, 37])
def test_delta_forward_x_v_is_X(gpu, rng, C, fused):
    """d_v = 1 with x_v bound to X's buffer: the one-pass forward takes x_v from X's registers."""
    rows = 13
    if fused and not kd.fused_forward(gpu):
        with pytest.raises(GpuError, match="storage buffers"):
            _delta_case(gpu, rng, rows, C, 1, fused=fused, alias=True)
        return
    _h, d, X_new, cache = _delta_case(gpu, rng, rows, C, 1, fused=fused, alias=True)
    _check_forward(gpu, d, X_new, cache, rows, C, 1)


def test_delta_forward_storage_limit(gpu):
    """The one-pass forward binds 10 storage buffers: used only where the adapter allows that many."""
    assert kd.FUSED_FORWARD_BUFFERS == 10
    assert kd.fused_forward(gpu) == (gpu.limits.get("max-storage-buffers-per-shader-stage", 8) >= 10)


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("dv", [1, 4])
@pytest.mark.parametrize("C", [10, 37, 64, 300])
def test_delta_backward(gpu, rng, C, dv, accumulate):
    rows = 13
    h, d, _, cache = _delta_case(gpu, rng, rows, C, dv)
    G = randn(rng, rows, C, dv)
    dX_ref, du_ref, dc_ref, dxv_ref, dwb_ref, dbb_ref, dWv_ref, dbv_ref = ref.delta_backward(f64(G), cache)
    # prior contents of the accumulated outputs
    dc0, dxv0 = randn(rng, rows, C), randn(rng, rows, C)
    pg0 = dict(dw_beta=randn(rng, C), db_beta=randn(rng, 1), dW_v=randn(rng, dv, C), db_v=randn(rng, dv))
    dX, du, da, dz = (gpu.buffer(4 * n) for n in (rows * C * dv, rows * C, rows, rows * dv))
    dc, dxv = gpu.upload(dc0), gpu.upload(dxv0)
    pg = {k: gpu.upload(v) for k, v in pg0.items()}
    ones = gpu.upload(np.ones(rows, f32))
    call = kd.delta_backward(gpu, dX, du, da, dz, dc, dxv, gpu.upload(G), d["X"], d["u"], d["stats"], d["w_beta"],
                             d["W_v"], rows, C, dv, V_SCALE, accumulate_dc=accumulate, accumulate_dx_v=accumulate)  # fmt: skip
    call += kd.delta_param_grads(gpu, pg["dw_beta"], pg["db_beta"], pg["dW_v"], pg["db_v"], da, dz, d["c"], d["x_v"],
                                 ones, rows, C, dv)  # fmt: skip
    call.run(gpu)
    a = 1.0 if accumulate else 0.0
    check("delta dX", gpu.read(dX, (rows, C, dv)), dX_ref, "norm")
    check("delta du", gpu.read(du, (rows, C)), du_ref, "norm")
    check("delta dc", gpu.read(dc, (rows, C)), dc_ref + a * f64(dc0), "norm")
    check("delta dx_v", gpu.read(dxv, (rows, C)), dxv_ref + a * f64(dxv0), "norm")
    check("delta dw_beta", gpu.read(pg["dw_beta"], (C,)), dwb_ref + pg0["dw_beta"], "matmul")
    check("delta db_beta", gpu.read(pg["db_beta"], (1,)), dbb_ref + pg0["db_beta"], "matmul")
    check("delta dW_v", gpu.read(pg["dW_v"], (dv, C)), dWv_ref + pg0["dW_v"], "matmul")
    check("delta db_v", gpu.read(pg["db_v"], (dv,)), dbv_ref + pg0["db_v"], "matmul")


@pytest.mark.parametrize("dv", [1, 4])
def test_delta_backward_deterministic(gpu, rng, dv):
    rows, C = 45, 37
    h, d, _, _ = _delta_case(gpu, rng, rows, C, dv)
    G = gpu.upload(randn(rng, rows, C, dv))
    sizes = dict(dX=rows * C * dv, du=rows * C, da=rows, dz=rows * dv, dc=rows * C, dxv=rows * C, dwb=C, dbb=1,
                 dWv=dv * C, dbv=dv)  # fmt: skip
    o = {n: gpu.buffer(4 * s) for n, s in sizes.items()}
    call = kd.delta_backward(gpu, o["dX"], o["du"], o["da"], o["dz"], o["dc"], o["dxv"], G, d["X"], d["u"],
                             d["stats"], d["w_beta"], d["W_v"], rows, C, dv, V_SCALE)  # fmt: skip
    call += kd.delta_param_grads(gpu, o["dwb"], o["dbb"], o["dWv"], o["dbv"], o["da"], o["dz"], d["c"], d["x_v"],
                                 gpu.upload(np.ones(rows, f32)), rows, C, dv)  # fmt: skip
    runs = []
    for _ in range(2):
        for n, s in sizes.items():
            gpu.write(o[n], np.zeros(s, f32))
        call.run(gpu)
        runs.append({n: gpu.download(o[n], f32, s) for n, s in sizes.items()})
    for n in sizes:
        assert np.array_equal(runs[0][n], runs[1][n]), f"delta backward {n} is not deterministic"


def test_ksum(gpu, rng):
    rows, C, dv = 45, 37, 4
    u = randn(rng, rows, C)
    stats = randn(rng, rows, kd.stats_size(dv))
    stats[:, kd.STAT_N] = rng.uniform(0.5, 3.0, rows)
    w = (rng.uniform(size=rows) < 0.7).astype(f32)
    out = gpu.buffer(4 * C)
    call = kd.ksum(gpu, out, gpu.upload(u), gpu.upload(stats), gpu.upload(w), rows, C, dv)
    call.run(gpu)
    got = gpu.read(out, (C,))
    check("ksum", got, np.sum(f64(w)[:, None] * f64(u) / f64(stats[:, :1]), axis=0), "norm")
    call.run(gpu)
    assert np.array_equal(got, gpu.read(out, (C,))), "ksum is not deterministic"
