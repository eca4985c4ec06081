"""Causal attention as GEMMs over materialised scores (`shaders/attention_scores.wgsl` + `matmul`).

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
run one after another within a step). Deterministic: the GEMMs sum in fixed order, the row kernels reduce over
a fixed tree, and the GQA sums over g run in order.

What this file deliberately does not do: choose between itself and the flash kernels (`attention.py` does).
"""

from __future__ import annotations

from ddl_wgpu.gpu import Call, GpuError
from ddl_wgpu.ops.matmul import matmul

FILE = "attention_scores.wgsl"
PARAMS = "uuuu"  # T, rows, z0, W (0: causal; else the chained draft's window)
SOFTMAX_WG = 128  # threads per row of scores_softmax (the shader's WG)
# Scores of at most this many bytes per scratch buffer (two of them in the backward): B*H*T*T*4 = 384 MiB for
# the small preset's 16 x 1024 tokens x 6 heads, so one chunk; longer sequences run in chunks of batches.
SCORE_BYTES = 512 << 20


def batches_per_chunk(gpu, B: int, H: int, T: int) -> int:
    """How many batches' scores one scratch buffer holds (0: not even one fits; use the flash kernels)."""
    limit = min(SCORE_BYTES, int(gpu.limits.get("max-storage-buffer-binding-size", SCORE_BYTES)))
    return min(B, limit // (H * T * T * 4))


def _scratch(gpu, name: str, nbytes: int):
    """The device's scratch buffer `name` of at least `nbytes`, shared by every attention call."""
    cache = gpu.__dict__.setdefault("_attention_scores", {})
    if name not in cache or cache[name].size < nbytes:
        cache[name] = gpu.buffer(nbytes, label=f"attention {name}")
    return cache[name]


def _plan(gpu, B: int, H: int, T: int) -> tuple[int, int]:
    nb = batches_per_chunk(gpu, B, H, T)
    if nb < 1:
        raise GpuError(f"attention: the scores of one batch ({H} heads x {T}^2) exceed the scratch limit")
    return nb, nb * H * T * T * 4


def _scores(gpu, dst, x, y, b0, n, T, H, K, D, alpha) -> Call:
    """dst (n*H, T, T) = alpha * x_bh y_bj^T on and below the diagonal; x (B,T,H,D), y (B,T,K,D)."""
    return matmul(
        gpu, dst, x, y, T, T, D, trans_b=True, alpha=alpha, batch=n * H, inner=H,
        lda=H * D, stride_a=T * H * D, istride_a=D, off_a=b0 * T * H * D,
        ldb=K * D, stride_b=T * K * D, istride_b=D, div_b=H // K, off_b=b0 * T * K * D,
        ldc=T, stride_c=H * T * T, istride_c=T * T, causal="skip_upper",
    )  # fmt: skip


def _row_call(
    gpu, entry: str, sig: str, buffers: list, T: int, rows: int, z0: int, W: int, groups: int
) -> Call:
    k = gpu.kernel(FILE, entry, sig, workgroup=(SOFTMAX_WG if entry == "scores_softmax" else 256, 1, 1))
    u = gpu.uniform(PARAMS, T, rows, z0, W, label=entry)
    return Call([(k, gpu.bind(k, *buffers, u), groups)], [u])


def forward(gpu, out, lse, q, k, v, B: int, T: int, H: int, K: int, D: int, scale: float, W: int = 0) -> Call:
    """out (B,T,H,D) and lse (B,H,T) from q (B,T,H,D), k, v (B,T,K,D); causal, or with W > 0 the chained
    draft's mask over T = chain*W stacked rows."""
    nb, nbytes = _plan(gpu, B, H, T)
    s = _scratch(gpu, "scores", nbytes)
    call = Call()
    for b0 in range(0, B, nb):
        n = min(nb, B - b0)
        call += _scores(gpu, s, q, k, b0, n, T, H, K, D, scale)
        call += _row_call(gpu, "scores_softmax", "wwu", [s, lse], T, n * H * T, b0 * H, W, n * H * T)
        call += matmul(
            gpu, out, s, v, T, D, T, batch=n * H, inner=H, causal="k_to_row",
            lda=T, stride_a=H * T * T, istride_a=T * T,
            ldb=K * D, stride_b=T * K * D, istride_b=D, div_b=H // K, off_b=b0 * T * K * D,
            ldc=H * D, stride_c=T * H * D, istride_c=D, off_c=b0 * T * H * D,
        )  # fmt: skip
    return call


def backward(
    gpu,
    dq,
    dk,
    dv,
    dout,
    lse,
    delta,
    q,
    k,
    v,
    B: int,
    T: int,
    H: int,
    K: int,
    D: int,
    scale: float,
    W: int = 0,
) -> Call:
    """dq (B,T,H,D), dk, dv (B,T,K,D) from dout, the forward's lse, delta = rowsum(dout * out) (B,H,T) and
    q, k, v; the mask as in `forward`. Outputs are overwritten."""
    nb, nbytes = _plan(gpu, B, H, T)
    s, dp = _scratch(gpu, "scores", nbytes), _scratch(gpu, "dscores", nbytes)
    G = H // K
    call = Call()
    for b0 in range(0, B, nb):
        n = min(nb, B - b0)
        call += _scores(gpu, s, q, k, b0, n, T, H, K, D, scale)
        call += _scores(gpu, dp, dout, v, b0, n, T, H, K, D, 1.0)
        groups = -(-(n * H * T * T) // 256)
        call += _row_call(
            gpu, "scores_backward", "rrwwu", [lse, delta, s, dp], T, n * H * T, b0 * H, W, groups
        )
        call += matmul(
            gpu, dq, dp, k, T, D, T, alpha=scale, batch=n * H, inner=H, causal="k_to_row",
            lda=T, stride_a=H * T * T, istride_a=T * T,
            ldb=K * D, stride_b=T * K * D, istride_b=D, div_b=G, off_b=b0 * T * K * D,
            ldc=H * D, stride_c=T * H * D, istride_c=D, off_c=b0 * T * H * D,
        )  # fmt: skip
        # kv head j collects its G query heads h = jG + g in order g = 0, 1, ...: one product per g
        for g in range(G):
            for dst, coef, rhs, alpha in ((dv, s, dout, 1.0), (dk, dp, q, scale)):
                call += matmul(
                    gpu, dst, coef, rhs, T, D, T, trans_a=True, alpha=alpha, accumulate=g > 0,
                    batch=n * K, inner=K, causal="k_from_row",
                    lda=T, stride_a=H * T * T, istride_a=G * T * T, off_a=g * T * T,
                    ldb=H * D, stride_b=T * H * D, istride_b=G * D, off_b=b0 * T * H * D + g * D,
                    ldc=K * D, stride_c=T * K * D, istride_c=D, off_c=b0 * T * K * D,
                )  # fmt: skip
    return call
