"""Reference ops for ddl-wgpu: each layer is a forward/backward pair of plain numpy functions.

Every WGSL kernel in `ddl_wgpu` is tested against the function of the same name here, and every backward here
is tested against central finite differences on `fakeloss = sum(out * dout)` (tests/test_ref_ops.py).

All functions preserve the input dtype: float64 for gradient checks, float32 to match the engine. Python
scalars are used for constants so that NumPy 2 (NEP 50) never promotes a float32 array to float64.

What this file deliberately does not do: no autodiff, no fused kernels, no speed tricks, no parameter
bookkeeping (that is `params.py`) and no model wiring (that is `model.py`).

Shape legend:
    B batch, T time (sequence), C d_model, H query heads, K key/value heads, D head_dim,
    F ffn hidden, V vocab, N rows (flattened B*T), k top-k width of a teacher distribution.
"""

from __future__ import annotations

import numpy as np

# ----------------------------------------------------------------------------------------------------------
# small helpers


def sigmoid(x):
    # sigmoid(x) = (1 + tanh(x/2)) / 2: stable for any |x| (tanh saturates, nothing overflows, as exp(-x) would
    # for x << 0) and, measured on the 2-core machine, 20x faster than exp(-logaddexp(0, -x)) on float32
    # arrays (numpy's tanh is vectorised, logaddexp is not): the sigmoids were a quarter of a numpy step.
    x = np.asarray(x)
    return (0.5 + 0.5 * np.tanh(0.5 * x)).astype(x.dtype, copy=False)


def silu(x):
    return x * sigmoid(x)


def logsumexp(x, axis=-1, keepdims=False):
    # Max subtraction keeps exp() in range; the max is added back outside the log.
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0).astype(x.dtype, copy=False)
    out = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m
    return out if keepdims else np.squeeze(out, axis=axis)


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


# ----------------------------------------------------------------------------------------------------------
# embedding


def embedding_forward(ids, wte):
    """ids (B, T) int, wte (V, C) -> (B, T, C)."""
    return wte[ids]


def embedding_backward(dout, ids, vocab_size):
    """dout (B, T, C) -> dwte (V, C). Repeated ids accumulate (np.add.at is unbuffered)."""
    C = dout.shape[-1]
    dwte = np.zeros((vocab_size, C), dtype=dout.dtype)
    np.add.at(dwte, np.asarray(ids).reshape(-1), dout.reshape(-1, C))
    return dwte


# ----------------------------------------------------------------------------------------------------------
# RMSNorm over the last axis


def rmsnorm_forward(x, w, eps, style="standard"):
    """x (..., C), w (C,) -> (out (..., C), cache).

    style "standard" (Llama/Qwen3): out = w * xhat; "offset" (Gemma/Qwen3.5): out = (1 + w) * xhat,
    where xhat = x * rstd and rstd = 1 / sqrt(mean(x^2) + eps).
    """
    if style not in ("standard", "offset"):
        raise ValueError(f"rmsnorm style must be 'standard' or 'offset', got {style!r}")
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + float(eps))  # (..., 1)
    weff = w if style == "standard" else 1.0 + w  # (C,)
    out = x * rstd * weff
    return out, (x, w, rstd, style)


def rmsnorm_backward(dout, cache):
    """-> (dx (..., C), dw (C,)); dw sums over every leading axis."""
    x, w, rstd, style = cache
    weff = w if style == "standard" else 1.0 + w
    xhat = x * rstd  # (..., C)
    # d(1+w)/dw = 1, so both styles share dw.
    dw = np.sum((dout * xhat).reshape(-1, x.shape[-1]), axis=0)
    dxhat = dout * weff
    # xhat = x * rstd(x): dx = rstd * (dxhat - xhat * mean(dxhat * xhat)).
    dx = rstd * (dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))
    return dx, dw


# ----------------------------------------------------------------------------------------------------------
# linear, Hugging Face layout: w is (OUT, IN), no bias


def linear_forward(x, w):
    """x (..., IN), w (OUT, IN) -> (..., OUT) = x @ w.T."""
    return x @ w.T


def linear_backward(dout, x, w):
    """dout (..., OUT) -> (dx (..., IN), dw (OUT, IN))."""
    dx = dout @ w
    dw = dout.reshape(-1, w.shape[0]).T @ x.reshape(-1, w.shape[1])
    return dx, dw


# ----------------------------------------------------------------------------------------------------------
# RoPE, rotate-half convention (HF Llama/Qwen3: halves, not interleaved pairs)


def rope_tables(T, D, theta, dtype, rotary_dim=None):
    """-> (cos, sin), each (T, R) with R = rotary_dim (default D, the whole head).

    Partial RoPE (Qwen3.5: R = D/4): the frequencies are those of an R-wide head, theta^(-2i/R) for i < R/2,
    and `rope_forward` rotates the first R dims of each head and passes the rest through. R = D gives
    exactly the full tables. Computed in float64, then cast: HF computes these in float32, which differs by
    about 1e-7 * position radians; the float64 tables are the more exact of the two and are what the engine
    uploads.
    """
    R = D if rotary_dim is None else int(rotary_dim)
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"rope needs an even rotary width in [2, head_dim {D}], got {R}")
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, R, 2, dtype=np.float64) / R))  # (R/2,)
    freqs = np.outer(np.arange(T, dtype=np.float64), inv_freq)  # (T, R/2)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (T, R)
    return np.cos(emb).astype(dtype), np.sin(emb).astype(dtype)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def _rotate_half_t(g):
    # Transpose of rotate_half: <rotate_half(x), g> = <x, concat(g2, -g1)>.
    h = g.shape[-1] // 2
    return np.concatenate([g[..., h:], -g[..., :h]], axis=-1)


def rope_forward(x, cos, sin):
    """x (B, T, N, D), cos/sin (>=T, R) with R <= D -> (B, T, N, D): the first R dims of each head become
    x*cos + rotate_half(x)*sin (rotate-half within those R), dims R.. pass through (partial RoPE)."""
    T, R = x.shape[1], cos.shape[-1]
    c = cos[None, :T, None, :]  # (1, T, 1, R)
    s = sin[None, :T, None, :]
    if x.shape[-1] == R:  # the whole head: no split, so full RoPE keeps its exact arithmetic
        return x * c + _rotate_half(x) * s
    xr = x[..., :R]
    return np.concatenate([xr * c + _rotate_half(xr) * s, x[..., R:]], axis=-1)


def rope_backward(dout, cos, sin):
    """dout (B, T, N, D) -> dx (B, T, N, D). RoPE is linear, so dx = R^T dout; the passed dims copy dout."""
    T, R = dout.shape[1], cos.shape[-1]
    c = cos[None, :T, None, :]
    s = sin[None, :T, None, :]
    if dout.shape[-1] == R:
        return dout * c + _rotate_half_t(dout * s)
    dr = dout[..., :R]
    return np.concatenate([dr * c + _rotate_half_t(dr * s), dout[..., R:]], axis=-1)


# ----------------------------------------------------------------------------------------------------------
# the attention output gate (Qwen3.5's gated full attention): out = a * sigmoid(gate), elementwise


def sigmoid_gate_forward(a, gate):
    """a, gate (...) -> a * sigmoid(gate)."""
    return a * sigmoid(gate)


def sigmoid_gate_backward(dout, a, gate):
    """-> (da, dgate); sigmoid'(g) = s * (1 - s)."""
    s = sigmoid(gate)
    return dout * s, dout * a * s * (1.0 - s)


# ----------------------------------------------------------------------------------------------------------
# causal grouped-query attention


def _expand_kv(x, H):
    # (B, K, T, D) -> (B, H, T, D): kv head j serves q heads [j*H/K, (j+1)*H/K) (HF repeat_kv).
    return np.repeat(x, H // x.shape[1], axis=1)


def _reduce_kv(dx, K):
    # Transpose of _expand_kv: sum the gradients of the H/K q heads that shared one kv head.
    B, H, T, D = dx.shape
    return dx.reshape(B, K, H // K, T, D).sum(axis=2)


def attention_forward(q, k, v):
    """q (B, T, H, D), k/v (B, T, K, D) -> (out (B, T, H, D), cache). Causal, scale D**-0.5."""
    B, T, H, D = q.shape
    K = k.shape[2]
    if H % K:
        raise ValueError(f"n_heads {H} must be a multiple of n_kv_heads {K}")
    scale = float(D) ** -0.5
    qh = q.transpose(0, 2, 1, 3)  # (B, H, T, D)
    kh = _expand_kv(k.transpose(0, 2, 1, 3), H)  # (B, H, T, D)
    vh = _expand_kv(v.transpose(0, 2, 1, 3), H)  # (B, H, T, D)
    scores = (qh @ kh.transpose(0, 1, 3, 2)) * scale  # (B, H, T, T)
    causal = np.tril(np.ones((T, T), dtype=bool))
    scores = np.where(causal, scores, -np.inf).astype(q.dtype, copy=False)
    # Row max is finite: the diagonal is always unmasked.
    m = np.max(scores, axis=-1, keepdims=True)  # (B, H, T, 1)
    e = np.exp(scores - m)  # masked entries become exactly 0
    s = np.sum(e, axis=-1, keepdims=True)
    probs = e / s  # (B, H, T, T)
    lse = (m + np.log(s))[..., 0]  # (B, H, T): the engine's flash kernel stores this instead of probs
    out = (probs @ vh).transpose(0, 2, 1, 3)  # (B, T, H, D)
    return out, (q, k, v, probs, lse)


def attention_backward(dout, cache):
    """dout (B, T, H, D) -> (dq (B, T, H, D), dk (B, T, K, D), dv (B, T, K, D))."""
    q, k, v, probs, _lse = cache
    H, D = q.shape[2], q.shape[3]
    K = k.shape[2]
    scale = float(D) ** -0.5
    qh = q.transpose(0, 2, 1, 3)
    kh = _expand_kv(k.transpose(0, 2, 1, 3), H)
    vh = _expand_kv(v.transpose(0, 2, 1, 3), H)
    doh = dout.transpose(0, 2, 1, 3)  # (B, H, T, D)
    dvh = probs.transpose(0, 1, 3, 2) @ doh  # (B, H, T, D)
    dprobs = doh @ vh.transpose(0, 1, 3, 2)  # (B, H, T, T)
    # Softmax backward: dscores = P * (dP - rowsum(dP * P)); masked entries have P = 0, so no gradient.
    dscores = probs * (dprobs - np.sum(dprobs * probs, axis=-1, keepdims=True))
    dqh = (dscores @ kh) * scale
    dkh = (dscores.transpose(0, 1, 3, 2) @ qh) * scale
    dq = dqh.transpose(0, 2, 1, 3)
    dk = _reduce_kv(dkh, K).transpose(0, 2, 1, 3)
    dv = _reduce_kv(dvh, K).transpose(0, 2, 1, 3)
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# masked attention at explicit positions: the chained draft's training-time-test layout
# (docs/heal.md#chain-attention-per-step-or-stacked)


def chain_positions(chain: int, T: int):
    """Stacked rows r = (σ−1)·T + p of chain steps σ = 1..chain over a window of T -> (chain·T,) int64
    RoPE positions p + σ − 1."""
    s, p = np.divmod(np.arange(chain * T), T)
    return (p + s).astype(np.int64)


def chain_mask(chain: int, T: int):
    """(chain·T, chain·T) bool, [query, key]: key (σ', p') is visible to query (σ, p) iff (σ' == 1 and
    p' <= p) or (2 <= σ' <= σ and p' == p): the step-1 rows (warm KV) up to the anchor, plus the same
    anchor's step-2..σ rows (the EAGLE-3/HASS "diagonal" mask)."""
    s, p = np.divmod(np.arange(chain * T), T)  # σ − 1, p
    sq, pq = s[:, None], p[:, None]
    sk, pk = s[None, :], p[None, :]
    return ((sk == 0) & (pk <= pq)) | ((sk >= 1) & (sk <= sq) & (pk == pq))


def rope_tables_at(positions, D, theta, dtype, rotary_dim=None):
    """-> (cos, sin), each (len(positions), R): row r is position positions[r] (`rope_tables`' rows, the same
    rotary width R = rotary_dim or D)."""
    positions = np.asarray(positions, np.int64)
    n = int(positions.max()) + 1 if positions.size else 1
    cos, sin = rope_tables(n, D, theta, np.float64, rotary_dim)
    return cos[positions].astype(dtype), sin[positions].astype(dtype)


def attention_masked_forward(q, k, v, mask):
    """`attention_forward` with an explicit mask (T, T) or (B, T, T) bool [query, key] instead of the causal
    one; every query must see at least one key. -> (out (B, T, H, D), cache)."""
    B, T, H, D = q.shape
    K = k.shape[2]
    if H % K:
        raise ValueError(f"n_heads {H} must be a multiple of n_kv_heads {K}")
    mask = np.broadcast_to(np.asarray(mask, bool), (B, T, T))
    if not mask.any(axis=-1).all():
        raise ValueError("attention mask: a query row sees no key")
    scale = float(D) ** -0.5
    qh = q.transpose(0, 2, 1, 3)
    kh = _expand_kv(k.transpose(0, 2, 1, 3), H)
    vh = _expand_kv(v.transpose(0, 2, 1, 3), H)
    scores = (qh @ kh.transpose(0, 1, 3, 2)) * scale  # (B, H, T, T)
    scores = np.where(mask[:, None], scores, -np.inf).astype(q.dtype, copy=False)
    m = np.max(scores, axis=-1, keepdims=True)
    e = np.exp(scores - m)
    s = np.sum(e, axis=-1, keepdims=True)
    probs = e / s
    lse = (m + np.log(s))[..., 0]
    out = (probs @ vh).transpose(0, 2, 1, 3)
    return out, (q, k, v, probs, lse)


def attention_masked_backward(dout, cache):
    """-> (dq, dk, dv). Masked entries have probability 0, so the causal backward applies unchanged."""
    return attention_backward(dout, cache)


# ----------------------------------------------------------------------------------------------------------
# SwiGLU


def swiglu_forward(gate, up):
    """gate/up (..., F) -> silu(gate) * up."""
    return silu(gate) * up


def swiglu_backward(dout, gate, up):
    """-> (dgate, dup). silu'(g) = s + g*s*(1-s) with s = sigmoid(g)."""
    s = sigmoid(gate)
    dup = dout * gate * s
    dgate = dout * up * (s + gate * s * (1.0 - s))
    return dgate, dup


# ----------------------------------------------------------------------------------------------------------
# losses


def cross_entropy_rows(logits, targets, weights):
    """logits (N, V), targets (N,) int, weights (N,) 0/1 -> (loss_sum, dlogits (N, V)).

    loss_sum = sum_n w_n * (logsumexp(z_n) - z_n[t_n]); dlogits = w_n * (softmax(z_n) - onehot(t_n)).
    Rows with weight 0 may carry any target (it is clipped into range and ignored).
    """
    N, V = logits.shape
    w = np.asarray(weights, dtype=logits.dtype)
    t = np.clip(np.asarray(targets).astype(np.int64), 0, V - 1)
    rows = np.arange(N)
    lse = logsumexp(logits, axis=-1)  # (N,)
    nll = lse - logits[rows, t]  # (N,)
    loss_sum = float(np.sum(w * nll))
    dlogits = softmax(logits, axis=-1)
    dlogits[rows, t] -= 1.0
    dlogits *= w[:, None]
    return loss_sum, dlogits


def lm_loss_forward(logits, ids, lengths):
    """Causal-LM mean cross-entropy, as the reference trainer computes it.

    logits (B, T, V), ids (B, T) int, lengths (B,) int. Row b predicts ids[b, p+1] from position p for
    p < min(lengths[b] - 1, T - 1); padding never counts. Returns (loss, cache) with loss = summed NLL /
    number of valid predictions, and 0.0 when there are none.
    """
    B, T, V = logits.shape
    ids = np.asarray(ids)
    lengths = np.asarray(lengths).reshape(B)
    targets = np.zeros((B, T), dtype=np.int64)
    targets[:, : T - 1] = ids[:, 1:]  # position T-1 has no next token
    limit = np.minimum(lengths - 1, T - 1)  # (B,) number of valid predictions per row
    weights = (np.arange(T)[None, :] < limit[:, None]).astype(logits.dtype)  # (B, T)
    count = int(weights.sum())
    loss_sum, drows = cross_entropy_rows(logits.reshape(B * T, V), targets.reshape(-1), weights.reshape(-1))
    loss = loss_sum / count if count > 0 else 0.0
    return loss, (drows.reshape(B, T, V), count)


def lm_loss_backward(cache, dloss=1.0):
    """-> dlogits (B, T, V), zero at positions that make no prediction."""
    drows, count = cache
    if count == 0:
        return np.zeros_like(drows)
    return drows * (float(dloss) / count)


KL_FORMS = ("full", "topk")


def topk_kl_forward(student_logits, teacher_ids, teacher_probs, weights, form: str = "full"):
    """Top-k KL distillation loss for MTP healing, summed over rows.

    student_logits (N, V), teacher_ids (N, k) int, teacher_probs (N, k), weights (N,) 0/1. p~ = teacher_probs
    renormalised over the k ids (a row without teacher mass, e.g. batch padding, gets p~ = 0 and contributes
    nothing). kl_sum = sum_n w_n * sum_i p~_i (log p~_i - log q_i), with 0 log 0 = 0, where log q is
    - form "full" (the reference heal tool's distillation loss): the student's full-vocabulary log-softmax at
      the teacher's ids, so every logit gets gradient (mass the student puts outside the top-k is penalised);
    - form "topk": the student's softmax restricted to the k ids and renormalised over them (KL(p~ || q~);
      logits outside the top-k get no gradient).
    """
    if form not in KL_FORMS:
        raise ValueError(f"kl form must be one of {list(KL_FORMS)}, got {form!r}")
    N = student_logits.shape[0]
    ids = np.asarray(teacher_ids).astype(np.int64)
    w = np.asarray(weights, dtype=student_logits.dtype)
    z = student_logits[np.arange(N)[:, None], ids]  # (N, k)
    if form == "full":
        lse = logsumexp(student_logits, axis=-1, keepdims=True)  # (N, 1), over the whole vocabulary
    else:
        lse = logsumexp(z, axis=-1, keepdims=True)
    logq = z - lse  # (N, k)
    psum = np.sum(teacher_probs, axis=-1, keepdims=True)
    p = np.divide(teacher_probs, psum, out=np.zeros_like(teacher_probs), where=psum > 0)  # (N, k) p~
    # 0 * log 0 is taken as 0; np.where keeps log(0) = -inf out of the sum.
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    kl_rows = np.sum(plogp - p * logq, axis=-1)  # (N,)
    kl_sum = float(np.sum(w * kl_rows))
    # the softmax the gradient needs: over the vocabulary ("full") or over the k ids ("topk")
    q = np.exp(student_logits - lse) if form == "full" else np.exp(logq)
    # the sum of p~: exactly 1, or 0 for a row without teacher mass (whose gradient is then 0 too)
    mass = (psum > 0).astype(q.dtype)
    return kl_sum, (student_logits.shape, ids, p, q * mass, w, form)


def topk_kl_backward(cache):
    """-> dlogits (N, V) of kl_sum: w * (m * q - p~), q the student's softmax over the vocabulary ("full") or
    over the k ids ("topk", zero elsewhere), p~ at the k ids, m = sum of p~ (1, or 0 for a row without
    teacher mass)."""
    shape, ids, p, mq, w, form = cache
    N = shape[0]
    rows = np.arange(N)[:, None]
    # add.at so that a repeated id (possible in malformed teacher data) accumulates instead of overwriting.
    if form == "full":
        dlogits = mq * w[:, None]
        np.add.at(dlogits, (rows, ids), -p * w[:, None])
        return dlogits
    dlogits = np.zeros(shape, dtype=mq.dtype)
    np.add.at(dlogits, (rows, ids), (mq - p) * w[:, None])
    return dlogits
