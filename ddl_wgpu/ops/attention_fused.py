"""Fused causal grouped-query attention with GEMM-style register tiles (`shaders/attention_fused.wgsl`).

Kernel path: `shaders/attention_fused.wgsl` -> `ddl_wgpu/ops/attention_fused.py` -> reference
`ddl_ref.ops.attention_forward`, `ddl_ref.ops.attention_backward` -> test `tests/test_kernel_attention_fused.py`.

Shapes as in `attention.py`: q (B,T,H,D), k and v (B,T,K,D), out (B,T,H,D), lse and delta (B,H,T); H % K == 0.
Reached through `attention.attention_forward/backward(..., impl="fused")` or DDL_WGPU_ATTENTION=fused (the
backward's delta = rowsum(dout * out) comes from `attention.wgsl`'s delta pass there).

The WGSL is a template: D, the tile (`Tile`, shared by the three kernels) and the straight-line per-thread
code (score and output accumulators, the softmax of each owned row, the products through shared memory, the
helpers that stage each binding) are generated here, one module per D and tile. `FORWARD_TILES` and
`BACKWARD_TILES` order the candidates (`TILES`) best first; a launcher takes the first whose shared memory
fits the adapter's workgroup storage (48 KiB on NVIDIA, 32 KiB on lavapipe, 16 KiB under
DDL_WGPU_LIMITS=webgpu).
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
    unroll: int = 1  # inner steps (channels or rows) generated per loop trip

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
            and self.dk % self.unroll == 0
            and self.bj % self.unroll == 0
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
        return f"q{self.bq}k{self.bk}t{self.wy}x{self.wx}d{self.dk}j{self.bj}" + (
            f"u{self.unroll}" if self.unroll > 1 else ""
        )


# Candidates, best first, in the order the H200 sweep measured them at B 16, T 1024, 6 x 128 heads
# (`bench/attention_sweep.py`, BENCHMARKS.md): 16 x 16 threads of 4 x 4 scores led both passes (forward 1.33 ms
# unrolled by 8, 1.34 not; backward 4.40 either way); 8 x 16 threads of 8 x 4 ran the forward in 1.39-1.50 ms.
# Tiles the sweep never reached keep their first guessed order.
FORWARD_TILES = (
    Tile(64, 64, 16, 16, 32, 32, 8),
    Tile(64, 64, 16, 16, 32, 32),
    Tile(64, 64, 8, 16, 32, 32, 8),
    Tile(64, 64, 8, 16, 32, 32),
    Tile(64, 64, 8, 16, 16, 16),
    Tile(64, 64, 16, 16, 16, 16),
    Tile(128, 32, 16, 8, 16, 16),
    Tile(64, 32, 16, 8, 32, 32),
    Tile(32, 64, 8, 16, 16, 16),
    Tile(32, 32, 8, 8, 16, 16),
    Tile(32, 32, 8, 8, 16, 8),
    Tile(16, 16, 4, 4, 16, 8),
    Tile(16, 16, 4, 4, 8, 4, 2),
)
BACKWARD_TILES = (
    Tile(64, 64, 16, 16, 32, 32),
    Tile(64, 64, 16, 16, 32, 32, 8),
    Tile(64, 64, 16, 16, 16, 16),
    Tile(64, 32, 16, 8, 32, 32),
    Tile(32, 64, 8, 16, 16, 16),
    Tile(64, 64, 8, 16, 32, 32),
    Tile(64, 64, 8, 16, 32, 32, 8),
    Tile(64, 64, 8, 16, 16, 16),
    Tile(128, 32, 16, 8, 16, 16),
    Tile(32, 32, 8, 8, 16, 16),
    Tile(32, 32, 8, 8, 16, 8),
    Tile(16, 16, 4, 4, 16, 8),
    Tile(16, 16, 4, 4, 8, 4, 2),
)
TILES = FORWARD_TILES  # every candidate


def fitting_tiles(gpu, D: int, backward: bool = False) -> list[Tile]:
    """The candidates this adapter can run at head_dim D (workgroup storage and invocations), in the
    forward's or the backward's order."""
    limit = int(gpu.limits.get("max-compute-workgroup-storage-size", 16384))
    threads = int(gpu.limits.get("max-compute-invocations-per-workgroup", 256))
    order = BACKWARD_TILES if backward else FORWARD_TILES
    return [t for t in order if t.wy * t.wx <= threads and t.shared_bytes(D) <= limit]


def choose_tile(gpu, D: int, tile: Tile | None = None, backward: bool = False) -> Tile:
    """`tile` after checking it, else the first candidate that fits (`fitting_tiles`)."""
    if not 1 <= D <= MAX_D:
        raise GpuError(f"attention_fused: head_dim {D} out of range 1..{MAX_D}")
    if tile is not None:
        limit = int(gpu.limits.get("max-compute-workgroup-storage-size", 16384))
        if not tile.valid() or tile.shared_bytes(D) > limit:
            raise GpuError(
                f"attention_fused: tile {tile} is not valid or does not fit {limit} bytes at D {D}"
            )
        return tile
    fit = fitting_tiles(gpu, D, backward)
    if not fit:
        raise GpuError(f"attention_fused: no tile fits this adapter at head_dim {D}")
    return fit[0]


_BUFFERS = {"q": "q", "k": "k", "v": "v", "dout": "gdout"}  # helper suffix -> WGSL binding


def _helpers() -> str:
    """at_X, rows_X, cols_X, chunk_X for X in q, k, v, dout, and the backward's lse / delta readers."""
    out = []
    for name, arr in _BUFFERS.items():
        out.append(
            f"fn at_{name}(base: u32, stride: u32, row: u32, d: u32) -> f32 {{\n"
            f"    if (row < P.T && d < D) {{ return {arr}[base + row * stride + d]; }}\n    return 0.0;\n}}"
        )
        for kind, rows, off, stride in (("rows", "BQ", "0u", "SQ"), ("cols", "BK", "KOFF", "SK")):
            four = ", ".join(f"at_{name}(base, stride, r + {e}u, d)" for e in range(4))
            out.append(
                f"fn {kind}_{name}(base: u32, stride: u32, r0: u32, d0: u32, lid: u32) {{\n"
                f"    for (var n = 0u; n < (DK * {rows} / 4u + NT - 1u) / NT; n++) {{\n"
                f"        let i = lid + n * NT;\n"
                f"        if (i < DK * {rows} / 4u) {{\n"
                f"            let d = d0 + i % DK;\n"
                f"            let r = r0 + 4u * (i / DK);\n"
                f"            stage[{off} + (i % DK) * {stride} + i / DK] = vec4<f32>({four});\n"
                f"        }}\n    }}\n}}"
            )
        four = ", ".join(f"at_{name}(base, stride, r, d + {e}u)" for e in range(4))
        out.append(
            f"fn chunk_{name}(base: u32, stride: u32, j0: u32, lid: u32) {{\n"
            f"    for (var n = 0u; n < (BJ * SV + NT - 1u) / NT; n++) {{\n"
            f"        let i = lid + n * NT;\n"
            f"        if (i < BJ * SV) {{\n"
            f"            let r = j0 + i / SV;\n"
            f"            let d = 4u * (i % SV);\n"
            f"            stage[i] = vec4<f32>({four});\n"
            f"        }}\n    }}\n}}"
        )
    out.append(
        "fn lse2_at(base: u32, i: u32) -> f32 {\n"
        "    if (i < P.T) { return glse[base + i] * LOG2E; }\n    return 0.0;\n}"
    )
    out.append(
        "fn delta_at(base: u32, i: u32) -> f32 {\n"
        "    if (i < P.T) { return gdelta[base + i]; }\n    return 0.0;\n}"
    )
    return "\n\n".join(out)


def _templates(D: int, t: Tile) -> dict:
    """The kernels' constants and straight-line code for head_dim D and tile t."""
    tm, nb, na = t.tm, t.tn // 4, t.tm // 4
    nu = t.sv(D) // t.wx
    rows, cols, chans = range(tm), range(nb), range(nu)
    xyzw = "xyzw"

    def row(r: int) -> str:  # the tile row of thread row r: 4 * (ty + WY * (r / 4)) + r % 4
        return f"4u * (ty + {t.wy * (r // 4)}u) + {r % 4}u"

    def col4(b: int, first: str) -> str:  # the 4 tile columns of thread column group b, from `first`
        return f"vec4<u32>({first} + 4u * (tx + {t.wx * b}u)) + vec4<u32>(0u, 1u, 2u, 3u)"

    def regs(prefix: str, n) -> list[str]:
        return [f"var {prefix}{r}_{j} = vec4<f32>(0.0);" for r in rows for j in n]

    def zero(*prefixes: str) -> list[str]:
        return [f"{p}{r}_{b} = vec4<f32>(0.0);" for p in prefixes for r in rows for b in cols]

    def unrolled(var: str, body: list[str]) -> list[str]:  # UNROLL copies of one step, var = var*var + c
        out = []
        for c in range(t.unroll):
            out += [f"{{ let {var} = {var}{var} + {c}u;", *("    " + line for line in body), "}"]
        return out

    def score_step(acc: str) -> list[str]:  # acc += one channel d of the row operand x the column operand
        lines = [f"let qa{a} = stage[d * SQ + ty + {t.wy * a}u];" for a in range(na)]
        lines += [f"let kb{b} = stage[KOFF + d * SK + tx + {t.wx * b}u];" for b in cols]
        lines += [f"{acc}{r}_{b} += qa{r // 4}.{xyzw[r % 4]} * kb{b};" for r in rows for b in cols]
        return unrolled("d", lines)

    def row_step(acc: str) -> list[str]:  # acc += column j0 + j of `ps` x staged row j
        lines = [f"let pa{a} = ps[(j0 + j) * SP + ty + {t.wy * a}u];" for a in range(na)]
        lines += [f"let vb{u} = stage[j * SV + tx + {t.wx * u}u];" for u in chans]
        lines += [f"{acc}{r}_{u} += pa{r // 4}.{xyzw[r % 4]} * vb{u};" for r in rows for u in chans]
        return unrolled("j", lines)

    def to_ps(src: str) -> list[str]:  # ps[column][row group] from the thread's score registers
        out = []
        for a in range(na):
            for b in cols:
                for e, w in enumerate(xyzw):
                    vals = ", ".join(f"{src}{4 * a + i}_{b}.{w}" for i in range(4))
                    out.append(
                        f"ps[(4u * (tx + {t.wx * b}u) + {e}u) * SP + ty + {t.wy * a}u] = vec4<f32>({vals});"
                    )
        return out

    def store(acc: str, idx: str, arr: str, base: str, stride: str, factor: str) -> list[str]:
        out = []
        for r in rows:
            puts = " ".join(
                f"if (c{u} + {e}u < D) {{ {arr}[o + c{u} + {e}u] = {acc}{r}_{u}.{xyzw[e]}{factor}; }}"
                for u in chans
                for e in range(4)
            )
            cs = " ".join(f"let c{u} = 4u * (tx + {t.wx * u}u);" for u in chans)
            out.append(f"if ({idx}{r} < P.T) {{ let o = {base} + {idx}{r} * {stride}; {cs} {puts} }}")
        return out

    def block(lines: list[str], indent: int) -> str:
        return "\n".join(" " * indent + line for line in lines)

    tpl = {"D": D, "WX": t.wx, "WY": t.wy, "BQ": t.bq, "BK": t.bk, "DK": t.dk, "BJ": t.bj, "UNROLL": t.unroll,
           "SV": t.sv(D), "STAGE": t.stage_vec4s(D), "HELPERS": _helpers()}  # fmt: skip

    # forward
    decl = [f"let qi{r} = q0 + {row(r)}; var m{r} = NEG; var l{r} = 0.0;" for r in rows]
    mask = [f"let kj{b} = {col4(b, 'k0')}; let kin{b} = kj{b} < vec4<u32>(P.T);" for b in cols]
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
    fw_store = []
    for r in rows:
        fw_store.append(
            f"{{ let row = (qi{r} - q0) * WX; var ls = red[row]; "
            f"for (var x = 1u; x < WX; x++) {{ ls += red[row + x]; }} let inv{r} = 1.0 / ls; "
            f"if (tx == 0u && qi{r} < P.T) {{ flse[bh * P.T + qi{r}] = (m{r} + log2(ls)) * LN2; }}"
        )
        fw_store += store("o", "qi", "fout", "qbase", "qs", f" * inv{r}")[r : r + 1]
        fw_store.append("}")
    tpl |= {
        "FW_DECL": block(decl + regs("s", cols) + regs("o", chans), 4),
        "FW_S_ZERO": block(zero("s"), 8),
        "FW_S_STEP": block(score_step("s"), 16),
        "FW_MASK": block(mask, 8),
        "FW_SOFTMAX": block(soft + to_ps("s"), 8),
        "FW_PV_STEP": block(row_step("o"), 20),
        "FW_L_PUT": block([f"red[(qi{r} - q0) * WX + tx] = l{r};" for r in rows], 4),
        "FW_STORE": block(fw_store, 4),
    }

    # backward, dq: rows are queries, columns keys
    decl = [
        f"let qi{r} = q0 + {row(r)}; let ql{r} = lse2_at(bh * P.T, qi{r}); let qd{r} = delta_at(bh * P.T, qi{r});"
        for r in rows
    ]
    ds = [f"let kj{b} = {col4(b, 'k0')}; let kin{b} = kj{b} < vec4<u32>(P.T);" for b in cols]
    for r in rows:
        for b in cols:
            ok = f"kin{b} & (kj{b} <= vec4<u32>(qi{r})) & vec4<bool>(qi{r} < P.T)"
            ds.append(
                f"s{r}_{b} = select(vec4<f32>(0.0), exp2(s{r}_{b} * c2 - vec4<f32>(ql{r})), {ok}) "
                f"* (dp{r}_{b} - vec4<f32>(qd{r}));"
            )
    tpl |= {
        "DQ_DECL": block(decl + regs("s", cols) + regs("dp", cols) + regs("a", chans), 4),
        "DQ_S_ZERO": block(zero("s", "dp"), 8),
        "DQ_S_STEP": block(score_step("s"), 16),
        "DQ_DP_STEP": block(score_step("dp"), 16),
        "DQ_DS": block(ds + to_ps("s"), 8),
        "DQ_PV_STEP": block(row_step("a"), 20),
        "DQ_STORE": block(store("a", "qi", "gdq", "qbase", "qs", " * P.scale"), 4),
    }

    # backward, dk and dv: rows are keys, columns queries
    decl = [f"let kr{r} = k0 + {row(r)};" for r in rows]
    kvp = []
    for b in cols:
        ci = f"c0 + 4u * (tx + {t.wx * b}u)"
        kvp.append(
            f"let ci{b} = {col4(b, 'c0')}; let cin{b} = ci{b} < vec4<u32>(P.T); "
            f"let cl{b} = vec4<f32>(" + ", ".join(f"lse2_at(lbase, {ci} + {e}u)" for e in range(4)) + "); "
            f"let cd{b} = vec4<f32>(" + ", ".join(f"delta_at(lbase, {ci} + {e}u)" for e in range(4)) + ");"
        )
    for r in rows:
        kvp += [
            f"s{r}_{b} = select(vec4<f32>(0.0), exp2(s{r}_{b} * c2 - cl{b}), cin{b} & (vec4<u32>(kr{r}) <= ci{b}));"
            for b in cols
        ]
    kvds = [f"dp{r}_{b} = s{r}_{b} * (dp{r}_{b} - cd{b});" for r in rows for b in cols]
    tpl |= {
        "KV_DECL": block(
            decl + regs("s", cols) + regs("dp", cols) + regs("dk", chans) + regs("dv", chans), 4
        ),
        "KV_S_ZERO": block(zero("s", "dp"), 12),
        "KV_S_STEP": block(score_step("s"), 20),
        "KV_DP_STEP": block(score_step("dp"), 20),
        "KV_P": block(kvp + to_ps("s"), 12),
        "KV_DV_STEP": block(row_step("dv"), 24),
        "KV_DS": block(kvds + to_ps("dp"), 12),
        "KV_DK_STEP": block(row_step("dk"), 24),
        "KV_STORE": block(
            store("dk", "kr", "gdk", "kbase", "ks", " * P.scale")
            + store("dv", "kr", "gdv", "kbase", "ks", ""),
            4,
        ),
    }
    return tpl


def attention_fused_forward(
    gpu, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, scale=None, tile: Tile | None = None
) -> Call:
    """out (B,T,H,D) and lse (B,H,T) from q (B,T,H,D), k, v (B,T,K,D); causal; scale defaults to D**-0.5.
    `tile`: a `Tile` to use instead of the first of `FORWARD_TILES` that fits."""
    if min(B, T, H, K) < 1 or H % K:
        raise GpuError(f"attention_fused: bad sizes B={B} T={T} H={H} K={K} (need H % K == 0)")
    t = choose_tile(gpu, D, tile)
    _need("attention_fused_forward", out=(out, B * T * H * D), lse=(lse, B * H * T), q=(q, B * T * H * D),
          k=(k, B * T * K * D), v=(v, B * T * K * D))  # fmt: skip
    scale = float(D) ** -0.5 if scale is None else float(scale)
    kern = gpu.kernel(FILE, "attention_fused_forward", "urrrww", templates=_templates(D, t), uniforms=(PARAMS,),
                      workgroup=(t.wy * t.wx, 1, 1))  # fmt: skip
    u = gpu.uniform(PARAMS, B=B, T=T, H=H, KH=K, scale=scale)
    groups = B * H * (-(-T // t.bq))
    return Call([(kern, gpu.bind(kern, u, q, k, v, out, lse), groups)], [u])


def attention_fused_backward(
    gpu, dq, dk, dv, dout, lse, delta, q, k, v, B: int, T: int, H: int, K: int, D: int, scale=None,
    tile: Tile | None = None,
) -> Call:  # fmt: skip
    """dq (B,T,H,D), dk, dv (B,T,K,D) from dout, the forward's lse, delta = rowsum(dout * out) (B,H,T) and
    q, k, v: dq per query tile, then dk and dv per key tile (each row owned by one workgroup, no atomics).
    Outputs are overwritten. `tile`: instead of the first of `BACKWARD_TILES` that fits."""
    if min(B, T, H, K) < 1 or H % K:
        raise GpuError(f"attention_fused: bad sizes B={B} T={T} H={H} K={K} (need H % K == 0)")
    t = choose_tile(gpu, D, tile, backward=True)
    nq, nk = B * T * H * D, B * T * K * D
    _need("attention_fused_backward", dq=(dq, nq), dk=(dk, nk), dv=(dv, nk), dout=(dout, nq), q=(q, nq),
          k=(k, nk), v=(v, nk), lse=(lse, B * H * T), delta=(delta, B * H * T))  # fmt: skip
    scale = float(D) ** -0.5 if scale is None else float(scale)
    tpl = _templates(D, t)
    wg = (t.wy * t.wx, 1, 1)
    kq = gpu.kernel(
        FILE, "attention_fused_backward_dq", "urrrrrrw", templates=tpl, uniforms=(PARAMS,), workgroup=wg
    )
    kk = gpu.kernel(FILE, "attention_fused_backward_dkdv", "urrrrrrww", templates=tpl, uniforms=(PARAMS,),
                    workgroup=wg)  # fmt: skip
    u = gpu.uniform(PARAMS, B=B, T=T, H=H, KH=K, scale=scale)
    return Call(
        [
            (kq, gpu.bind(kq, u, q, k, v, dout, lse, delta, dq), B * H * (-(-T // t.bq))),
            (kk, gpu.bind(kk, u, q, k, v, dout, lse, delta, dk, dv), B * K * (-(-T // t.bq))),
        ],
        [u],
    )
