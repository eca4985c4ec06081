"""The embedding table and the LM head of a net on the GPU, bound in row chunks where a table is larger than
one storage binding (`net.Net.row_views`); full logits never exist (`head_chunk_rows`).

`Vocab` builds the Calls of the embedding gather and its backward, and of the head product and its backward,
vocabulary chunk by vocabulary chunk. A tied head shares the embedding's chunks.
"""

from __future__ import annotations

import math

from ddl_wgpu.engine.layout import ALIGN, EMBED, F32
from ddl_wgpu.ops import embedding as k_emb
from ddl_wgpu.ops import matmul as k_mm
from ddl_wgpu.runtime.gpu import Call, GpuError


def head_chunk_rows(gpu, N: int, C: int, V: int) -> int:
    """Rows per chunk of the LM head over N rows (full logits never exist). Chunks are multiples of 64 rows
    (64·C·4 bytes keeps every chunk's view offset 256-aligned), bounded to 512 MiB of logits (half the binding
    limit on small adapters) and of equal height (no short last chunk of thin products). Tall chunks matter:
    the head's dx product has K = V, and a 320-row chunk gave the H200 only 15 workgroups (3.9 TFLOP/s; see
    commit 56c5f5d). Where 64 rows of logits do not fit the budget (lowered test limits), the smallest row
    count that keeps views aligned."""
    budget = min(512 << 20, gpu.max_binding // 2)
    fit = budget // (V * F32)
    step = 64 if fit >= 64 else ALIGN // math.gcd(ALIGN, C * F32)
    rows = max(step, fit // step * step)
    if rows < N:
        chunks = -(-N // rows)
        per = -(-N // chunks)
        rows = -(-per // step) * step
    return min(N, rows)


class Vocab:
    """The embedding gather and the LM head of `net` (a `net.Net`), in row chunks of their tables."""

    def __init__(self, net):
        self.net, self.gpu = net, net.gpu
        self.C, self.V = net.cfg.d_model, net.cfg.vocab_size
        self.split_k: int | None = None  # the head's K slices (`ops.matmul`; `blocks.Blocks.split_k`)

    def embed_forward(self, out, ids, n: int) -> Call:
        """out (n, C) = E[ids]; a table larger than a binding runs one range-gather per row chunk."""
        g, C = self.gpu, self.C
        chunks, dt = self.net.row_views(EMBED), self.net.wdtype(EMBED)
        if len(chunks) == 1:
            return k_emb.embedding_forward(g, out, ids, chunks[0][2], n, C, w_dtype=dt)
        call = Call()
        for j, (v0, rows, w) in enumerate(chunks):
            last = j == len(chunks) - 1
            call += k_emb.embedding_forward_range(g, out, ids, w, n, C, v0, rows, last=last, w_dtype=dt)
        return call

    def embed_backward(self, dout, order, starts) -> Call:
        """dE (+)= the bucketed sums of dout, one deterministic pass per row chunk of the gradient."""
        call = Call()
        for v0, rows, dw in self.net.row_views(EMBED, "g"):
            call += k_emb.embedding_backward(self.gpu, dw, dout, order, starts, rows, self.C, accumulate=True,
                                             v0=v0)  # fmt: skip
        return call

    def head_chunks(self) -> list[tuple[int, int, tuple, tuple]]:
        """The head's vocabulary chunks [(v0, rows, W view, dW view)]: one when it fits a binding. A frozen
        head (an inference Net, or no state kept for it) has no dW views (None)."""
        net = self.net
        pv = net.row_views(net.head_name, "p")
        frozen = net.inference or net.head_name not in net.has_state
        gv = [(None, None, None)] * len(pv) if frozen else net.row_views(net.head_name, "g")
        if len(pv) > 1 and any(v0 % 64 for v0, _, _ in pv):
            raise GpuError(
                f"{net.head_name}: vocabulary chunks of {pv[0][1]} rows do not keep logits column offsets "
                f"256-byte aligned (64 rows of {net.slots[net.head_name].nbytes // self.V} bytes "
                f"exceed the binding limit {self.gpu.max_binding})"
            )
        return [(v0, rows, w, dw) for (v0, rows, w), (_, _, dw) in zip(pv, gv, strict=True)]

    def _logit_cols(self, logits, n: int, v0: int, rows: int) -> tuple:
        """Columns [v0, v0 + rows) of an (n, V) logits view, as a view whose rows are V floats apart."""
        buf, off, _ = logits
        return (buf, off + v0 * F32, ((n - 1) * self.V + rows) * F32)

    def head_forward(self, logits, xf, n: int) -> Call:
        """logits (n, V) = xf (n, C) · Wᵀ, vocabulary chunk by vocabulary chunk (ldc = V)."""
        g, C, V = self.gpu, self.C, self.V
        call = Call()
        dt = self.net.wdtype(self.net.head_name)
        for v0, rows, w, _dw in self.head_chunks():
            cols = self._logit_cols(logits, n, v0, rows)
            call += k_mm.matmul(
                g, cols, xf, w, n, rows, C, trans_b=True, ldc=V, b_dtype=dt, split_k=self.split_k
            )
        return call

    def head_backward(self, dxf, dlogits, xf, n: int, with_dw: bool) -> Call:
        """dxf (n, C) = dlogits · W, summed over the vocabulary chunks; with `with_dw`, each chunk's
        dW (+)= dlogits[:, chunk]ᵀ · xf into its own rows of the gradient."""
        g, C, V = self.gpu, self.C, self.V
        call = Call()
        dt = self.net.wdtype(self.net.head_name)  # f16: a frozen head shared from an f16 trunk (heal's draft)
        for j, (v0, rows, w, dw) in enumerate(self.head_chunks()):
            d = self._logit_cols(dlogits, n, v0, rows)
            call += k_mm.matmul(g, dxf, d, w, n, C, rows, lda=V, accumulate=j > 0, b_dtype=dt)
            if with_dw:
                call += k_mm.matmul(g, dw, d, xf, rows, C, n, trans_a=True, lda=V, accumulate=True)
        return call
