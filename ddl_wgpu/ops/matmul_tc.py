"""Launcher for `shaders/matmul_tc.wgsl`: the GEMM on the matrix units through WGSL subgroup matrices.

Kernel path: `shaders/matmul_tc.wgsl` -> `ddl_wgpu/ops/matmul_tc.py` -> reference `ddl_ref.ops.linear_forward`,
`ddl_ref.ops.linear_backward` -> test `tests/test_kernel_matmul_tc.py` (on a GPU that lists a configuration;
skipped with the reason elsewhere).

`matmul_tc` computes what `ops.matmul.matmul` computes, C = alpha * op(A) * op(B) (+ C) with one batch level,
but each product runs on the matrix units: the operands are rounded to f16 as they are copied into workgroup
memory and every sum accumulates in f32. It needs a runtime whose adapter lists a subgroup-matrix configuration
with f16 operands and f32 results (`Gpu.matrix_configs`; Dawn on NVIDIA, AMD and Intel GPUs); `ops.matmul`
routes a product here when the Gpu has one and the product is one this kernel takes (no causal mode, no
two-level batch).

The WGSL is generated from a `TcTile` (subgroups per workgroup as rows x columns, result matrices per subgroup,
the k depth of one workgroup-memory step) and the configuration's matrix shape (MM x NN x KK): staging copies,
accumulators, products and the epilogue straight-line, so every offset into workgroup memory is a constant.
The tiles come from a sweep on the GPU (`bench/matmul_tc.py --sweep`), as the SIMT tiles did.
"""

from __future__ import annotations

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
    ("pad0", "pad"),
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

    def block(self, cfg: Config) -> tuple[int, int]:
        return self.sg_rows * self.tm * cfg.m, self.sg_cols * self.tn * cfg.n

    def name(self) -> str:
        return f"{self.sg_rows}x{self.sg_cols}sg-{self.tm}x{self.tn}-k{self.bk}-p{self.pad_a}.{self.pad_b}"


def _copy(
    name: str, rows: int, cols: int, stride: int, threads: int, along_rows: bool, src: str, bound: str
) -> list:
    """The unrolled copy of one operand's rows x cols tile into workgroup array `name` (row stride `stride`),
    element (r, q) read by `src` where `bound` holds, else 0; `along_rows`: consecutive threads take consecutive
    rows (the operand is contiguous along them in storage), else consecutive columns."""
    n, lines = rows * cols, []
    for e in range(-(-n // threads)):
        i = f"(li + {e * threads}u)"
        guard = "" if (e + 1) * threads <= n else f"if {i} < {n}u "
        rc = (f"let r = {i} % {rows}u; let q = {i} / {rows}u;" if along_rows
              else f"let r = {i} / {cols}u; let q = {i} % {cols}u;")  # fmt: skip
        lines.append(f"        {guard}{{ {rc} var v = f16(0.0); if ({bound}) {{ v = f16({src}); }} "
                     f"{name}[r * {stride}u + q] = v; }}")  # fmt: skip
    return lines


def _stage(tile: TcTile, cfg: Config, threads: int, trans_a: bool, trans_b: bool) -> str:
    """The copies of one K step into As (BM x BK) and Bs (BK x BN), unrolled; each reads global memory along its
    operand's contiguous axis: A (M, K) along k, A stored (K, M) along m; B (K, N) along n, B stored (N, K)
    along k. In Bs, r is k and q is n."""
    BM, BN = tile.block(cfg)
    BK, SA, SB = tile.bk, tile.bk + tile.pad_a, BN + tile.pad_b
    a_src = "a[oa + (k0 + q) * P.lda + m0 + r]" if trans_a else "a[oa + (m0 + r) * P.lda + k0 + q]"
    b_src = "b[ob + (n0 + q) * P.ldb + k0 + r]" if trans_b else "b[ob + (k0 + r) * P.ldb + n0 + q]"
    lines = _copy("As", BM, BK, SA, threads, trans_a, a_src, "m0 + r < P.M && k0 + q < P.K")
    lines += _copy("Bs", BK, BN, SB, threads, trans_b, b_src, "n0 + q < P.N && k0 + r < P.K")
    return "\n".join(lines)


def _products(tile: TcTile, cfg: Config) -> str:
    BN = tile.block(cfg)[1]
    SA, SB = tile.bk + tile.pad_a, BN + tile.pad_b
    left = f"subgroup_matrix_left<f16, {cfg.k}, {cfg.m}>"
    right = f"subgroup_matrix_right<f16, {cfg.n}, {cfg.k}>"
    lines = []
    for kk in range(0, tile.bk, cfg.k):
        for i in range(tile.tm):
            lines.append(
                f"        let l{i}_{kk} = subgroupMatrixLoad<{left}>(&As, (sm + {i * cfg.m}u) * {SA}u + {kk}u, false, {SA}u);"
            )
        for j in range(tile.tn):
            lines.append(
                f"        let r{j}_{kk} = subgroupMatrixLoad<{right}>(&Bs, {kk * SB}u + sn + {j * cfg.n}u, false, {SB}u);"
            )
        for i in range(tile.tm):
            for j in range(tile.tn):
                lines.append(
                    f"        c{i}_{j} = subgroupMatrixMultiplyAccumulate(l{i}_{kk}, r{j}_{kk}, c{i}_{j});"
                )
    return "\n".join(lines)


def _epilogue(tile: TcTile, cfg: Config) -> str:
    lines = []
    for i in range(tile.tm):
        for j in range(tile.tn):
            lines += [
                f"    subgroupMatrixStore(&Cs, slab, c{i}_{j}, false, {cfg.n}u);",
                "    workgroupBarrier();",
                f"    for (var e = lane; e < {cfg.m * cfg.n}u; e += sg_size) {{",
                f"        let row = m0 + sm + {i * cfg.m}u + e / {cfg.n}u;",
                f"        let col = n0 + sn + {j * cfg.n}u + e % {cfg.n}u;",
                "        if (row < P.M && col < P.N) {",
                "            let o = oc + row * P.ldc + col;",
                "            var v = P.alpha * Cs[slab + e];",
                "            if (P.accumulate == 1u) { v += c[o]; }",
                "            c[o] = v;",
                "        }",
                "    }",
                "    workgroupBarrier();",
            ]
    return "\n".join(lines)


def templates(
    tile: TcTile,
    cfg: Config,
    subgroup_size: int,
    trans_a: bool,
    trans_b: bool,
    a_dtype: str = "f32",
    b_dtype: str = "f32",
) -> dict:
    """The placeholders of matmul_tc.wgsl for one tile, configuration, layout and operand types."""
    if tile.bk % cfg.k:
        raise ValueError(f"tile bk={tile.bk} is not a multiple of the configuration's k={cfg.k}")
    BM, BN = tile.block(cfg)
    threads = tile.sg_rows * tile.sg_cols * subgroup_size
    SA, SB = tile.bk + tile.pad_a, BN + tile.pad_b
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
    acc = f"subgroup_matrix_result<f32, {cfg.n}, {cfg.m}>"
    return {
        "a_array": a_dtype,
        "b_array": b_dtype,
        "consts": consts,
        "as_size": str(BM * SA),
        "bs_size": str(tile.bk * SB),
        "cs_size": str(subgroups * cfg.m * cfg.n),
        "threads": str(threads),
        "accumulators": "\n".join(
            f"    var c{i}_{j} = {acc}();" for i in range(tile.tm) for j in range(tile.tn)
        ),
        "stage": _stage(tile, cfg, threads, trans_a, trans_b),
        "products": _products(tile, cfg),
        "epilogue": _epilogue(tile, cfg),
    }


def workgroup_bytes(tile: TcTile, cfg: Config) -> int:
    BM, BN = tile.block(cfg)
    return (
        2 * (BM * (tile.bk + tile.pad_a) + tile.bk * (BN + tile.pad_b))
        + 4 * tile.sg_rows * tile.sg_cols * cfg.m * cfg.n
    )


def groups(tile: TcTile, cfg: Config, M: int, N: int, batch: int = 1) -> tuple[int, int, int]:
    BM, BN = tile.block(cfg)
    return -(-N // BN), -(-M // BM), batch


# The tiles, best first, by the sweep on an H100 through Dawn (bench/matmul_tc.py; BENCHMARKS.md, "The GEMM on
# the matrix units"): at the Qwen3.8-27B products 8 subgroups of 4 x 4 matrices staged 32 deep ran 122-139
# TFLOP/s, 4 subgroups staged 16 deep 101-129 (and fit WebGPU's 16 KiB of workgroup memory), 4 subgroups
# staged 32 deep 94-157 (its dW the slowest). `pick_tile` takes the first that fits the adapter.
TILES = (TcTile(4, 2, 4, 4, 32, 8, 8), TcTile(2, 2, 4, 4, 16, 8, 8), TcTile(2, 2, 2, 2, 16, 8, 8))
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


def pick_tile(gpu, cfg: Config) -> TcTile:
    """The first of TILES whose workgroup memory the adapter has (WebGPU's default limits give 16 KiB)."""
    limit = gpu.limits.get("max-compute-workgroup-storage-size", 16384)
    for tile in TILES:
        if workgroup_bytes(tile, cfg) <= limit:
            return tile
    raise GpuError(f"matmul_tc: no tile fits {limit} bytes of workgroup memory")


def kernel(gpu, cfg: Config, tile: TcTile, trans_a: bool, trans_b: bool, a_dtype: str, b_dtype: str):
    """The compiled `matmul_tc` entry point for one configuration, tile, layout and operand types."""
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
        templates=templates(tile, cfg, sg, trans_a, trans_b, a_dtype, b_dtype),
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
    g = groups(tile, cfg, M, N, batch)
    if max(g) > MAX_GROUPS:
        raise GpuError(f"matmul_tc: {g} workgroups exceed {MAX_GROUPS} per dimension; split the product")
    k = kernel(gpu, cfg, tile, trans_a, trans_b, a_dtype, b_dtype)
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
        label="matmul_tc",
    )
    return Call(dispatches=[(k, gpu.bind(k, a, b, c, u), g)], uniforms=[u])
