"""The decoding matrix-vector products (`shaders/gemv.wgsl`, `ddl_wgpu/ops/gemv.py`) against `ddl_ref`: every
vector form (f32 as vec4 and as scalars, f16 as 8 and as 4 halves per load) on both reductions (subgroup
shuffles, workgroup memory), one and several x rows, accumulation, an output column offset and row stride;
stacked segments in one dispatch (outputs in two buffers, two segments into one buffer) and the fallback when
the weights lie in different buffers; the fused gate/up/SwiGLU; an RMSNorm fused into the input read; a row's bits independent of the x rows beside
it and of the unrolling, rows per team and rows per workgroup (the decoder's rows computed apart); the default
tune (the subgroup reduction where its probe passes), the tune syntax and its refusals."""

import numpy as np
import pytest

from ddl_ref import ops as ref
from ddl_ref.check import check
from ddl_wgpu.ops import gemv as k_gemv
from ddl_wgpu.runtime.gpu import GpuError

f32 = np.float32


def reductions(gpu):
    return ["subgroup", "shared"] if "subgroup" in gpu.features else ["shared"]


def tune(reduce, **kw):
    # small shapes that still give several teams per workgroup and several turns per team
    return k_gemv.GemvTune(reduce=reduce, **{"wg": 64, "rows": 8, "rt": 2, "unroll": 2, "team": 8, **kw})


def weights(gpu, rng, OUT, IN, w_dtype):
    """(buffer, the weights the kernel multiplies by, in float64)."""
    w = rng.standard_normal((OUT, IN)).astype(f32)
    if w_dtype == "f16":
        return gpu.upload(w.astype(np.float16)), w.astype(np.float16).astype(np.float64)
    return gpu.upload(w), w.astype(np.float64)


@pytest.mark.parametrize("reduce", ["subgroup", "shared"])
@pytest.mark.parametrize("IN,w_dtype,f16_vec", [(36, "f32", 8), (37, "f32", 8), (296, "f16", 8), (296, "f16", 4),
                                                (300, "f16", 8)])  # fmt: skip
@pytest.mark.parametrize("n,accumulate", [(1, False), (3, True)])
def test_gemv(gpu, rng, reduce, IN, w_dtype, f16_vec, n, accumulate):
    if reduce not in reductions(gpu):
        pytest.skip("the adapter has no subgroup feature")
    OUT, ldy, col0 = 70, 75, 5
    x = rng.standard_normal((n, IN)).astype(f32)
    wb, w_used = weights(gpu, rng, OUT, IN, w_dtype)
    y0 = rng.standard_normal((n, ldy)).astype(f32)
    y = gpu.upload(y0)
    t = tune(reduce, f16_vec=f16_vec)
    k_gemv.gemv(gpu, y, gpu.upload(x), wb, n, OUT, IN, w_dtype, ldy, col0, accumulate, tune=t).run(gpu)
    want = y0.astype(np.float64).copy()
    prod = ref.linear_forward(x.astype(np.float64), w_used)
    want[:, col0 : col0 + OUT] = (want[:, col0 : col0 + OUT] if accumulate else 0.0) + prod
    check("gemv", gpu.download(y, f32, n * ldy).reshape(n, ldy), want, "matmul")


@pytest.mark.parametrize("w_dtype", ["f32", "f16"])
def test_gemv_stacked(gpu, rng, w_dtype):
    """Three matrices at 256-byte-aligned offsets of one buffer (as in a parameter arena) in one dispatch: the
    first into its own buffer, the other two into one buffer at an offset each (a Gated DeltaNet's a and b)."""
    n, IN, rows = 2, 40, [37, 9, 9]
    item = 2 if w_dtype == "f16" else 4
    offs, end = [], 0
    for r in rows:
        offs.append(end)
        end += -(-r * IN * item // 256) * 256
    arena = gpu.buffer(end)
    ws = []
    for r, off in zip(rows, offs, strict=True):
        w = rng.standard_normal((r, IN)).astype(f32)
        gpu.write(arena, w.astype(np.float16) if w_dtype == "f16" else w, off)
        ws.append(w.astype(np.float16).astype(np.float64) if w_dtype == "f16" else w.astype(np.float64))
    views = [(arena, off, -(-r * IN * item // 4) * 4) for r, off in zip(rows, offs, strict=True)]
    x = rng.standard_normal((n, IN)).astype(f32)
    y_a = gpu.buffer(n * rows[0] * 4)
    y_ab = gpu.buffer(128 * 4)  # a at float 0, b at float 64 (256 bytes)
    segs = [
        k_gemv.Segment(y_a, views[0], rows[0]),
        k_gemv.Segment((y_ab, 0, n * rows[1] * 4), views[1], rows[1]),
        k_gemv.Segment((y_ab, 256, n * rows[2] * 4), views[2], rows[2]),
    ]
    for reduce in reductions(gpu):
        call = k_gemv.gemv_stacked(gpu, gpu.upload(x), segs, n, IN, w_dtype, tune=tune(reduce))
        assert len(call.dispatches) == 1
        call.run(gpu)
        want = [ref.linear_forward(x.astype(np.float64), w) for w in ws]
        check("stacked 0", gpu.read(y_a, (n, rows[0])), want[0], "matmul")
        ab = gpu.read(y_ab, (128,))
        check("stacked 1", ab[: n * rows[1]].reshape(n, rows[1]), want[1], "matmul")
        check("stacked 2", ab[64 : 64 + n * rows[2]].reshape(n, rows[2]), want[2], "matmul")
    # weights in two buffers: one dispatch per segment, the same results
    other = gpu.buffer(views[2][2])
    rec = gpu.recorder()
    rec.copy(arena, offs[2], other, 0, views[2][2])
    rec.submit()
    y_c = gpu.buffer(n * rows[2] * 4)
    split = [segs[0], k_gemv.Segment(y_c, other, rows[2])]
    call = k_gemv.gemv_stacked(gpu, gpu.upload(x), split, n, IN, w_dtype)
    assert len(call.dispatches) == 2
    call.run(gpu)
    check("split", gpu.read(y_c, (n, rows[2])), want[2], "matmul")


@pytest.mark.parametrize("w_dtype,IN", [("f32", 37), ("f16", 48)])
def test_gemv_swiglu(gpu, rng, w_dtype, IN):
    n, F = 3, 45
    x = rng.standard_normal((n, IN)).astype(f32)
    (wg, g64), (wu, u64) = weights(gpu, rng, F, IN, w_dtype), weights(gpu, rng, F, IN, w_dtype)
    x64 = x.astype(np.float64)
    want = ref.swiglu_forward(ref.linear_forward(x64, g64), ref.linear_forward(x64, u64))
    for reduce in reductions(gpu):
        y = gpu.buffer(n * F * 4)
        k_gemv.gemv_swiglu(gpu, y, gpu.upload(x), wg, wu, n, F, IN, w_dtype, tune=tune(reduce)).run(gpu)
        check("gemv_swiglu", gpu.read(y, (n, F)), want, "matmul")


@pytest.mark.parametrize("w_dtype,IN,style", [("f32", 37, "standard"), ("f32", 40, "offset"), ("f16", 48, "offset"),
                                              ("f16", 296, "standard")])  # fmt: skip
def test_gemv_norm(gpu, rng, w_dtype, IN, style):
    """An RMSNorm fused into the input read (`Norm`): stacked segments and the gate/up/SwiGLU form of the raw
    x give the products of `ddl_ref`'s rmsnorm of x (both weight styles, every vector form, both
    reductions), with a row's bits independent of the rows beside it."""
    n, F, eps = 3, 45, 1e-5
    x = (rng.standard_normal((n, IN)) * 3.0).astype(f32)
    g = (1.0 + 0.2 * rng.standard_normal(IN)).astype(f32)
    norm = k_gemv.Norm(gpu.upload(g), eps, style)
    h = ref.rmsnorm_forward(x.astype(np.float64), g.astype(np.float64), eps, style)[0]
    (wa, a64), (wb, b64) = weights(gpu, rng, F, IN, w_dtype), weights(gpu, rng, 9, IN, w_dtype)
    wu, u64 = weights(gpu, rng, F, IN, w_dtype)
    xb = gpu.upload(x)
    for reduce in reductions(gpu):
        y = gpu.buffer(n * F * 4)
        k_gemv.gemv_swiglu(gpu, y, xb, wa, wu, n, F, IN, w_dtype, tune=tune(reduce), norm=norm).run(gpu)
        want = ref.swiglu_forward(ref.linear_forward(h, a64), ref.linear_forward(h, u64))
        check("gemv_swiglu norm", gpu.read(y, (n, F)), want, "norm")
        ya, yb = gpu.buffer(n * F * 4), gpu.buffer(n * 9 * 4)
        segs = [k_gemv.Segment(ya, wa, F), k_gemv.Segment(yb, wb, 9)]
        k_gemv.gemv_stacked(gpu, xb, segs, n, IN, w_dtype, tune=tune(reduce), norm=norm).run(gpu)
        check("gemv norm a", gpu.read(ya, (n, F)), ref.linear_forward(h, a64), "norm")
        check("gemv norm b", gpu.read(yb, (n, 9)), ref.linear_forward(h, b64), "norm")
        one = gpu.buffer(9 * 4)
        k_gemv.gemv(gpu, one, gpu.upload(x[1]), wb, 1, 9, IN, w_dtype, tune=tune(reduce), norm=norm).run(gpu)
        assert np.array_equal(gpu.read(one, (9,)), gpu.read(yb, (n, 9))[1]), reduce


def test_rows_apart(gpu, rng):
    """A row's bits do not depend on the x rows beside it, nor on unroll / rt / rows (same team size): what
    lets a speculative verify leave the cache a plain decode would (docs/generate.md#rows-computed-apart).
    A different team size sums in another order, so the check can fail."""
    IN, OUT, n = 264, 50, 4
    x = rng.standard_normal((n, IN)).astype(f32)
    wb, _ = weights(gpu, rng, OUT, IN, "f16")
    xs = [gpu.upload(x)] + [gpu.upload(x[r]) for r in range(n)]

    def run(m, t, row=None):
        y = gpu.buffer(m * OUT * 4)
        k_gemv.gemv(gpu, y, xs[0 if row is None else 1 + row], wb, m, OUT, IN, "f16", tune=t).run(gpu)
        return gpu.read(y, (m, OUT))

    for reduce in reductions(gpu):
        base = run(n, tune(reduce))
        for r in range(n):
            assert np.array_equal(run(1, tune(reduce), r)[0], base[r]), (reduce, r)
        for kw in ({"unroll": 1}, {"unroll": 3}, {"rt": 1}, {"rt": 4, "rows": 16}, {"rows": 16}):
            assert np.array_equal(run(n, tune(reduce, **kw)), base), (reduce, kw)
    shared = run(n, tune("shared"))
    assert not np.array_equal(run(n, tune("shared", team=16, rows=16)), shared)  # another order: other bits


def test_default_tune(gpu, monkeypatch):
    """The subgroup reduction by default where the adapter has it and its probe sums right (lavapipe's do),
    else workgroup memory; DDL_WGPU_GEMV overrides fields."""
    assert k_gemv.subgroups_work(gpu) == ("subgroup" in gpu.features)
    want = "subgroup" if "subgroup" in gpu.features else "shared"
    assert k_gemv.default_tune(gpu).reduce == want
    monkeypatch.setitem(k_gemv._SUBGROUPS, id(gpu), False)  # a driver whose subgroup path failed the probe
    assert k_gemv.default_tune(gpu).reduce == "shared"
    monkeypatch.setenv(k_gemv.ENV_TUNE, "rows=8,unroll=4")
    t = k_gemv.default_tune(gpu)
    assert (t.reduce, t.rows, t.unroll) == ("shared", 8, 4)


def test_tune_syntax(gpu):
    t = k_gemv.GemvTune.parse("reduce=shared, wg=128,rt=1")
    assert (t.reduce, t.wg, t.rt, t.rows) == ("shared", 128, 1, k_gemv.GemvTune().rows)
    for bad in ("wg", "threads=4", "wg=x"):
        with pytest.raises((GpuError, ValueError)):
            k_gemv.GemvTune.parse(bad)
    with pytest.raises(GpuError, match="powers of two"):
        k_gemv.fit_tune(gpu, k_gemv.GemvTune(wg=96), 1, False)
    # within WebGPU's 16 KiB of workgroup memory the shared reduction shrinks rt, then wg, to fit
    t = k_gemv.fit_tune(gpu, k_gemv.GemvTune(reduce="shared", wg=256, rt=4, team=32), 8, True)
    assert 4 * (2 * t.rt * 8 * t.wg) <= gpu.limits["max-compute-workgroup-storage-size"]
    assert t.rows % ((t.wg // t.team) * t.rt) == 0
    # rows=0: per shape, the most rows per workgroup that leave 1024 workgroups, a workgroup of as many teams
    auto = k_gemv.GemvTune(reduce="shared", team=32, rt=2)
    small, big = (k_gemv.fit_tune(gpu, auto, 1, False, out) for out in (5120, 17408))
    assert (small.rows, small.wg, big.rows, big.wg) == (4, 64, 16, 256)
    # unroll=0: a lane's few items in one turn (768 f32 inputs: 6 a lane), capped by the loads a turn
    # (8 x rows), 2 where a lane walks many (5120 f16 inputs: 20 a lane); 2 when the row length is unknown
    fit = lambda nx, items, swiglu=False: k_gemv.fit_tune(gpu, auto, nx, swiglu, 768, items=items).unroll  # noqa: E731
    assert (fit(1, 192), fit(8, 192), fit(1, 640), fit(1, 0)) == (6, 1, 2, 2)
