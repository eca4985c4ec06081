"""Launchers for `shaders/embedding.wgsl`: the token-embedding gather and its deterministic backward.

The backward needs, each step, the token positions sorted by id and the bucket bounds; the host has the ids
anyway, so `embedding_buckets(ids, V)` computes them with numpy and the step writes them into two u32
buffers (`gpu.write(order_buf, order)`, `gpu.write(starts_buf, starts)`) bound once by
`embedding_backward`. Each dwte element is then written by exactly one thread, in a fixed order (llm.c's
bucketed wte backward; style rule 9): two runs give the same bits. Rows move as vec4<f32> when C % 4 == 0.

Cost: a bucket is summed by one thread per channel (four interleaved partial sums), so the step's most
frequent token sets the backward's time. Measured on the H200 (V 50304, C 768, 16384 tokens): 1.2 ms with
one id 2000 times, 1.6 ms for Zipf(1.2) ids (largest bucket 2972); real text's top token is a few percent
of the tokens. Splitting long buckets over a workgroup (a fixed-order tree) is the next step if it matters.

What it does not do: position embeddings, or a table wider than one binding (a GPT-2-sized table does not
fit lavapipe's 128 MiB binding; wgpu.md §1).
"""

from __future__ import annotations

import numpy as np

from ddl_wgpu.gpu import Call, Gpu
from ddl_wgpu.ops.elementwise import need, templates, vec_width

FILE = "embedding.wgsl"
WG = 256  # threads per workgroup, as in the shader
PARAMS = "uuu"  # Params {rows, C, accumulate}; C in items of the shader's type (C / 4 on the vec4 path)


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


def embedding_forward(gpu: Gpu, out, ids, wte, n_tokens: int, C: int) -> Call:
    """out (n_tokens, C) = wte[ids]; ids (n_tokens,) u32, wte (V, C). An id >= V gives a zero row."""
    n_tokens, C = int(n_tokens), int(C)
    need("embedding_forward", "out", out, n_tokens * C)
    need("embedding_forward", "ids", ids, n_tokens)
    width = vec_width(C, wte, out)
    k = gpu.kernel(FILE, "embedding_forward", "rrwu", templates=templates(width), workgroup=(WG, 1, 1))
    u = gpu.uniform(PARAMS, n_tokens, C // width, 0, label="embedding_forward")
    return Call([(k, gpu.bind(k, ids, wte, out, u), max(1, -(-n_tokens * C // width // WG)))], [u])


def embedding_backward(gpu: Gpu, dwte, dout, order, starts, V: int, C: int, accumulate: bool = True) -> Call:
    """dwte (V, C) (+)= per-id sums of dout (n_tokens, C), from `embedding_buckets`' order and starts.

    With `accumulate` (the default: with tied embeddings the LM head's gradient may already be in dwte) rows
    of unseen ids are left untouched; without it every row is overwritten (unseen ones with 0).
    """
    V, C = int(V), int(C)
    need("embedding_backward", "dwte", dwte, V * C)
    need("embedding_backward", "starts", starts, V + 1)
    width = vec_width(C, dwte, dout)
    k = gpu.kernel(FILE, "embedding_backward", "rrrwu", templates=templates(width), workgroup=(WG, 1, 1))
    u = gpu.uniform(PARAMS, V, C // width, int(bool(accumulate)), label="embedding_backward")
    return Call([(k, gpu.bind(k, dout, order, starts, dwte, u), max(1, -(-V * C // width // WG)))], [u])
