"""Fused causal grouped-query attention with GEMM-style register tiles (`shaders/attention_fused.wgsl`).

Kernel path: `shaders/attention_fused.wgsl` -> `ddl_wgpu/ops/attention_fused.py` -> reference
`ddl_ref.ops.attention_forward` (the backward consumes its lse: `ddl_ref.ops.attention_backward`) -> test
`tests/test_kernel_attention_fused.py`.

Shapes as in `attention.py`: q (B,T,H,D), k and v (B,T,K,D), out (B,T,H,D), lse (B,H,T); H % K == 0. Reached
through `attention.attention_forward(..., impl="fused")` or DDL_WGPU_ATTENTION=fused; the backward of that
choice runs on the scores path (GPUs) or the flash kernels (CPU adapters), which read the same lse.

The WGSL is a template: D, the tile (`Tile`) and the straight-line per-thread code (score and output
accumulators, the softmax of each owned row, the P and V products) are generated here, one module per D and
tile. `TILES` lists the candidates best first; the launcher takes the first whose shared memory fits the
adapter's workgroup storage (48 KiB on NVIDIA, 32 KiB on lavapipe, 16 KiB under DDL_WGPU_LIMITS=webgpu).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddl_wgpu.gpu import Call, GpuError, Uniform
from ddl_wgpu.ops import need_all as _need

FILE = "attention_fused.wgsl"
PARAMS = Uniform("Params", ("B", "u32"), ("T", "u32"), ("H", "u32"), ("KH", "u32"), ("scale", "f32"))
MAX_D = 256


@dataclass(frozen=True)
class Tile:
    """BQ query rows x BK keys per step, WY x WX threads (each TM = BQ/WY rows x TN = BK/WX keys of S, and
    TM rows x the channel groups tx + WX*u of O); DK channels of Q and K, BJ keys of V staged at a time."""

    bq: int
    bk: int
    wy: int
    wx: int
    dk: int
    bj: int

    @property
    def tm(self) -> int:
        return self.bq // self.wy

    @property
    def tn(self) -> int:
        return self.bk // self.wx

    def valid(self) -> bool:
        return (
            self.bq == self.wy * self.tm
            and self.bk == self.wx * self.tn
            and self.tm % 4 == 0
            and self.tn % 4 == 0
            and self.bk % self.bj == 0
            and self.dk >= 1
        )

    def sv(self, D: int) -> int:
        """vec4s per staged V row: the O channel groups of all WX threads (zero past D)."""
        d4 = -(-D // 4)
        return self.wx * -(-d4 // self.wx)

    def stage_vec4s(self, D: int) -> int:
        return max(self.dk * (self.bq // 4 + 1 + self.bk // 4 + 1), self.bj * self.sv(D))

    def shared_bytes(self, D: int) -> int:
        """Workgroup storage (mirrors the `var<workgroup>` declarations)."""
        return 16 * (self.stage_vec4s(D) + self.bk * (self.bq // 4 + 1)) + 4 * self.bq * self.wx

    def label(self) -> str:
        return f"q{self.bq}k{self.bk}t{self.wy}x{self.wx}d{self.dk}j{self.bj}"


# Candidates, best first (a guess until the H200 sweep, bench/attention_sweep.py, orders them).
TILES = (
    Tile(64, 64, 16, 16, 32, 32),
    Tile(64, 64, 8, 16, 32, 32),
    Tile(64, 64, 16, 16, 16, 16),
    Tile(64, 32, 16, 8, 32, 32),
    Tile(128, 32, 16, 8, 16, 16),
    Tile(32, 64, 8, 16, 16, 16),
    Tile(32, 32, 8, 8, 16, 16),
    Tile(32, 32, 8, 8, 16, 8),
    Tile(16, 16, 4, 4, 16, 8),
    Tile(16, 16, 4, 4, 8, 4),
)


def fitting_tiles(gpu, D: int) -> list[Tile]:
    """The candidates this adapter can run at head_dim D (workgroup storage and invocations)."""
    limit = int(gpu.limits.get("max-compute-workgroup-storage-size", 16384))
    threads = int(gpu.limits.get("max-compute-invocations-per-workgroup", 256))
    return [t for t in TILES if t.wy * t.wx <= threads and t.shared_bytes(D) <= limit]


def choose_tile(gpu, D: int, tile: Tile | None = None) -> Tile:
    if not 1 <= D <= MAX_D:
        raise GpuError(f"attention_fused: head_dim {D} out of range 1..{MAX_D}")
    if tile is not None:
        limit = int(gpu.limits.get("max-compute-workgroup-storage-size", 16384))
        if not tile.valid() or tile.shared_bytes(D) > limit:
            raise GpuError(
                f"attention_fused: tile {tile} is not valid or does not fit {limit} bytes at D {D}"
            )
        return tile
    fit = fitting_tiles(gpu, D)
    if not fit:
        raise GpuError(f"attention_fused: no tile fits this adapter at head_dim {D}")
    return fit[0]


def _templates(D: int, t: Tile) -> dict:
    """The kernel's constants and straight-line code for head_dim D and tile t."""
    tm, nb, na = t.tm, t.tn // 4, t.tm // 4
    nu = t.sv(D) // t.wx
    rows = range(tm)
    cols = range(nb)
    chans = range(nu)

    def qi(r: int) -> str:  # the tile row of thread row r: 4 * (ty + WY * (r / 4)) + r % 4
        return f"4u * (ty + {t.wy * (r // 4)}u) + {r % 4}u"

    decl = [f"    let qi{r} = q0 + {qi(r)}; var m{r} = NEG; var l{r} = 0.0;" for r in rows]
    decl += [f"    var s{r}_{b} = vec4<f32>(0.0);" for r in rows for b in cols]
    decl += [f"    var o{r}_{u} = vec4<f32>(0.0);" for r in rows for u in chans]

    s_step = [f"let qa{a} = stage[d * SQ + ty + {t.wy * a}u];" for a in range(na)]
    s_step += [f"let kb{b} = stage[KOFF + d * SK + tx + {t.wx * b}u];" for b in cols]
    s_step += [f"s{r}_{b} += qa{r // 4}.{'xyzw'[r % 4]} * kb{b};" for r in rows for b in cols]

    mask = [
        f"let kj{b} = vec4<u32>(k0 + 4u * (tx + {t.wx * b}u)) + vec4<u32>(0u, 1u, 2u, 3u); "
        f"let kin{b} = kj{b} < vec4<u32>(fp.T);"
        for b in cols
    ]
    for r in rows:
        mask += [
            f"s{r}_{b} = select(vec4<f32>(NEG), s{r}_{b} * c2, kin{b} & (kj{b} <= vec4<u32>(qi{r})));"
            for b in cols
        ]
        mx = f"max4(s{r}_0)"
        for b in range(1, nb):
            mx = f"max({mx}, max4(s{r}_{b}))"
        mask.append(f"red[(qi{r} - q0) * WX + tx] = {mx};")

    soft = []
    for r in rows:
        sm = " + ".join(f"sum4(s{r}_{b})" for b in cols)
        soft.append(
            f"{{ let row = (qi{r} - q0) * WX; var mx = red[row]; "
            f"for (var x = 1u; x < WX; x++) {{ mx = max(mx, red[row + x]); }} "
            f"let mn = max(m{r}, mx); let al = exp2(m{r} - mn); m{r} = mn; "
            + " ".join(f"s{r}_{b} = exp2(s{r}_{b} - vec4<f32>(mn));" for b in cols)
            + f" l{r} = l{r} * al + ({sm}); "
            + " ".join(f"o{r}_{u} *= al;" for u in chans)
            + " }"
        )
    for a in range(na):
        for b in cols:
            for e, w in enumerate("xyzw"):
                vals = ", ".join(f"s{4 * a + i}_{b}.{w}" for i in range(4))
                soft.append(
                    f"ps[(4u * (tx + {t.wx * b}u) + {e}u) * SP + ty + {t.wy * a}u] = vec4<f32>({vals});"
                )

    pv = [f"let pa{a} = ps[(j0 + j) * SP + ty + {t.wy * a}u];" for a in range(na)]
    pv += [f"let vb{u} = stage[j * SV + tx + {t.wx * u}u];" for u in chans]
    pv += [f"o{r}_{u} += pa{r // 4}.{'xyzw'[r % 4]} * vb{u};" for r in rows for u in chans]

    store = []
    for r in rows:
        puts = []
        for u in chans:
            puts += [
                f"if (c{u} + {k}u < D) {{ fout[ob + c{u} + {k}u] = o{r}_{u}.{'xyzw'[k]} * inv; }}"
                for k in range(4)
            ]
        store.append(
            f"    {{ let row = (qi{r} - q0) * WX; var ls = red[row]; "
            f"for (var x = 1u; x < WX; x++) {{ ls += red[row + x]; }} "
            f"if (qi{r} < fp.T) {{ let inv = 1.0 / ls; let ob = qbase + qi{r} * fp.H * D; "
            + " ".join(f"let c{u} = 4u * (tx + {t.wx * u}u);" for u in chans)
            + " "
            + " ".join(puts)
            + f" if (tx == 0u) {{ flse[bh * fp.T + qi{r}] = (m{r} + log2(ls)) * LN2; }} }} }}"
        )

    def block(lines: list[str], indent: int) -> str:
        return "\n".join(" " * indent + line for line in lines)

    return {
        "D": D,
        "WX": t.wx,
        "WY": t.wy,
        "BQ": t.bq,
        "BK": t.bk,
        "DK": t.dk,
        "BJ": t.bj,
        "SV": t.sv(D),
        "STAGE": t.stage_vec4s(D),
        "DECL": "\n".join(decl),
        "S_ZERO": block([f"s{r}_{b} = vec4<f32>(0.0);" for r in rows for b in cols], 8),
        "S_STEP": block(s_step, 16),
        "S_MASK": block(mask, 8),
        "S_SOFTMAX": block(soft, 8),
        "PV_STEP": block(pv, 20),
        "L_PUT": block([f"red[(qi{r} - q0) * WX + tx] = l{r};" for r in rows], 4),
        "STORE": "\n".join(store),
    }


def attention_fused_forward(
    gpu, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, scale=None, tile: Tile | None = None
) -> Call:
    """out (B,T,H,D) and lse (B,H,T) from q (B,T,H,D), k, v (B,T,K,D); causal; scale defaults to D**-0.5.
    `tile`: a `Tile` to use instead of the first of `TILES` that fits."""
    if min(B, T, H, K) < 1 or H % K:
        raise GpuError(f"attention_fused: bad sizes B={B} T={T} H={H} K={K} (need H % K == 0)")
    t = choose_tile(gpu, D, tile)
    _need("attention_fused_forward", out=(out, B * T * H * D), lse=(lse, B * H * T), q=(q, B * T * H * D),
          k=(k, B * T * K * D), v=(v, B * T * K * D))  # fmt: skip
    scale = float(D) ** -0.5 if scale is None else float(scale)
    kern = gpu.kernel(FILE, "attention_fused_forward", "rrrwwu", templates=_templates(D, t), uniforms=(PARAMS,),
                      workgroup=(t.wy * t.wx, 1, 1))  # fmt: skip
    u = gpu.uniform(PARAMS, B=B, T=T, H=H, KH=K, scale=scale)
    groups = B * H * (-(-T // t.bq))
    return Call([(kern, gpu.bind(kern, q, k, v, out, lse, u), groups)], [u])
