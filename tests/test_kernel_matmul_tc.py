"""`shaders/matmul_tc.wgsl` (the GEMM on the matrix units) against `ddl_ref.ops.linear_forward` and
`linear_backward` at f16 tolerance, on a Gpu whose runtime lists an f16 -> f32 subgroup-matrix configuration
(Dawn on NVIDIA, AMD or Intel GPUs: `make test-gpu` on such a machine, BENCHMARKS.md). Where none exists
(lavapipe, wgpu-native) every test here skips with the reason; the WGSL generator's own checks run everywhere.

The reference runs in float64 on the operands rounded to f16, as the kernel stages them: what is left is the
f32 accumulation's rounding, far below the tolerance. Shapes are odd on purpose (no dimension a multiple of
the 16 x 16 matrices or the tile), so every edge path runs."""

from __future__ import annotations

import re

import emulated_matrices
import numpy as np
import pytest
from emulated_matrices import emulation

from ddl_ref import ops as ref
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.ops import matmul_tc as tc

TOL = 2e-3  # relative to the largest |C|: f32 accumulation over K <= 400 of f16 products


parse_tile = tc.parse_tile


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
    [
        "4x2sg-4x4-k32",
        "2x2sg-4x4-k32",
        "2x4sg-4x4-k32",
        "2x2sg-4x4-k16-v1-np",
        "2x2sg-2x2-k16-np",
        "2x2sg-4x4-k32-v1",
        "4x2sg-2x4-k32",
        "2x2sg-4x4-k64-p0",
    ],
)
@pytest.mark.parametrize("shape", [(41, 150, 67), (264, 264, 96)])
def test_every_tile_layout_and_batch(mgpu, rng, tile, shape):
    """Each swept tile, the three layouts, a batch of two with offsets, accumulating with alpha 0.25 and 1:
    against float64. Odd sizes take the scalar loads and every edge; multiples of 4 the vec4 loads and whole
    blocks."""
    (M, N, K), nb, g, t = shape, 2, mgpu, parse_tile(tile)
    pad = 4 if M % 4 == 0 else 5
    for alpha, (ta, tb) in (
        (al, lay) for al in (0.25, 1.0) for lay in ((False, True), (False, False), (True, False))
    ):
        a = rng.standard_normal((nb, K, M) if ta else (nb, M, K)).astype(np.float32)
        b = rng.standard_normal((nb, N, K) if tb else (nb, K, N)).astype(np.float32)
        c = rng.standard_normal((nb, M, N)).astype(np.float32)
        ab, bb, cb = (
            g.upload(np.concatenate([[0] * pad, a.ravel()]).astype(np.float32)),
            g.upload(b),
            g.upload(c),
        )
        tc.matmul_tc(g, cb, ab, bb, M, N, K, ta, tb, accumulate=True, alpha=alpha, offsets=(pad, 0, 0),
                     strides=(M * K, N * K, M * N), batch=nb, tile=t).run(g)  # fmt: skip
        fa, fb = f16(a), f16(b)
        want = (
            alpha
            * np.einsum(
                "zij,zjk->zik", fa.transpose(0, 2, 1) if ta else fa, fb.transpose(0, 2, 1) if tb else fb
            )
            + c
        )
        assert rel_err(g.read(cb, (nb, M, N)), want) < TOL, (tile, ta, tb, alpha)


@pytest.mark.parametrize("tile", ["4x2sg-4x4-k32", "4x2sg-4x4-k32-v1-np"])
def test_a_product_smaller_than_one_result_matrix(mgpu, rng, tile):
    """C of 1 x 1 and 3 x 5 (a scalar parameter's gradient, say): its binding is smaller than a 16 x 16 result
    matrix, which Dawn refuses for a kernel that stores matrices to C (an earlier epilogue did, and the ddl
    variant's train step failed on an H100)."""
    g = mgpu
    for M, N, K in ((1, 1, 40), (3, 5, 33)):
        a = rng.standard_normal((M, K)).astype(np.float32)
        b = rng.standard_normal((N, K)).astype(np.float32)
        cb = g.upload(np.zeros((M, N), np.float32))
        tc.matmul_tc(g, cb, g.upload(a), g.upload(b), M, N, K, trans_b=True, tile=parse_tile(tile)).run(g)
        assert rel_err(g.read(cb, (M, N)), f16(a) @ f16(b).T) < TOL


def test_the_generator_refuses_what_the_kernel_cannot_do():
    """Runs everywhere: a k depth that is not a multiple of the configuration's k is refused; the workgroup
    memory a tile needs is what its staging (each operand as stored, the larger layout) and epilogue take; a
    transposed operand is staged as stored and read column-major; C is never touched by a matrix access."""
    cfg = tc.Config(16, 16, 16)
    with pytest.raises(ValueError, match="multiple"):
        tc.templates(tc.TcTile(bk=24), cfg, 32, False, True)
    t = tc.TcTile(2, 2, 4, 4, 32, 8, 8)  # 128 x 128 blocks: A's rows 32 + 8, or (K, M) 128 + 8
    assert tc.workgroup_bytes(t, cfg) == 2 * (128 * 40 + 128 * 40) + 4 * 4 * 256
    src = tc.templates(t, cfg, 32, True, False)
    assert src["threads"] == "128" and src["loop"].count("subgroupMatrixMultiplyAccumulate") == 2 * 16
    assert src["as_size"] == str(32 * 136) and src["bs_size"] == str(32 * 136)
    assert src["loop"].count("(&As, ") == src["loop"].count("true, 136u)") == 2 * 4  # A (K, M): column-major
    nt = tc.templates(t, cfg, 32, False, True)
    assert (
        nt["as_size"] == nt["bs_size"] == str(128 * 40) and nt["loop"].count("true, 40u)") == 2 * 4
    )  # B (N, K)
    assert "&c," not in src["epilogue"] + src["accumulators"]  # Dawn would size C's binding by such an access


def test_tile_names_round_trip_and_bad_ones_are_refused(monkeypatch):
    """Every flag combination reads back from its name; DDL_WGPU_TC_TILE picks the tile; a bad name is one
    GpuError naming the form."""
    from ddl_wgpu.runtime.gpu import GpuError

    for t in (*tc.TILES, tc.TcTile(2, 4, 4, 2, 16, 0, 16), tc.TcTile(prefetch=False), tc.TcTile(vec=False)):
        assert tc.parse_tile(t.name()) == t
    assert tc.parse_tile("4x2sg-4x4-k32") == tc.TcTile(4, 2, 4, 4, 32)

    class Fake:
        limits = {"max-compute-workgroup-storage-size": 49152}

    monkeypatch.setenv(tc.ENV_TILE, "2x2sg-2x2-k16-np")
    assert tc.pick_tile(Fake(), tc.Config(16, 16, 16)) == tc.TcTile(2, 2, 2, 2, 16, prefetch=False)
    for bad in ("4x2-4x4-k32", "4x2sg-4x4", "4x2sg-4x4-k32-zz", "4x2sg-4x4-k32-nd"):
        with pytest.raises(GpuError, match="not of the form"):
            tc.parse_tile(bad)


def test_the_tile_fits_the_adapter():
    """pick_tile: the sweep's best where the workgroup memory holds it, a smaller one within WebGPU's 16 KiB."""

    class Fake:
        limits = {"max-compute-workgroup-storage-size": 49152}

    cfg = tc.Config(16, 16, 16)
    assert tc.pick_tile(Fake(), cfg) == tc.STAGED == tc.TILES[0]
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


# -- the generated kernel on any GPU, its matrix calls emulated ----------------------------------------------
# Lavapipe lists no subgroup matrix, so the tests above skip there. These run the very WGSL `matmul_tc`
# generates (staging in vec4 or scalar loads, prefetch, bounds, transposed operands read column-major, the
# epilogue, batches, causal modes, split-K), with only the matrix types and builtins replaced by WGSL
# functions doing the same arithmetic (`emulated_matrices`); the matrix units themselves are checked above,
# on a GPU.

EMULATION = emulation("As", "Bs", ("Cs",))


def emulated(src: str) -> str:
    """matmul_tc's WGSL with the matrices emulated (`emulated_matrices`)."""
    return emulated_matrices.emulated(src, EMULATION)


_EMULATED_KERNELS = {}  # compiled once per session (lavapipe takes seconds per kernel)


@pytest.fixture
def emulating(gpu, monkeypatch):
    """`matmul_tc` launching the emulated kernel, with 32-lane subgroups. On Dawn only: the kernel exists for
    Dawn's compiler (Tint) alone, and lavapipe compiles naga's form of it for minutes where Tint's takes
    seconds (make test's second pass runs these under Dawn)."""
    if getattr(gpu, "runtime_name", "native") != "dawn":
        pytest.skip(
            "matmul_tc runs only through Dawn: its emulated form is tested in the Dawn pass (make test)"
        )
    from ddl_wgpu.runtime.gpu import Kernel
    from ddl_wgpu.runtime.shader_files import shader_source

    cache = _EMULATED_KERNELS

    def kernel(g, cfg, tile, trans_a, trans_b, a_dtype, b_dtype, widths=(1, 1)):
        key = (id(g.device), cfg, tile, trans_a, trans_b, a_dtype, b_dtype, widths)
        if key not in cache:
            t = tc.templates(tile, cfg, 32, trans_a, trans_b, a_dtype, b_dtype, widths)
            src = emulated(shader_source(tc.SHADER, {**t, "struct TcParams": tc.PARAMS.wgsl()}))
            bgl, layout = g._layout("rrwu")
            pipe = g.device.create_compute_pipeline(
                layout=layout, compute={"module": g._create_module(src, "matmul_tc (emulated)"),
                                        "entry_point": "matmul_tc"})  # fmt: skip
            cache[key] = Kernel(name="matmul_tc (emulated)", sig="rrwu", workgroup=(int(t["threads"]), 1, 1),
                                pipeline=pipe, layout=bgl)  # fmt: skip
        return cache[key]

    monkeypatch.setattr(tc, "kernel", kernel)
    monkeypatch.setattr(tc, "subgroup_size", lambda g: 32)
    seen = []
    real = tc.load_widths
    monkeypatch.setattr(tc, "load_widths", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    gpu.widths_seen = seen
    return gpu


ODD, ALIGNED = (41, 150, 67), (136, 132, 48)
# the layouts' operand types: shared with the causal test below, so its kernels are compiled once
LAYOUTS = (((False, True), ("f32", "f16")), ((False, False), ("f16", "f32")), ((True, False), ("f32", "f32")))


# Few result matrices per subgroup, and few kernels: lavapipe compiles an emulated kernel in 10-100 s when its
# cache is cold (more matrices, longer), so each generated path appears once: scalar loads with guarded edges
# (ODD), the default path (vec4, prefetch; its kernels serve the causal and split-K tests too), the default
# path 32 deep (its rows paired: `matmul_tc._paired`), vec4 without prefetch. Each runs the three layouts, so
# both operands are staged as stored and read column-major.
@pytest.mark.parametrize("tile, shape", [("2x2sg-2x2-k16", ODD), ("2x2sg-1x2-k16", ALIGNED),
                                         ("2x2sg-1x2-k32", ALIGNED), ("2x2sg-2x1-k16-np", ALIGNED)])  # fmt: skip
def test_the_generated_kernel_with_emulated_matrices(emulating, rng, tile, shape):
    """Odd shapes (scalar loads, every edge guarded) and multiples of 4 (vec4 loads, blocks inside the
    operands): three layouts, f32 and f16 operands, a batch of two with offsets, accumulating with alpha 1
    and 0.5."""
    g, (M, N, K), nb, t = emulating, shape, 2, parse_tile(tile)
    cfg = tc.Config(16, 16, 16)
    pad = 4 if M % 4 == 0 else 5  # keeps the vec4 loads' alignment on the aligned shape
    for ((ta, tb), (adt, bdt)), alpha in zip(LAYOUTS, (1.0, 0.5, 1.0), strict=True):
        a = rng.standard_normal((nb, K, M) if ta else (nb, M, K)).astype(np.float32)
        b = rng.standard_normal((nb, N, K) if tb else (nb, K, N)).astype(np.float32)
        c0 = rng.standard_normal((nb, M, N)).astype(np.float32)
        host = {"f32": np.float32, "f16": np.float16}
        ab = g.upload(np.concatenate([np.zeros(pad, np.float32), a.ravel()]).astype(host[adt]))
        bb, cb = g.upload(b.astype(host[bdt])), g.upload(c0)
        tc.matmul_tc(g, cb, ab, bb, M, N, K, ta, tb, accumulate=True, alpha=alpha, offsets=(pad, 0, 0),
                     strides=(M * K, N * K, M * N), batch=nb, a_dtype=adt, b_dtype=bdt, cfg=cfg, tile=t).run(g)  # fmt: skip
        fa, fb = f16(a), f16(b)
        want = (
            alpha
            * np.einsum(
                "zij,zjk->zik", fa.transpose(0, 2, 1) if ta else fa, fb.transpose(0, 2, 1) if tb else fb
            )
            + c0
        )
        assert rel_err(g.read(cb, (nb, M, N)), want) < 1e-5, (tile, ta, tb)
    vec = M % 4 == 0 and t.vec
    assert g.widths_seen == [(4, 4) if vec else (1, 1)] * 3


@pytest.mark.parametrize("causal", [1, 2, 3])
def test_the_generated_kernel_causal_modes_with_emulated_matrices(emulating, rng, causal):
    """The causal modes attention's scores path uses (tiles skipped above the diagonal, k stopped at the
    tile's end, k started at its first row), against the same masks in float64."""
    g, T, D = emulating, 72, 32
    cfg, t = tc.Config(16, 16, 16), parse_tile("2x2sg-1x2-k16")
    (ta, tb), (adt, bdt) = LAYOUTS[causal - 1]
    host = {"f32": np.float32, "f16": np.float16}
    low = np.tril(np.ones((T, T)))
    if causal == 1:  # S = q k^T: the blocks on and below the diagonal computed, the rest left as they were
        q, k = rng.standard_normal((T, D)), rng.standard_normal((T, D))
        cb = g.upload(np.zeros((T, T), np.float32))
        tc.matmul_tc(g, cb, g.upload(q.astype(host[adt])), g.upload(k.astype(host[bdt])), T, T, D, ta, tb,
                     causal=1, a_dtype=adt, b_dtype=bdt, cfg=cfg, tile=t).run(g)  # fmt: skip
        got, want = g.read(cb, (T, T)), f16(q) @ f16(k).T
        assert rel_err(got * low, want * low) < 1e-5
    else:  # P v with P lower-triangular (2: k stops at the block's end); P^T dout stored as P (3: k starts at m)
        p, v = rng.standard_normal((T, T)) * low, rng.standard_normal((T, D))
        cb = g.upload(np.zeros((T, D), np.float32))
        tc.matmul_tc(g, cb, g.upload(p.astype(host[adt])), g.upload(v.astype(host[bdt])), T, D, T, ta, tb,
                     causal=causal, a_dtype=adt, b_dtype=bdt, cfg=cfg, tile=t).run(g)  # fmt: skip
        assert rel_err(g.read(cb, (T, D)), (f16(p).T if ta else f16(p)) @ f16(v)) < 1e-5


def test_split_k_on_the_emulated_matrix_units(emulating, rng, monkeypatch):
    """A long K with few blocks of C (dW's layout) goes through `matmul` as K slices on the matrix units plus
    the fixed-order reduction: three full slices batched, the short fourth at its offsets, accumulating with
    alpha 0.5; the same bits twice."""
    g, (M, N, K) = emulating, (48, 72, 4160)
    cfg = tc.Config(16, 16, 16)
    monkeypatch.setattr(tc, "usable_config", lambda gpu: cfg)
    monkeypatch.setenv(tc.ENV_TILE, "2x2sg-1x2-k16")  # compiled for the test above (dW, f32, vec4)
    monkeypatch.setitem(g.info, "type", "DiscreteGPU")  # CPU adapters never slice K
    assert k_mm.auto_split_k_tc(g, cfg, parse_tile("2x2sg-1x2-k16"), M, N, K) == 4
    assert k_mm.split_k_slices(K, 4) == (1088, 3, 896)
    a = rng.standard_normal((K, M)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    c0 = rng.standard_normal((M, N)).astype(np.float32)
    runs = []
    for _ in range(2):
        cb = g.upload(c0)
        k_mm.matmul(g, cb, g.upload(a), g.upload(b), M, N, K, trans_a=True, accumulate=True, alpha=0.5).run(g)
        runs.append(g.read(cb, (M, N)))
    assert rel_err(runs[0], 0.5 * f16(a).T @ f16(b) + c0) < 1e-5
    assert np.array_equal(runs[0], runs[1])


def test_split_k_on_the_matrix_units(mgpu, rng):
    """On the GPU: the small preset's dW shape (768 x 768 over 16 K rows) is sliced, and still right."""
    g, (M, N, K) = mgpu, (768, 768, 16384)
    cfg = tc.usable_config(g)
    assert k_mm.auto_split_k_tc(g, cfg, tc.pick_tile(g, cfg), M, N, K) > 1
    a = rng.standard_normal((K, M)).astype(np.float32)
    b = rng.standard_normal((K, N)).astype(np.float32)
    cb = g.buffer(M * N * 4)
    k_mm.matmul(g, cb, g.upload(a), g.upload(b), M, N, K, trans_a=True).run(g)
    assert rel_err(g.read(cb, (M, N)), f16(a).T @ f16(b)) < TOL


def _copy_cost(tile: tc.TcTile, trans_a: bool, trans_b: bool) -> dict:
    """Runs everywhere: each staged operand's copy as the generated slot expressions place it (evaluated here
    for every thread), checked to cover the tile once, and the worst number of bank wavefronts of one
    subgroup's vec4 store (NVIDIA's compiler merges a lane's four f16 stores into one 8-byte store, served
    16 lanes at a time over 32 banks of 4 bytes)."""
    cfg, threads = tc.Config(16, 16, 16), tile.sg_rows * tile.sg_cols * 32
    out = {}
    for op in tc._operands(tile, cfg, trans_a, trans_b, 4, 4):
        cells, worst = [], 0
        for r, q, _guard in tc._slots(op, threads):
            py = [re.sub(r"(\d+)u", r"\1", x).replace("/", "//") for x in (r, q)]
            at = [(eval(py[0], {"li": li}), eval(py[1], {"li": li})) for li in range(threads)]  # noqa: S307
            cells += [(row, col + j) for row, col in at for j in range(4)]
            for h0 in range(0, threads, 16):
                banks = {}
                for row, col in at[h0 : h0 + 16]:
                    for word in ((row * op.stride + col) // 2, (row * op.stride + col) // 2 + 1):
                        banks.setdefault(word % 32, set()).add(word)
                worst = max(worst, max(len(s) for s in banks.values()))
        assert sorted(cells) == [(i, j) for i in range(op.rows) for j in range(op.cols)], op
        out[op.tag] = worst
    return out


@pytest.mark.parametrize("layout", [(False, True), (False, False), (True, False)])
def test_the_staging_copy_stores_in_one_wavefront(layout):
    """The default tile's staging copy at each layout (forward, dx, dW): every element once, and every half
    subgroup's 8-byte stores in one bank wavefront. Consecutive rows (before the pairing) took two wherever a
    row is 32 deep: both operands of the forward, A of dx."""
    assert _copy_cost(tc.STAGED, *layout) == {"a": 1, "b": 1}


def test_the_grid_order_variable_is_read_strictly(monkeypatch):
    """Runs everywhere: DDL_WGPU_TC_ORDER forces either order, and a value it does not know is one clear error
    (a typo would otherwise fall back to `auto` unnoticed)."""
    from ddl_wgpu.runtime.gpu import GpuError

    cfg, args = tc.Config(16, 16, 16), (512, 209664, 5120, 1, 4)
    for value, want in (("rows", True), ("COLS", False), ("", True), ("auto", True)):
        monkeypatch.setenv(tc.ENV_ORDER, value)
        assert tc.rows_first(tc.STAGED, cfg, *args) is want, value
    monkeypatch.setenv(tc.ENV_ORDER, "row")
    with pytest.raises(GpuError, match="DDL_WGPU_TC_ORDER='row': one of auto, rows, cols"):
        tc.rows_first(tc.STAGED, cfg, *args)


@pytest.mark.parametrize("sg", [32, 64])
def test_the_epilogue_loads_c_before_it_stores(sg):
    """Runs everywhere: each round of the generated epilogue (one result matrix, a lane's MM*NN / subgroup
    elements) issues every load of C before any store into C. Alternated, each load waited for the store
    before it, and an accumulating product (dW at 512 rows) spent half its time there on the H100."""
    cfg = tc.Config(16, 16, 16)
    text = tc._epilogue(tc.STAGED, cfg, sg)
    rounds = text.split("for (var e0 = lane;")[1:]
    assert len(rounds) == tc.STAGED.tm * tc.STAGED.tn
    for r in rounds:
        lines = r.splitlines()
        loads = [i for i, x in enumerate(lines) if "= c[o" in x]
        stores = [i for i, x in enumerate(lines) if re.search(r"\bc\[o\d+\] =", x)]
        assert len(loads) == len(stores) == 16 * 16 // sg
        assert max(loads) < min(stores)


def test_few_block_rows_walk_the_grid_rows_first(emulating, rng, monkeypatch):
    """`rows_first`: a single product with fewer block rows than block columns and a small A (heal's draft
    rows against its head) has the grid walk C's block rows first; either order gives the same bits, edge
    blocks included. Batched products, and an A too large to stay cached, keep columns first."""
    g, t, cfg = emulating, parse_tile("2x2sg-1x2-k16"), tc.Config(16, 16, 16)  # BM 32, BN 64
    M, N, K = 40, 200, 48
    assert tc.rows_first(t, cfg, M, N, K, 1, 4) and not tc.rows_first(t, cfg, N, M, K, 1, 4)
    assert not tc.rows_first(t, cfg, M, N, K, 2, 4) and not tc.rows_first(t, cfg, M, N, 1 << 20, 1, 4)
    a = rng.standard_normal((M, K)).astype(np.float32)
    b = rng.standard_normal((N, K)).astype(np.float32)
    got = {}
    for order, grid in (("rows", (2, 4, 1)), ("cols", (4, 2, 1))):
        monkeypatch.setenv(tc.ENV_ORDER, order)
        cb = g.upload(np.zeros((M, N), np.float32))
        call = tc.matmul_tc(g, cb, g.upload(a), g.upload(b.astype(np.float16)), M, N, K, False, True,
                            a_dtype="f32", b_dtype="f16", cfg=cfg, tile=t)  # fmt: skip
        assert call.dispatches[0][2] == grid
        call.run(g)
        got[order] = g.read(cb, (M, N))
    assert rel_err(got["rows"], f16(a) @ f16(b).T) < 1e-5
    assert np.array_equal(got["rows"], got["cols"])
