"""Deterministic reductions (`shaders/reduce.wgsl`): gradient norm and clip multiplier, and plain sums.

Kernel path: `shaders/reduce.wgsl` -> `ddl_wgpu/ops/reduce.py` -> reference `ddl_ref.optim.global_grad_norm`,
`ddl_ref.optim.clip_multiplier` -> test `tests/test_kernel_reduce.py`.

Global gradient norm over several flat ranges (one per arena or per tensor), with nothing read back:

    partials = gpu.buffer(4 * total_partials([n1, n2, n3]))
    scalars = gpu.buffer(SCALARS_BYTES)                    # see finalize_clip
    call = grad_norm_clip(gpu, scalars, partials, [(g1, n1), (g2, n2), (g3, n3)], clip=1.0)

`grad_norm_clip` is `sum_squares` per range (each writing its own slice of `partials`, at consecutive
offsets) followed by one `finalize_clip`. AdamW (`ops/adamw.py`) reads the clip multiplier and the
finite flag straight from `scalars`. The engine reads `scalars` (and the loss) after a step, if at all.

Per-tensor clipping (`tensor_norm_clip`, the reference trainer's rule) sums each tensor's squares into its
own slice of `partials`, reduces them all once for the global norm and finite flag (`finalize_clip`), then
each tensor's slice for its own norm and multiplier (`finalize_tensors`), one 256-byte record per tensor
that AdamW binds as its `scalars`; reference `ddl_ref.optim.clip_multipliers`.

`sum_rows` reduces a row_loss buffer to one f32 (the batch loss sum) in a single workgroup, so it is meant
for row counts (up to ~1e6), not parameter counts.

Mixed precision (docs/precision.md) hands the finalize kernels a gradient of S * loss and `unscale` = 1 / S:
they report the unscaled norm and fold 1 / S into the multiplier AdamW applies (exact for a power-of-two S).

Launch sizes depend only on n, so results are bit-reproducible run to run.
"""

from __future__ import annotations

import numpy as np

from ddl_wgpu.ops import need_bytes as _need
from ddl_wgpu.runtime.gpu import Call, Uniform

FILE = "reduce.wgsl"
WG = 256
ELEMS_PER_GROUP = 2048  # a workgroup sums at least this many elements before the cap applies
MAX_GROUPS = 1024  # cap on partials per range (grid-stride beyond it)

SUM_SQUARES = Uniform("SumSquaresParams", ("n", "u32"), ("offset", "u32"), ("_a", "pad"), ("_b", "pad"))
FINALIZE = Uniform(
    "FinalizeParams", ("count", "u32"), ("clip", "f32"), ("unscale", "f32", "1 / loss scale"), ("_b", "pad")
)
SUM_ROWS = Uniform("SumRowsParams", ("n", "u32"), ("index", "u32"), ("_a", "pad"), ("_b", "pad"))
TENSOR_CLIP = Uniform(
    "TensorClipParams",
    ("tensors", "u32"),
    ("clip", "f32"),
    ("stride", "u32", "f32 per record"),
    ("unscale", "f32", "1 / loss scale"),
)
UNIFORMS = (SUM_SQUARES, FINALIZE, SUM_ROWS, TENSOR_CLIP)

# the `scalars` buffer written by finalize_clip: 4 f32 (norm, clip multiplier, finite flag, sum of squares)
SCALARS_BYTES = 16
# one tensor's record written by finalize_tensors: the layout of `scalars` in a 256-byte slot, so a storage
# view of it is offset-aligned on every adapter and AdamW binds it as its `scalars`
RECORD_BYTES = 256


def sum_squares_groups(n: int, max_groups: int = MAX_GROUPS) -> int:
    """How many partials `sum_squares` writes for a range of n elements (at least 1)."""
    return max(1, min(max_groups, -(-int(n) // ELEMS_PER_GROUP)))


def total_partials(sizes, max_groups: int = MAX_GROUPS) -> int:
    """Length of a partials buffer serving ranges of these sizes through `grad_norm_clip`."""
    return sum(sum_squares_groups(n, max_groups) for n in sizes)


def sum_squares(gpu, partials, x, n: int, offset: int = 0, max_groups: int = MAX_GROUPS) -> Call:
    """partials[offset + w] = sum of x[i]^2 over workgroup w's elements, w < sum_squares_groups(n).

    x: a buffer or view of at least n f32. `offset` is an element index into `partials`, so several
    ranges share one partials buffer (and one finalize_clip).
    """
    if n < 1:
        raise ValueError(f"sum_squares: n={n} must be positive")
    groups = sum_squares_groups(n, max_groups)
    _need("x", x, n * 4)
    _need("partials", partials, (offset + groups) * 4)
    k = gpu.kernel(FILE, "sum_squares", "rwu", workgroup=(WG, 1, 1), uniforms=UNIFORMS)
    u = gpu.uniform(SUM_SQUARES, n=n, offset=offset, label="sum_squares")
    bg = gpu.bind(k, x, partials, u)
    return Call([(k, bg, (groups, 1, 1))], [u])


def finalize_clip(gpu, scalars, partials, count: int, clip: float, unscale: float = 1.0) -> Call:
    """scalars[0..4) = (global norm, clip multiplier, finite flag, sum of squares) from partials[0..count).

    The clip threshold lives in the Call's uniform (`call.uniforms[0]`, FINALIZE); rewrite it with
    `gpu.write_fields(call.uniforms[0], FINALIZE, clip=new_clip)`.
    clip <= 0 disables clipping (multiplier 1).
    `unscale` (1 / S, the same uniform's field) for partials of a gradient scaled by the loss scale S: the
    norm is sqrt(sum) * unscale and the multiplier min(1, clip / norm) * unscale (the sum of squares stays
    the scaled gradient's); 1 gives the unscaled kernel's bits.
    """
    if count < 1:
        raise ValueError(f"finalize_clip: count={count} must be positive")
    _need("partials", partials, count * 4)
    _need("scalars", scalars, SCALARS_BYTES)
    k = gpu.kernel(FILE, "finalize_clip", "rwu", workgroup=(WG, 1, 1), uniforms=UNIFORMS)
    u = gpu.uniform(FINALIZE, count=count, clip=clip, unscale=unscale, label="finalize_clip")
    bg = gpu.bind(k, partials, scalars, u)
    return Call([(k, bg, (1, 1, 1))], [u])


def grad_norm_clip(
    gpu, scalars, partials, ranges, clip: float, max_groups: int = MAX_GROUPS, unscale: float = 1.0
) -> Call:
    """Global norm of several flat ranges [(buffer_or_view, n), ...] and its clip multiplier, into
    `scalars` (see finalize_clip). `partials` needs total_partials([n for _, n in ranges]) f32.
    The finalize uniform (clip, unscale) is the returned Call's last uniform."""
    call = Call()
    offset = 0
    for x, n in ranges:
        call = call + sum_squares(gpu, partials, x, n, offset=offset, max_groups=max_groups)
        offset += sum_squares_groups(n, max_groups)
    return call + finalize_clip(gpu, scalars, partials, offset, clip, unscale)


def finalize_tensors(gpu, records, partials, scalars, ranges, clip: float, unscale: float = 1.0) -> Call:
    """Per-tensor clipping: record t of `records` (RECORD_BYTES each) = (norm_t, min(1, clip / norm_t), the
    global finite flag scalars[2], sum of squares) from t's partials[start_t .. start_t + count_t); with
    `unscale` (1 / S, a TENSOR_CLIP field) norm_t = sqrt(sum_t) * unscale and the multiplier times unscale,
    as in `finalize_clip`.

    ranges: [(start_t, count_t)] into `partials` (what `sum_squares` wrote for tensor t); `scalars` is
    finalize_clip's output over the same partials (its finite flag, read on the GPU). The clip lives in
    `call.uniforms[0]` (TENSOR_CLIP: `gpu.write_fields(call.uniforms[0], TENSOR_CLIP, clip=new_clip)`);
    `call.uniforms[1]` keeps the ranges buffer alive."""
    ranges = [(int(a), int(c)) for a, c in ranges]
    if not ranges or min(c for _, c in ranges) < 1:
        raise ValueError("finalize_tensors: every tensor needs at least one partial")
    _need("partials", partials, max(a + c for a, c in ranges) * 4)
    _need("scalars", scalars, SCALARS_BYTES)
    _need("records", records, len(ranges) * RECORD_BYTES)
    if len(ranges) > 65535:
        raise ValueError(f"finalize_tensors: {len(ranges)} tensors, one dispatch takes at most 65535")
    table = gpu.upload(np.asarray(ranges, np.uint32).reshape(-1), label="clip_ranges")
    k = gpu.kernel(FILE, "finalize_tensors", "rrrwu", workgroup=(WG, 1, 1), uniforms=UNIFORMS)
    u = gpu.uniform(
        TENSOR_CLIP,
        tensors=len(ranges),
        clip=clip,
        stride=RECORD_BYTES // 4,
        unscale=unscale,
        label="finalize_tensors",
    )
    bg = gpu.bind(k, partials, table, scalars, records, u)
    return Call([(k, bg, (len(ranges), 1, 1))], [u, table])


def tensor_norm_clip(
    gpu, scalars, records, partials, tensors, clip: float, max_groups: int = MAX_GROUPS, unscale: float = 1.0
) -> Call:
    """Per-tensor clipping of several tensors, each given as its pieces [(buffer_or_view, n), ...] (a tensor
    larger than one binding comes in several): `sum_squares` per piece (a tensor's pieces at consecutive
    partials), `finalize_clip` over all (the global norm and finite flag into `scalars`, as in
    `grad_norm_clip`), then `finalize_tensors` (record t into `records`). `partials` needs
    total_partials of every piece's n. The clip uniforms (clip, unscale): FINALIZE at `call.uniforms[-3]`,
    TENSOR_CLIP at `call.uniforms[-2]`."""
    call = Call()
    offset = 0
    ranges = []
    for pieces in tensors:
        start = offset
        for x, n in pieces:
            call = call + sum_squares(gpu, partials, x, n, offset=offset, max_groups=max_groups)
            offset += sum_squares_groups(n, max_groups)
        ranges.append((start, offset - start))
    call = call + finalize_clip(gpu, scalars, partials, offset, clip, unscale)
    return call + finalize_tensors(gpu, records, partials, scalars, ranges, clip, unscale)


def sum_rows(gpu, out, x, n: int, index: int = 0) -> Call:
    """out[index] = sum of x[0..n) (one workgroup, fixed order). E.g. row_loss -> batch loss sum."""
    if n < 1:
        raise ValueError(f"sum_rows: n={n} must be positive")
    _need("x", x, n * 4)
    _need("out", out, (index + 1) * 4)
    k = gpu.kernel(FILE, "sum_rows", "rwu", workgroup=(WG, 1, 1), uniforms=UNIFORMS)
    u = gpu.uniform(SUM_ROWS, n=n, index=index, label="sum_rows")
    bg = gpu.bind(k, x, out, u)
    return Call([(k, bg, (1, 1, 1))], [u])
