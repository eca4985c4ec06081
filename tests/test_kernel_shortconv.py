"""The d_v > 1 short convolutions (`shaders/shortconv.wgsl`, `ddl_wgpu/ops/shortconv.py`) against
`ddl_ref.shortconv` (float64 reference of the float32 inputs): TC, CC, EC and repetition, forward and backward.

B = 2, T = 7 with k = 4 makes the causal window cross sequence starts; a longer TC/EC case spreads the
parameter-gradient reduction over several row blocks.
"""

import numpy as np
import pytest

from ddl_ref import shortconv as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import shortconv as ksc

f32 = np.float32
K_EPS, V_SCALE = 1e-5, 4.0


def randn(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(f32)


B, T, C_SC, DV, KT = 2, 7, 10, 4, 4


def _grads(gpu, shapes, rng):
    """Parameter-gradient buffers holding prior (random) contents, to check the += accumulation."""
    prior = {n: randn(rng, *s) for n, s in shapes.items()}
    return prior, {n: gpu.upload(v) for n, v in prior.items()}


@pytest.mark.parametrize("b,t", [(B, T), (3, 50)])
def test_tc(gpu, rng, b, t):
    rows, C, dv, k = b * t, C_SC, DV, KT
    X, conv, read = randn(rng, b, t, C, dv), randn(rng, C * dv, k), randn(rng, dv)
    dx_in, dX0 = randn(rng, b, t, C), randn(rng, b, t, C, dv)
    x_in = gpu.buffer(4 * rows * C)
    bX, bconv, bread = gpu.upload(X), gpu.upload(conv), gpu.upload(read)
    ksc.tc_forward(gpu, x_in, bX, bconv, bread, b, t, C, dv, k).run(gpu)
    ref_x, cache = ref.tc_forward(f64(X), f64(conv), f64(read))
    check("tc x_in", gpu.read(x_in, (b, t, C)), ref_x, "norm")

    dX_ref, dconv_ref, dread_ref = ref.tc_backward(f64(dx_in), cache)
    prior, g = _grads(gpu, {"dconv": (C * dv, k), "dread": (dv,)}, rng)
    dX = gpu.upload(dX0)
    call = ksc.tc_backward(
        gpu, dX, g["dconv"], g["dread"], gpu.upload(dx_in), bX, bconv, bread, b, t, C, dv, k
    )
    call.run(gpu)
    check("tc dX (+=)", gpu.read(dX, (b, t, C, dv)), dX_ref + dX0, "norm")
    check("tc dconv", gpu.read(g["dconv"], (C * dv, k)), dconv_ref + prior["dconv"], "matmul")
    check("tc dread", gpu.read(g["dread"], (dv,)), dread_ref + prior["dread"], "matmul")
    # overwrite mode, and determinism of the reductions
    dX2 = gpu.buffer(4 * rows * C * dv)
    ksc.tc_backward(gpu, dX2, g["dconv"], g["dread"], gpu.upload(dx_in), bX, bconv, bread, b, t, C, dv, k,
                    accumulate_dX=False).run(gpu)  # fmt: skip
    check("tc dX (=)", gpu.read(dX2, (b, t, C, dv)), dX_ref, "norm")
    _check_deterministic(gpu, call, g["dconv"], C * dv * k, g["dread"], dv)


def _check_deterministic(gpu, call, *bufs_and_sizes):
    """Zero the accumulated outputs, run `call` twice from zero: bit-identical results."""
    pairs = list(zip(bufs_and_sizes[::2], bufs_and_sizes[1::2], strict=True))
    runs = []
    for _ in range(2):
        for buf, n in pairs:
            gpu.write(buf, np.zeros(n, f32))
        call.run(gpu)
        runs.append([gpu.download(buf, f32, n) for buf, n in pairs])
    for a, b in zip(*runs, strict=True):
        assert np.array_equal(a, b), "parameter-gradient reduction is not deterministic"


def test_cc(gpu, rng):
    rows, C, dv = B * T, C_SC, DV
    X, conv, read = randn(rng, rows, C, dv), randn(rng, C, dv), randn(rng, dv)
    dx_in, dX0 = randn(rng, rows, C), randn(rng, rows, C, dv)
    x_in = gpu.buffer(4 * rows * C)
    bX, bconv, bread = gpu.upload(X), gpu.upload(conv), gpu.upload(read)
    ksc.cc_forward(gpu, x_in, bX, bconv, bread, rows, C, dv).run(gpu)
    ref_x, cache = ref.cc_forward(f64(X), f64(conv), f64(read))
    check("cc x_in", gpu.read(x_in, (rows, C)), ref_x, "norm")

    dX_ref, dconv_ref, dread_ref = ref.cc_backward(f64(dx_in), cache)
    prior, g = _grads(gpu, {"dconv": (C, dv), "dread": (dv,)}, rng)
    dX = gpu.upload(dX0)
    call = ksc.cc_backward(gpu, dX, g["dconv"], g["dread"], gpu.upload(dx_in), bX, bconv, bread, rows, C, dv)
    call.run(gpu)
    check("cc dX (+=)", gpu.read(dX, (rows, C, dv)), dX_ref + dX0, "norm")
    check("cc dconv", gpu.read(g["dconv"], (C, dv)), dconv_ref + prior["dconv"], "matmul")
    check("cc dread", gpu.read(g["dread"], (dv,)), dread_ref + prior["dread"], "matmul")
    dX2 = gpu.buffer(4 * rows * C * dv)
    ksc.cc_backward(gpu, dX2, g["dconv"], g["dread"], gpu.upload(dx_in), bX, bconv, bread, rows, C, dv,
                    accumulate_dX=False).run(gpu)  # fmt: skip
    check("cc dX (=)", gpu.read(dX2, (rows, C, dv)), dX_ref, "norm")
    _check_deterministic(gpu, call, g["dconv"], C * dv, g["dread"], dv)


@pytest.mark.parametrize("b,t", [(B, T), (3, 50)])
def test_ec(gpu, rng, b, t):
    rows, C, dv, k = b * t, C_SC, DV, KT
    e, conv, dX0 = randn(rng, b, t, C), randn(rng, C * dv, k), randn(rng, b, t, C, dv)
    X0 = gpu.buffer(4 * rows * C * dv)
    be, bconv = gpu.upload(e), gpu.upload(conv)
    ksc.ec_forward(gpu, X0, be, bconv, b, t, C, dv, k).run(gpu)
    ref_X0, cache = ref.ec_forward(f64(e), f64(conv))
    check("ec X0", gpu.read(X0, (b, t, C, dv)), ref_X0, "norm")

    de_ref, dconv_ref = ref.ec_backward(f64(dX0), cache)
    prior, g = _grads(gpu, {"dconv": (C * dv, k)}, rng)
    de0 = randn(rng, b, t, C)
    de = gpu.upload(de0)
    call = ksc.ec_backward(gpu, de, g["dconv"], gpu.upload(dX0), be, bconv, b, t, C, dv, k)
    call.run(gpu)
    check("ec de (=)", gpu.read(de, (b, t, C)), de_ref, "norm")
    check("ec dconv", gpu.read(g["dconv"], (C * dv, k)), dconv_ref + prior["dconv"], "matmul")
    gpu.write(de, de0)
    ksc.ec_backward(gpu, de, g["dconv"], gpu.upload(dX0), be, bconv, b, t, C, dv, k, accumulate_de=True).run(
        gpu
    )
    check("ec de (+=)", gpu.read(de, (b, t, C)), de_ref + de0, "norm")
    _check_deterministic(gpu, call, g["dconv"], C * dv * k)


def test_repeat(gpu, rng):
    rows, C, dv = B * T, C_SC, DV
    e, dX0 = randn(rng, rows, C), randn(rng, rows, C, dv)
    X0, de = gpu.buffer(4 * rows * C * dv), gpu.buffer(4 * rows * C)
    ksc.repeat_forward(gpu, X0, gpu.upload(e), rows, C, dv).run(gpu)
    check("repeat X0", gpu.read(X0, (rows, C, dv)), ref.repeat_forward(f64(e), dv), "elementwise")
    ksc.repeat_backward(gpu, de, gpu.upload(dX0), rows, C, dv).run(gpu)
    check("repeat de", gpu.read(de, (rows, C)), ref.repeat_backward(f64(dX0)), "elementwise")
