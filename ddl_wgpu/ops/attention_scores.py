"""Causal attention as GEMMs over materialised scores (`shaders/attention_scores.wgsl` + `matmul`).

Kernel path: `shaders/attention_scores.wgsl` -> `ddl_wgpu/ops/attention_scores.py` -> reference
`ddl_ref.ops.attention_forward`, `ddl_ref.ops.attention_backward` (the chain mask:
`ddl_ref.ops.attention_masked_forward`, `ddl_ref.ops.attention_masked_backward`) -> test
`tests/test_kernel_attention.py` (the chain mask, row blocks and row ranges: `tests/test_chain_attention.py`).

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
consecutive in (B, H) order, so lse and delta of row t of pair z sit at (z0 + z)*T + t.

Row blocks: when even one kv head's scores (G*T*T floats) do not fit, a chunk is a block of R query rows
[r0, r0 + R) of one kv head of one batch (`row_block`: the most rows whose G*R*T scores fit, a multiple of
64 where 64 fit). Neither mask shows row t a key past t, so a block's scores are R x Tk with Tk = r0 + R:
S = scale q[r0:r0+R] k[:Tk]^T and out = P v[:Tk] are rectangular products (the first block, r0 = 0, is square
and keeps the causal tile bounds), the row kernels get R, r0 and Tk in their uniform. In the backward dq is
written per block; dk[:Tk] and dv[:Tk] add up over the blocks (matmul's accumulate), which `plan` lists last
first so that the block seeing all T keys writes them before the others add. A call may also ask for a range
of query rows only (`rows=(lo, hi)`: the EAGLE-3 draft's one step of its stack): its chunks then cover those
rows against keys [0, hi), and the backward zero-fills dk, dv first when hi < T (no block writes their rows
past hi). With all T rows and whole heads every product and row pass is the one that ran before row blocks.

Deterministic: the GEMMs sum in fixed order, the row kernels reduce over a fixed tree, the GQA sums over g
and the sums over row blocks run in order.

What this file deliberately does not do: choose between itself and the flash kernels (`attention.py` does).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ddl_wgpu.ops.elementwise import fill
from ddl_wgpu.ops.matmul import Batch, Strides, matmul
from ddl_wgpu.runtime.gpu import Call, GpuError, Uniform

FILE = "attention_scores.wgsl"
PARAMS = Uniform(
    "Params",
    ("T", "u32"),
    ("rows", "u32", "Z * R rows in this chunk"),
    ("z0", "u32", "(batch, head) index of the chunk's first row, for lse / delta of shape (B*H, T)"),
    ("W", "u32", "0: causal; else the chain mask's window"),
    ("R", "u32", "query rows per (batch, head) in this chunk"),
    ("r0", "u32", "position of the chunk's first query row within T"),
    ("Tk", "u32", "keys per row (the scores' row length): r0 + R"),
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


def _row_block(limit: int, G: int, keys: int, n: int) -> int:
    R = min(n, limit // (G * keys * 4))
    return R - R % ROW_ALIGN if R >= ROW_ALIGN else R


def row_block(gpu, H: int, K: int, T: int) -> int:
    """Query rows per row block when `fits` fails: the most whose scores against all T keys, for one kv
    head's query heads, fit the scratch limit, rounded down to a multiple of ROW_ALIGN when at least that many
    fit; 0 when not even one row fits."""
    return _row_block(_limit(gpu), H // K, T, T)


def fits_rows(gpu, H: int, K: int, T: int) -> bool:
    """Whether the scores path can run this shape at all: whole heads (`fits`) or row blocks."""
    return fits(gpu, H, K, T) or row_block(gpu, H, K, T) > 0


@dataclass(frozen=True)
class Chunk:
    """Batches [b0, b0 + nb), kv heads [j0, j0 + nk) of each (all K, or one batch's subset), query rows
    [r0, r0 + nr) of each (all T, the call's row range, or a row block of one kv head of one batch)."""

    b0: int
    nb: int
    j0: int
    nk: int
    r0: int
    nr: int

    @property
    def keys(self) -> int:
        """Keys the chunk's rows can see: neither mask shows row t a key past t."""
        return self.r0 + self.nr


def _range(T: int, rows) -> tuple[int, int]:
    lo, hi = (0, T) if rows is None else (int(rows[0]), int(rows[1]))
    if not 0 <= lo < hi <= T:
        raise GpuError(f"attention: query rows [{lo}, {hi}) are not a range within {T}")
    return lo, hi


def plan(gpu, B: int, H: int, K: int, T: int, rows=None) -> tuple[list[Chunk], int]:
    """The chunks of one attention call over query rows `rows` = (lo, hi) (default all T; keys [0, hi)) and
    the scratch bytes each needs: whole batches while one batch's scores fit, else runs of kv heads of one
    batch, else blocks of up to `row_block` query rows of one kv head of one batch, the last block first (its
    rows see every key the range sees: in the backward it initialises dk and dv where hi = T, and the earlier
    blocks add to their first r0 + R rows)."""
    lo, hi = _range(T, rows)
    n = hi - lo
    G, per_head, limit = H // K, n * hi * 4, _limit(gpu)
    if H * per_head <= limit:
        nb = min(B, limit // (H * per_head))
        return [Chunk(b0, min(nb, B - b0), 0, K, lo, n) for b0 in range(0, B, nb)], nb * H * per_head
    if G * per_head <= limit:
        nk = limit // (G * per_head)
        chunks = [Chunk(b, 1, j0, min(nk, K - j0), lo, n) for b in range(B) for j0 in range(0, K, nk)]
        return chunks, nk * G * per_head
    R = _row_block(limit, G, hi, n)
    if R < 1:
        raise GpuError(
            f"attention: the scores of {G} query head(s) ({hi} floats each) exceed the scratch limit"
        )
    starts = range(lo + (n - 1) // R * R, lo - 1, -R)
    chunks = [Chunk(b, 1, j, 1, r0, min(R, hi - r0)) for b in range(B) for j in range(K) for r0 in starts]
    return chunks, G * R * hi * 4


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
    nr, tk = c.nr, c.keys
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
    u = gpu.uniform(PARAMS, T=T, rows=rows, z0=z0, W=W, R=c.nr, r0=c.r0, Tk=c.keys, label=entry)
    return Call([(k, gpu.bind(k, *buffers, u), groups)], [u])


def _causal(c: Chunk, mode: str) -> str | None:
    """matmul's causal mode for a chunk: its tile bounds assume query row m is key m, true where the chunk's
    rows start at 0 (all T rows, or the first row block, whose R x R scores are square)."""
    return mode if c.r0 == 0 else None


def _scores(gpu, s, q, k, c: Chunk, T: int, D: int, lay: dict, scale: float) -> Call:
    """S = scale·QKᵀ for one chunk (its rows x its keys), tiles above the diagonal skipped where the rows start
    at 0: the forward's, recomputed by the backward."""
    return _mm(gpu, s, q, k, c.nr, c.keys, D, lay, "q", "k", "s", trans_b=True, alpha=scale,
               causal=_causal(c, "skip_upper"))  # fmt: skip


def forward(gpu, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, scale: float, W: int = 0,
            rows=None) -> Call:  # fmt: skip
    """out (B,T,H,D) and lse (B,H,T) from q (B,T,H,D), k, v (B,T,K,D); causal, or with W > 0 the chained
    draft's mask over T = chain*W stacked rows. `rows` = (lo, hi): only those query rows of each batch
    (keys [0, hi)); out and lse of the other rows are left as they are."""
    chunks, nbytes = plan(gpu, B, H, K, T, rows)
    s = _scratch(gpu, "scores", nbytes)
    call = Call()
    for c in chunks:
        lay = _heads(c, T, H, K, D)
        nr, tk = c.nr, c.keys
        n, z0 = lay["batch"] * nr, c.b0 * H + c.j0 * (H // K)  # rows of scores, first (batch, head)
        call += _scores(gpu, s, q, k, c, T, D, lay, scale)
        call += _row_call(gpu, "scores_softmax", "wwu", [s, lse], c, T, n, z0, W, n)
        call += _mm(gpu, out, s, v, nr, D, tk, lay, "s", "k", "q", causal=_causal(c, "k_to_row"))
    return call


def backward(
    gpu, dq, dk, dv, dout, lse, delta, q, k, v, B: int, T: int, H: int, K: int, D: int, scale: float, W: int = 0,
    rows=None,
) -> Call:  # fmt: skip
    """dq (B,T,H,D), dk, dv (B,T,K,D) from dout, the forward's lse, delta = rowsum(dout * out) (B,H,T) and
    q, k, v; the mask as in `forward`. Outputs are overwritten. `rows` = (lo, hi): only those query rows
    contribute (as if dout were 0 elsewhere): dq of the other rows is left as it is, dk and dv are whole
    (zero past hi)."""
    chunks, nbytes = plan(gpu, B, H, K, T, rows)
    s, dp = _scratch(gpu, "scores", nbytes), _scratch(gpu, "dscores", nbytes)
    G = H // K
    call = Call()
    if _range(T, rows)[1] < T:  # no block sees the keys past hi: zeros, and every block adds
        call += fill(gpu, dk, B * T * K * D) + fill(gpu, dv, B * T * K * D)
    for c in chunks:
        lay = _heads(c, T, H, K, D)
        nr, tk = c.nr, c.keys
        n, z0 = lay["batch"] * nr, c.b0 * H + c.j0 * G
        call += _scores(gpu, s, q, k, c, T, D, lay, scale)
        call += _mm(gpu, dp, dout, v, nr, tk, D, lay, "q", "k", "s", trans_b=True,
                    causal=_causal(c, "skip_upper"))  # fmt: skip
        groups = -(-(n * tk) // 256)
        call += _row_call(gpu, "scores_backward", "rrwwu", [lse, delta, s, dp], c, T, n, z0, W, groups)
        call += _mm(gpu, dq, dp, k, nr, D, tk, lay, "s", "k", "q", alpha=scale, causal=_causal(c, "k_to_row"))
        # kv head j collects its G query heads h = jG + g in order g = 0, 1, ...: one product per g, over
        # z = (batch, kv head of the chunk); the scores of head jG + g sit g*nr*Tk past those of head jG. A row
        # block other than the last (which `plan` lists first), or any block when hi < T, adds to the rows
        # [0, Tk) of dk and dv.
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
