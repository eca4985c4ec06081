"""Causal grouped-query attention launchers (`shaders/attention.wgsl`), forward above backward.

Shapes: q (B,T,H,D), k and v (B,T,K,D), out (B,T,H,D), lse and delta (B,H,T); H % K == 0 and kv head j serves
q heads [j*H/K, (j+1)*H/K). The scale defaults to D**-0.5 and travels in the uniform.

The WGSL is a template: D, the tile shape of each kernel (R rows x TR columns of threads) and the per-thread
accumulator code (ceil(D/TR) scalars, straight-line) are filled in here, so one module is compiled per D.
Tile shapes are picked so each kernel's workgroup storage fits the adapter's limit.
"""

from __future__ import annotations

from ddl_wgpu.gpu import Call, GpuError

FILE = "attention.wgsl"
PARAMS = "uuuuf"  # B, T, H, KH, scale
MAX_D = 256

# (R, TR) candidates, best first: R rows x TR columns of threads per workgroup.
_TILES = ((16, 16), (8, 16), (4, 16), (8, 8), (4, 8), (2, 8), (1, 8), (2, 4), (1, 4), (1, 2), (1, 1))


def _stride(D: int) -> int:
    return D + 1 if D % 2 == 0 else D


def _floats(kernel: str, D: int, R: int, TR: int) -> int:
    """Workgroup storage of one kernel's shared tiles, in f32 (mirrors the `var<workgroup>` declarations)."""
    SD = _stride(D)
    col_tiles = 2 * (TR * SD + TR)  # k/v tiles (forward, dq) or q/dout tiles (dkdv)
    if kernel == "fw":
        return R * SD + col_tiles + 2 * R * TR
    if kernel == "dq":
        return 2 * R * SD + col_tiles + R * TR
    return 2 * R * SD + col_tiles + 2 * R * TR + 2 * TR  # dkdv


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


def _templates(gpu, D: int) -> tuple[dict, dict]:
    """Template values for `attention.wgsl` at head_dim D, and the tile config they encode."""
    if not 1 <= D <= MAX_D:
        raise GpuError(f"attention: head_dim {D} out of range 1..{MAX_D}")
    limit = int(gpu.limits.get("max-compute-workgroup-storage-size", 16384))
    threads = int(gpu.limits.get("max-compute-invocations-per-workgroup", 256))
    cfg = tile_config(D, limit, min(threads, 256))
    t = {"D": D, "SD": _stride(D)}

    def guard(u, TR, stmt):
        return stmt if (u + 1) * TR <= D else f"if (x + {u * TR}u < D) {{ {stmt} }}"

    R, TR = cfg["fw"]
    nc = -(-D // TR)
    t |= {
        "FW_R": R,
        "FW_TR": TR,
        "FW_DECL": " ".join(f"var a{u} = 0.0;" for u in range(nc)),
        "FW_SCALE": " ".join(f"a{u} *= alpha;" for u in range(nc)),
        "FW_UPDATE": " ".join(f"a{u} += pj * fw_vs[vrow + {u * TR}u];" for u in range(nc)),
        "FW_STORE": " ".join(guard(u, TR, f"fw_out[obase + {u * TR}u] = a{u} * inv;") for u in range(nc)),
    }
    R, TR = cfg["dq"]
    nc = -(-D // TR)
    t |= {
        "DQ_R": R,
        "DQ_TR": TR,
        "DQ_DECL": " ".join(f"var a{u} = 0.0;" for u in range(nc)),
        "DQ_UPDATE": " ".join(f"a{u} += dsj * dq_ks[krow + {u * TR}u];" for u in range(nc)),
        "DQ_STORE": " ".join(guard(u, TR, f"dq_dq[obase + {u * TR}u] = a{u} * sc;") for u in range(nc)),
    }
    R, TR = cfg["kv"]
    nc = -(-D // TR)
    t |= {
        "KV_R": R,
        "KV_TR": TR,
        "KV_DECL": " ".join(f"var ak{u} = 0.0; var av{u} = 0.0;" for u in range(nc)),
        "KV_UPDATE": " ".join(
            f"ak{u} += dsj * kv_qs[qrow + {u * TR}u]; av{u} += pj * kv_os[qrow + {u * TR}u];"
            for u in range(nc)
        ),
        "KV_STORE": " ".join(
            guard(u, TR, f"kv_dk[obase + {u * TR}u] = ak{u} * sc; kv_dv[obase + {u * TR}u] = av{u};")
            for u in range(nc)
        ),
    }
    return t, cfg


def _check(B: int, T: int, H: int, K: int, D: int):
    if min(B, T, H, K) < 1 or H % K:
        raise GpuError(f"attention: bad sizes B={B} T={T} H={H} K={K} (need H % K == 0)")


def attention_forward(gpu, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, scale=None) -> Call:
    """out (B,T,H,D) and lse (B,H,T) from q (B,T,H,D), k, v (B,T,K,D); causal; scale defaults to D**-0.5."""
    _check(B, T, H, K, D)
    templates, cfg = _templates(gpu, D)
    R, TR = cfg["fw"]
    kern = gpu.kernel(FILE, "attention_forward", "rrrwwu", templates=templates, workgroup=(R * TR, 1, 1))
    scale = float(D) ** -0.5 if scale is None else float(scale)
    u = gpu.uniform(PARAMS, B, T, H, K, scale)
    groups = B * H * (-(-T // R))
    return Call([(kern, gpu.bind(kern, q, k, v, out, lse, u), groups)], [u])


def attention_backward(
    gpu, dq, dk, dv, dout, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, scratch=None, scale=None
) -> Call:
    """dq (B,T,H,D), dk, dv (B,T,K,D) from dout, the forward's out and lse, and q, k, v. Three passes:
    delta = rowsum(dout * out) into `scratch` (B*H*T floats, allocated here when None), then dq per query
    block, then dk and dv per key block. Deterministic; outputs are overwritten."""
    _check(B, T, H, K, D)
    templates, cfg = _templates(gpu, D)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    u = gpu.uniform(PARAMS, B, T, H, K, scale)
    delta = gpu.buffer(B * H * T * 4, label="attention delta") if scratch is None else scratch

    kd = gpu.kernel(FILE, "attention_backward_delta", "rrwu", templates=templates)
    R, TR = cfg["dq"]
    kq = gpu.kernel(FILE, "attention_backward_dq", "rrrrrrwu", templates=templates, workgroup=(R * TR, 1, 1))
    Rk, TRk = cfg["kv"]
    kk = gpu.kernel(
        FILE, "attention_backward_dkdv", "rrrrrrwwu", templates=templates, workgroup=(Rk * TRk, 1, 1)
    )
    dispatches = [
        (kd, gpu.bind(kd, dout, out, delta, u), -(-(B * T * H) // 64)),
        (kq, gpu.bind(kq, q, k, v, dout, lse, delta, dq, u), B * H * (-(-T // R))),
        (kk, gpu.bind(kk, q, k, v, dout, lse, delta, dk, dv, u), B * K * (-(-T // Rk))),
    ]
    # the Call keeps a delta it allocated alive along with its uniform
    return Call(dispatches, [u] if scratch is not None else [u, delta])
