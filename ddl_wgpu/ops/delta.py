"""Launchers for `shaders/delta.wgsl`: the Deep Delta residual update of one sublayer
(docs/model.md#deep-delta-learning).

Kernel path: `shaders/delta.wgsl` -> `ddl_wgpu/ops/delta.py` -> reference `ddl_ref.delta.delta_forward`,
`ddl_ref.delta.delta_backward` -> test `tests/test_kernel_delta.py`.

Rows r = b*T + t (N = B*T rows). The state X is (rows, C, dv) row-major (d_v = 1 is X of shape (rows, C, 1)),
u (the sublayer output k̃), c (the normalized context, β input) and x_v (the v input) are (rows, C).
Parameters: w_beta (C,), b_beta (1,), W_v (dv, C), b_v (dv,).

The forward saves per row `stats` (rows, STATS) with STATS = stats_size(dv) = 2 + 2*dv:

    stats[r, STAT_N]                    n = sqrt(|u|^2 + eps^2)
    stats[r, STAT_BETA]                 beta = 2 sigmoid(w_beta . c + b_beta)
    stats[r, STAT_V : STAT_V + dv]      v = s sigmoid(W_v x_v + b_v)
    stats[r, stat_p(dv) : + dv]         p = X^T k  (p starts at STAT_V + dv)

read by the backward and by the spectral diagnostics (k = u / n, δ = v - p, γ = β δ).

The forward is one dispatch where the adapter binds 10 storage buffers per stage (`fused_forward`), else two
(`delta_heads` then `delta_update`, at most 8 each); the backward is two (`delta_backward_rows`, then
`delta_backward_inputs` for dc and dx_v), a split that costs no extra traffic (the second pass reads only
da, dz and the small weights). Each row kernel keeps
its row in registers (`rmsnorm.row_layout`: TPR threads per row, IPT items each, straight-line per-item
code) and moves vec4<f32> items when d_v = 1 and C % 4 == 0. Memory traffic with x_v = X (the engine's
d_v = 1 call): forward reads X, u, c and writes X_new (4 rows·C floats; the two-pass form also re-reads X as
x_v); backward reads G, X, u and writes dX, du, dc, dx_v (7; 9 when dc and dx_v accumulate). Parameter
gradients are plain GEMMs through `ops.matmul` (deterministic: each output summed by one thread in a fixed
order).

What it does not do: mixed precision, the MLP β head (`ddl_beta_single_linear=False`), or d_v > 4.
"""

from __future__ import annotations

from ddl_wgpu.ops import need_all as _need
from ddl_wgpu.ops import view
from ddl_wgpu.ops.elementwise import templates as _item_templates
from ddl_wgpu.ops.elementwise import vec_width
from ddl_wgpu.ops.matmul import matmul
from ddl_wgpu.ops.rmsnorm import row_layout, unroll
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError, Uniform

FILE = "delta.wgsl"
PARAMS = Uniform(
    "Params",
    ("rows", "u32"),
    ("C", "u32", "channels (not items of F)"),
    ("eps2", "f32", "k_eps^2"),
    ("v_scale", "f32", "s"),
    ("accumulate_dc", "u32", "delta_backward_inputs: 1 adds into dc, 0 overwrites it"),
    ("accumulate_dx_v", "u32", "delta_backward_inputs: 1 adds into dx_v"),
    ("_pad0", "pad"),
    ("_pad1", "pad"),
)
MAX_DV = 4
WG = 256  # threads per workgroup, as in the shader
FUSED_FORWARD_BUFFERS = 10  # storage buffers the one-pass forward binds
KSUM_KW = 8  # channels per ksum workgroup, as in the shader

# the per-row stats layout
STAT_N = 0
STAT_BETA = 1
STAT_V = 2


def stats_size(dv: int) -> int:
    """Floats per row of `stats`: [n, beta, v_0..v_{dv-1}, p_0..p_{dv-1}]."""
    return 2 + 2 * int(dv)


def stat_p(dv: int) -> int:
    """Offset of p = X^T k within a row of `stats`."""
    return STAT_V + int(dv)


def _check_dv(entry: str, dv: int):
    if not 1 <= int(dv) <= MAX_DV:
        raise ValueError(f"{entry}: dv={dv} must be in 1..{MAX_DV}")


def _dv_run(name: str, store: bool) -> str:
    """A loader (ld4_) or storer (st4_) of the DV consecutive floats of an f32 binding from index i, as a
    vec4 (unused components 0)."""
    comps = range(1, MAX_DV)
    if store:
        body = f"{name}[i] = v.x;" + "".join(
            f" if (DV > {j}u) {{ {name}[i + {j}u] = v.{'xyzw'[j]}; }}" for j in comps
        )
        return f"fn st4_{name}(i: u32, v: vec4<f32>) {{ {body} }}"
    body = "".join(f" if (DV > {j}u) {{ x.{'xyzw'[j]} = {name}[i + {j}u]; }}" for j in comps)
    return f"fn ld4_{name}(i: u32) -> vec4<f32> {{ var x = vec4<f32>({name}[i], 0.0, 0.0, 0.0);{body} return x; }}"


def _loaders(width: int) -> str:
    """The LOADERS template: per-binding access to XT items (ld_/st_ at item index e), to W_v^T items
    (ldw_ at channel item c of a (DV, C) matrix) and to runs of DV floats (ld4_/st4_)."""
    out = [_dv_run(n, False) for n in ("fw_b_v", "hd_b_v", "up_stats", "br_stats", "bi_dz")]
    out += [_dv_run(n, True) for n in ("fw_stats", "hd_stats", "up_stats", "br_dz")]
    x_in, x_out, w = (
        ("fw_X", "up_X", "br_G", "br_X"),
        ("fw_X_new", "up_X_new", "br_dX"),
        ("fw_W_v", "hd_W_v", "bi_W_v"),
    )
    if width == 4:  # d_v = 1: an XT item is an F item
        out += [f"fn ld_{n}(e: u32) -> XT {{ return {n}[e]; }}" for n in x_in]
        out += [f"fn st_{n}(e: u32, v: XT) {{ {n}[e] = v; }}" for n in x_out]
        out += [f"fn ldw_{n}(c: u32, C: u32) -> XT {{ return {n}[c]; }}" for n in w]
    else:  # f32 arrays: channel e's DV values start at e * DV; W_v's rows are C apart
        out += [_dv_run(n, False) + f"\nfn ld_{n}(e: u32) -> XT {{ return ld4_{n}(e * DV); }}" for n in x_in]
        out += [_dv_run(n, True) + f"\nfn st_{n}(e: u32, v: XT) {{ st4_{n}(e * DV, v); }}" for n in x_out]
        for n in w:
            body = "".join(
                f" if (DV > {j}u) {{ x.{'xyzw'[j]} = {n}[{j}u * C + c]; }}" for j in range(1, MAX_DV)
            )
            out.append(
                f"fn ldw_{n}(c: u32, C: u32) -> XT {{ var x = vec4<f32>({n}[c], 0.0, 0.0, 0.0);{body} return x; }}"
            )
    return "\n".join(out)


def _templates(width: int, ipt: int, xv_is_x: bool = False) -> dict:
    """Template values of delta.wgsl for items of `width` (4: vec4, d_v = 1) and `ipt` items per thread;
    `xv_is_x`: the one-pass forward takes x_v from X's registers (x_v is X, d_v = 1)."""
    t = dict(_item_templates(width))
    if width == 4:
        t |= {"XT": "F", "XDOT": "return vec4<f32>(hsum(k * x), 0.0, 0.0, 0.0);", "XDOTV": "return x * v.x;",
              "XAXPY": "return x + k * g.x;"}  # fmt: skip
    else:
        t |= {
            "XT": "vec4<f32>",
            "XDOT": "return k * x;",
            "XDOTV": "return dot(x, v);",
            "XAXPY": "return x + k * g;",
        }
    t["LOADERS"] = _loaders(width)
    item = "let c# = lane + #u * TPR; let ok# = ok && c# < CI;"
    xv = ("x#" if width == 4 else "x#.x") if xv_is_x else "fw_x_v[base + c#]"
    t["FF_LOAD"] = unroll(
        ipt,
        f"{item} var u# = F(0.0); var x# = XT(0.0); var cc# = F(0.0); var xv# = F(0.0); var wb# = F(0.0); "
        "var wv# = XT(0.0); if (ok#) { u# = fw_u[base + c#]; x# = ld_fw_X(base + c#); cc# = fw_c[base + c#]; "
        f"xv# = {xv}; wb# = fw_w_beta[c#]; wv# = ldw_fw_W_v(c#, C); }}",
    )
    t["FF_A"] = unroll(ipt, "wb# * cc#", " + ")
    t["FF_UU"] = unroll(ipt, "u# * u#", " + ")
    t["FF_Z"] = unroll(ipt, "xdot(xv#, wv#)", " + ")
    t["FF_UX"] = unroll(ipt, "xdot(u#, x#)", " + ")
    t["FF_STORE"] = unroll(ipt, "if (c# < CI) { st_fw_X_new(base + c#, xaxpy(x#, u# / n, gamma)); }")
    t["HD_LOAD"] = unroll(
        ipt,
        f"{item} var cc# = F(0.0); var xv# = F(0.0); var wb# = F(0.0); var wv# = XT(0.0); if (ok#) {{ "
        "cc# = hd_c[base + c#]; xv# = hd_x_v[base + c#]; wb# = hd_w_beta[c#]; wv# = ldw_hd_W_v(c#, C); }",
    )
    t["HD_A"] = unroll(ipt, "wb# * cc#", " + ")
    t["HD_Z"] = unroll(ipt, "xdot(xv#, wv#)", " + ")
    t["UP_LOAD"] = unroll(
        ipt,
        f"{item} var u# = F(0.0); var x# = XT(0.0); if (ok#) {{ u# = up_u[base + c#]; x# = ld_up_X(base + c#); }}",
    )
    t["UP_UU"] = unroll(ipt, "u# * u#", " + ")
    t["UP_UX"] = unroll(ipt, "xdot(u#, x#)", " + ")
    t["UP_STORE"] = unroll(ipt, "if (c# < CI) { st_up_X_new(base + c#, xaxpy(x#, u# / n, gamma)); }")
    t["BR_LOAD"] = unroll(
        ipt,
        f"{item} var u# = F(0.0); var g# = XT(0.0); var x# = XT(0.0); if (ok#) {{ u# = br_u[base + c#]; "
        "g# = ld_br_G(base + c#); x# = ld_br_X(base + c#); }",
    )
    t["BR_Q"] = unroll(ipt, "xdot(u#, g#)", " + ")
    t["BR_STORE"] = unroll(
        ipt,
        "if (c# < CI) { let k# = u# / n; let dk# = beta * (xdotv(g#, delta) - xdotv(x#, q)); "
        "br_du[base + c#] = (dk# - k# * kdk) / n; st_br_dX(base + c#, xaxpy(g#, k#, -bq)); }",
    )
    t["BI_STORE"] = unroll(
        ipt,
        "let c# = lane + #u * TPR; if (c# < CI) { var dc# = da * bi_w_beta[c#]; "
        "var dxv# = xdotv(ldw_bi_W_v(c#, C), dz); if (acc_dc) { dc# += bi_dc[base + c#]; } "
        "if (acc_dxv) { dxv# += bi_dx_v[base + c#]; } bi_dc[base + c#] = dc#; bi_dx_v[base + c#] = dxv#; }",
    )
    return t


def _width(C: int, dv: int, *row_bindings) -> int:
    """4 (vec4 items) when d_v = 1 and every (rows, C)-shaped binding can move as vec4, else 1."""
    return vec_width(C, *row_bindings) if int(dv) == 1 else 1


def _kernel(gpu: Gpu, entry: str, sig: str, C: int, dv: int, width: int, xv_is_x: bool = False):
    """The kernel and its rows per workgroup."""
    tpr, ipt = row_layout(int(C) // width)
    k = gpu.kernel(
        FILE,
        entry,
        sig,
        {"TPR": tpr, "DV": int(dv)},
        _templates(width, ipt, xv_is_x),
        (WG, 1, 1),
        uniforms=(PARAMS,),
    )
    return k, WG // tpr


def fused_forward(gpu: Gpu) -> bool:
    """Whether the adapter binds the one-pass forward's 10 storage buffers in one shader stage."""
    return int(gpu.limits.get("max-storage-buffers-per-shader-stage", 8)) >= FUSED_FORWARD_BUFFERS


def delta_forward(
    gpu: Gpu, X_new, stats, X, u, c, x_v, w_beta, b_beta, W_v, b_v, rows: int, C: int, dv: int,
    k_eps: float, v_scale: float, fused: bool | None = None,
) -> Call:  # fmt: skip
    """X_new (rows, C, dv) = X + k (β (v - Xᵀk))ᵀ; stats (rows, STATS) as in the module docstring.
    X_new must be a different buffer from X; x_v may be X (d_v = 1), which the one-pass form reads once.
    `fused`: one pass (True), two (False), or one where the adapter allows (None, `fused_forward`)."""
    rows, C, dv = int(rows), int(C), int(dv)
    _check_dv("delta_forward", dv)
    S = stats_size(dv)
    _need("delta_forward", X_new=(X_new, rows * C * dv), stats=(stats, rows * S), X=(X, rows * C * dv),
          u=(u, rows * C), c=(c, rows * C), x_v=(x_v, rows * C), w_beta=(w_beta, C), b_beta=(b_beta, 1),
          W_v=(W_v, dv * C), b_v=(b_v, dv))  # fmt: skip
    p = gpu.uniform(PARAMS, rows=rows, C=C, eps2=float(k_eps) ** 2, v_scale=v_scale, accumulate_dc=0, accumulate_dx_v=0,
                    label="delta_forward")  # fmt: skip
    width = _width(C, dv, X_new, X, u, c, x_v, w_beta, W_v)
    if fused and not fused_forward(gpu):
        raise GpuError(
            f"delta_forward: the one-pass form binds {FUSED_FORWARD_BUFFERS} storage buffers, this device allows "
            f"{gpu.limits.get('max-storage-buffers-per-shader-stage', 8)}; use fused=False or None"
        )
    if fused_forward(gpu) if fused is None else fused:
        xv_is_x = dv == 1 and view(x_v) == view(X)
        k, rpw = _kernel(gpu, "delta_forward", "rrrrrrrrwwu", C, dv, width, xv_is_x)
        bg = gpu.bind(k, X, u, c, x_v, w_beta, b_beta, W_v, b_v, X_new, stats, p)
        return Call([(k, bg, -(-rows // rpw))], [p])
    kh, rpw = _kernel(gpu, "delta_heads", "rrrrrrwu", C, dv, width)
    ku, _ = _kernel(gpu, "delta_update", "rrwwu", C, dv, width)
    return Call(
        [
            (kh, gpu.bind(kh, c, x_v, w_beta, b_beta, W_v, b_v, stats, p), -(-rows // rpw)),
            (ku, gpu.bind(ku, X, u, X_new, stats, p), -(-rows // rpw)),
        ],
        [p],
    )


def delta_backward(
    gpu: Gpu, dX, du, da, dz, dc, dx_v, G, X, u, stats, w_beta, W_v, rows: int, C: int, dv: int,
    v_scale: float, accumulate_dc: bool = True, accumulate_dx_v: bool = True,
) -> Call:  # fmt: skip
    """From G = dL/dX_new (rows, C, dv), with q = Gᵀk:

    dX (rows, C, dv) = G - β k qᵀ                     du (rows, C) = (dk - k (k·dk)) / n, dk = β (G δ - X q)
    da (rows,) = (δ·q) β (1 - β/2)  (dL/d beta logit)  dz (rows, dv) = β q ⊙ v (1 - v/s)  (dL/d v logits)
    dc (rows, C) (+)= da w_β                           dx_v (rows, C) (+)= dz W_v

    dX, du, da, dz are overwritten; dc and dx_v accumulate by default. All buffers distinct (G and dX too).
    Feed da and dz to `delta_param_grads`.
    """
    rows, C, dv = int(rows), int(C), int(dv)
    _check_dv("delta_backward", dv)
    _need("delta_backward", dX=(dX, rows * C * dv), du=(du, rows * C), da=(da, rows), dz=(dz, rows * dv),
          dc=(dc, rows * C), dx_v=(dx_v, rows * C), G=(G, rows * C * dv), X=(X, rows * C * dv), u=(u, rows * C),
          stats=(stats, rows * stats_size(dv)), w_beta=(w_beta, C), W_v=(W_v, dv * C))  # fmt: skip
    p = gpu.uniform(PARAMS, rows=rows, C=C, eps2=0.0, v_scale=v_scale, accumulate_dc=int(bool(accumulate_dc)),
                    accumulate_dx_v=int(bool(accumulate_dx_v)), label="delta_backward")  # fmt: skip
    width = _width(C, dv, dX, du, dc, dx_v, G, X, u, w_beta, W_v)
    kr, rpw = _kernel(gpu, "delta_backward_rows", "rrrrwwwwu", C, dv, width)
    ki, _ = _kernel(gpu, "delta_backward_inputs", "rrrrwwu", C, dv, width)
    return Call(
        [
            (kr, gpu.bind(kr, G, X, u, stats, dX, du, da, dz, p), -(-rows // rpw)),
            (ki, gpu.bind(ki, da, dz, w_beta, W_v, dc, dx_v, p), -(-rows // rpw)),
        ],
        [p],
    )


def delta_param_grads(
    gpu: Gpu, dw_beta, db_beta, dW_v, db_v, da, dz, c, x_v, ones, rows: int, C: int, dv: int
) -> Call:
    """Accumulate (+=) the head parameters' gradients, summed over rows, as GEMMs:
    dw_β (1, C) += daᵀ c,  db_β (1,) += daᵀ 1,  dW_v (dv, C) += dzᵀ x_v,  db_v (dv,) += dzᵀ 1.
    `ones` is a (rows,) buffer of 1.0 the caller provides (shared by every Delta layer)."""
    rows, C, dv = int(rows), int(C), int(dv)
    _need("delta_param_grads", ones=(ones, rows), da=(da, rows), dz=(dz, rows * dv), c=(c, rows * C),
          x_v=(x_v, rows * C))  # fmt: skip
    call = matmul(gpu, dw_beta, da, c, 1, C, rows, trans_a=True, accumulate=True)
    call += matmul(gpu, db_beta, da, ones, 1, 1, rows, trans_a=True, accumulate=True)
    call += matmul(gpu, dW_v, dz, x_v, dv, C, rows, trans_a=True, accumulate=True)
    call += matmul(gpu, db_v, dz, ones, dv, 1, rows, trans_a=True, accumulate=True)
    return call


def ksum(gpu: Gpu, out, u, stats, weights, rows: int, C: int, dv: int) -> Call:
    """out (C,) = sum_r weights[r] u[r, :] / n_r = sum_r weights[r] k_r (the spectral k-coherence numerator;
    weights (rows,) is typically the real-token mask). Deterministic: a fixed row order per lane and a
    fixed tree over the lanes."""
    rows, C, dv = int(rows), int(C), int(dv)
    _check_dv("ksum", dv)
    _need("ksum", out=(out, C), u=(u, rows * C), stats=(stats, rows * stats_size(dv)), weights=(weights, rows))  # fmt: skip
    p = gpu.uniform(
        PARAMS, rows=rows, C=C, eps2=0.0, v_scale=0.0, accumulate_dc=0, accumulate_dx_v=0, label="delta_ksum"
    )
    k, _ = _kernel(gpu, "delta_ksum", "rrrwu", C, dv, 1)
    return Call([(k, gpu.bind(k, u, stats, weights, out, p), -(-C // KSUM_KW))], [p])
