"""Launcher for `shaders/matmul_tc.wgsl`: the GEMM on the matrix units through WGSL subgroup matrices.

Kernel path: `shaders/matmul_tc.wgsl` -> `ddl_wgpu/ops/matmul_tc.py` -> reference `ddl_ref.ops.linear_forward`,
`ddl_ref.ops.linear_backward` -> test `tests/test_kernel_matmul_tc.py` (on a GPU that lists a configuration;
skipped with the reason elsewhere).

`matmul_tc` computes what `ops.matmul.matmul` computes, C = alpha * op(A) * op(B) (+ C) with one batch level,
but each product runs on the matrix units: the operands are rounded to f16 as they are copied into workgroup
memory and every sum accumulates in f32. It needs a runtime whose adapter lists a subgroup-matrix configuration
with f16 operands and f32 results (`Gpu.matrix_configs`; Dawn on NVIDIA, AMD and Intel GPUs); `ops.matmul`
routes every product here when the Gpu has one, unless its caller asks for a SIMT tile or a K split (a long K
with few blocks of C is sliced on the matrix units too: `ops.matmul._split_k_tc`).

The WGSL is generated from a `TcTile` (subgroups per workgroup as rows x columns, result matrices per subgroup,
the k depth of one workgroup-memory step) and the configuration's matrix shape (MM x NN x KK): staging copies,
accumulators, products and the epilogue straight-line, so every offset into workgroup memory is a constant.
The tiles come from a sweep on the GPU (`bench/matmul_tc.py --tiles ...`), as the SIMT tiles did.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ddl_wgpu.runtime.gpu import MAX_GROUPS, Call, GpuError, Uniform

SHADER = "matmul_tc.wgsl"
PARAMS = Uniform(
    "TcParams",
    ("M", "u32"),
    ("N", "u32"),
    ("K", "u32"),
    ("lda", "u32"),
    ("ldb", "u32"),
    ("ldc", "u32"),
    ("off_a", "u32", "element offsets"),
    ("off_b", "u32"),
    ("off_c", "u32"),
    ("stride_a", "u32", "elements between batch entries"),
    ("stride_b", "u32"),
    ("stride_c", "u32"),
    ("accumulate", "u32", "1: C = alpha*op(A)op(B) + C"),
    ("alpha", "f32"),
    ("inner", "u32", "two-level batch: z = zo * inner + zi, as matmul.wgsl"),
    ("div_a", "u32"),
    ("div_b", "u32"),
    ("istride_a", "u32"),
    ("istride_b", "u32"),
    ("istride_c", "u32"),
    ("causal", "u32", "0 none; 1 skip tiles above the diagonal; 2 k < tile end; 3 k from tile start"),
    ("rows_first", "u32", "1: workgroup x walks C's block rows, y its block columns (`rows_first`)"),
)
UNIFORMS = (PARAMS,)


@dataclass(frozen=True)
class Config:
    """One subgroup-matrix configuration of an adapter: left M x K times right K x N into an M x N result."""

    m: int
    n: int
    k: int
    operand: str = "f16"
    result: str = "f32"


@dataclass(frozen=True)
class TcTile:
    """A workgroup of sg_rows x sg_cols subgroups; each subgroup owns tm x tn result matrices; bk is the k depth
    of one workgroup-memory step (a multiple of the configuration's k); pad_a / pad_b widen the rows of the
    staged tiles (f16 elements) against bank conflicts."""

    sg_rows: int = 2
    sg_cols: int = 2
    tm: int = 4
    tn: int = 4
    bk: int = 32
    pad_a: int = 8
    pad_b: int = 8
    vec: bool = True  # vec4 global loads where the operand allows them (`load_widths`)
    prefetch: bool = True  # the next K step's loads issued before this step's products (registers)

    def block(self, cfg: Config) -> tuple[int, int]:
        return self.sg_rows * self.tm * cfg.m, self.sg_cols * self.tn * cfg.n

    def name(self) -> str:
        flags = ("" if self.vec else "-v1") + ("" if self.prefetch else "-np")
        return f"{self.sg_rows}x{self.sg_cols}sg-{self.tm}x{self.tn}-k{self.bk}-p{self.pad_a}.{self.pad_b}{flags}"


@dataclass(frozen=True)
class _Operand:
    """One operand's staging copy: a `rows` x `cols` tile of the operand as it is stored (`cols` the axis
    contiguous in storage), from storage (r0, c0) within bounds (rext, cext), into `smem` in the same
    orientation with row stride `stride` (the row plus a pad). A transposed operand (A stored (K, M), B stored
    (N, K)) therefore stays transposed in workgroup memory and its matrices are loaded column-major
    (`col_major`), which is how the matrix units take B anyway: every copy writes along a staged row, never
    down a column. `w` elements travel per load (4: a vec4 binding)."""

    tag: str  # "a" | "b": the binding, its offset `o{tag}` and leading dimension `P.ld{tag}`
    smem: str
    rows: int
    cols: int
    r0: str
    c0: str
    rext: str
    cext: str
    stride: int
    w: int
    col_major: bool

    @property
    def size(self) -> int:
        return self.rows * self.stride


def _operands(tile: TcTile, cfg: Config, trans_a: bool, trans_b: bool, wa: int = 1, wb: int = 1) -> tuple:
    """A and B as staged, their k origin the variable `kl`: op(A)'s BM x BK block (stored (K, M): BK x BM) and
    op(B)'s BK x BN block (stored (N, K): BN x BK)."""
    BM, BN = tile.block(cfg)
    BK, pa, pb = tile.bk, tile.pad_a, tile.pad_b
    a = (_Operand("a", "As", BK, BM, "kl", "m0", "P.K", "P.M", BM + pa, wa, True) if trans_a
         else _Operand("a", "As", BM, BK, "m0", "kl", "P.M", "P.K", BK + pa, wa, False))  # fmt: skip
    b = (_Operand("b", "Bs", BN, BK, "n0", "kl", "P.N", "P.K", BK + pb, wb, True) if trans_b
         else _Operand("b", "Bs", BK, BN, "kl", "n0", "P.K", "P.N", BN + pb, wb, False))  # fmt: skip
    return a, b


def _slots(op: _Operand, threads: int) -> list:
    """(row, column) expressions of each pass of the copy: thread li moves `w` consecutive elements per pass,
    consecutive threads consecutive vectors along a row (global reads coalesce, and the stores fall along one
    staged row). Where the threads divide evenly each thread keeps its column and steps rows by a constant;
    otherwise every pass recomputes both from its slot number. A trailing guard when the slots do not fill the
    last pass. Rows of 8 vectors (a 32-deep step) are paired instead (`_paired`)."""
    vecs = op.cols // op.w
    n = op.rows * vecs
    if _paired(op, threads):
        at = [f"(li + {e * threads}u)" for e in range(n // threads)]
        return [(f"(({x} / 64u) * 8u + ({x} / 16u) % 4u + (({x} % 16u) / 8u) * 4u)", f"(({x} % 8u) * 4u)", "")
                for x in at]  # fmt: skip
    out = []
    for e in range(-(-n // threads)):
        guard = "" if (e + 1) * threads <= n else f"li + {e * threads}u < {n}u"
        if threads % vecs == 0:
            r, q = f"(li / {vecs}u + {e * threads // vecs}u)", f"((li % {vecs}u) * {op.w}u)"
        else:
            r, q = f"((li + {e * threads}u) / {vecs}u)", f"(((li + {e * threads}u) % {vecs}u) * {op.w}u)"
        out.append((r, q, guard))
    return out


def _paired(op: _Operand, threads: int) -> bool:
    """Whether the copy pairs rows: vec4 copies of rows 8 vectors long (BK 32 as stored). NVIDIA's compiler
    merges a lane's four f16 stores into one 8-byte store, which the shared memory serves 16 lanes at a time;
    with consecutive rows (80 bytes apart with the pad) the two rows of those 16 lanes share two banks, a
    second wavefront. So each 16 slots take rows r and r + 4 of a block of 8 rows (320 bytes apart: disjoint
    banks), and every store of a half subgroup is one wavefront (`tests/test_kernel_matmul_tc.py` models it).
    Measured on the H100: +3-5 % on the forwards, +3 % on dx (docs/experiments.md)."""
    return op.w == 4 and op.cols == 32 and op.rows % 8 == 0 and (op.rows * 8) % threads == 0


def _reg(op: _Operand, e: int) -> str:
    return f"r{op.tag}{e}"


def _loads(op: _Operand, threads: int, bounded: bool) -> list:
    """Global -> registers for every pass (converted to f16 there): `bounded` checks each vector against the
    operand's extent (a vector is wholly in or out: the host picks w = 4 only where the extent is a multiple
    of 4), else the whole tile is known inside."""
    typ = "vec4<f16>" if op.w == 4 else "f16"
    lines = []
    for e, (r, q, guard) in enumerate(_slots(op, threads)):
        idx = f"o{op.tag} + ({op.r0} + {r}) * P.ld{op.tag} + {op.c0} + {q}"
        src = f"{typ}({op.tag}[({idx}) / {op.w}u])" if op.w > 1 else f"f16({op.tag}[{idx}])"
        cond = [
            c for c in (guard, bounded and f"{op.r0} + {r} < {op.rext} && {op.c0} + {q} < {op.cext}") if c
        ]
        if cond:
            lines.append(
                f"        {_reg(op, e)} = {typ}(0.0); if ({' && '.join(cond)}) {{ {_reg(op, e)} = {src}; }}"
            )
        else:
            lines.append(f"        {_reg(op, e)} = {src};")
    return lines


def _stores(op: _Operand, threads: int) -> list:
    """Registers -> workgroup memory, one f16 at a time (subgroupMatrixLoad reads an array of scalars)."""
    lines = []
    for e, (r, q, guard) in enumerate(_slots(op, threads)):
        parts = [f"{op.smem}[{r} * {op.stride}u + {q} + {j}u] = {_reg(op, e)}{'.' + 'xyzw'[j] if op.w > 1 else ''};"
                 for j in range(op.w)]  # fmt: skip
        body = " ".join(parts)
        lines.append(f"        if ({guard}) {{ {body} }}" if guard else f"        {body}")
    return lines


def _loop(tile: TcTile, cfg: Config, threads: int, trans_a: bool, trans_b: bool, wa: int, wb: int) -> dict:
    """The register declarations and the K loop: each step's loads (at k origin `kl`; unbounded when the block
    and the step lie inside the operands, a uniform branch), its stores into As and Bs, a barrier, its
    products, a barrier. With prefetch the next step's loads are issued between the first barrier and the
    products, so global memory's latency hides behind the matrix units; without, at the step's start."""
    ops = _operands(tile, cfg, trans_a, trans_b, wa, wb)
    decl = [f"    var {_reg(op, e)}: {'vec4<f16>' if op.w == 4 else 'f16'};"
            for op in ops for e in range(len(_slots(op, threads)))]  # fmt: skip
    inside = sum((_loads(op, threads, False) for op in ops), [])
    edge = sum((_loads(op, threads, True) for op in ops), [])

    def loads(guard: str, k: str, indent: str) -> str:
        """The loads of the step at k origin `k`, where `guard` holds."""
        body = [f"if ({guard}) {{", f"    let kl = {k};", "    if (inside_mn && kl + BK <= P.K) {",
                *inside, "    } else {", *edge, "    }", "}"]  # fmt: skip
        return "\n".join(indent + x for x in body)

    stores = "\n".join("        " + x.strip() for x in sum((_stores(op, threads) for op in ops), []))
    products = _products(tile, cfg, *ops)
    if tile.prefetch:
        body = [loads("k_begin < k_end", "k_begin", "    "), "    for (var k0 = k_begin; k0 < k_end; k0 += BK) {",
                stores, "        workgroupBarrier();", loads("k0 + BK < k_end", "k0 + BK", "        ")]  # fmt: skip
    else:
        body = ["    for (var k0 = k_begin; k0 < k_end; k0 += BK) {", loads("true", "k0", "        "), stores,
                "        workgroupBarrier();"]  # fmt: skip
    body += [products, "        workgroupBarrier();", "    }"]
    return {"regs": "\n".join(decl), "loop": "\n".join(body)}


def _products(tile: TcTile, cfg: Config, a: _Operand, b: _Operand) -> str:
    """One step's products: per KK slice the subgroup's TM left and TN right matrices from workgroup memory
    (column-major where the operand is staged transposed), then the TM x TN multiply-accumulates."""
    left = f"subgroup_matrix_left<f16, {cfg.k}, {cfg.m}>"
    right = f"subgroup_matrix_right<f16, {cfg.n}, {cfg.k}>"
    lines = []
    for kk in range(0, tile.bk, cfg.k):
        for i in range(tile.tm):  # rows sm + i*MM.., columns kk..
            at = (
                f"{kk * a.stride}u + sm + {i * cfg.m}u"
                if a.col_major
                else f"(sm + {i * cfg.m}u) * {a.stride}u + {kk}u"
            )
            lines.append(
                f"        let l{i}_{kk} = subgroupMatrixLoad<{left}>(&As, {at}, {str(a.col_major).lower()}, {a.stride}u);"
            )
        for j in range(tile.tn):  # rows kk.., columns sn + j*NN..
            at = (
                f"(sn + {j * cfg.n}u) * {b.stride}u + {kk}u"
                if b.col_major
                else f"{kk * b.stride}u + sn + {j * cfg.n}u"
            )
            lines.append(
                f"        let r{j}_{kk} = subgroupMatrixLoad<{right}>(&Bs, {at}, {str(b.col_major).lower()}, {b.stride}u);"
            )
        for i in range(tile.tm):
            for j in range(tile.tn):
                lines.append(
                    f"        c{i}_{j} = subgroupMatrixMultiplyAccumulate(l{i}_{kk}, r{j}_{kk}, c{i}_{j});"
                )
    return "\n".join(lines)


def _epilogue(tile: TcTile, cfg: Config, subgroup_size: int) -> str:
    """C from the accumulators, through workgroup memory one result matrix at a time, each lane writing
    alpha * acc (+ C) for its elements, guarded at the edges. A lane takes its E = MM*NN / subgroup_size
    elements of a matrix in one round, every load of C issued before any store: with the loads and stores
    alternating, each load of C waited for the store before it (the compiler cannot move a load past a store
    to the same buffer), and an accumulating product (every dW, the residual's products) paid E serial
    latencies per matrix. (Storing the result matrices straight to C measured no faster on the H100:
    docs/experiments.md.)"""
    e_count = max(1, cfg.m * cfg.n // subgroup_size)
    lines = []
    for i in range(tile.tm):
        for j in range(tile.tn):
            lines += [
                f"    subgroupMatrixStore(&Cs, slab, c{i}_{j}, false, {cfg.n}u);",
                "    workgroupBarrier();",
                f"    for (var e0 = lane; e0 < {cfg.m * cfg.n}u; e0 += {e_count}u * sg_size) {{",
            ]
            for t in range(e_count):
                e = "e0" if t == 0 else f"e0 + {t}u * sg_size"
                lines += [
                    f"        let e{t} = {e};",
                    f"        let row{t} = m0 + sm + {i * cfg.m}u + e{t} / {cfg.n}u;",
                    f"        let col{t} = n0 + sn + {j * cfg.n}u + e{t} % {cfg.n}u;",
                    f"        let in{t} = e{t} < {cfg.m * cfg.n}u && row{t} < P.M && col{t} < P.N;",
                    f"        let o{t} = oc + row{t} * P.ldc + col{t};",
                    f"        var old{t} = 0.0;",
                    f"        if (P.accumulate == 1u && in{t}) {{ old{t} = c[o{t}]; }}",
                ]
            for t in range(e_count):
                lines += [f"        if (in{t}) {{",
                          f"            let v{t} = P.alpha * Cs[slab + e{t}];",
                          f"            c[o{t}] = select(v{t}, v{t} + old{t}, P.accumulate == 1u);",
                          "        }"]  # fmt: skip
            lines += ["    }", "    workgroupBarrier();"]
    return "\n".join(lines)


def templates(
    tile: TcTile,
    cfg: Config,
    subgroup_size: int,
    trans_a: bool,
    trans_b: bool,
    a_dtype: str = "f32",
    b_dtype: str = "f32",
    widths: tuple[int, int] = (1, 1),
) -> dict:
    """The placeholders of matmul_tc.wgsl for one tile, configuration, layout, operand types and load widths
    (`widths`: elements per load of A and B, 4 where `load_widths` allows it and the tile asks for it)."""
    if tile.bk % cfg.k:
        raise ValueError(f"tile bk={tile.bk} is not a multiple of the configuration's k={cfg.k}")
    if any(w not in (1, 4) for w in widths):
        raise ValueError(f"load widths {widths}: each 1 or 4")
    BM, BN = tile.block(cfg)
    threads = tile.sg_rows * tile.sg_cols * subgroup_size
    sa, sb = _operands(tile, cfg, trans_a, trans_b)
    subgroups = tile.sg_rows * tile.sg_cols
    consts = "\n".join(
        f"const {n}: u32 = {v}u;"
        for n, v in (
            ("BM", BM),
            ("BN", BN),
            ("BK", tile.bk),
            ("MM", cfg.m),
            ("NN", cfg.n),
            ("TM", tile.tm),
            ("TN", tile.tn),
            ("SG_COLS", tile.sg_cols),
        )  # fmt: skip
    )
    return {
        "a_array": f"vec4<{a_dtype}>" if widths[0] == 4 else a_dtype,
        "b_array": f"vec4<{b_dtype}>" if widths[1] == 4 else b_dtype,
        "consts": consts,
        "as_size": str(sa.size),
        "bs_size": str(sb.size),
        "cs_size": str(subgroups * cfg.m * cfg.n),
        "threads": str(threads),
        "accumulators": "\n".join(
            f"    var c{i}_{j} = subgroup_matrix_result<f32, {cfg.n}, {cfg.m}>();"
            for i in range(tile.tm)
            for j in range(tile.tn)
        ),  # fmt: skip
        **_loop(tile, cfg, threads, trans_a, trans_b, *widths),
        "epilogue": _epilogue(tile, cfg, subgroup_size),
    }


def load_widths(
    tile: TcTile,
    M: int,
    N: int,
    K: int,
    trans_a: bool,
    trans_b: bool,
    lds: tuple[int, int],
    offsets: tuple[int, int],
    strides: tuple[int, int],
    istrides: tuple[int, int],
) -> tuple[int, int]:
    """Elements per global load of A and B: 4 (one vec4) where the tile asks for vectors and every vector of
    the operand is whole and 4-aligned (its contiguous extent, leading dimension, offset and batch strides
    multiples of 4), else 1."""
    if not tile.vec:
        return 1, 1
    extents = (M if trans_a else K, K if trans_b else N)
    return tuple(4 if all(v % 4 == 0 for v in (extents[x], lds[x], offsets[x], strides[x], istrides[x])) else 1
                 for x in (0, 1))  # fmt: skip


def workgroup_bytes(tile: TcTile, cfg: Config) -> int:
    """The largest workgroup memory the tile takes over the layouts (a transposed operand is staged as stored,
    its rows padded along the other axis)."""
    staged = max(
        sum(op.size for op in _operands(tile, cfg, ta, tb)) for ta in (False, True) for tb in (False, True)
    )
    return 2 * staged + 4 * tile.sg_rows * tile.sg_cols * cfg.m * cfg.n


def groups(tile: TcTile, cfg: Config, M: int, N: int, batch: int = 1, first: bool = False) -> tuple:
    """The grid: (block columns, block rows, batch), or with `first` (`rows_first`) block rows first."""
    BM, BN = tile.block(cfg)
    cols, rows = -(-N // BN), -(-M // BM)
    return (rows, cols, batch) if first else (cols, rows, batch)


ENV_ORDER = "DDL_WGPU_TC_ORDER"  # auto | rows | cols: which way the grid walks C's blocks (`rows_first`)
# bytes of A that stay cached while every block column reads them (the H100's L2 is 50 MB). Measured there
# (`bench/matmul_tc.py --shapes draft --orders cols,rows`, TFLOP/s columns first -> rows first): A of 10 MB
# (512 x 5120 f32) against the head's chunk 170.1 -> 190.9 and gate/up 112.8 -> 116.7; 31.5 MB (1,536 rows)
# through q+gate 156.3 -> 161.6; 35.7 MB (512 x 17408, down) 112.9 -> 104.2, so down keeps columns first
A_CACHED = 32 << 20


def rows_first(tile: TcTile, cfg: Config, M: int, N: int, K: int, batch: int, a_bytes: int) -> bool:
    """Whether the grid walks C's block rows first. Workgroups start in grid order (x fastest), so with block
    columns first the workgroups in flight share one block row of A and each reads its own columns of B: B
    streams from memory once per block row. With block rows first they share a block column of B, which is read
    once, and A is read by every block column, from the cache where it fits. So rows first where the product has
    fewer block rows than block columns, one batch entry, and an A (M x K, `a_bytes` an element) of at most
    A_CACHED bytes: heal's draft, whose 512-1,536 rows meet a head of 248 K rows and the block's weights.
    DDL_WGPU_TC_ORDER=rows|cols forces it (the bench's comparison)."""
    forced = os.environ.get(ENV_ORDER, "auto").strip().lower() or "auto"
    if forced not in ("auto", "rows", "cols"):
        raise GpuError(f"{ENV_ORDER}={os.environ[ENV_ORDER]!r}: one of auto, rows, cols")
    if forced != "auto":
        return forced == "rows"
    cols, rows, _ = groups(tile, cfg, M, N)
    return batch == 1 and rows < cols and M * K * a_bytes <= A_CACHED


# The tiles, best first; `pick_tile` takes the first whose workgroup memory the adapter has. `STAGED` is the
# fifth session's best on an H100 through Dawn (bench/matmul_tc.py, f16 operands; BENCHMARKS.md, "The matrix
# units, fifth session"): 4 subgroups of 4 x 4 matrices staged 32 deep, vec4 loads, prefetch, every operand
# staged as stored, 189.1-199.2 TFLOP/s on the 27B's forwards, 210.7-212.4 on dx, 213.9-214.8 on dW, twice
# (the 8-subgroup 4x2sg-4x4-k32 before it: 165.0-166.0, 170.6, 183.2 in the same run). Half the workgroup, so
# two share an SM and one's staging overlaps the other's products. The two fallbacks fit WebGPU's default
# 16 KiB and ran 101-129 TFLOP/s in the first sweep (scalar loads, no prefetch, the transposing copy then).
STAGED = TcTile(2, 2, 4, 4, 32, 8, 8)
TILES = (STAGED, *(TcTile(*t, 8, 8, vec=False, prefetch=False) for t in ((2, 2, 4, 4, 16), (2, 2, 2, 2, 16))))
OPERANDS = {"f32": 4, "f16": 2}  # element bytes of A and B in storage


def usable_config(gpu) -> Config | None:
    """The configuration `ops.matmul` routes products to: one with f16 operands and f32 results among the Gpu's
    subgroup-matrix configurations (16 x 16 x 16 first, the shape NVIDIA and AMD run natively), when the Gpu's
    products are on the matrix units (`gpu.products == "matrix"`); None otherwise."""
    if getattr(gpu, "products", "simt") != "matrix":
        return None
    found = [Config(*c[:3]) for c in getattr(gpu, "matrix_configs", ()) if tuple(c[3:5]) == ("f16", "f32")]
    found.sort(key=lambda c: (c != Config(16, 16, 16), -c.m * c.n * c.k))
    return found[0] if found else None


def subgroup_size(gpu) -> int:
    """The subgroup size the kernel's workgroup is counted in: the adapter's (its largest, where it has a range,
    as Dawn sizes subgroup-matrix workgroups)."""
    return int(gpu.limits.get("max-subgroup-size") or gpu.limits.get("min-subgroup-size") or 32)


ENV_TILE = (
    "DDL_WGPU_TC_TILE"  # a tile by the name the sweep prints: what bench runs time before TILES changes
)
FLAGS = {"v1": "vec", "np": "prefetch"}  # name parts that turn a path off


def parse_tile(text: str) -> TcTile:
    """'4x2sg-4x4-k32[-pA[.B]][-v1][-np]' -> a TcTile: subgroups as rows x columns, result matrices per
    subgroup, the k depth, pads; -v1 scalar loads only, -np no prefetch (`TcTile.name` writes the same form)."""
    try:
        parts = text.strip().split("-")
        if not parts[0].endswith("sg") or not parts[2].startswith("k"):
            raise ValueError("subgroups end in 'sg', the depth starts with 'k'")
        sr, sc = map(int, parts[0].removesuffix("sg").split("x"))
        tm, tn = map(int, parts[1].split("x"))
        bk = int(parts[2].removeprefix("k"))
        pads, flags = (8, 8), {}
        for part in parts[3:]:
            if part.startswith("p"):
                pa, _, pb = part.removeprefix("p").partition(".")
                pads = (int(pa), int(pb or pa))
            elif part in FLAGS:
                flags[FLAGS[part]] = False
            else:
                raise ValueError(part)
        return TcTile(sr, sc, tm, tn, bk, *pads, **flags)
    except (ValueError, IndexError) as e:
        raise GpuError(
            f"matmul_tc: tile {text!r} is not of the form 4x2sg-4x4-k32[-p8.8][-v1][-np] ({e})"
        ) from None


def pick_tile(gpu, cfg: Config) -> TcTile:
    """The tile env DDL_WGPU_TC_TILE names, else the first of TILES whose workgroup memory the adapter has
    (WebGPU's default limits give 16 KiB)."""
    limit = gpu.limits.get("max-compute-workgroup-storage-size", 16384)
    if os.environ.get(ENV_TILE):
        return parse_tile(os.environ[ENV_TILE])
    for tile in TILES:
        if workgroup_bytes(tile, cfg) <= limit:
            return tile
    raise GpuError(f"matmul_tc: no tile fits {limit} bytes of workgroup memory")


def kernel(
    gpu,
    cfg: Config,
    tile: TcTile,
    trans_a: bool,
    trans_b: bool,
    a_dtype: str,
    b_dtype: str,
    widths: tuple[int, int] = (1, 1),
):
    """The compiled `matmul_tc` entry point for one configuration, tile, layout, operand types and widths."""
    sg = subgroup_size(gpu)
    limit = gpu.limits.get("max-compute-workgroup-storage-size", 16384)
    if workgroup_bytes(tile, cfg) > limit:
        raise GpuError(f"matmul_tc: tile {tile.name()} needs {workgroup_bytes(tile, cfg)} bytes of workgroup "
                       f"memory, the adapter has {limit}")  # fmt: skip
    threads = tile.sg_rows * tile.sg_cols * sg
    return gpu.kernel(
        SHADER,
        "matmul_tc",
        "rrwu",
        templates=templates(tile, cfg, sg, trans_a, trans_b, a_dtype, b_dtype, widths),
        workgroup=(threads, 1, 1),
        uniforms=UNIFORMS,
    )


def matmul_tc(
    gpu,
    c,
    a,
    b,
    M: int,
    N: int,
    K: int,
    trans_a: bool = False,
    trans_b: bool = False,
    accumulate: bool = False,
    alpha: float = 1.0,
    lda: int | None = None,
    ldb: int | None = None,
    ldc: int | None = None,
    offsets: tuple[int, int, int] = (0, 0, 0),
    strides: tuple[int, int, int] = (0, 0, 0),
    batch: int = 1,
    inner: int = 1,
    divs: tuple[int, int] = (1, 1),
    istrides: tuple[int, int, int] = (0, 0, 0),
    causal: int = 0,
    a_dtype: str = "f32",
    b_dtype: str = "f32",
    cfg: Config | None = None,
    tile: TcTile | None = None,
) -> Call:
    """C = alpha * op(A) * op(B) (+ C when `accumulate`) on the matrix units, for `batch` products; product z
    = zo * inner + zi reads operand X from offsets[X] + zo * strides[X] + (zi / divs[X]) * istrides[X]
    (elements; C's div is 1), as `ops.matmul.matmul`'s two-level batch, and `causal` is its mode number
    (`ops.matmul.CAUSAL_MODES`). `cfg` defaults to `usable_config(gpu)` (an error when there is none), `tile`
    to `pick_tile`'s."""
    cfg = cfg or usable_config(gpu)
    if cfg is None:
        raise GpuError(f"matmul_tc: {gpu.name} lists no f16 -> f32 subgroup-matrix configuration in use")
    if a_dtype not in OPERANDS or b_dtype not in OPERANDS:
        raise GpuError(f"matmul_tc: operand types {a_dtype}, {b_dtype}: each one of {list(OPERANDS)}")
    tile = tile or pick_tile(gpu, cfg)
    M, N, K, batch = int(M), int(N), int(K), int(batch)
    lda = int(lda if lda is not None else (M if trans_a else K))
    ldb = int(ldb if ldb is not None else (K if trans_b else N))
    ldc = int(ldc if ldc is not None else N)
    if M == 0 or N == 0 or batch == 0:
        return Call()
    order = rows_first(tile, cfg, M, N, K, batch, OPERANDS[a_dtype])
    g = groups(tile, cfg, M, N, batch, order)
    if max(g) > MAX_GROUPS:
        raise GpuError(f"matmul_tc: {g} workgroups exceed {MAX_GROUPS} per dimension; split the product")
    widths = load_widths(tile, M, N, K, trans_a, trans_b, (lda, ldb), offsets[:2], strides[:2], istrides[:2])
    k = kernel(gpu, cfg, tile, trans_a, trans_b, a_dtype, b_dtype, widths)
    u = gpu.uniform(
        PARAMS,
        M=M,
        N=N,
        K=K,
        lda=lda,
        ldb=ldb,
        ldc=ldc,
        off_a=offsets[0],
        off_b=offsets[1],
        off_c=offsets[2],
        stride_a=strides[0],
        stride_b=strides[1],
        stride_c=strides[2],
        accumulate=int(accumulate),
        alpha=alpha,
        inner=int(inner),
        div_a=int(divs[0]),
        div_b=int(divs[1]),
        istride_a=istrides[0],
        istride_b=istrides[1],
        istride_c=istrides[2],
        causal=int(causal),
        rows_first=int(order),
        label="matmul_tc",
    )
    return Call(dispatches=[(k, gpu.bind(k, a, b, c, u), g)], uniforms=[u])
