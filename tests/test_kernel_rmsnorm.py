"""RMSNorm (`shaders/rmsnorm.wgsl`, `ddl_wgpu/ops/rmsnorm.py`) against `ddl_ref.ops.rmsnorm_forward` /
`rmsnorm_backward` (float64 reference of the float32 inputs): both styles, per-head use, accumulation,
deterministic dw.

Shapes are small and deliberately not multiples of the workgroup size, so every bounds guard runs.
"""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check, f64
from ddl_wgpu.ops import rmsnorm

f32 = np.float32


# (rows, C): rows/C off the workgroup grid; C=6/16 the per-head shapes (many rows per workgroup); C=300/1100
# several items per thread (1100: a whole workgroup per row, a two-stage row sum); C=12/10 the vec4 and f32
# items of a short row; rows 150/300 (many row slots: a two-stage slot sum) and 100 x 768 several dw row
# blocks of several passes each, the last one partial.
RMS_SHAPES = [
    (37, 50),
    (2 * 7 * 5, 6),
    (2 * 5 * 3, 16),
    (5, 300),
    (3, 1100),
    (150, 20),
    (300, 6),
    (41, 12),
    (41, 10),
    (100, 768),
]


def _rms_inputs(rng, rows, C, style):
    x = rng.standard_normal((rows, C)).astype(f32) * f32(1.5)
    w = (rng.standard_normal(C) * 0.2 + (1.0 if style == "standard" else 0.0)).astype(f32)
    dout = rng.standard_normal((rows, C)).astype(f32)
    return x, w, dout


@pytest.mark.parametrize("style", ["standard", "offset"])
@pytest.mark.parametrize("rows,C", RMS_SHAPES)
def test_rmsnorm_forward(gpu, rng, rows, C, style):
    eps = 1e-5
    x, w, _ = _rms_inputs(rng, rows, C, style)
    out, rstd = gpu.buffer(4 * rows * C), gpu.buffer(4 * rows)
    rmsnorm.rmsnorm_forward(gpu, out, rstd, gpu.upload(x), gpu.upload(w), rows, C, eps, style).run(gpu)
    ref_out, cache = ref.rmsnorm_forward(f64(x), f64(w), eps, style)
    check("rmsnorm out", gpu.read(out, (rows, C)), ref_out, "norm")
    check("rmsnorm rstd", gpu.read(rstd, (rows,)), cache[2][:, 0], "norm")


@pytest.mark.parametrize("style", ["standard", "offset"])
@pytest.mark.parametrize("rows,C", RMS_SHAPES)
def test_rmsnorm_backward(gpu, rng, rows, C, style):
    eps = 1e-6
    x, w, dout = _rms_inputs(rng, rows, C, style)
    rstd_ref = 1.0 / np.sqrt(np.mean(f64(x) ** 2, axis=-1) + eps)
    # rstd as the GPU forward would give it, so the backward is tested on its own
    bx, bw, brstd, bdout = gpu.upload(x), gpu.upload(w), gpu.upload(rstd_ref.astype(f32)), gpu.upload(dout)
    dx0 = rng.standard_normal((rows, C)).astype(f32)
    dw0 = rng.standard_normal(C).astype(f32)
    _, cache = ref.rmsnorm_forward(f64(x), f64(w), eps, style)
    ref_dx, ref_dw = ref.rmsnorm_backward(f64(dout), cache)

    # overwrite dx, accumulate dw (the defaults)
    dx, dw = gpu.buffer(4 * rows * C), gpu.upload(dw0)
    rmsnorm.rmsnorm_backward(gpu, dx, dw, bdout, bx, bw, brstd, rows, C, style).run(gpu)
    check("rmsnorm dx", gpu.read(dx, (rows, C)), ref_dx, "norm")
    check("rmsnorm dw (accumulated)", gpu.read(dw, (C,)), f64(dw0) + ref_dw, "norm")

    # accumulate dx, overwrite dw, with a caller-given partials buffer
    dx, dw = gpu.upload(dx0), gpu.upload(dw0)
    partials = gpu.buffer(rmsnorm.rmsnorm_partials_size(rows, C))
    rmsnorm.rmsnorm_backward(
        gpu,
        dx,
        dw,
        bdout,
        bx,
        bw,
        brstd,
        rows,
        C,
        style,
        accumulate_dx=True,
        accumulate_dw=False,
        partials=partials,
    ).run(gpu)
    check("rmsnorm dx (accumulated)", gpu.read(dx, (rows, C)), f64(dx0) + ref_dx, "norm")
    check("rmsnorm dw", gpu.read(dw, (C,)), ref_dw, "norm")


def test_rmsnorm_per_head_roundtrip(gpu, rng):
    """q/k norm use: x (B, T, H, D) normed over D, forward then backward from the GPU's own rstd."""
    B, T, H, D = 2, 5, 3, 16
    rows = B * T * H
    x = rng.standard_normal((B, T, H, D)).astype(f32)
    w = (1.0 + 0.1 * rng.standard_normal(D)).astype(f32)
    dout = rng.standard_normal((B, T, H, D)).astype(f32)
    out, rstd, dx, dw = gpu.buffer(x.nbytes), gpu.buffer(4 * rows), gpu.buffer(x.nbytes), gpu.buffer(4 * D)
    bx, bw = gpu.upload(x), gpu.upload(w)
    call = rmsnorm.rmsnorm_forward(gpu, out, rstd, bx, bw, rows, D, 1e-6, "standard")
    call += rmsnorm.rmsnorm_backward(gpu, dx, dw, gpu.upload(dout), bx, bw, rstd, rows, D, "standard")
    call.run(gpu)
    ref_out, cache = ref.rmsnorm_forward(f64(x), f64(w), 1e-6, "standard")
    ref_dx, ref_dw = ref.rmsnorm_backward(f64(dout), cache)
    check("per-head out", gpu.read(out, x.shape), ref_out, "norm")
    check("per-head dx", gpu.read(dx, x.shape), ref_dx, "norm")
    check("per-head dw", gpu.read(dw, (D,)), ref_dw, "norm")


def test_rmsnorm_dw_deterministic(gpu, rng):
    rows, C = 300, 37  # 5 row blocks of 64 (4 passes of 16 row slots)
    x, w, dout = _rms_inputs(rng, rows, C, "standard")
    rstd = (1.0 / np.sqrt(np.mean(f64(x) ** 2, axis=-1) + 1e-6)).astype(f32)
    bx, bw, brstd, bdout = gpu.upload(x), gpu.upload(w), gpu.upload(rstd), gpu.upload(dout)
    got = []
    for _ in range(2):
        dx, dw = gpu.buffer(x.nbytes), gpu.buffer(4 * C)
        rmsnorm.rmsnorm_backward(gpu, dx, dw, bdout, bx, bw, brstd, rows, C, accumulate_dw=False).run(gpu)
        got.append((gpu.read(dx, (rows, C)), gpu.read(dw, (C,))))
    assert np.array_equal(got[0][0], got[1][0])
    assert np.array_equal(got[0][1], got[1][1])


def test_rmsnorm_dw_blocks():
    # (TPR, IPT): at most IPT_MAX = 4 items per thread while a row has at most WG threads
    assert [rmsnorm.row_layout(c) for c in (1, 6, 16, 50, 128, 192, 300, 768, 1100)] == [
        (1, 1), (2, 3), (4, 4), (16, 4), (32, 4), (64, 3), (128, 3), (256, 3), (256, 5),
    ]  # fmt: skip
    # blocks of MIN_PASSES passes of the row slots (WG / TPR), at least MIN_BLOCK_ROWS rows
    assert rmsnorm.rmsnorm_dw_blocks(37, 50) == (64, 1)  # 16 slots
    assert rmsnorm.rmsnorm_dw_blocks(300, 37) == (64, 5)
    assert rmsnorm.rmsnorm_dw_blocks(300, 6) == (512, 1)  # 128 slots
    assert rmsnorm.rmsnorm_dw_blocks(16384, 768, 4) == (16, 1024)  # the small preset's norms: 4 slots
    assert rmsnorm.rmsnorm_dw_blocks(98304, 128, 4) == (128, 768)  # its q-norm: 32 slots
    assert rmsnorm.rmsnorm_dw_blocks(16384, 768) == (16, 1024)  # f32 items: one slot, MIN_BLOCK_ROWS rows
    assert rmsnorm.rmsnorm_dw_blocks(262144, 128) == (64, 4096)  # past MAX_BLOCKS blocks grow
    assert rmsnorm.rmsnorm_dw_blocks(300, 16, 4) == (1024, 1)
    assert rmsnorm.rmsnorm_partials_size(300, 16) == 4 * 16 * 2  # the f32 path needs more blocks
    assert rmsnorm.rmsnorm_partials_size(300, 37) == 4 * 37 * 5
    # the reduce pass: about 4 blocks per lane
    assert [rmsnorm.reduce_channels(192, n) for n in (1, 16, 1024, 4096)] == [256, 64, 1, 1]
    with pytest.raises(ValueError):
        rmsnorm._style("layer")
