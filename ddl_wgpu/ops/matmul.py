"""Launchers for `shaders/matmul.wgsl`: one generic, batched f32 GEMM and the linear-layer products built on it.

Kernel path: `shaders/matmul.wgsl` -> `ddl_wgpu/ops/matmul.py` -> reference `ddl_ref.ops.linear_forward`,
`ddl_ref.ops.linear_backward` -> test `tests/test_kernel_matmul.py`.

`matmul` computes C = alpha * op(A) * op(B) (+ C), row-major everywhere: op(A) is M x K, stored (M, K) or
(K, M) when `trans_a`; op(B) is K x N, stored (K, N) or (N, K) when `trans_b`; C is (M, N). A linear layer
with the Hugging Face weight layout W (OUT, IN) needs three of the four layouts:

    forward   y  = x  W^T     matmul(y, x, w, rows, OUT, IN, trans_b=True)
    backward  dx = dy W       matmul(dx, dy, w, rows, IN, OUT)
              dW = dy^T x     matmul(dw, dy, x, OUT, IN, rows, trans_a=True)

The kernel body is generated here as straight-line WGSL from a `Tile` (threads per workgroup, outputs per
thread, k depth): accumulators are separate `vec4<f32>` variables, never a private array indexed in a loop
(0.7 vs 25-28 TFLOP/s on the H200, docs/wgpu-notes.md#why-straight-line-wgsl). Two tiles are predefined, 4x4
and 8x8 outputs per thread; `pick_tile` chooses between them by the number of workgroups a product yields.

Split-K: a product with few output tiles and a long K (dW = dy^T x with K = tokens; the LM head's dx with
K = vocabulary) runs as `split_k` products over consecutive K slices (the batch axis of the same kernel, with
slice offsets as batch strides) into a partials buffer, then `splitk_reduce` sums the slices in a fixed order:
deterministic, no atomics. GPUs use it automatically (`auto_split_k`); CPU adapters never do.

f16 weights (`b_dtype="f16"`, the inference Net's big matrices): the B operand is bound as array<f16> and
converted to f32 when copied into shared memory; A, C and the accumulation stay f32, so the result equals the
f32 kernel run on the same weights rounded to f16 (same k order). It needs the adapter feature shader-f16;
the module gets `enable f16;` only in that variant. Offsets/strides of B are in elements either way; a view
of f16 data is (buffer, byte offset, bytes) with the bytes rounded up to 4.

What this file deliberately does not do: pick tiles by timing, or vectorise its global loads, double-buffer
its shared tiles or rearrange which thread owns which outputs: each was built and measured no faster on the
H200 (docs/experiments.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddl_wgpu.ops import matmul_tc as k_tc
from ddl_wgpu.ops import nbytes as _nbytes
from ddl_wgpu.runtime.gpu import MAX_GROUPS, Call, GpuError, Uniform

SHADER = "matmul.wgsl"
PARAMS = Uniform(
    "Params",
    ("M", "u32"),
    ("N", "u32"),
    ("K", "u32"),
    ("lda", "u32"),
    ("ldb", "u32"),
    ("ldc", "u32"),
    ("stride_a", "u32"),
    ("stride_b", "u32"),
    ("stride_c", "u32"),
    ("batch", "u32"),
    ("accumulate", "u32", "1: C = alpha*op(A)op(B) + C"),
    ("alpha", "f32"),
    ("inner", "u32", "two-level batch: z = zo * inner + zi"),
    ("div_a", "u32"),
    ("div_b", "u32"),
    ("istride_a", "u32"),
    ("istride_b", "u32"),
    ("istride_c", "u32"),
    ("off_a", "u32", "element offsets"),
    ("off_b", "u32"),
    ("off_c", "u32"),
    ("causal", "u32", "0 none; 1, 2, 3: see the header"),
)
CAUSAL_MODES = {None: 0, "skip_upper": 1, "k_to_row": 2, "k_from_row": 3}
REDUCE_PARAMS = Uniform(
    "RParams",
    ("n", "u32", "elements of C (packed M x N)"),
    ("parts", "u32"),
    ("stride", "u32", "elements between two slices' partials"),
    ("accumulate", "u32"),
    ("alpha", "f32"),
    ("pad0", "pad"),
    ("pad1", "pad"),
    ("pad2", "pad"),
)
UNIFORMS = (PARAMS, REDUCE_PARAMS)  # both structs of matmul.wgsl

# Split-K is used when a product yields fewer LARGE_TILE workgroups than this on a GPU and K is long: the
# H200 has 132 SMs, and the dW products of the small preset (36-96 workgroups) ran at 8-17 TFLOP/s.
SPLIT_K_BELOW_GROUPS = 264
# LARGE_TILE workgroups resident at once on the H200 (132 SMs, two 256-thread 8x8 tiles each): a launch runs
# in waves of this many, so the slice count is chosen by the waves it costs (`split_k_cost`).
SPLIT_K_SLOTS = 264
SPLIT_K_MIN_SLICE = 1024  # never slice K thinner than this
# The matrix-unit tile's workgroups resident at once: two of `matmul_tc.STAGED`'s 4-subgroup workgroups per SM
# on the H100's and H200's 132 SMs. Measured on an H100 (`bench/matmul_tc.py --split-slots 132,264 --shapes
# draft --operands f32,f16 --accumulate`, TFLOP/s 132 -> 264): heal's head dx at 512 rows (160 blocks of C,
# K 209,664) 123.0 -> 188.4 as 13 slices, the draft's down forward (160 blocks, K 17,408) 111.6 -> 134.6 as 8
TC_SPLIT_SLOTS = 264
SPLIT_K_MAX = 16


@dataclass(frozen=True)
class Tile:
    """Work split of one workgroup: wx x wy threads, each owning a tm x tn block of C, K walked in steps of
    bk. The workgroup's block of C is (wy*tm) x (wx*tn); tm and tn are multiples of 4 (vec4 accumulators)."""

    wx: int = 16  # threads along N
    wy: int = 16  # threads along M
    tm: int = 4  # rows of C per thread (multiple of 4)
    tn: int = 4  # columns of C per thread (multiple of 4)
    bk: int = 16  # k depth of one shared-memory tile
    unroll: bool = True  # the bk products of a k step as straight-line code (constant shared offsets)
    prefetch: bool = True  # fetch the next k step's tiles into registers before this step's products

    @property
    def bm(self) -> int:
        return self.wy * self.tm

    @property
    def bn(self) -> int:
        return self.wx * self.tn

    @property
    def shared_bytes(self) -> int:
        return 16 * self.bk * (self.bm // 4 + 1 + self.bn // 4 + 1)  # rows padded by one vec4

    def validate(self, gpu) -> None:
        if self.tm % 4 or self.tn % 4 or min(self.tm, self.tn, self.wx, self.wy, self.bk) <= 0:
            raise GpuError(f"matmul tile {self}: tm and tn must be positive multiples of 4")
        if self.wx * self.wy > gpu.limits.get("max-compute-invocations-per-workgroup", 256):
            raise GpuError(f"matmul tile {self}: {self.wx * self.wy} threads exceed the adapter's limit")
        if self.shared_bytes > gpu.limits.get("max-compute-workgroup-storage-size", 16384):
            raise GpuError(
                f"matmul tile {self}: {self.shared_bytes} bytes of workgroup memory exceed the limit"
            )

    def templates(self, b_dtype: str = "f32") -> dict:
        """The `{{name}}` values of matmul.wgsl for this tile: sizes plus the generated straight-line code;
        `b_dtype` "f16" reads B as array<f16> (and enables the f16 extension)."""
        mq, nq = self.tm // 4, self.tn // 4  # vec4 groups of rows (of As) and of columns (of Bs) per thread
        acc = [(i, r, j) for i in range(mq) for r in range(4) for j in range(nq)]
        name = "acc_{}{}_{}".format
        comp = "xyzw"
        decl = [f"    var {name(i, r, j)} = vec4<f32>(0.0);" for i, r, j in acc]

        def products(kk: str, ind: str) -> list[str]:
            # one k of the step: TM/4 + TN/4 vec4 loads from shared memory, TM*TN/4 vec4 FMAs
            out = [f"{ind}let a{i} = As[{kk}SA + ty + {i}u * WY];" for i in range(mq)]
            out += [f"{ind}let b{j} = Bs[{kk}SB + tx + {j}u * WX];" for j in range(nq)]
            out += [
                f"{ind}{name(i, r, j)} = fma(vec4<f32>(a{i}.{comp[r]}), b{j}, {name(i, r, j)});"
                for i, r, j in acc
            ]
            return out

        if self.unroll:  # braces scope each k's loads, so the names repeat
            inner = [
                line
                for kk in range(self.bk)
                for line in ["        {", *products(f"{kk}u * ", "            "), "        }"]
            ]
        else:
            inner = [
                "        for (var kk = 0u; kk < BK; kk++) {",
                *products("kk * ", "            "),
                "        }",
            ]
        # the vec4 copies of one k step: (operand, copy s of this thread) for slots t + s*NT of As and Bs
        nt = self.wx * self.wy
        slots = [
            (x, s)
            for x, n in (("a", self.bk * self.bm), ("b", self.bk * self.bn))
            for s in range(-(-n // (4 * nt)))
        ]

        def fetch(x: str, s: int, k0: str) -> str:
            return f"fetch_{x}(base_{x}, {'m0' if x == 'a' else 'n0'}, {k0}, t + {s}u * NT)"

        def stash(ind: str, value) -> list[str]:  # this thread's copies into shared memory
            return [f"{ind}stash_{x}(t + {s}u * NT, {value(x, s)});" for x, s in slots]

        def reg(x: str, s: int) -> str:
            return f"p{x}{s}"

        refill = [f"p{x}{s} = {fetch(x, s, 'k0 + BK')};" for x, s in slots]
        head = [f"    var p{x}{s} = {fetch(x, s, 'k_begin')};" for x, s in slots] if self.prefetch else []
        loop = "    for (var k0 = k_begin; k0 < k_end; k0 += BK) {"
        i8, i12 = " " * 8, " " * 12
        if self.prefetch:  # registers p<x><s> carry the next step's copies across its products
            kloop = [*head, loop, *stash(i8, reg), f"{i8}workgroupBarrier();",
                     f"{i8}if (k0 + BK < k_end) {{", *(i12 + r for r in refill), f"{i8}}}",
                     *inner, f"{i8}workgroupBarrier();", "    }"]  # fmt: skip
        else:
            kloop = [loop, *stash(i8, lambda x, s: fetch(x, s, "k0")), f"{i8}workgroupBarrier();",
                     *inner, f"{i8}workgroupBarrier();", "    }"]  # fmt: skip
        store = [
            f"    store4(base_c, m0 + 4u * (ty + {i}u * WY) + {r}u, n0 + 4u * (tx + {j}u * WX), {name(i, r, j)});"
            for i, r, j in acc
        ]
        return {
            "wx": self.wx,
            "wy": self.wy,
            "bk": self.bk,
            "bmv": self.bm // 4,
            "bnv": self.bn // 4,
            "as_len": self.bk * (self.bm // 4 + 1),
            "bs_len": self.bk * (self.bn // 4 + 1),
            "acc_decl": "\n".join(decl),
            "kloop": "\n".join(kloop),
            "store": "\n".join(store),
            "b_array": b_dtype,
            "enable": "enable f16;" if b_dtype == "f16" else "",
        }


SMALL_TILE = Tile()  # 64 x 64 per workgroup, 4 x 4 per thread (the lavapipe shape)
LARGE_TILE = Tile(tm=8, tn=8, bk=16)  # 128 x 128 per workgroup, 8 x 8 per thread (the H200 shape)


# Fewest LARGE_TILE workgroups for which the large tile is used: below this a product has too few
# workgroups to fill the device and the small tile's 4x as many win. Measured (GPU timestamps):
# - H200 (Vulkan): 8x8 tile 24-26 TFLOP/s vs 19-21 for 4x4 on 4096^3, 8192^3, 16384x768x768 and
#   16384x2048x768 (768 or more large workgroups); but the dW products 768x768x16384 (36 large workgroups)
#   and 2048x768x16384 (96) ran at 4.6 / 12.4 TFLOP/s with 8x8 vs 8.1 / 17.0 with 4x4. So 256 for GPUs.
# - lavapipe (2 cores): the large tile is already faster at 4 workgroups: 512^3 in 17 vs 31 ms,
#   1024x256x256 in 9 vs 16 ms, 256x192x64 in 1.4 vs 1.7 ms.
LARGE_TILE_MIN_GROUPS = {"CPU": 4}
LARGE_TILE_MIN_GROUPS_GPU = 256


def pick_tile(gpu, M: int, N: int, batch: int = 1) -> Tile:
    """The tile `matmul` uses when none is given: LARGE_TILE where it yields enough workgroups and fits the
    adapter's workgroup memory, else SMALL_TILE. Every tile sums each C element in the same k order."""
    need = LARGE_TILE_MIN_GROUPS.get(gpu.info.get("type", ""), LARGE_TILE_MIN_GROUPS_GPU)
    groups = -(-M // LARGE_TILE.bm) * -(-N // LARGE_TILE.bn) * batch
    fits = LARGE_TILE.shared_bytes <= gpu.limits.get("max-compute-workgroup-storage-size", 16384)
    return LARGE_TILE if groups >= need and fits else SMALL_TILE


B_DTYPES = {"f32": 4, "f16": 2}  # element bytes of B


def _b_itemsize(gpu, b_dtype: str) -> int:
    if b_dtype not in B_DTYPES:
        raise GpuError(f"matmul: b_dtype {b_dtype!r} is not one of {list(B_DTYPES)}")
    if b_dtype == "f16" and "shader-f16" not in gpu.features:
        raise GpuError(f"matmul: f16 weights need the adapter feature shader-f16, which {gpu.name} lacks")
    return B_DTYPES[b_dtype]


def kernel(gpu, trans_a: bool, trans_b: bool, tile: Tile, b_dtype: str = "f32"):
    """The compiled `matmul` entry point for one layout, tile and B element type (cached by the device
    layer)."""
    _b_itemsize(gpu, b_dtype)
    tile.validate(gpu)
    return gpu.kernel(
        SHADER,
        "matmul",
        "rrwu",
        constants={"TRANS_A": int(trans_a), "TRANS_B": int(trans_b)},
        templates=tile.templates(b_dtype),
        workgroup=(tile.wx, tile.wy, 1),
        uniforms=UNIFORMS,
    )


def auto_split_k(gpu, M: int, N: int, K: int, batch: int) -> int:
    """How many K slices `matmul` uses when the caller doesn't say: 1 on CPU adapters, for batched products
    and for products that already fill the GPU."""
    if gpu.info.get("type", "") == "CPU" or batch != 1:
        return 1
    groups = -(-M // LARGE_TILE.bm) * -(-N // LARGE_TILE.bn)
    if groups >= SPLIT_K_BELOW_GROUPS:
        return 1
    counts = range(1, max(1, min(SPLIT_K_MAX, K // SPLIT_K_MIN_SLICE)) + 1)
    return min(counts, key=lambda p: (split_k_cost(groups, K, p), p))


def split_k_slices(K: int, parts: int) -> tuple[int, int, int]:
    """(slice length, full slices, remainder) of K cut into `parts`: slices are multiples of 64 elements,
    which keeps the short last slice's view offset 256-byte aligned."""
    ks = _ceil(_ceil(K, parts), 64) * 64
    return ks, K // ks, K - (K // ks) * ks


def split_k_cost(groups: int, K: int, parts: int, slots: int = SPLIT_K_SLOTS) -> int:
    """Estimated time of a product with `groups` output tiles as `parts` K slices, in k elements walked by
    the slowest wave: the full slices run as one launch and a short last slice as another, each in waves of
    `slots` workgroups (SPLIT_K_SLOTS for the SIMT tile, TC_SPLIT_SLOTS for the matrix units'). Measured on the H200 (768x768x16384, 36 tiles): 15 slices (14 of 1152 + 256,
    cost 2560) took 0.53 ms where 16 equal slices of 1024 (576 workgroups, 3 waves, cost 3072) took 0.81."""
    ks, full, rest = split_k_slices(K, parts)
    waves = lambda n: -(-n // slots)  # noqa: E731
    return waves(groups * full) * ks + (waves(groups) * rest if rest else 0)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _scratch(gpu, nbytes: int):
    """A partials buffer shared by every split-K product of this device: products run one after another
    within a step (wgpu orders dependent dispatches), so one buffer of the largest size needed serves all."""
    cache = gpu.__dict__.setdefault("_splitk_scratch", {})
    size = 1 << max(16, (int(nbytes) - 1).bit_length())
    if size not in cache:
        cache[size] = gpu.buffer(size, label="splitk_partials")
    return cache[size]


def _split_k(
    gpu,
    c,
    a,
    b,
    M,
    N,
    K,
    trans_a,
    trans_b,
    accumulate,
    alpha,
    lda,
    ldb,
    parts,
    tile,
    b_dtype="f32",
) -> Call:
    """C (+)= alpha * op(A) op(B) as `parts` products over K slices plus a fixed-order reduction."""
    ks, full, rest, pstride, scratch, sa, sb = _slices(gpu, M, N, K, parts, trans_a, trans_b, lda, ldb)
    parts = full + (rest > 0)
    part_bytes = M * N * 4
    call = matmul(
        gpu,
        scratch,
        a,
        b,
        M,
        N,
        ks,
        trans_a,
        trans_b,
        batch=Batch(full, a=Strides(sa), b=Strides(sb), c=Strides(pstride)),
        lda=lda,
        ldb=ldb,
        tile=tile or pick_tile(gpu, M, N, full),
        split_k=1,
        b_dtype=b_dtype,
    )
    if rest:  # the short last slice
        a_view = _offset_view(a, full * sa)
        b_view = _offset_view(b, full * sb, B_DTYPES[b_dtype])
        if a_view is None or b_view is None:
            return None
        call += matmul(
            gpu,
            (scratch, full * pstride * 4, part_bytes),
            a_view,
            b_view,
            M,
            N,
            rest,
            trans_a,
            trans_b,
            lda=lda,
            ldb=ldb,
            tile=tile,
            split_k=1,
            b_dtype=b_dtype,
        )
    return call + _reduce_slices(gpu, scratch, c, M * N, parts, pstride, accumulate, alpha)


def _slices(gpu, M, N, K, parts, trans_a, trans_b, lda, ldb) -> tuple:
    """A split-K product's layout, shared by both GEMMs: K cut into `parts` (`split_k_slices`: full slices of
    ks and the remainder, if any, one more product), the elements between slices' partials (256-byte aligned
    slots), the partials buffer, and how far slice s moves A and B: ks columns of op(A) (a column offset when A
    is (M, K), ks rows when stored (K, M)) and ks rows of op(B)."""
    ks, full, rest = split_k_slices(K, parts)
    pstride = -(-(M * N) // 64) * 64
    scratch = _scratch(gpu, (full + (rest > 0)) * pstride * 4)
    return ks, full, rest, pstride, scratch, (ks * lda if trans_a else ks), (ks if trans_b else ks * ldb)


def _reduce_slices(gpu, scratch, c, n: int, parts: int, pstride: int, accumulate: bool, alpha: float) -> Call:
    """C (+)= alpha * the sum of `parts` partial products, slot by slot in a fixed order (no atomics)."""
    k = gpu.kernel(
        SHADER,
        "splitk_reduce",
        "rwu",
        templates=SMALL_TILE.templates(),
        workgroup=(256, 1, 1),
        uniforms=UNIFORMS,
    )
    u = gpu.uniform(
        REDUCE_PARAMS,
        n=n,
        parts=parts,
        stride=pstride,
        accumulate=int(accumulate),
        alpha=alpha,
        label="splitk",
    )
    return Call([(k, gpu.bind(k, (scratch, 0, parts * pstride * 4), c, u), -(-n // 256))], [u])


def auto_split_k_tc(gpu, cfg, tile, M: int, N: int, K: int) -> int:
    """K slices for a product on the matrix units (`_split_k_tc`), chosen as `auto_split_k` chooses them but
    counting the matrix-unit tile's workgroups, TC_SPLIT_SLOTS resident at once."""
    bm, bn = tile.block(cfg)
    groups = -(-M // bm) * -(-N // bn)
    if gpu.info.get("type", "") == "CPU" or groups >= TC_SPLIT_SLOTS:
        return 1
    counts = range(1, max(1, min(SPLIT_K_MAX, K // SPLIT_K_MIN_SLICE)) + 1)
    return min(counts, key=lambda p: (split_k_cost(groups, K, p, TC_SPLIT_SLOTS), p))


def _split_k_tc(gpu, c, a, b, M, N, K, trans_a, trans_b, accumulate, alpha, lda, ldb, offs, parts, b_dtype,
                cfg, tile) -> Call:  # fmt: skip
    """`_split_k` on the matrix units: the full slices are one batched `matmul_tc` (a slice's offsets are its
    batch strides), the short last slice one more at its element offsets, each into its partials slot; then
    the same fixed-order reduction."""
    ks, full, rest, pstride, scratch, sa, sb = _slices(gpu, M, N, K, parts, trans_a, trans_b, lda, ldb)
    common = dict(lda=lda, ldb=ldb, ldc=N, b_dtype=b_dtype, cfg=cfg, tile=tile)
    call = k_tc.matmul_tc(gpu, scratch, a, b, M, N, ks, trans_a, trans_b, offsets=(offs[0], offs[1], 0),
                          strides=(sa, sb, pstride), batch=full, **common)  # fmt: skip
    if rest:
        call += k_tc.matmul_tc(gpu, scratch, a, b, M, N, rest, trans_a, trans_b,
                               offsets=(offs[0] + full * sa, offs[1] + full * sb, full * pstride), **common)  # fmt: skip
    return call + _reduce_slices(gpu, scratch, c, M * N, full + (rest > 0), pstride, accumulate, alpha)


def _offset_view(res, elements: int, itemsize: int = 4):
    """`res` advanced by `elements` items, or None when the offset breaks the binding alignment."""
    buf, off, size = res if isinstance(res, tuple) else (res, 0, res.size)
    shift = itemsize * elements
    if shift % 256 or shift >= size:
        return None
    return (buf, off + shift, size - shift)


def _check_fits(
    what: str, res, batch: int, inner: int, s: Strides, rows: int, cols: int, ld: int, itemsize: int = 4
) -> None:
    """Raise if the last element this GEMM touches lies outside the bound buffer (or view): the shader's
    bounds checks would otherwise clamp silently (or, in a trusted module, read out of bounds)."""
    if rows == 0 or cols == 0:
        return
    if ld < cols:
        raise GpuError(f"matmul: {what} row stride {ld} is smaller than its {cols} columns")
    last = s.off + (batch // inner - 1) * s.stride + ((inner - 1) // s.div) * s.istride
    need = itemsize * (last + (rows - 1) * ld + cols)
    if need > _nbytes(res):
        raise GpuError(f"matmul: {what} needs {need} bytes, its buffer/view has {_nbytes(res)}")


@dataclass(frozen=True)
class Strides:
    """Where one operand of a batched `matmul` lies in its buffer, in elements: product z = zo * inner + zi
    (see `Batch`) starts at off + zo * stride + (zi // div) * istride."""

    stride: int = 0
    istride: int = 0
    off: int = 0
    div: int = 1


@dataclass(frozen=True)
class Batch:
    """The products of one `matmul` launch: `count` of them, in `count // inner` groups of `inner` (the
    two-level batch of per-(batch, head) products of (B, T, H, D) tensors), each operand placed by its
    `Strides`. C's `div` must be 1."""

    count: int = 1
    inner: int = 1
    a: Strides = Strides()
    b: Strides = Strides()
    c: Strides = Strides()


def matmul(
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
    batch: Batch = Batch(),
    causal: str | None = None,
    tile: Tile | None = None,
    split_k: int | None = None,
    b_dtype: str = "f32",
) -> Call:
    """C = alpha * op(A) * op(B) (+ C when `accumulate`), for the products of `batch` (one by default).
    `lda`, `ldb`, `ldc` are the row strides (in elements) of the stored matrices; they default to packed rows
    (A: K, or M when trans_a; B: N, or K when trans_b; C: N). `c` must be a different buffer from `a` and
    `b`. `tile` defaults to `pick_tile`. `split_k` slices K into that many products plus a reduction (None:
    `auto_split_k`; only for packed, unbatched C). `b_dtype` "f16": B holds f16 values (converted to f32 on
    load; needs shader-f16).

    `causal` (square positions x positions products of attention): "skip_upper" leaves the C tiles wholly
    above the diagonal unwritten, "k_to_row" stops the k loop after each tile's last row (op(A) zero for
    k > m), "k_from_row" starts it at the tile's first row (op(A) zero for k < m)."""
    sa, sb, sc = batch.a, batch.b, batch.c
    div_a, div_b = sa.div, sb.div
    M, N, K, inner = int(M), int(N), int(K), int(batch.inner)
    batch = int(batch.count)
    if min(M, N, K, batch) < 0:
        raise GpuError(f"matmul: negative size M={M} N={N} K={K} batch={batch}")
    if inner < 1 or batch % inner or min(div_a, div_b) < 1 or sc.div != 1 or causal not in CAUSAL_MODES:
        raise GpuError(f"matmul: bad batch split batch={batch} inner={inner} div={div_a},{div_b} {causal=}")
    lda = int(lda if lda is not None else (M if trans_a else K))
    ldb = int(ldb if ldb is not None else (K if trans_b else N))
    ldc = int(ldc if ldc is not None else N)
    if M == 0 or N == 0 or batch == 0:
        return Call()
    _check_fits("A", a, batch, inner, sa, *((K, M) if trans_a else (M, K)), lda)
    _check_fits("B", b, batch, inner, sb, *((N, K) if trans_b else (K, N)), ldb, _b_itemsize(gpu, b_dtype))
    _check_fits("C", c, batch, inner, sc, M, N, ldc)
    cfg = k_tc.usable_config(gpu)
    if cfg is not None and tile is None and split_k in (None, 1):
        # on the matrix units (ops/matmul_tc.py): operands rounded to f16, sums in f32; a long K with few
        # blocks of C (dW of a narrow model: 768 x 768 is 18 workgroups) is sliced as on the SIMT path
        tc_tile = k_tc.pick_tile(gpu, cfg)
        if split_k is None and batch == 1 and inner == 1 and causal is None and ldc == N and sc.off == 0:
            parts = auto_split_k_tc(gpu, cfg, tc_tile, M, N, K)
            if parts > 1:
                return _split_k_tc(gpu, c, a, b, M, N, K, trans_a, trans_b, accumulate, alpha, lda, ldb,
                                   (sa.off, sb.off), parts, b_dtype, cfg, tc_tile)  # fmt: skip
        return k_tc.matmul_tc(gpu, c, a, b, M, N, K, trans_a, trans_b, accumulate, alpha, lda, ldb, ldc,
                              offsets=(sa.off, sb.off, sc.off), strides=(sa.stride, sb.stride, sc.stride),
                              batch=batch, inner=inner, divs=(div_a, div_b),
                              istrides=(sa.istride, sb.istride, sc.istride), causal=CAUSAL_MODES[causal],
                              b_dtype=b_dtype, cfg=cfg, tile=tc_tile)  # fmt: skip
    plain = inner == 1 and causal is None and sa.off == sb.off == sc.off == 0
    parts = auto_split_k(gpu, M, N, K, batch) if split_k is None else int(split_k)
    if parts > 1 and batch == 1 and ldc == N and 2 * parts <= K and plain:
        call = _split_k(
            gpu,
            c,
            a,
            b,
            M,
            N,
            K,
            trans_a,
            trans_b,
            accumulate,
            alpha,
            lda,
            ldb,
            parts,
            tile,
            b_dtype,
        )
        if call is not None:
            return call
    tile = tile or pick_tile(gpu, M, N, batch)
    groups = (-(-N // tile.bn), -(-M // tile.bm), batch)
    if max(groups) > MAX_GROUPS:
        raise GpuError(f"matmul: {groups} workgroups exceed {MAX_GROUPS} per dimension; split the product")
    k = kernel(gpu, trans_a, trans_b, tile, b_dtype)
    u = gpu.uniform(
        PARAMS,
        M=M,
        N=N,
        K=K,
        lda=lda,
        ldb=ldb,
        ldc=ldc,
        stride_a=sa.stride,
        stride_b=sb.stride,
        stride_c=sc.stride,
        batch=batch,
        accumulate=int(accumulate),
        alpha=alpha,
        inner=inner,
        div_a=div_a,
        div_b=div_b,
        istride_a=sa.istride,
        istride_b=sb.istride,
        istride_c=sc.istride,
        off_a=sa.off,
        off_b=sb.off,
        off_c=sc.off,
        causal=CAUSAL_MODES[causal],
        label="matmul",
    )
    return Call(dispatches=[(k, gpu.bind(k, a, b, c, u), groups)], uniforms=[u])


def linear_forward(
    gpu,
    out,
    x,
    w,
    rows: int,
    out_features: int,
    in_features: int,
    w_dtype: str = "f32",
    split_k: int | None = None,
) -> Call:
    """out (rows, OUT) = x (rows, IN) @ w (OUT, IN)^T; `w_dtype` "f16" reads f16 weights; `split_k` as `matmul`'s."""
    return matmul(
        gpu, out, x, w, rows, out_features, in_features, trans_b=True, b_dtype=w_dtype, split_k=split_k
    )


def linear_backward(
    gpu,
    dx,
    dw,
    dout,
    x,
    w,
    rows: int,
    out_features: int,
    in_features: int,
    accumulate_dx: bool = False,
    accumulate_dw: bool = False,
) -> Call:
    """dx (rows, IN) (+)= dout (rows, OUT) @ w (OUT, IN); dw (OUT, IN) (+)= dout^T @ x (rows, IN).
    `dx=None` skips the input gradient (e.g. when x is the embedding output of a frozen input)."""
    call = Call()
    if dx is not None:
        call += matmul(gpu, dx, dout, w, rows, in_features, out_features, accumulate=accumulate_dx)
    call += matmul(
        gpu,
        dw,
        dout,
        x,
        out_features,
        in_features,
        rows,
        trans_a=True,
        accumulate=accumulate_dw,
    )
    return call
