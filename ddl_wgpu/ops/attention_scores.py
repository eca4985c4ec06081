"""Causal attention as GEMMs over materialised scores (`shaders/attention_scores.wgsl` + `matmul`).

Kernel path: `shaders/attention_scores.wgsl` -> `ddl_wgpu/ops/attention_scores.py` -> reference
`ddl_ref.ops.attention_forward`, `ddl_ref.ops.attention_backward` -> test `tests/test_kernel_attention.py`.

The flash kernels of `attention.wgsl` never store the T x T scores, but each thread there computes a score as
a D-long dot product from shared memory, which runs at about a quarter of the GEMM's rate on the H200
(BENCHMARKS.md). This path instead writes the scores of up to `SCORE_BYTES` worth of (batch, head) pairs at a
time to a scratch buffer and runs every product through the tuned GEMM, with the two-level batch
(per-(b, h) operands straight from the (B, T, H, D) tensors, GQA by head division) and the causal tile bounds:

    forward    S = scale q k^T             (tiles above the diagonal skipped)
               P = softmax(S), lse          scores_softmax, in place
               out = P v                    (k loop stops at the row tile's end)
    backward   S = scale q k^T,  dP = dout v^T
               P = exp(S - lse), dS = P (dP - delta)     scores_backward, in place
               dq = scale dS k
               dv_j = sum_g P_{jG+g}^T dout_{jG+g},  dk_j = scale sum_g dS^T q    (k loop from the row tile)

`delta` = rowsum(dout * out) comes from the flash module's delta pass (`attention.attention_backward`).
Memory: two scratch buffers of up to SCORE_BYTES each, shared by every attention call of the device (calls
run one after another within a step). A chunk is a run of whole batches, or, when one batch's scores do not
fit, a run of kv heads (with their G query heads) of one batch: either way its (batch, head) pairs are
consecutive in (B, H) order, so lse and delta rows stay at z0*T + row. Deterministic: the GEMMs sum in fixed order, the row kernels reduce over
a fixed tree, and the GQA sums over g run in order.

What this file deliberately does not do: choose between itself and the flash kernels (`attention.py` does).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ddl_wgpu.ops.matmul import Batch, Strides, matmul
from ddl_wgpu.runtime.gpu import Call, GpuError, Uniform

FILE = "attention_scores.wgsl"
PARAMS = Uniform(
    "Params",
    ("T", "u32"),
    ("rows", "u32", "Z * R rows in this chunk"),
    ("z0", "u32", "(batch, head) index of the chunk's first row, for lse / delta of shape (B*H, T)"),
    ("W", "u32", "0: causal; else the chain mask's window"),
    ("R", "u32", "query rows per (batch, head) in this chunk: T, or a row block's"),
    ("r0", "u32", "position of the chunk's first query row within T"),
    ("Tk", "u32", "keys per row (the scores' row length): T, or r0 + R for a row block"),
    ("pad0", "pad"),
)
SOFTMAX_WG = 128  # threads per row of scores_softmax (the shader's WG)
# Scores of at most this many bytes per scratch buffer (two of them in the backward): B*H*T*T*4 = 384 MiB for
# the small preset's 16 x 1024 tokens x 6 heads, so one chunk; longer sequences run in chunks.
SCORE_BYTES = 512 << 20
ROW_ALIGN = 64  # row blocks are a multiple of this many rows when at least that many fit (the GEMM's tile)


def _limit(gpu) -> int:
    return min(SCORE_BYTES, int(gpu.limits.get("max-storage-buffer-binding-size", SCORE_BYTES)))


def fits(gpu, H: int, K: int, T: int) -> bool:
    """Whether the scores of one kv head's query heads over all T rows (the smallest chunk without row
    blocks) fit the scratch limit."""
    return _limit(gpu) >= (H // K) * T * T * 4


def row_block(gpu, H: int, K: int, T: int) -> int:
    """Query rows per row block when `fits` fails: the most whose scores against all T keys, for one kv
    head's query heads, fit the scratch limit, rounded down to a multiple of ROW_ALIGN when at least that many
    fit; 0 when not even one row fits."""
    R = min(T, _limit(gpu) // ((H // K) * T * 4))
    return R - R % ROW_ALIGN if R >= ROW_ALIGN else R


def fits_rows(gpu, H: int, K: int, T: int) -> bool:
    """Whether the scores path can run this shape at all: whole heads (`fits`) or row blocks."""
    return fits(gpu, H, K, T) or row_block(gpu, H, K, T) > 0


@dataclass(frozen=True)
class Chunk:
    """Batches [b0, b0 + nb), kv heads [j0, j0 + nk) of each (all K, or one batch's subset), query rows
    [r0, r0 + nr) (nr = 0: all T; else a row block of one kv head of one batch)."""

    b0: int
    nb: int
    j0: int
    nk: int
    r0: int = 0
    nr: int = 0

    def rows(self, T: int) -> int:
        return self.nr or T

    def keys(self, T: int) -> int:
        """Keys the chunk's rows can see: both masks show row t no key past t."""
        return min(T, self.r0 + self.rows(T))


def plan(gpu, B: int, H: int, K: int, T: int) -> tuple[list[Chunk], int]:
    """The chunks of one attention call and the scratch bytes each needs: whole batches while one batch's
    scores fit, else runs of kv heads of one batch, else blocks of `row_block` query rows of one kv head of one
    batch, the last block first (its rows see every key, so in the backward it initialises dk and dv and the
    earlier blocks add to their first r0 + R rows)."""
    G, per_head, limit = H // K, T * T * 4, _limit(gpu)
    if H * per_head <= limit:
        nb = min(B, limit // (H * per_head))
        return [Chunk(b0, min(nb, B - b0), 0, K) for b0 in range(0, B, nb)], nb * H * per_head
    if G * per_head <= limit:
        nk = limit // (G * per_head)
        return [Chunk(b, 1, j0, min(nk, K - j0)) for b in range(B) for j0 in range(0, K, nk)], nk * G * per_head
    R = row_block(gpu, H, K, T)
    if R < 1:
        raise GpuError(f"attention: the scores of {G} query head(s) ({T} floats each) exceed the scratch limit")
    starts = range((T - 1) // R * R, -1, -R)
    return [Chunk(b, 1, j, 1, r0, min(R, T - r0)) for b in range(B) for j in range(K) for r0 in starts], G * R * T * 4


def _scratch(gpu, name: str, nbytes: int):
    """The device's scratch buffer `name` of at least `nbytes`, shared by every attention call."""
    cache = gpu.__dict__.setdefault("_attention_scores", {})
    if name not in cache or cache[name].size < nbytes:
        cache[name] = gpu.buffer(nbytes, label=f"attention {name}")
    return cache[name]


def _heads(c: Chunk, T: int, H: int, K: int, D: int) -> dict:
    """The two-level batch of a chunk's per-(b, h) products: z = (batch, query head of the chunk), operands
    of shape (B,T,H,D) ("q": from the chunk's first query row) or (B,T,K,D) ("k": from key 0), scores
    (nb, hc, nr, Tk)."""
    G = H // K
    hc = c.nk * G
    nr, tk = c.rows(T), c.keys(T)
    return {
        "batch": c.nb * hc,
        "inner": hc,
        # (row stride, placement of the products)
        "q": (H * D, Strides(stride=T * H * D, istride=D, off=((c.b0 * T + c.r0) * H + c.j0 * G) * D)),
        "k": (K * D, Strides(stride=T * K * D, istride=D, off=(c.b0 * T * K + c.j0) * D, div=G)),
        "s": (tk, Strides(stride=hc * nr * tk, istride=nr * tk)),
    }


def _mm(gpu, c_res, a_res, b_res, M, N, K, lay: dict, a: str, b: str, cc: str, **kw) -> Call:
    """matmul with the operands' strides taken from the chunk layout `lay` (keys "q", "k", "s"); `kw`: matmul's
    other keywords."""
    (lda, sa), (ldb, sb), (ldc, sc) = lay[a], lay[b], lay[cc]
    batch = Batch(lay["batch"], lay["inner"], sa, sb, sc)
    return matmul(gpu, c_res, a_res, b_res, M, N, K, lda=lda, ldb=ldb, ldc=ldc, batch=batch, **kw)


def _row_call(gpu, entry: str, sig: str, buffers: list, c: Chunk, T: int, rows: int, z0: int, W: int,
              groups: int) -> Call:  # fmt: skip
    k = gpu.kernel(
        FILE,
        entry,
        sig,
        workgroup=(SOFTMAX_WG if entry == "scores_softmax" else 256, 1, 1),
        uniforms=(PARAMS,),
    )
    u = gpu.uniform(PARAMS, T=T, rows=rows, z0=z0, W=W, R=c.rows(T), r0=c.r0, Tk=c.keys(T), label=entry)
    return Call([(k, gpu.bind(k, *buffers, u), groups)], [u])


def _causal(c: Chunk, mode: str) -> str | None:
    """matmul's causal mode for a chunk: its tile bounds assume query row m is key m, true where the chunk's
    rows start at 0 (all T rows, or the first row block, whose R x R scores are square)."""
    return mode if c.r0 == 0 else None


def _scores(gpu, s, q, k, c: Chunk, T: int, D: int, lay: dict, scale: float) -> Call:
    """S = scale·QKᵀ for one chunk (its rows x its keys), tiles above the diagonal skipped where the rows start
    at 0: the forward's, recomputed by the backward."""
    return _mm(gpu, s, q, k, c.rows(T), c.keys(T), D, lay, "q", "k", "s", trans_b=True, alpha=scale,
               causal=_causal(c, "skip_upper"))  # fmt: skip


def forward(gpu, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, scale: float, W: int = 0) -> Call:
    """out (B,T,H,D) and lse (B,H,T) from q (B,T,H,D), k, v (B,T,K,D); causal, or with W > 0 the chained
    draft's mask over T = chain*W stacked rows."""
    chunks, nbytes = plan(gpu, B, H, K, T)
    s = _scratch(gpu, "scores", nbytes)
    call = Call()
    for c in chunks:
        lay = _heads(c, T, H, K, D)
        nr, tk = c.rows(T), c.keys(T)
        rows, z0 = lay["batch"] * nr, c.b0 * H + c.j0 * (H // K)
        call += _scores(gpu, s, q, k, c, T, D, lay, scale)
        call += _row_call(gpu, "scores_softmax", "wwu", [s, lse], c, T, rows, z0, W, rows)
        call += _mm(gpu, out, s, v, nr, D, tk, lay, "s", "k", "q", causal=_causal(c, "k_to_row"))
    return call


def backward(
    gpu, dq, dk, dv, dout, lse, delta, q, k, v, B: int, T: int, H: int, K: int, D: int, scale: float, W: int = 0
) -> Call:  # fmt: skip
    """dq (B,T,H,D), dk, dv (B,T,K,D) from dout, the forward's lse, delta = rowsum(dout * out) (B,H,T) and
    q, k, v; the mask as in `forward`. Outputs are overwritten."""
    chunks, nbytes = plan(gpu, B, H, K, T)
    s, dp = _scratch(gpu, "scores", nbytes), _scratch(gpu, "dscores", nbytes)
    G = H // K
    call = Call()
    for c in chunks:
        lay = _heads(c, T, H, K, D)
        nr, tk = c.rows(T), c.keys(T)
        rows, z0 = lay["batch"] * nr, c.b0 * H + c.j0 * G
        call += _scores(gpu, s, q, k, c, T, D, lay, scale)
        call += _mm(gpu, dp, dout, v, nr, tk, D, lay, "q", "k", "s", trans_b=True,
                    causal=_causal(c, "skip_upper"))  # fmt: skip
        groups = -(-(rows * tk) // 256)
        call += _row_call(gpu, "scores_backward", "rrwwu", [lse, delta, s, dp], c, T, rows, z0, W, groups)
        call += _mm(gpu, dq, dp, k, nr, D, tk, lay, "s", "k", "q", alpha=scale, causal=_causal(c, "k_to_row"))
        # kv head j collects its G query heads h = jG + g in order g = 0, 1, ...: one product per g, over
        # z = (batch, kv head of the chunk); the scores of head jG + g sit g*nr*Tk past those of head jG. A row
        # block other than the last (which `plan` lists first) adds to the rows [0, Tk) of dk and dv.
        hc = c.nk * G
        per_kv = {
            "batch": c.nb * c.nk,
            "inner": c.nk,
            "k": (lay["k"][0], replace(lay["k"][1], istride=D, div=1)),
        }
        first = c.r0 + nr == T
        for g in range(G):
            per_kv["s"] = (tk, Strides(stride=hc * nr * tk, istride=G * nr * tk, off=g * nr * tk))
            ldq, sq = lay["q"]
            per_kv["q"] = (ldq, replace(sq, istride=G * D, off=sq.off + g * D))
            for dst, coef, rhs, alpha in ((dv, s, dout, 1.0), (dk, dp, q, scale)):
                call += _mm(gpu, dst, coef, rhs, tk, D, nr, per_kv, "s", "q", "k", trans_a=True, alpha=alpha,
                            accumulate=g > 0 or not first, causal=_causal(c, "k_from_row"))  # fmt: skip
    return call
