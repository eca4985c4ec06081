"""Launchers for `shaders/embedding.wgsl`: the token-embedding gather and its deterministic backward.

Kernel path: `shaders/embedding.wgsl` -> `ddl_wgpu/ops/embedding.py` -> reference
`ddl_ref.ops.embedding_forward`, `ddl_ref.ops.embedding_backward` -> test `tests/test_kernel_embedding.py`.

The backward needs, each step, the token positions sorted by id and the bucket bounds; the host has the ids
anyway, so `embedding_buckets(ids, V)` computes them with numpy and the step writes them into two u32
buffers (`gpu.write(order_buf, order)`, `gpu.write(starts_buf, starts)`) bound once by
`embedding_backward`. Each dwte element is then written by exactly one thread, in a fixed order (llm.c's
bucketed wte backward; docs/kernels.md#deterministic-reductions): two runs give the same bits. Rows move as
vec4<f32> when C % 4 == 0.

Cost: a bucket is summed by one thread per channel (four interleaved partial sums), so the step's most
frequent token sets the backward's time. Measured on the H200 (V 50304, C 768, 16384 tokens): 1.2 ms with
one id 2000 times, 1.6 ms for Zipf(1.2) ids (largest bucket 2972); real text's top token is a few percent
of the tokens. Splitting long buckets over a workgroup (a fixed-order tree) is the next step if it matters.

A table larger than one storage binding (a 150 K vocabulary at d 4096 is 2.5 GB in f32) is bound in row
chunks (`net.Net.row_views`): the forward runs `embedding_forward_range` once per chunk (each writes only
the rows of its ids), the backward runs `embedding_backward(..., v0=row0)` once per chunk with that chunk's
rows of the gradient, reading the buckets v0 .. v0 + rows of the one `starts` array. Every dwte element is
still written by one thread, so the result stays deterministic.

f16 tables (`w_dtype="f16"`, forward only: the inference Net's f16 embedding): the gather reads f16 (or
vec4<f16>) items and writes f32 rows; it needs the adapter feature shader-f16. The backward is f32 only.

What it does not do: position embeddings.
"""

from __future__ import annotations

import numpy as np

from ddl_wgpu.ops.elementwise import need, templates, vec_width
from ddl_wgpu.runtime.gpu import Call, Gpu, GpuError, Uniform

FILE = "embedding.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = Uniform(
    "Params",
    ("rows", "u32", "forward: n_tokens; backward: V (the rows of this chunk of the table)"),
    ("C", "u32", "channels per row, in items of F (C / 4 on vec4)"),
    ("accumulate", "u32", "backward: 1 adds into dwte, 0 overwrites it"),
    ("v0", "u32", "first table row bound (row chunks); 0 for a whole table"),
    ("hi", "u32", "forward_range: ids >= hi belong to later chunks (0xFFFFFFFF for the last chunk)"),
)
ALL = 0xFFFFFFFF  # `hi` of the last row chunk: every id from v0 on


def _templates(width: int, w_dtype: str = "f32") -> dict:
    """Templates of embedding.wgsl: F (rows, gradients) is f32 / vec4<f32>; W (the forward's table) the
    same in f32, or f16 / vec4<f16> for an f16 table."""
    t = templates(width)
    if w_dtype == "f32":
        return {**t, "W": t["F"], "enable": ""}
    if w_dtype != "f16":
        raise GpuError(f"embedding: table dtype {w_dtype!r} is not f32 or f16")
    return {**t, "W": "vec4<f16>" if width == 4 else "f16", "enable": "enable f16;"}


def _check_f16(gpu: Gpu, w_dtype: str) -> None:
    if w_dtype == "f16" and "shader-f16" not in gpu.features:
        raise GpuError(
            f"embedding: an f16 table needs the adapter feature shader-f16, which {gpu.name} lacks"
        )


def embedding_buckets(ids, V: int) -> tuple[np.ndarray, np.ndarray]:
    """ids (any shape) of one step -> (order (n_tokens,) u32, starts (V + 1,) u32).

    order lists the flat token positions sorted by id, stably (equal ids keep their position order), so
    bucket v is order[starts[v]:starts[v + 1]].
    """
    flat = np.asarray(ids).reshape(-1).astype(np.int64)
    if flat.size and (flat.min() < 0 or flat.max() >= V):
        raise ValueError(f"token ids must lie in [0, {V}), got [{flat.min()}, {flat.max()}]")
    order = np.argsort(flat, kind="stable").astype(np.uint32)
    starts = np.zeros(V + 1, np.uint32)
    np.cumsum(np.bincount(flat, minlength=V), out=starts[1:])
    return order, starts


def embedding_forward(gpu: Gpu, out, ids, wte, n_tokens: int, C: int, w_dtype: str = "f32") -> Call:
    """out (n_tokens, C) = wte[ids]; ids (n_tokens,) u32, wte (V, C) of `w_dtype` (f32 or f16). An id >= V
    gives a zero row."""
    n_tokens, C = int(n_tokens), int(C)
    need("embedding_forward", "out", out, n_tokens * C)
    need("embedding_forward", "ids", ids, n_tokens)
    _check_f16(gpu, w_dtype)
    width = vec_width(C, wte, out)
    k = gpu.kernel(
        FILE,
        "embedding_forward",
        "rrwu",
        templates=_templates(width, w_dtype),
        workgroup=(WG, 1, 1),
        uniforms=(PARAMS,),
    )
    u = gpu.uniform(
        PARAMS, rows=n_tokens, C=C // width, accumulate=0, v0=0, hi=ALL, label="embedding_forward"
    )
    return Call([(k, gpu.bind(k, ids, wte, out, u), max(1, -(-n_tokens * C // width // WG)))], [u])


def embedding_forward_range(
    gpu: Gpu,
    out,
    ids,
    wte_rows,
    n_tokens: int,
    C: int,
    v0: int,
    rows: int,
    last: bool = False,
    w_dtype: str = "f32",
) -> Call:
    """The rows of out (n_tokens, C) whose id lies in [v0, v0 + rows) = wte_rows[id - v0]; wte_rows
    (rows, C) is one row chunk of the table. Other rows of `out` are left untouched, so one call per chunk
    writes every row once. `last`: ids past the chunk (past the table) give zero rows, as in
    `embedding_forward`."""
    n_tokens, C, v0, rows = int(n_tokens), int(C), int(v0), int(rows)
    need("embedding_forward_range", "out", out, n_tokens * C)
    need("embedding_forward_range", "ids", ids, n_tokens)
    _check_f16(gpu, w_dtype)
    need("embedding_forward_range", "wte_rows", wte_rows, rows * C * (2 if w_dtype == "f16" else 4) // 4)
    width = vec_width(C, wte_rows, out)
    t = _templates(width, w_dtype)
    k = gpu.kernel(
        FILE, "embedding_forward_range", "rrwu", templates=t, workgroup=(WG, 1, 1), uniforms=(PARAMS,)
    )
    hi = ALL if last else v0 + rows
    u = gpu.uniform(
        PARAMS, rows=n_tokens, C=C // width, accumulate=0, v0=v0, hi=hi, label="embedding_forward_range"
    )
    return Call([(k, gpu.bind(k, ids, wte_rows, out, u), max(1, -(-n_tokens * C // width // WG)))], [u])


def embedding_backward(
    gpu: Gpu, dwte, dout, order, starts, V: int, C: int, accumulate: bool = True, v0: int = 0
) -> Call:
    """dwte (V, C) (+)= per-id sums of dout (n_tokens, C), from `embedding_buckets`' order and starts.

    With `accumulate` (the default: with tied embeddings the LM head's gradient may already be in dwte) rows
    of unseen ids are left untouched; without it every row is overwritten (unseen ones with 0).
    Row chunks: `dwte` holds the V rows from table row `v0` (ids v0 .. v0 + V - 1); `starts` is the whole
    table's, so the chunk's buckets are starts[v0 .. v0 + V].
    """
    V, C, v0 = int(V), int(C), int(v0)
    need("embedding_backward", "dwte", dwte, V * C)
    need("embedding_backward", "starts", starts, v0 + V + 1)
    width = vec_width(C, dwte, dout)
    k = gpu.kernel(
        FILE,
        "embedding_backward",
        "rrrwu",
        templates=_templates(width),
        workgroup=(WG, 1, 1),
        uniforms=(PARAMS,),
    )
    u = gpu.uniform(
        PARAMS,
        rows=V,
        C=C // width,
        accumulate=int(bool(accumulate)),
        v0=v0,
        hi=0,
        label="embedding_backward",
    )
    return Call([(k, gpu.bind(k, dout, order, starts, dwte, u), max(1, -(-V * C // width // WG)))], [u])
