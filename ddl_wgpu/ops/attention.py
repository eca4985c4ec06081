"""Causal grouped-query attention launchers (`shaders/attention.wgsl`), forward above backward.

Kernel path: `shaders/attention.wgsl` -> `ddl_wgpu/ops/attention.py` -> reference
`ddl_ref.ops.attention_forward`, `ddl_ref.ops.attention_backward`, `ddl_ref.ops.attention_masked_forward`,
`ddl_ref.ops.attention_masked_backward` -> test `tests/test_kernel_attention.py` (the masked kernels:
`tests/test_chain_attention.py`).

Shapes: q (B,T,H,D), k and v (B,T,K,D), out (B,T,H,D), lse and delta (B,H,T); H % K == 0 and kv head j serves
q heads [j*H/K, (j+1)*H/K). The scale defaults to D**-0.5 and travels in the uniform.

The WGSL is a template: D, the tile shape of each kernel (R rows x TR columns of threads, the first of
`_TILES` whose shared tiles fit the adapter's workgroup storage), and the straight-line per-thread code
(vec4 accumulators, register prefetch, row loaders) are filled in here: one module per D and tile choice.
"""

from __future__ import annotations

import os

from ddl_wgpu.ops import attention_scores
from ddl_wgpu.ops import need_all as _need
from ddl_wgpu.runtime.gpu import Call, GpuError, Uniform

FILE = "attention.wgsl"
# Which causal-attention implementation `attention_forward` / `attention_backward` run: "flash" (this file's
# kernels: no T x T storage), "scores" (GEMMs over materialised scores, `attention_scores.py`), or "auto":
# scores on GPUs whenever one kv head's scores fit the scratch limit (H200, T = 1024: fwd + bwd several
# times faster), flash on CPU adapters (lavapipe) and for sequences too long for the scratch.
ENV_IMPL = "DDL_WGPU_ATTENTION"
IMPLS = ("auto", "flash", "scores")
PARAMS = Uniform("Params", ("B", "u32"), ("T", "u32"), ("H", "u32"), ("KH", "u32"), ("scale", "f32"))
MAX_D = 256

# (R, TR) candidates, best first: R rows x TR columns of threads per workgroup (TR a multiple of 4: the
# score tiles are read as vec4).
# Per key tile a workgroup pays a fixed cost (tile load, four barriers), so more rows per workgroup is faster:
# on the H200 (32, 8) beat (16, 16) by 10-25% and (4, 16) by 4x (2026-11-30).
_TILES = ((32, 8), (16, 16), (16, 8), (8, 16), (8, 8), (4, 16), (4, 8), (2, 8), (1, 8), (2, 4), (1, 4))


def _vec4s(D: int) -> tuple[int, int]:
    """(D4, SD4): vec4s per padded row, and the odd row stride of the shared tiles in vec4s."""
    d4 = -(-D // 4)
    return d4, d4 | 1


def _floats(kernel: str, D: int, R: int, TR: int) -> int:
    """Workgroup storage of one kernel's shared tiles, in f32 (mirrors the `var<workgroup>` declarations)."""
    _, sd4 = _vec4s(D)
    col_tiles = 4 * 2 * (TR * sd4 + TR)  # k/v tiles (forward, dq) or q/dout tiles (dkdv)
    if kernel == "fw":
        return 4 * R * sd4 + col_tiles + 2 * R * TR
    if kernel == "dq":
        return 4 * 2 * R * sd4 + col_tiles + R * TR
    return 4 * 2 * R * sd4 + col_tiles + 2 * R * TR + 2 * TR  # dkdv


def tile_config(D: int, storage_bytes: int, max_threads: int = 256) -> dict:
    """{'fw'|'dq'|'kv': (R, TR)}: the first candidate tile of each kernel that fits `storage_bytes`."""
    cfg = {}
    for kernel in ("fw", "dq", "kv"):
        for rows, cols in _TILES:
            if rows * cols <= max_threads and 4 * _floats(kernel, D, rows, cols) <= storage_bytes:
                cfg[kernel] = (rows, cols)
                break
        else:
            raise GpuError(f"attention: head_dim {D} does not fit {storage_bytes} bytes of workgroup storage")
    return cfg


def _store(u: int, TR: int, stmt: str) -> str:
    """Write the 4 channels 4c..4c+3 of accumulator column c = x + u*TR that lie below D; `stmt` is a format
    with {k} (channel offset) and {w} (component)."""
    body = " ".join(f"if (c + {k}u < D) {{ {stmt.format(k=k, w='xyzw'[k])} }}" for k in range(4))
    return f"{{ let c = 4u * (x + {u * TR}u); {body} }}"


def _loader(name: str, D: int) -> str:
    """WGSL `ld_<name>(base, c)`: vec4 column c of the row starting at float `base`, zero-filled past D."""
    head = f"fn ld_{name}(base: u32, c: u32) -> vec4<f32> {{"
    if D % 4 == 0:  # the binding is array<vec4<f32>> and rows start on a vec4
        return f"{head} return {name}[base / 4u + c]; }}"
    tail = " ".join(f"if (d + {k}u < D) {{ v.{'yzw'[k - 1]} = {name}[i + {k}u]; }}" for k in (1, 2, 3))
    return f"{head} let d = 4u * c; let i = base + d; var v = vec4<f32>({name}[i], 0.0, 0.0, 0.0); {tail} return v; }}"


def _prefetch(kn: str, R: int, TR: int, d4: int, arrays: list, base: str, first: str) -> tuple[str, str, str]:
    """Straight-line register prefetch of one column tile (TR rows of D4 vec4s, spread over the R*TR threads):
    FETCH loads it from global memory into variables, STASH writes them to the shared tiles; DECL declares
    them. `arrays` = [(variable prefix, binding, shared tile)], `base` the WGSL float offset of row `first`
    + e / D4."""
    wg, n_per = R * TR, -(-(TR * d4) // (R * TR))
    fetch, stash, decl = [], [], []
    for n in range(n_per):
        full = (n + 1) * wg <= TR * d4  # every thread's element exists: no guard needed
        inb = "" if full else f"e < {kn}_TR * D4 && "
        zero = " ".join(f"{v}{n} = vec4<f32>(0.0);" for v, _, _ in arrays)
        loads = " ".join(f"{v}{n} = ld_{g}(base, e % D4);" for v, g, _ in arrays)
        fetch.append(
            f"{{ let e = lid + {n}u * {kn}_WG; {zero} "
            f"if ({inb}{first} + e / D4 < T) {{ let base = {base}; {loads} }} }}"
        )
        stores = " ".join(f"{sh}[(e / D4) * SD4 + e % D4] = {v}{n};" for v, _, sh in arrays)
        stash.append(
            f"{{ let e = lid + {n}u * {kn}_WG; "
            + (stores if full else f"if (e < {kn}_TR * D4) {{ {stores} }}")
            + " }"
        )
        decl.append(" ".join(f"var {v}{n} = vec4<f32>(0.0);" for v, _, _ in arrays))
    return " ".join(fetch), " ".join(stash), " ".join(decl)


def _templates(gpu, D: int) -> tuple[dict, dict]:
    """Template values for `attention.wgsl` at head_dim D, and the tile config they encode. Thread column x
    owns the vec4 columns x + u*TR, u < ceil(D4/TR), each accumulated in its own variable (straight-line)."""
    if not 1 <= D <= MAX_D:
        raise GpuError(f"attention: head_dim {D} out of range 1..{MAX_D}")
    limit = int(gpu.limits.get("max-compute-workgroup-storage-size", 16384))
    threads = int(gpu.limits.get("max-compute-invocations-per-workgroup", 256))
    cfg = tile_config(D, limit, min(threads, 256))
    d4, sd4 = _vec4s(D)
    t = {"D": D, "D4": d4, "SD4": sd4, "VT": "vec4<f32>" if D % 4 == 0 else "f32"}
    # every q/k/v/dout binding of the three tiled kernels gets a loader (one per binding: WGSL cannot pass them)
    bindings = ["fw_q", "fw_k", "fw_v", "dq_q", "dq_dout", "dq_k", "dq_v", "kv_k", "kv_v", "kv_q", "kv_dout"]
    t["LOADERS"] = "\n".join(_loader(n, D) for n in bindings)

    def update(acc: str, coef: str, tile: str, base: str, u: int, TR: int) -> str:
        # acc_u += coef.x * tile[row 0] + ... + coef.w * tile[row 3], rows SD4 apart
        rows = ("", " + SD4", " + 2u * SD4", " + 3u * SD4")
        return " ".join(
            f"{acc}{u} += {coef}.{'xyzw'[k]} * {tile}[{base}{rows[k]} + {u * TR}u];" for k in range(4)
        )

    def kv_tiles(kn: str) -> tuple[int, int, int, str, str, str]:
        # the forward and dq kernels stream the same key/value tiles: (R, TR, accumulators, fetch, stash, decl)
        R, TR = cfg[kn.lower()]
        p = kn.lower()
        fetch, stash, decl = _prefetch(
            kn, R, TR, d4, [("pk", f"{p}_k", f"{p}_ks"), ("pv", f"{p}_v", f"{p}_vs")],
            "((b * T + sn + e / D4) * KH + kh) * D", "sn",
        )  # fmt: skip
        return R, TR, -(-d4 // TR), fetch, stash, decl

    R, TR, nc, fetch, stash, pdecl = kv_tiles("FW")
    t |= {
        "FW_R": R,
        "FW_TR": TR,
        "FW_FETCH": fetch,
        "FW_STASH": stash,
        "FW_DECL": pdecl + " " + " ".join(f"var a{u} = vec4<f32>(0.0);" for u in range(nc)),
        "FW_SCALE": " ".join(f"a{u} *= alpha;" for u in range(nc)),
        "FW_UPDATE": " ".join(update("a", "p4", "fw_vs", "v0", u, TR) for u in range(nc)),
        "FW_STORE": " ".join(
            _store(u, TR, f"fw_out[obase + c + {{k}}u] = a{u}.{{w}} * inv;") for u in range(nc)
        ),
    }
    R, TR, nc, fetch, stash, pdecl = kv_tiles("DQ")
    t |= {
        "DQ_R": R,
        "DQ_TR": TR,
        "DQ_FETCH": fetch,
        "DQ_STASH": stash,
        "DQ_DECL": pdecl + " " + " ".join(f"var a{u} = vec4<f32>(0.0);" for u in range(nc)),
        "DQ_UPDATE": " ".join(update("a", "d4", "dq_ks", "k0", u, TR) for u in range(nc)),
        "DQ_STORE": " ".join(
            _store(u, TR, f"dq_dq[obase + c + {{k}}u] = a{u}.{{w}} * sc;") for u in range(nc)
        ),
    }
    R, TR = cfg["kv"]
    nc = -(-d4 // TR)
    fetch, stash, pdecl = _prefetch(
        "KV",
        R,
        TR,
        d4,
        [("pq", "kv_q", "kv_qs"), ("po", "kv_dout", "kv_os")],
        "((b * T + tn + e / D4) * H + hn) * D",
        "tn",
    )
    # the query tile's lse and delta travel with it
    fetch += (
        " if (lid < KV_TR) { ln = 0.0; en = 0.0; if (tn + lid < T) {"
        " ln = kv_lse[(b * H + hn) * T + tn + lid]; en = kv_delta[(b * H + hn) * T + tn + lid]; } }"
    )
    t |= {
        "KV_R": R,
        "KV_TR": TR,
        "KV_FETCH": fetch,
        "KV_STASH": stash,
        "KV_DECL": pdecl
        + " "
        + " ".join(f"var ak{u} = vec4<f32>(0.0); var av{u} = vec4<f32>(0.0);" for u in range(nc)),
        "KV_UPDATE": " ".join(
            update("ak", "d4", "kv_qs", "q0", u, TR) + " " + update("av", "p4", "kv_os", "q0", u, TR)
            for u in range(nc)
        ),
        "KV_STORE": " ".join(
            _store(
                u,
                TR,
                f"kv_dk[obase + c + {{k}}u] = ak{u}.{{w}} * sc; kv_dv[obase + c + {{k}}u] = av{u}.{{w}};",
            )
            for u in range(nc)
        ),
    }
    return t, cfg


def _check(B: int, T: int, H: int, K: int, D: int):
    if min(B, T, H, K) < 1 or H % K:
        raise GpuError(f"attention: bad sizes B={B} T={T} H={H} K={K} (need H % K == 0)")


def _check_bindings(entry: str, B: int, T: int, H: int, K: int, D: int, **named) -> None:
    """Every binding holds what the shapes need: attention.wgsl is built without naga's index clamps
    (`shader_files.TRUSTED_FILES`), so a short buffer would be read out of bounds. Names: q/out/dq/dout (B,T,H,D),
    k/v/dk/dv (B,T,K,D), lse/delta (B,H,T)."""
    per = {"q": H * D, "out": H * D, "dq": H * D, "dout": H * D, "k": K * D, "v": K * D, "dk": K * D,
           "dv": K * D, "lse": H, "delta": H}  # fmt: skip
    _need(entry, **{name: (res, B * T * per[name]) for name, res in named.items()})


def choose_impl(gpu, H: int, K: int, T: int, impl: str | None = None, masked: bool = False) -> str:
    """'flash' or 'scores' for one attention shape: `impl`, else env DDL_WGPU_ATTENTION, else 'auto'. The
    scores path runs whole heads where one kv head's scores fit the scratch (`attention_scores.fits`), else
    blocks of query rows (`attention_scores.row_block`). For the causal attention 'auto' picks it on GPUs
    where whole heads fit, else the flash kernels. For the chain-masked attention 'flash' means its
    plain-loop kernels, and 'auto' picks the scores path on every adapter whenever it can run, in row blocks
    if need be (the loops are slow everywhere; on lavapipe their dk/dv also came out wrong at W = 80, D = 128
    with grouped heads, a result no other adapter was checked for)."""
    impl = impl or os.environ.get(ENV_IMPL) or "auto"
    if impl not in IMPLS:
        raise GpuError(f"attention: implementation {impl!r} is not one of {', '.join(IMPLS)}")
    if impl == "auto":
        if masked:
            return "scores" if attention_scores.fits_rows(gpu, H, K, T) else "flash"
        fits = attention_scores.fits(gpu, H, K, T)
        return "scores" if fits and gpu.info.get("type", "") != "CPU" else "flash"
    if impl == "scores" and not attention_scores.fits_rows(gpu, H, K, T):
        raise GpuError(
            f"attention: the scores of {H // K} query head(s) ({T} floats per row) exceed the scratch limit"
        )
    return impl


def attention_forward(
    gpu, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, scale=None, impl: str | None = None
) -> Call:  # fmt: skip
    """out (B,T,H,D) and lse (B,H,T) from q (B,T,H,D), k, v (B,T,K,D); causal; scale defaults to D**-0.5.
    `impl`: see `choose_impl`."""
    _check(B, T, H, K, D)
    _check_bindings("attention_forward", B, T, H, K, D, out=out, lse=lse, q=q, k=k, v=v)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    chosen = choose_impl(gpu, H, K, T, impl)
    if chosen == "scores":
        return attention_scores.forward(gpu, out, lse, q, k, v, B, T, H, K, D, scale)
    templates, cfg = _templates(gpu, D)
    R, TR = cfg["fw"]
    kern = gpu.kernel(
        FILE, "attention_forward", "rrrwwu", templates=templates, uniforms=UNIFORMS, workgroup=(R * TR, 1, 1)
    )
    u = gpu.uniform(PARAMS, B=B, T=T, H=H, KH=K, scale=scale)
    groups = B * H * (-(-T // R))
    return Call([(kern, gpu.bind(kern, q, k, v, out, lse, u), groups)], [u])


def attention_backward(
    gpu, dq, dk, dv, dout, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, scratch=None, scale=None,
    impl: str | None = None,
) -> Call:  # fmt: skip
    """dq (B,T,H,D), dk, dv (B,T,K,D) from dout, the forward's out and lse, and q, k, v. First delta =
    rowsum(dout * out) into `scratch` (B*H*T floats, allocated here when None); then, flash: dq per query
    block and dk, dv per key block; scores: `attention_scores.backward`. Deterministic; outputs are overwritten. `impl`: see
    `choose_impl`."""
    _check(B, T, H, K, D)
    delta = gpu.buffer(B * H * T * 4, label="attention delta") if scratch is None else scratch
    _check_bindings("attention_backward", B, T, H, K, D, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse, q=q,
                    k=k, v=v, delta=delta)  # fmt: skip
    templates, cfg = _templates(gpu, D)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    u = gpu.uniform(PARAMS, B=B, T=T, H=H, KH=K, scale=scale)
    # the Call keeps a delta it allocated alive along with its uniform
    keep = [u] if scratch is not None else [u, delta]

    kd = gpu.kernel(FILE, "attention_backward_delta", "rrwu", templates=templates, uniforms=UNIFORMS)
    delta_pass = (kd, gpu.bind(kd, dout, out, delta, u), -(-(B * T * H) // 64))
    chosen = choose_impl(gpu, H, K, T, impl)
    if chosen == "scores":
        grads = attention_scores.backward(gpu, dq, dk, dv, dout, lse, delta, q, k, v, B, T, H, K, D, scale)
        return Call([delta_pass], keep) + grads
    R, TR = cfg["dq"]
    kq = gpu.kernel(
        FILE,
        "attention_backward_dq",
        "rrrrrrwu",
        templates=templates,
        uniforms=UNIFORMS,
        workgroup=(R * TR, 1, 1),
    )
    Rk, TRk = cfg["kv"]
    kk = gpu.kernel(
        FILE,
        "attention_backward_dkdv",
        "rrrrrrwwu",
        templates=templates,
        uniforms=UNIFORMS,
        workgroup=(Rk * TRk, 1, 1),
    )
    dispatches = [
        delta_pass,
        (kq, gpu.bind(kq, q, k, v, dout, lse, delta, dq, u), B * H * (-(-T // R))),
        (kk, gpu.bind(kk, q, k, v, dout, lse, delta, dk, dv, u), B * K * (-(-T // Rk))),
    ]
    return Call(dispatches, keep)


# ----------------------------------------------------------------------------------------------------------
# masked attention of the chained draft's stacked rows (`ddl_ref.ops.chain_mask`,
# docs/heal.md#chain-attention-per-step-or-stacked)

MPARAMS = Uniform(
    "MParams",
    ("B", "u32"),
    ("T", "u32", "stacked rows"),
    ("H", "u32"),
    ("KH", "u32"),
    ("scale", "f32"),
    ("W", "u32", "the window"),
    ("pad0", "pad"),
    ("pad1", "pad"),
)
UNIFORMS = (PARAMS, MPARAMS)  # both structs of attention.wgsl, for every entry point's module


def _check_chain(T: int, W: int):
    if W < 1 or T % W:
        raise GpuError(f"attention: {T} stacked rows are not whole windows of {W}")


def attention_masked_forward(gpu, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, W: int,
                             scale=None, impl: str | None = None, rows=None) -> Call:  # fmt: skip
    """`attention_forward` over T = chain·W stacked rows (row (σ−1)·W + p) with the chain mask instead of
    the causal one: the scores path with the mask (`attention_scores`), or plain loops, one thread per
    (b, row, head) ('flash', and where the scores do not fit). `impl`: see `choose_impl`. `rows` = (lo, hi):
    only query rows [lo, hi) of each batch are wanted; out and lse of the other rows are unspecified (the
    scores path leaves them, the loops compute them)."""
    _check(B, T, H, K, D)
    _check_chain(T, W)
    _check_bindings("attention_masked_forward", B, T, H, K, D, out=out, lse=lse, q=q, k=k, v=v)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    if choose_impl(gpu, H, K, T, impl, masked=True) == "scores":
        return attention_scores.forward(gpu, out, lse, q, k, v, B, T, H, K, D, scale, W=W, rows=rows)
    templates, _cfg = _templates(gpu, D)
    kern = gpu.kernel(FILE, "attention_masked_forward", "rrrwwu", templates=templates, uniforms=UNIFORMS)
    u = gpu.uniform(MPARAMS, B=B, T=T, H=H, KH=K, scale=scale, W=W)
    return Call([(kern, gpu.bind(kern, q, k, v, out, lse, u), -(-(B * T * H) // 64))], [u])


def attention_masked_backward(gpu, dq, dk, dv, dout, out, lse, q, k, v, B: int, T: int, H: int, K: int,
                              D: int, W: int, scratch=None, scale=None, impl: str | None = None,
                              rows=None) -> Call:  # fmt: skip
    """Backward of `attention_masked_forward`: delta (`attention_backward_delta`), then the scores path's
    backward with the mask, or the loops: dq per query row, then dk and dv per key row. Deterministic;
    outputs are overwritten. `rows` = (lo, hi), as in the forward: the caller holds dout = 0 outside those
    rows, so dk and dv are the same with or without it (the scores path only visits the rows in range and
    writes zeros past hi); dq outside the range is unspecified."""
    _check(B, T, H, K, D)
    _check_chain(T, W)
    delta = gpu.buffer(B * H * T * 4, label="attention delta") if scratch is None else scratch
    _check_bindings("attention_masked_backward", B, T, H, K, D, dq=dq, dk=dk, dv=dv, dout=dout, out=out, lse=lse,
                    q=q, k=k, v=v, delta=delta)  # fmt: skip
    templates, _cfg = _templates(gpu, D)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    u = gpu.uniform(PARAMS, B=B, T=T, H=H, KH=K, scale=scale)
    um = gpu.uniform(MPARAMS, B=B, T=T, H=H, KH=K, scale=scale, W=W)
    keep = [u, um] if scratch is not None else [u, um, delta]
    kd = gpu.kernel(FILE, "attention_backward_delta", "rrwu", templates=templates, uniforms=UNIFORMS)
    delta_pass = (kd, gpu.bind(kd, dout, out, delta, u), -(-(B * T * H) // 64))
    if choose_impl(gpu, H, K, T, impl, masked=True) == "scores":
        grads = attention_scores.backward(
            gpu, dq, dk, dv, dout, lse, delta, q, k, v, B, T, H, K, D, scale, W=W, rows=rows
        )
        return Call([delta_pass], keep) + grads
    kq = gpu.kernel(FILE, "attention_masked_backward_dq", "rrrrrrwu", templates=templates, uniforms=UNIFORMS)
    kk = gpu.kernel(
        FILE, "attention_masked_backward_dkdv", "rrrrrrwwu", templates=templates, uniforms=UNIFORMS
    )
    dispatches = [
        delta_pass,
        (kq, gpu.bind(kq, q, k, v, dout, lse, delta, dq, um), -(-(B * T * H) // 64)),
        (kk, gpu.bind(kk, q, k, v, dout, lse, delta, dk, dv, um), -(-(B * T * K) // 64)),
    ]
    return Call(dispatches, keep)
