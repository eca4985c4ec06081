"""AdamW (`shaders/adamw.wgsl`, `ddl_wgpu/ops/adamw.py`) against `ddl_ref.optim.adamw_step` (float64): clip,
decay, the skip of a non-finite step, the owned uniform and determinism.
"""

import numpy as np

from ddl_ref import optim as ref_optim
from ddl_ref.check import check
from ddl_wgpu.ops import adamw as adamw_ops
from ddl_wgpu.ops import reduce as red_ops


def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def test_adamw_three_steps_with_clip_decay_and_skip(gpu, rng):
    n1, n2 = 1001, 77
    hp = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    lrs = [1e-2, 3e-3, 1e-3]
    clip = 1.0
    p0 = {"a": rng.normal(size=n1), "b": rng.normal(size=n2)}
    grads = [{"a": rng.normal(size=n1) * s, "b": rng.normal(size=n2) * s} for s in (3.0, 0.01, 0.02)]

    # GPU: p, m, v, g each one arena with two ranges; one shared hyper uniform
    arenas = {}
    views = {}
    for name in ("p", "g", "m", "v"):
        src = p0 if name == "p" else {"a": np.zeros(n1), "b": np.zeros(n2)}
        arenas[name], views[name] = gpu.upload_ranges([src["a"], src["b"]])
    scalars = gpu.buffer(red_ops.SCALARS_BYTES)
    partials = gpu.buffer(4 * red_ops.total_partials([n1, n2]))
    norm_call = red_ops.grad_norm_clip(gpu, scalars, partials, views["g"], clip)
    hyper = adamw_ops.adamw_hyper(gpu, lrs[0], 1, **hp)
    step_call = norm_call
    for i in range(2):
        (pv, n), (gv, _), (mv, _), (vv, _) = (views[k][i] for k in ("p", "g", "m", "v"))
        step_call = step_call + adamw_ops.adamw(gpu, pv, gv, mv, vv, scalars, n, hyper)

    # reference (float64), fed the same float32-rounded inputs
    params = {k: f32(v).astype(np.float64) for k, v in p0.items()}
    state = {}
    for step, (lr, g) in enumerate(zip(lrs, grads, strict=True), start=1):
        g32 = {k: f32(v).astype(np.float64) for k, v in g.items()}
        mult = ref_optim.clip_multiplier(ref_optim.global_grad_norm(g32), clip)
        ref_optim.adamw_step(params, g32, state, lr, step, grad_multiplier=mult, **hp)
        gpu.write(views["g"][0][0][0], f32(g["a"]), views["g"][0][0][1])
        gpu.write(views["g"][1][0][0], f32(g["b"]), views["g"][1][0][1])
        gpu.write_uniform(hyper, adamw_ops.ADAMW, **adamw_ops.adamw_fields(lr, step, **hp))
        step_call.run(gpu)
        assert (mult < 1.0) == (step == 1)  # step 1 is clipped, the others are not

    def get(name, i):
        (buf, off, nb), n = views[name][i]
        return gpu.download(buf, np.float32, n, off)

    for i, key in enumerate(("a", "b")):
        check(f"p[{key}]", get("p", i), params[key], "optimizer")
        check(f"m[{key}]", get("m", i), state["m"][key], "optimizer")
        check(f"v[{key}]", get("v", i), state["v"][key], "optimizer")

    # a non-finite gradient anywhere: p, m, v untouched everywhere
    before = [get(k, i) for k in ("p", "m", "v") for i in range(2)]
    bad = f32(grads[0]["b"])
    bad[5] = np.nan
    gpu.write(views["g"][1][0][0], bad, views["g"][1][0][1])
    gpu.write_uniform(hyper, adamw_ops.ADAMW, **adamw_ops.adamw_fields(1e-2, 4, **hp))
    step_call.run(gpu)
    assert gpu.download(scalars, np.float32, 4)[2] == 0.0
    after = [get(k, i) for k in ("p", "m", "v") for i in range(2)]
    for a, b in zip(before, after, strict=True):
        assert np.array_equal(a, b)


def test_adamw_owned_uniform_and_determinism(gpu, rng):
    n = 300
    p, g = f32(rng.normal(size=n)), f32(rng.normal(size=n))
    scalars = gpu.upload(f32([0.0, 0.5, 1.0, 0.0]))  # multiplier 0.5, finite
    vals = adamw_ops.adamw_fields(1e-3, 1, 0.9, 0.999, 1e-8, 0.0)

    def once():
        bufs = [gpu.upload(a) for a in (p, g, np.zeros(n, np.float32), np.zeros(n, np.float32))]
        adamw_ops.adamw(gpu, bufs[0], bufs[1], bufs[2], bufs[3], scalars, n, vals).run(gpu)
        return [gpu.download(b, np.float32, n) for b in (bufs[0], bufs[2], bufs[3])]

    a, b = once(), once()
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)
    params, state = {"w": p.astype(np.float64)}, {}
    ref_optim.adamw_step(
        params, {"w": g.astype(np.float64)}, state, 1e-3, 1, 0.9, 0.999, 1e-8, 0.0, grad_multiplier=0.5
    )
    check("p", a[0], params["w"], "optimizer")
    check("v", a[2], state["v"]["w"], "optimizer")
