"""`shaders/matmul_tc.wgsl` (the GEMM on the matrix units) against `ddl_ref.ops.linear_forward` and
`linear_backward` at f16 tolerance, on a Gpu whose runtime lists an f16 -> f32 subgroup-matrix configuration
(Dawn on NVIDIA, AMD or Intel GPUs: `make test-gpu` on such a machine, BENCHMARKS.md). Where none exists
(lavapipe, wgpu-native) every test here skips with the reason; the WGSL generator's own checks run everywhere.

The reference runs in float64 on the operands rounded to f16, as the kernel stages them: what is left is the
f32 accumulation's rounding, far below the tolerance. Shapes are odd on purpose (no dimension a multiple of
the 16 x 16 matrices or the tile), so every edge path runs."""

from __future__ import annotations

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.ops import matmul_tc as tc

TOL = 2e-3  # relative to the largest |C|: f32 accumulation over K <= 400 of f16 products


@pytest.fixture(scope="module")
def mgpu(gpu):
    """The session's Gpu with its products on the matrix units for this module's tests, restored after."""
    configs = [c for c in getattr(gpu, "matrix_configs", ()) if tuple(c[3:5]) == ("f16", "f32")]
    if not configs:
        pytest.skip(
            f"{gpu.name} ({getattr(gpu, 'runtime_name', 'native')}) lists no f16 -> f32 subgroup-matrix "
            "configuration: the matrix units run only on a GPU through Dawn (make test-gpu)"
        )
    before = getattr(gpu, "products", "simt")
    gpu.products = "matrix"
    yield gpu
    gpu.products = before


def f16(x):
    return np.asarray(x, np.float32).astype(np.float16).astype(np.float64)


def rel_err(got, want) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("w_dtype", ["f32", "f16"])
def test_linear_forward_on_the_matrix_units(mgpu, rng, w_dtype):
    g, rows, OUT, IN = mgpu, 77, 45, 131
    x = rng.standard_normal((rows, IN)).astype(np.float32)
    w = rng.standard_normal((OUT, IN)).astype(np.float32)
    wb = g.upload(w.astype(np.float16) if w_dtype == "f16" else w)
    out = g.buffer(rows * OUT * 4)
    k_mm.linear_forward(g, out, g.upload(x), wb, rows, OUT, IN, w_dtype=w_dtype).run(g)
    want = ref.linear_forward(f16(x), f16(w))
    assert rel_err(g.read(out, (rows, OUT)), want) < TOL


def test_linear_backward_on_the_matrix_units(mgpu, rng):
    g, rows, OUT, IN = mgpu, 93, 37, 70
    x = rng.standard_normal((rows, IN)).astype(np.float32)
    w = rng.standard_normal((OUT, IN)).astype(np.float32)
    dy = rng.standard_normal((rows, OUT)).astype(np.float32)
    dw0 = rng.standard_normal((OUT, IN)).astype(np.float32)
    dx, dw = g.buffer(rows * IN * 4), g.upload(dw0)
    k_mm.linear_backward(
        g, dx, dw, g.upload(dy), g.upload(x), g.upload(w), rows, OUT, IN, accumulate_dw=True
    ).run(g)
    want_dx, want_dw = ref.linear_backward(f16(dy), f16(x), f16(w))
    assert rel_err(g.read(dx, (rows, IN)), want_dx) < TOL
    assert rel_err(g.read(dw, (OUT, IN)), want_dw + dw0) < TOL


@pytest.mark.parametrize(
    "tile",
    ["4x2sg-4x4-k32", "2x2sg-4x4-k16", "2x2sg-2x2-k16", "2x2sg-4x4-k32", "4x2sg-2x4-k32", "2x2sg-4x4-k64-p0"],
)
def test_every_tile_layout_and_batch(mgpu, rng, tile):
    """Each swept tile, the three layouts, a batch of two with offsets and alpha: against float64."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from matmul_tc import parse_tile

    g, M, N, K, nb = mgpu, 41, 150, 67, 2
    t = parse_tile(tile)
    for ta, tb in ((False, True), (False, False), (True, False)):
        a = rng.standard_normal((nb, K, M) if ta else (nb, M, K)).astype(np.float32)
        b = rng.standard_normal((nb, N, K) if tb else (nb, K, N)).astype(np.float32)
        c = np.zeros((nb, M, N), np.float32)
        ab, bb, cb = (
            g.upload(np.concatenate([[0] * 5, a.ravel()]).astype(np.float32)),
            g.upload(b),
            g.upload(c),
        )
        tc.matmul_tc(g, cb, ab, bb, M, N, K, ta, tb, alpha=0.25, offsets=(5, 0, 0),
                     strides=(M * K, N * K, M * N), batch=nb, tile=t).run(g)  # fmt: skip
        fa, fb = f16(a), f16(b)
        want = 0.25 * np.einsum(
            "zij,zjk->zik", fa.transpose(0, 2, 1) if ta else fa, fb.transpose(0, 2, 1) if tb else fb
        )
        assert rel_err(g.read(cb, (nb, M, N)), want) < TOL, (tile, ta, tb)


def test_the_generator_refuses_what_the_kernel_cannot_do():
    """Runs everywhere: a k depth that is not a multiple of the configuration's k is refused, and the
    workgroup memory a tile needs is what its staging and epilogue arrays take."""
    cfg = tc.Config(16, 16, 16)
    with pytest.raises(ValueError, match="multiple"):
        tc.templates(tc.TcTile(bk=24), cfg, 32, False, True)
    t = tc.TcTile(2, 2, 4, 4, 32, 8, 8)
    assert tc.workgroup_bytes(t, cfg) == 2 * (128 * 40 + 32 * 136) + 4 * 4 * 256
    src = tc.templates(t, cfg, 32, True, False)
    assert src["threads"] == "128" and src["products"].count("subgroupMatrixMultiplyAccumulate") == 2 * 16


def test_the_tile_fits_the_adapter():
    """pick_tile: the sweep's best where the workgroup memory holds it, a smaller one within WebGPU's 16 KiB."""

    class Fake:
        limits = {"max-compute-workgroup-storage-size": 49152}

    cfg = tc.Config(16, 16, 16)
    assert tc.pick_tile(Fake(), cfg) == tc.TILES[0]
    Fake.limits = {"max-compute-workgroup-storage-size": 16384}
    assert tc.workgroup_bytes(tc.pick_tile(Fake(), cfg), cfg) <= 16384 < tc.workgroup_bytes(tc.TILES[0], cfg)


def test_products_stay_on_simt_unless_asked(gpu):
    """Routing: `ops.matmul` goes to the matrix units only with gpu.products == "matrix" and a configuration;
    a Gpu without one (lavapipe) never does, whatever it is asked."""
    assert tc.usable_config(gpu) is None or getattr(gpu, "products", "simt") == "matrix"

    class Fake:
        products = "matrix"
        matrix_configs = [(8, 8, 8, "f32", "f32"), (16, 8, 16, "f16", "f32"), (16, 16, 16, "f16", "f32")]

    assert tc.usable_config(Fake()) == tc.Config(16, 16, 16)
    Fake.products = "simt"
    assert tc.usable_config(Fake()) is None
    Fake.products, Fake.matrix_configs = "matrix", [(8, 8, 8, "f32", "f32")]
    assert tc.usable_config(Fake()) is None
