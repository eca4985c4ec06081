"""Launcher for `shaders/gemv.wgsl`: matrix-vector products for the few rows of a decoding pass.

Kernel path: `shaders/gemv.wgsl` -> `ddl_wgpu/ops/gemv.py` -> references `ddl_ref.ops.linear_forward`,
`ddl_ref.ops.swiglu_forward`, `ddl_ref.ops.rmsnorm_forward` -> test `tests/test_kernel_gemv.py`.

- `gemv(y, x, w, n, OUT, IN)`: y[r, col0 + o] (+)= Σ_i x[r, i] · w[o, i] for r < n, w (OUT, IN) the Hugging Face
  linear layout in f32 or f16 (read as u32 pairs and widened, so no shader-f16 is needed);
- `gemv_stacked(x, segments, n, IN)`: several such products over the same x in one dispatch (`Segment`: its
  output view, its weight view, its rows), when the weights lie in one buffer within one binding (a layer's
  q/k/v, a Gated DeltaNet's four input projections: adjacent in the parameter arena); else one dispatch each;
- `gemv_swiglu(y, x, w_gate, w_up, n, F, IN)`: y = silu(x W_gateᵀ) ⊙ (x W_upᵀ) in one dispatch;
- each with `norm=Norm(w, eps, style)`: of RMSNorm(x) instead of x, the norm computed in the input read (a
  decoding pass's sublayer input norm: no norm launch, no normalised row written).

The work layout and its tunables (`GemvTune`: threads per workgroup, rows per workgroup, rows a team computes
at once, loop unrolling, subgroup or workgroup-memory reduction, the f16 load width) are the shader's
(its header). Defaults come from `default_tune` (the subgroup reduction where the adapter has `subgroup`;
shapes that fit the device's limits); `DDL_WGPU_GEMV="reduce=shared,wg=128,rows=8,rt=1,unroll=4,team=32,f16_vec=4"`
overrides any of them for a whole process (a benchmark sweep passes `tune=` instead). Every form is
deterministic, and a row's bits do not depend on how many x rows share the pass (the decoder relies on it:
docs/generate.md#rows-computed-apart).

`ddl_wgpu.engine.decode` uses these for the linear layers and the LM head of passes of at most `GEMV_MAX_ROWS` rows,
where the tiled GEMM would leave most of each tile idle.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from ddl_wgpu.ops import need, view
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError, Uniform, grid

FILE = "gemv.wgsl"
GEMV_MAX_ROWS = 8  # rows up to which a decoding pass uses gemv instead of the tiled GEMM
MAX_SEGMENTS = 4
ENV_TUNE = "DDL_WGPU_GEMV"
NONE = 0xFFFFFFFF  # the start row of an unused segment: no output row reaches it
PARAMS = Uniform(
    "GemvParams",
    ("out_", "u32", "output rows: OUT over all segments (swiglu: F)"),
    ("items", "u32", "items (vector loads) per weight row"),
    ("acc", "u32", "1: y += ..., 0: y = ..."),
    ("st1", "u32", "first output row of segment 1 (NONE: unused)"),
    ("st2", "u32"),
    ("st3", "u32"),
    ("wb0", "u32", "segment s's first weight item in its binding (swiglu: gate, up)"),
    ("wb1", "u32"),
    ("wb2", "u32"),
    ("wb3", "u32"),
    ("yb0", "u32", "segment s's output binding"),
    ("yb1", "u32"),
    ("yb2", "u32"),
    ("yb3", "u32"),
    ("yo0", "u32", "segment s's first output float in its binding (+ its column offset)"),
    ("yo1", "u32"),
    ("yo2", "u32"),
    ("yo3", "u32"),
    ("ld0", "u32", "segment s's floats per output row"),
    ("ld1", "u32"),
    ("ld2", "u32"),
    ("ld3", "u32"),
    ("n_in", "u32", "the fused RMSNorm's width (in_features)"),
    ("eps", "f32", "the fused RMSNorm's epsilon"),
    ("noff", "f32", "the fused RMSNorm's weight offset: 0 (w·x̂) or 1 ((1 + w)·x̂)"),
)
# (x load, weight item, floats of IN per item, bytes per item) of each vector form
FORMS = {
    "f32x4": ("vec4<f32>", "vec4<f32>", 4, 16),
    "f32x1": ("f32", "f32", 1, 4),
    "f16x8": ("vec4<f32>", "vec4<u32>", 8, 16),
    "f16x4": ("vec4<f32>", "vec2<u32>", 4, 8),
}


@dataclass(frozen=True)
class GemvTune:
    """The kernel's shape (shaders/gemv.wgsl's header): `reduce` "subgroup" (a team is a subgroup, summed by a
    shuffle butterfly) or "shared" (teams of `team` threads summed through workgroup memory); `wg` threads per
    workgroup (at most); `rows` outputs per workgroup, 0: per shape (`fit_tune`); `rt` rows a team computes at
    once (each lane keeps rt (2·rt for swiglu) weight loads in flight per item); `unroll` items per loop
    turn, 0: per shape (`fit_tune`); `f16_vec` halves per f16 load (8: 16 bytes, or 4)."""

    reduce: str = "subgroup"
    wg: int = 256
    rows: int = 0
    rt: int = 2
    unroll: int = 0
    team: int = 32
    f16_vec: int = 8

    @classmethod
    def parse(cls, text: str, base: GemvTune | None = None) -> GemvTune:
        """`key=value,...` over `base` (default the class defaults): the `DDL_WGPU_GEMV` syntax."""
        base = base or cls()
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        out = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            key, _, value = item.partition("=")
            key = key.strip()
            if key not in fields or not value:
                raise GpuError(f"{ENV_TUNE}: {item!r} is not key=value with a key of {sorted(fields)}")
            out[key] = value.strip() if key == "reduce" else int(value)
        return dataclasses.replace(base, **out)

    def spec(self) -> str:
        """The `DDL_WGPU_GEMV` text of this tune."""
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))

    def label(self) -> str:
        shape = f"wg{self.wg} rows{self.rows} rt{self.rt} u{self.unroll} f16x{self.f16_vec}"
        return f"{self.reduce}{'' if self.reduce == 'subgroup' else f' team{self.team}'} {shape}"


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def default_tune(gpu: Gpu) -> GemvTune:
    """The subgroup reduction where the adapter has `subgroup` and it passes `subgroups_work`, else workgroup
    memory; `DDL_WGPU_GEMV` on top."""
    base = GemvTune(reduce="subgroup" if subgroups_work(gpu) else "shared")
    text = os.environ.get(ENV_TUNE, "").strip()
    return GemvTune.parse(text, base) if text else base


_SUBGROUPS: dict = {}  # id(gpu) -> whether the subgroup reduction compiled and summed right there


def subgroups_work(gpu: Gpu) -> bool:
    """Whether the adapter has `subgroup` and a small product through the subgroup reduction compiles and
    matches numpy (checked once per device): a driver whose subgroup path fails falls back to the
    workgroup-memory reduction instead of failing every decode."""
    if "subgroup" not in gpu.features:
        return False
    if id(gpu) not in _SUBGROUPS:
        import numpy as np

        rng = np.random.default_rng(0)
        x, w = (
            rng.standard_normal((1, 72)).astype(np.float32),
            rng.standard_normal((40, 72)).astype(np.float32),
        )
        try:
            y = gpu.buffer(40 * 4, label="gemv_probe")
            gemv(gpu, y, gpu.upload(x), gpu.upload(w), 1, 40, 72, tune=GemvTune(reduce="subgroup")).run(gpu)
            got = gpu.download(y, np.float32, 40)
            ok = bool(
                np.allclose(got, (x.astype(np.float64) @ w.T.astype(np.float64))[0], rtol=1e-4, atol=1e-4)
            )
        except Exception:  # a compiler or validation error: the other reduction
            ok = False
        _SUBGROUPS[id(gpu)] = ok
    return _SUBGROUPS[id(gpu)]


AUTO_GROUPS = 1024  # rows=0 takes the most rows per workgroup (of 16, 8, 4) that still give this many
SUBGROUP = 32  # threads of a team assumed when sizing a workgroup for rows=0 (NVIDIA's subgroup; any works)


AUTO_UNROLL_LANE = 16  # unroll=0: a lane with at most this many items takes them in one or two turns
AUTO_UNROLL_MAX = 8  # ... of at most this many items
AUTO_UNROLL_LOADS = 32  # ... and at most this many loads a turn (weights and x: registers)


def _auto_unroll(tune: GemvTune, items: int, nx: int, per: int) -> int:
    """unroll=0: the items a lane walks (items / team) in as few turns as its registers allow when they are few
    (a short row: `small`'s 768 inputs are 6 items a lane, which unroll=2 took in three turns of two loads in
    flight, at a quarter of the bandwidth); longer rows keep 2 (the 27B shapes, measured at the bound)."""
    per_lane = -(-items // (SUBGROUP if tune.reduce == "subgroup" else tune.team))
    if per_lane > AUTO_UNROLL_LANE:
        return 2
    return max(1, min(per_lane, AUTO_UNROLL_MAX, AUTO_UNROLL_LOADS // (per * tune.rt + 2 * nx)))


def fit_tune(gpu: Gpu, tune: GemvTune, nx: int, swiglu: bool, out_rows: int = 1 << 20, norm: bool = False,
             items: int = 0) -> GemvTune:  # fmt: skip
    """`tune` checked and made concrete for a product of `out_rows` outputs of `items` vector loads a row:
    rows=0 picks rows per workgroup (the most of 16, 8, 4 that leave at least AUTO_GROUPS workgroups: a
    product of 5120 outputs then spreads over 1280 workgroups rather than 320, which the H200's 132 SMs take
    in unequal shares) and a workgroup of as many teams as those rows need; unroll=0 per shape
    (`_auto_unroll`; 2 when `items` is not given); then shrunk where the device's limits require (workgroup
    size, workgroup memory of the shared reduction: rt, then wg, are halved), rows a whole number of the
    shared path's team steps."""
    if tune.reduce not in ("subgroup", "shared"):
        raise GpuError(f"gemv: reduce must be 'subgroup' or 'shared', got {tune.reduce!r}")
    if tune.reduce == "subgroup" and "subgroup" not in gpu.features:
        raise GpuError(
            f"gemv: the subgroup reduction needs the adapter feature subgroup ({gpu.name} lacks it)"
        )
    if not (_pow2(tune.wg) and _pow2(tune.team) and tune.team <= tune.wg):
        raise GpuError(f"gemv: wg and team must be powers of two with team <= wg, got {tune.wg}, {tune.team}")
    if min(tune.rows, tune.rt - 1, tune.unroll) < 0 or tune.f16_vec not in (4, 8):
        raise GpuError(f"gemv: rows and unroll >= 0, rt >= 1, f16_vec 4 or 8, got {tune}")
    wg = min(tune.wg, gpu.limits.get("max-compute-invocations-per-workgroup", 256),
             gpu.limits.get("max-compute-workgroup-size-x", 256))  # fmt: skip
    rt, rows = tune.rt, tune.rows
    if rows == 0:
        rows = next((r for r in (16, 8) if -(-out_rows // r) >= AUTO_GROUPS), 4)
        rt = min(rt, rows)
        team = SUBGROUP if tune.reduce == "subgroup" else tune.team
        wg = max(min(wg, team * (rows // rt)), min(wg, 64))
    if tune.reduce == "shared":
        budget = gpu.limits.get("max-compute-workgroup-storage-size", 16384) // 4
        per = 2 if swiglu else 1

        def words(rt: int, wg: int) -> int:  # the reduction's workgroup memory: every accumulator per thread
            return (per * rt + norm) * nx * wg

        while rt > 1 and words(rt, wg) > budget:
            rt //= 2
        while wg > tune.team and words(rt, wg) > budget:
            wg //= 2
        if words(rt, wg) > budget:
            raise GpuError(f"gemv: {nx} rows do not fit workgroup memory with teams of {tune.team}")
        step = (wg // tune.team) * rt
        rows = max(step, rows // step * step)
    else:
        rows = max(rows, rt)
    team = min(tune.team, wg)
    fitted = dataclasses.replace(tune, wg=wg, rt=rt, rows=rows, team=team)
    if tune.unroll == 0:
        unroll = _auto_unroll(fitted, items, nx, 2 if swiglu else 1) if items else 2
        fitted = dataclasses.replace(fitted, unroll=unroll)
    return fitted


# ---------------------------------------------------------------------------------------------------------
# code generation (straight-line: every accumulator and load its own variable, docs/kernels.md#generated-wgsl)


def _templates(form: str, nx: int, tune: GemvTune, swiglu: bool, n_y: int, norm: bool = False) -> dict:
    xa, wv, _, _ = FORMS[form]
    nw = 2 * tune.rt if swiglu else tune.rt  # weight rows per loop turn
    pairs = form == "f16x8"
    sub = tune.reduce == "subgroup"
    warr = (lambda k: "gw1" if k % 2 else "gw0") if swiglu else (lambda k: "gw")

    # bindings: x, the weights (one span, or gate and up), the outputs; the uniform is the last (UBIND)
    wb = ["gw0", "gw1"] if swiglu else ["gw"]
    lines = ["@group(0) @binding(0) var<storage, read> gx: array<XA>;"]
    lines += [f"@group(0) @binding({1 + j}) var<storage, read> {w}: array<WV>;" for j, w in enumerate(wb)]
    if norm:  # the RMSNorm weight, laid out as x
        lines.append(f"@group(0) @binding({1 + len(wb)}) var<storage, read> gn: array<XA>;")
    y0 = 1 + len(wb) + norm
    lines += [f"@group(0) @binding({y0 + b}) var<storage, read_write> gy{b}: array<f32>;" for b in range(n_y)]

    halves = ("a", "b") if pairs else ("",)  # 8 halves of W meet 8 floats of x: two vec4 loads
    raw = "r" if norm else ""  # with the norm, x as loaded; x·(g + noff) is what meets W

    def x_item(r: int, u: int, at: str) -> list[str]:
        if pairs:
            return [
                f"let x{r}_{u}a{raw} = gx[2u * (xb{r} + {at})];",
                f"let x{r}_{u}b{raw} = gx[2u * (xb{r} + {at}) + 1u];",
            ]
        return [f"let x{r}_{u}{raw} = gx[xb{r} + {at}];"]

    def g_item(u: int, at: str) -> list[str]:
        if pairs:
            return [f"let g{u}a = gn[2u * {at}] + gp.noff;", f"let g{u}b = gn[2u * {at} + 1u] + gp.noff;"]
        return [f"let g{u} = gn[{at}] + gp.noff;"]

    def normed(r: int, u: int) -> list[str]:
        """x's squares into row r's sum, then x scaled by the norm weight."""
        sq = (lambda v: f"dot({v}, {v})") if xa.startswith("vec") else (lambda v: f"{v} * {v}")
        out = [f"s{r} += {sq(f'x{r}_{u}{h}r')};" for h in halves]
        return out + [f"let x{r}_{u}{h} = x{r}_{u}{h}r * g{u}{h};" for h in halves]

    def product(k: int, r: int, u: int) -> str:
        w = f"w{k}_{u}"
        if form == "f16x8":
            lo = f"vec4<f32>(unpack2x16float({w}.x), unpack2x16float({w}.y))"
            hi = f"vec4<f32>(unpack2x16float({w}.z), unpack2x16float({w}.w))"
            return f"dot(x{r}_{u}a, {lo}) + dot(x{r}_{u}b, {hi})"
        if form == "f16x4":
            return f"dot(x{r}_{u}, vec4<f32>(unpack2x16float({w}.x), unpack2x16float({w}.y)))"
        if form == "f32x4":
            return f"dot(x{r}_{u}, {w})"
        return f"x{r}_{u} * {w}"

    def body(count: int, ind: str) -> str:
        out = []
        for u in range(count):  # every load first, then the arithmetic in increasing item order
            at = "i" if u == 0 else f"(i + {u}u * T)"
            out += [f"let w{k}_{u} = {warr(k)}[wr{k} + {at}];" for k in range(nw)]
            for r in range(nx):
                out += x_item(r, u, at)
            if norm:
                out += g_item(u, at)
        for u in range(count):
            if norm:
                out += [line for r in range(nx) for line in normed(r, u)]
            out += [f"a{k}_{r} += {product(k, r, u)};" for k in range(nw) for r in range(nx)]
        return "\n".join(ind + s for s in out)

    ind = " " * 12
    if swiglu:
        bases = []
        for j in range(tune.rt):
            bases += [f"let oc{j} = min(o0 + {j}u, last);", f"let wr{2 * j} = gp.wb0 + oc{j} * items;",
                      f"let wr{2 * j + 1} = gp.wb1 + oc{j} * items;"]  # fmt: skip
    else:
        bases = [f"let wr{k} = wrow(min(o0 + {k}u, last));" for k in range(nw)]
    bases += [f"let xb{r} = {r}u * items;" for r in range(nx)]
    decl = [f"var a{k}_{r} = 0.0;" for k in range(nw) for r in range(nx)]
    accs = [(f"a{k}_{r}") for k in range(nw) for r in range(nx)]
    if norm:  # and per x row the sum of its squares (every team sums them in the same order: the same bits)
        decl += [f"var s{r} = 0.0;" for r in range(nx)]
        accs += [f"s{r}" for r in range(nx)]
    # a row's sum as stored: with the norm, times its rstd = 1 / sqrt(mean(x²) + eps)
    acc = (lambda k, r: f"(a{k}_{r} * rs{r})") if norm else (lambda k, r: f"a{k}_{r}")
    rstd = [f"let rs{r} = 1.0 / sqrt(s{r} / f32(gp.n_in) + gp.eps);" for r in range(nx)] if norm else []

    # the stores of lane 0: per output row of the team's turn (swiglu: gate and up of it), per x row
    stores = []
    for j in range(tune.rt):
        inner = []
        for r in range(nx):
            g, up = acc(2 * j, r), acc(2 * j + 1, r)
            v = f"{g} * sigmoid({g}) * {up}" if swiglu else acc(j, r)
            inner.append(f"store(o0 + {j}u, {r}u, {v});")
        stores.append(f"if (o0 + {j}u <= last) {{ " + " ".join(inner) + " }")
    if sub:
        red = [f"{a} = team_sum({a}, T);" for a in accs]
        red += ["if (lane == 0u) {"] + ["    " + s for s in rstd + stores] + ["}"]
    else:  # every accumulator's tree at once, one barrier per level
        red = [f"part[{q}u * WG + li] = {a};" for q, a in enumerate(accs)]
        red += ["workgroupBarrier();", "for (var m = TEAM >> 1u; m > 0u; m >>= 1u) {", "    if (lane < m) {"]
        red += [f"        part[{q}u * WG + li] += part[{q}u * WG + li + m];" for q in range(len(accs))]
        red += ["    }", "    workgroupBarrier();", "}", "if (lane == 0u) {"]
        red += [f"    {a} = part[{q}u * WG + li];" for q, a in enumerate(accs)]
        red += ["    " + s for s in rstd + stores] + [
            "}",
            "workgroupBarrier();  // part is rewritten by the next turn",
        ]

    if swiglu:
        store = "    let at = gp.yo0 + r * gp.ld0 + o;\n    gy0[at] = select(0.0, gy0[at], gp.acc == 1u) + v;"
    else:
        cases = " ".join(
            f"case {b}u: {{ gy{b}[at] = select(0.0, gy{b}[at], gp.acc == 1u) + v; }}" for b in range(n_y)
        )
        store = (
            "    let s = seg(o);\n"
            "    let yb = select(select(select(gp.yb0, gp.yb1, s >= 1u), gp.yb2, s >= 2u), gp.yb3, s >= 3u);\n"
            "    let yo = select(select(select(gp.yo0, gp.yo1, s >= 1u), gp.yo2, s >= 2u), gp.yo3, s >= 3u);\n"
            "    let ld = select(select(select(gp.ld0, gp.ld1, s >= 1u), gp.ld2, s >= 2u), gp.ld3, s >= 3u);\n"
            "    let at = yo + r * ld + (o - seg_start(s));\n"
            f"    switch yb {{ {cases} default: {{}} }}"
        )
    if sub:
        teamsum = (
            "// a row's lane sums -> its sum in every lane: a butterfly over the subgroup, the same order everywhere\n"
            "fn team_sum(v: f32, T: u32) -> f32 {\n    var s = v;\n"
            "    for (var m = T >> 1u; m > 0u; m >>= 1u) { s += subgroupShuffleXor(s, m); }\n    return s;\n}\n"
        )
        builtins = (
            ",\n        @builtin(subgroup_invocation_id) lane: u32, @builtin(subgroup_size) T: u32,"
            "\n        @builtin(subgroup_id) team: u32, @builtin(num_subgroups) nteams: u32"
        )
        teams = "    // a team is a subgroup: lane, T (its size), team and nteams come from the builtins"
        rowloop, rr = "for (var rs = team * RT; rs < ROWS; rs += nteams * RT)", "rs"
    else:
        teamsum, builtins = "", ""
        teams = "    let T = TEAM;\n    let lane = li % TEAM;\n    let team = li / TEAM;\n    let nteams = WG / TEAM;"
        # the same number of turns for every team (rows is a multiple of nteams·RT): barriers stay uniform
        rowloop, rr = "for (var rs = 0u; rs < ROWS / (nteams * RT); rs++)", "(rs * nteams + team) * RT"
    return {
        "RT": tune.rt,
        "UNROLL": tune.unroll,
        "XA": xa,
        "WV": wv,
        "BINDINGS": "\n".join(lines),
        "UBIND": y0 + n_y,
        "PART": len(accs) * tune.wg if not sub else 1,
        "WROW": "    let s = seg(o);\n    return seg_w(s) + (o - seg_start(s)) * gp.items;",
        "STORE": store,
        "TEAMSUM": teamsum,
        "BUILTINS": builtins,
        "TEAMS": teams,
        "ROWLOOP": rowloop,
        "RR": rr,
        "ROWBASES": "\n".join(" " * 8 + s for s in bases),
        "DECL": "\n".join(" " * 8 + s for s in decl),
        "BODY_UNROLLED": body(tune.unroll, ind),
        "BODY_ONE": body(1, ind),
        "REDUCE_STORE": "\n".join(" " * 8 + s for s in red),
    }


def row_items(w_dtype: str, in_features: int, tune: GemvTune) -> int:
    """Vector loads per weight row of 16-byte-aligned operands (what `fit_tune`'s `items` is)."""
    per = 8 if w_dtype == "f16" and tune.f16_vec == 8 and in_features % 8 == 0 else 4
    return in_features // per if in_features % 4 == 0 else in_features


def _form(w_dtype: str, in_features: int, x, weights, tune: GemvTune) -> str:
    if w_dtype == "f16":
        if in_features % 4 or view(x)[1] % 16:
            raise ValueError(
                f"gemv: f16 weights need in_features % 4 == 0 and x 16-byte aligned, got {in_features}"
            )
        return "f16x8" if tune.f16_vec == 8 and in_features % 8 == 0 else "f16x4"
    if w_dtype != "f32":
        raise ValueError(f"gemv: weights must be f32 or f16, got {w_dtype!r}")
    vec = in_features % 4 == 0 and all(view(r)[1] % 16 == 0 for r in (x, *weights))
    return "f32x4" if vec else "f32x1"


def _kernel(gpu: Gpu, form: str, nx: int, tune: GemvTune, swiglu: bool, n_y: int, norm: bool = False):
    sig = "r" * (3 if swiglu else 2) + "r" * norm + "w" * n_y + "u"
    return gpu.kernel(FILE, "gemv", sig, constants={"WG": tune.wg, "ROWS": tune.rows, "TEAM": tune.team},
                      templates=_templates(form, nx, tune, swiglu, n_y, norm), workgroup=(tune.wg, 1, 1),
                      uniforms=(PARAMS,))  # fmt: skip


@dataclass(frozen=True)
class Norm:
    """An RMSNorm fused into a product's input read (`gemv_stacked`, `gemv_swiglu`): the product reads the
    raw x and computes y = rstd · Σ_i W[o, i] · (w_i + offset) · x_i, rstd = 1 / sqrt(mean(x²) + eps), so the
    normalised row is never written. `w` the norm weight (in_features f32), `style` "standard" (w·x̂) or
    "offset" ((1 + w)·x̂), as `ops.rmsnorm`'s."""

    w: object
    eps: float
    style: str = "standard"

    def fields(self, in_features: int) -> dict:
        if self.style not in ("standard", "offset"):
            raise ValueError(f"gemv norm style must be 'standard' or 'offset', got {self.style!r}")
        return {"n_in": in_features, "eps": float(self.eps), "noff": float(self.style == "offset")}


NO_NORM = {"n_in": 0, "eps": 0.0, "noff": 0.0}


# ---------------------------------------------------------------------------------------------------------
# launchers


@dataclass(frozen=True)
class Segment:
    """One product of `gemv_stacked`: y[r, col0 + o] (+)= x[r] · w[o] for o < rows; ldy floats per row of y
    (default rows)."""

    y: object
    w: object
    rows: int
    ldy: int | None = None
    col0: int = 0


def gemv(gpu: Gpu, y, x, w, n: int, out_features: int, in_features: int, w_dtype: str = "f32", ldy: int | None = None,
         col0: int = 0, accumulate: bool = False, tune: GemvTune | None = None, norm: Norm | None = None) -> Call:  # fmt: skip
    """y[r, col0 + o] (+)= Σ_i x[r, i] · w[o, i] for r < n; w (OUT, IN) f32 or f16 (read as u32 pairs); `norm`:
    of RMSNorm(x) (`Norm`)."""
    seg = Segment(y, w, out_features, ldy, col0)
    return gemv_stacked(gpu, x, [seg], n, in_features, w_dtype, accumulate, tune, norm)


def _span(views: list[tuple], limit: int) -> tuple | None:
    """The one binding covering `views` (buffer, lo, bytes), or None when they lie in several buffers or
    the span exceeds `limit`."""
    if len({id(v[0]) for v in views}) != 1:
        return None
    lo = min(v[1] for v in views)
    hi = max(v[1] + v[2] for v in views)
    return (views[0][0], lo, -(-(hi - lo) // 4) * 4) if hi - lo <= limit else None


def gemv_stacked(gpu: Gpu, x, segments: list[Segment], n: int, in_features: int, w_dtype: str = "f32",
                 accumulate: bool = False, tune: GemvTune | None = None, norm: Norm | None = None) -> Call:  # fmt: skip
    """Each segment's product over the same x (module docstring): one dispatch when their weights lie in
    one buffer within one storage binding, else one per segment; `norm`: of RMSNorm(x) (`Norm`)."""
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"gemv_stacked: 1..{MAX_SEGMENTS} segments, got {len(segments)}")
    if not 1 <= n <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv: 1..{GEMV_MAX_ROWS} rows of x, got {n}")
    tune = tune or default_tune(gpu)
    wviews = [view(s.w) for s in segments]
    form = _form(w_dtype, in_features, x, wviews + ([view(norm.w)] if norm else []), tune)
    _, _, per_item, item_bytes = FORMS[form]
    items = in_features // per_item
    tune = fit_tune(gpu, tune, n, False, sum(s.rows for s in segments), norm is not None, items)
    span = _span(wviews, gpu.max_binding)
    if span is None and len(segments) > 1:
        call = Call()
        for s in segments:
            call += gemv_stacked(gpu, x, [s], n, in_features, w_dtype, accumulate, tune, norm)
        return call
    need("gemv", "x", x, n * in_features)
    if norm is not None:
        need("gemv", "norm weight", norm.w, in_features)
    wbytes = (2 if w_dtype == "f16" else 4) * in_features
    fields, ybinds, ykeys, row = {}, [], [], 0
    for s_i, s in enumerate(segments):
        ldy = s.rows if s.ldy is None else int(s.ldy)
        need("gemv", f"y{s_i}", s.y, (n - 1) * ldy + s.col0 + s.rows)
        need("gemv", f"w{s_i}", s.w, s.rows * wbytes // 4)
        yv = view(s.y)
        if id(yv[0]) not in ykeys:  # one binding per output buffer, spanning its segments' views
            ykeys.append(id(yv[0]))
            same = [view(t.y) for t in segments if view(t.y)[0] is yv[0]]
            ybinds.append(_span(same, gpu.max_binding) or yv)
        b = ykeys.index(id(yv[0]))
        if view(ybinds[b])[1] > yv[1] or (yv[1] - view(ybinds[b])[1]) % 4:
            raise ValueError("gemv_stacked: an output view outside its binding")  # the span failed
        fields.update({f"wb{s_i}": (wviews[s_i][1] - span[1]) // item_bytes, f"yb{s_i}": b, f"ld{s_i}": ldy,
                       f"yo{s_i}": (yv[1] - view(ybinds[b])[1]) // 4 + s.col0})  # fmt: skip
        if s_i:
            fields[f"st{s_i}"] = row
        if (wviews[s_i][1] - span[1]) % item_bytes:
            raise ValueError(f"gemv: weight view {s_i} is not aligned to the {item_bytes}-byte item")
        row += s.rows
    for s_i in range(len(segments), MAX_SEGMENTS):
        fields.update({f"wb{s_i}": 0, f"yb{s_i}": 0, f"yo{s_i}": 0, f"ld{s_i}": 0})
        if s_i:
            fields[f"st{s_i}"] = NONE
    k = _kernel(gpu, form, n, tune, False, len(ybinds), norm is not None)
    fields.update(norm.fields(in_features) if norm else NO_NORM)
    u = gpu.uniform(PARAMS, label="gemv", out_=row, items=items, acc=int(accumulate), **fields)
    label = f"gemv{'_norm' if norm else ''} {'+'.join(str(s.rows) for s in segments)}x{in_features} {w_dtype} n{n} wbytes={row * wbytes}"
    gn = [norm.w] if norm else []
    return Call([(k, gpu.bind(k, x, span, *gn, *ybinds, u, label=label), grid(-(-row // tune.rows)))], [u])


def gemv_swiglu(gpu: Gpu, y, x, w_gate, w_up, n: int, F: int, in_features: int, w_dtype: str = "f32",
                tune: GemvTune | None = None, norm: Norm | None = None) -> Call:  # fmt: skip
    """y (n, F) = silu(x · W_gateᵀ) ⊙ (x · W_upᵀ), both (F, IN), in one dispatch (the MLP's first half);
    `norm`: of RMSNorm(x) (`Norm`)."""
    if not 1 <= n <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv: 1..{GEMV_MAX_ROWS} rows of x, got {n}")
    tune = tune or default_tune(gpu)
    form = _form(w_dtype, in_features, x, [view(w_gate), view(w_up)] + ([view(norm.w)] if norm else []), tune)
    items = in_features // FORMS[form][2]
    tune = fit_tune(gpu, tune, n, True, F, norm is not None, items)
    wbytes = (2 if w_dtype == "f16" else 4) * in_features
    need("gemv_swiglu", "x", x, n * in_features)
    need("gemv_swiglu", "y", y, n * F)
    need("gemv_swiglu", "w_gate", w_gate, F * wbytes // 4)
    need("gemv_swiglu", "w_up", w_up, F * wbytes // 4)
    fields = {f"{f}{s}": 0 for f in ("wb", "yb", "yo", "ld") for s in range(MAX_SEGMENTS)}
    fields.update(ld0=F, st1=NONE, st2=NONE, st3=NONE)
    if norm is not None:
        need("gemv_swiglu", "norm weight", norm.w, in_features)
    fields.update(norm.fields(in_features) if norm else NO_NORM)
    k = _kernel(gpu, form, n, tune, True, 1, norm is not None)
    u = gpu.uniform(PARAMS, label="gemv_swiglu", out_=F, items=items, acc=0, **fields)
    label = f"gemv_swiglu{'_norm' if norm else ''} 2x{F}x{in_features} {w_dtype} n{n} wbytes={2 * F * wbytes}"
    gn = [norm.w] if norm else []
    return Call([(k, gpu.bind(k, x, w_gate, w_up, *gn, y, u, label=label), grid(-(-F // tune.rows)))], [u])
