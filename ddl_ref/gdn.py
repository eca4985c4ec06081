"""The Gated DeltaNet token mixer of hybrid trunks (Qwen3.5's `linear_attention` layers), forward and backward.

Per token t and value head h (key head h // (Hv/Hk): consecutive value heads share a key head):

    qkv   = in_proj_qkv · x                      channels [q (Hk·Dk); k (Hk·Dk); v (Hv·Dv)]
    c     = silu(causal depthwise conv over time of qkv)            `causal_conv_forward`
    q, k  = l2norm(q), l2norm(k) over Dk;  q ← q / √Dk               `l2norm_forward`
    β     = sigmoid(in_proj_b · x);  g = −exp(A_log) · softplus(in_proj_a · x + dt_bias)
    S     ← exp(g_t)·S;  u = Sᵀk_t;  S ← S + k_t (β_t (v_t − u))ᵀ;  o_t = Sᵀq_t     `gated_delta_forward`
    y     = w ⊙ o/√(mean(o²)+eps) ⊙ silu(z),  z = in_proj_z · x      `gated_rmsnorm_forward`
    out   = out_proj · y

S is Dk × Dv per (batch, value head), zero before the first token unless a state is passed in. The conv uses
PyTorch's tap convention (tap m multiplies the input at t − (k−1−m); zeros before t = 0), so Qwen3.5's
(channels, 1, k) weight loads by dropping its middle axis.

State for decoding: `gdn_forward(..., state=GdnState(conv, delta))` continues a sequence: `conv` holds the last
k−1 inputs of the conv (B, k−1, Ch), `delta` the recurrent state (B, Hv, Dk, Dv); the cache's `"state"` is the
state after the last token, so two halves run with the state passed give the whole sequence's outputs.
`state_after(cache, t)` replays a pass's cache to the state after its first t tokens (a decoder's roll-back).

Memory: the backward of the recurrence needs every per-step state S_t. They are not all kept: the forward keeps
one every `checkpoint` tokens and the backward recomputes the states of one segment at a time from its first
(the recurrence cannot be run backwards: with |k| = 1 and β → 1, I − βkkᵀ is singular).

The chunked form (`gated_delta_chunked_forward` / `gated_delta_chunked_backward`) computes the same rule with
matrix products over chunks of tokens, the state carried between chunks: the decomposition the GPU's chunked
kernels follow (they form Δ = Tm R as U − W S₀, Tm applied before the state is known), checked against the
recurrence and by finite differences. The recurrence stays the reference the model runs.

What this file deliberately does not do: variable-length packing, or anything for speed.

Shape legend: B batch, T time, C d_model, Ch conv channels 2·Hk·Dk + Hv·Dv, Hk key heads, Hv value heads,
Dk key head dim, Dv value head dim, k conv kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ddl_ref import ops
from ddl_ref.config import ModelConfig

# Qwen3.5's (and flash-linear-attention's) l2norm epsilon, inside the sqrt of the sum of squares
L2_EPS = 1e-6


class GdnState(NamedTuple):
    """What a Gated DeltaNet layer carries from one token to the next."""

    conv: np.ndarray  # (B, k−1, Ch) the last k−1 conv inputs (the projected qkv rows), oldest first
    delta: np.ndarray  # (B, Hv, Dk, Dv) the recurrent state S


def _silu_grad(x):
    s = ops.sigmoid(x)
    return s + x * s * (1.0 - s)


def softplus(x):
    # log(1 + e^x) without overflow for large x.
    return np.logaddexp(0.0, x).astype(x.dtype, copy=False)


# ----------------------------------------------------------------------------------------------------------
# depthwise causal conv over time, then SiLU


def causal_conv_forward(x, w, state=None):
    """x (B, T, Ch), w (Ch, k), state (B, k−1, Ch) the inputs before t = 0 (None: zeros)
    -> (out = silu(conv) (B, T, Ch), cache). pre[t, c] = Σ_m w[c, m] · x[t − (k−1−m), c]."""
    B, T, Ch = x.shape
    k = w.shape[1]
    hist = np.zeros((B, k - 1, Ch), x.dtype) if state is None else np.asarray(state, x.dtype)
    xp = np.concatenate([hist, x], axis=1)  # (B, T+k−1, Ch): row j is time j − (k−1)
    pre = np.zeros_like(x)
    for m in range(k):  # tap m reads time t − (k−1−m), i.e. row t + m of xp
        pre += xp[:, m : m + T, :] * w[:, m]
    return ops.silu(pre), (xp, w, pre)


def causal_conv_backward(dout, cache, with_state=False):
    """-> (dx (B, T, Ch), dw (Ch, k)), and dstate (B, k−1, Ch) with `with_state`."""
    xp, w, pre = cache
    T, k = pre.shape[1], w.shape[1]
    dpre = dout * _silu_grad(pre)
    dxp = np.zeros_like(xp)
    dw = np.zeros_like(w)
    for m in range(k):
        dw[:, m] = np.sum(dpre * xp[:, m : m + T, :], axis=(0, 1))
        dxp[:, m : m + T, :] += dpre * w[:, m]
    if with_state:
        return dxp[:, k - 1 :], dw, dxp[:, : k - 1]
    return dxp[:, k - 1 :], dw


def conv_tail(cache):
    """The last k−1 conv inputs (B, k−1, Ch) of a `causal_conv_forward` cache: the next call's `state`."""
    xp, w, _ = cache
    return xp[:, xp.shape[1] - (w.shape[1] - 1) :].copy()


# ----------------------------------------------------------------------------------------------------------
# L2 normalisation over the last axis


def l2norm_forward(x, eps=L2_EPS):
    """x (..., D) -> (x · rsqrt(Σx² + eps), cache)."""
    r = 1.0 / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + float(eps))  # (..., 1)
    return x * r, (x, r)


def l2norm_backward(dout, cache):
    """-> dx. out = x·r with dr/dx = −r³x, so dx = r·dout − r³·x·(x·dout)."""
    x, r = cache
    return r * dout - (r * r * r) * x * np.sum(x * dout, axis=-1, keepdims=True)


# ----------------------------------------------------------------------------------------------------------
# the decay and write gates


def gates_forward(araw, braw, A_log, dt_bias):
    """araw, braw (..., Hv) the in_proj_a / in_proj_b outputs, A_log, dt_bias (Hv,) -> (g, beta, cache):
    g = −exp(A_log)·softplus(araw + dt_bias) (the log decay, <= 0), beta = sigmoid(braw)."""
    x_dt = araw + dt_bias
    A = np.exp(A_log)
    g = -A * softplus(x_dt)
    beta = ops.sigmoid(braw)
    return g, beta, (x_dt, A, g, beta)


def gates_backward(dg, dbeta, cache):
    """-> (daraw, dbraw, dA_log, ddt_bias); dg/dx_dt = −A·sigmoid(x_dt), dg/dA_log = g, so dA_log and
    ddt_bias sum the per-token terms over every leading axis."""
    x_dt, A, g, beta = cache
    lead = tuple(range(dg.ndim - 1))
    daraw = dg * (-A) * ops.sigmoid(x_dt)
    return daraw, dbeta * beta * (1.0 - beta), np.sum(dg * g, axis=lead), np.sum(daraw, axis=lead)


# ----------------------------------------------------------------------------------------------------------
# the gated delta rule


def _step(S, q, k, v, a, beta):
    """One token for every (batch, value head): S (B, Hv, Dk, Dv), q/k (B, Hv, Dk), v (B, Hv, Dv), a = exp(g)
    and beta (B, Hv) -> (decayed S, u, delta, new S, o)."""
    Sd = S * a[:, :, None, None]  # decay the memory
    u = np.einsum("bhkv,bhk->bhv", Sd, k)  # what the decayed memory recalls for k
    d = beta[:, :, None] * (v - u)  # the correction written back (the delta rule)
    Sn = Sd + k[:, :, :, None] * d[:, :, None, :]
    o = np.einsum("bhkv,bhk->bhv", Sn, q)  # read with q after the write
    return Sd, u, d, Sn, o


def _expand_heads(x, G):
    # (B, T, Hk, D) -> (B, T, Hv, D): key head j serves value heads j·G .. j·G+G−1 (repeat_interleave).
    return np.repeat(x, G, axis=2)


def gated_delta_forward(q, k, v, g, beta, state=None, checkpoint=64):
    """The recurrence, token by token.

    q, k (B, T, Hk, Dk) as given (normalised and scaled already), v (B, T, Hv, Dv), g and beta (B, T, Hv),
    state (B, Hv, Dk, Dv) or None (zeros) -> (o (B, T, Hv, Dv), final state (B, Hv, Dk, Dv), cache).
    The cache keeps the state before every `checkpoint`-th token (module docstring).
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if Hv % Hk:
        raise ValueError(f"value heads {Hv} must be a multiple of key heads {Hk}")
    if checkpoint < 1:
        raise ValueError(f"checkpoint must be >= 1, got {checkpoint}")
    G = Hv // Hk
    qe, ke = _expand_heads(q, G), _expand_heads(k, G)  # (B, T, Hv, Dk)
    a = np.exp(g)  # (B, T, Hv): decay factors in (0, 1]
    S = np.zeros((B, Hv, Dk, Dv), v.dtype) if state is None else np.array(state, v.dtype)
    o = np.empty_like(v)
    kept = []  # the state before tokens 0, checkpoint, 2·checkpoint, ...
    for t in range(T):
        if t % checkpoint == 0:
            kept.append(S)
        _, _, _, S, o[:, t] = _step(S, qe[:, t], ke[:, t], v[:, t], a[:, t], beta[:, t])
    cache = {"qe": qe, "ke": ke, "v": v, "a": a, "beta": beta, "kept": kept, "checkpoint": checkpoint, "G": G}
    return o, S, cache


def state_after(cache, t: int):
    """The state (B, Hv, Dk, Dv) after the first t tokens (0..T) of the `gated_delta_forward` pass whose cache
    this is: from the kept state before token t − (t mod checkpoint), the same steps on the same stored inputs,
    so bit for bit the state the pass itself held after token t − 1 (t = 0: the state it started from).
    What a decoder's roll-back inside a pass reads (`ddl_ref.decode`); at most checkpoint − 1 steps."""
    qe, ke, v, a, beta, kept, cp = (cache[n] for n in ("qe", "ke", "v", "a", "beta", "kept", "checkpoint"))
    T = v.shape[1]
    if not (kept and 0 <= t <= T):
        raise ValueError(f"a state after {t} tokens of a {T}-token pass does not exist")
    j = min(t // cp, len(kept) - 1)
    S = kept[j]
    for s in range(j * cp, t):
        S = _step(S, qe[:, s], ke[:, s], v[:, s], a[:, s], beta[:, s])[3]
    return S


def gated_delta_backward(do, cache, dstate=None):
    """do (B, T, Hv, Dv), dstate (B, Hv, Dk, Dv) the gradient of the final state (None: zero)
    -> (dq, dk (B, T, Hk, Dk), dv (B, T, Hv, Dv), dg, dbeta (B, T, Hv), dstate0 (B, Hv, Dk, Dv)).

    Derivation (per batch and value head; S_t the state after token t, ⟨·,·⟩ the Frobenius product). One
    step is S̃ = a_t S_{t−1}, u = S̃ᵀk_t, δ = β_t (v_t − u), S_t = S̃ + k_t δᵀ, o_t = S_tᵀ q_t. Let Ḡ be the
    gradient of the loss w.r.t. S_t from the later tokens (dstate for t = T−1). Then, backwards in time:

        G     = Ḡ + q_t do_tᵀ                  S_t feeds o_t and the next step
        dq_t  = S_t do_t
        dδ    = Gᵀ k_t,        dk_t  = G δ + S̃ du
        dv_t  = β_t dδ,        dβ_t  = ⟨v_t − u, dδ⟩,      du = −β_t dδ
        dS̃    = G + k_t duᵀ                    through S_t = S̃ + kδᵀ and u = S̃ᵀk
        dg_t  = ⟨dS̃, S̃⟩                        since dS̃/dg = a_t S_{t−1} = S̃
        Ḡ     ← a_t dS̃                         the gradient w.r.t. S_{t−1}

    and dstate0 is the last Ḡ. Per step it needs S_{t−1} (hence S̃, u and δ by one forward step) and S_t:
    the states between two kept ones are recomputed from the earlier, one segment at a time. A key head's
    gradient sums those of the value heads it serves.
    """
    qe, ke, v, a, beta = cache["qe"], cache["ke"], cache["v"], cache["a"], cache["beta"]
    kept, cp, G = cache["kept"], cache["checkpoint"], cache["G"]
    B, T, Hv, Dk = qe.shape
    Dv = v.shape[3]
    dqe, dke = np.zeros_like(qe), np.zeros_like(ke)
    dv, dg, dbeta = np.zeros_like(v), np.zeros_like(a), np.zeros_like(beta)
    dS = np.zeros((B, Hv, Dk, Dv), v.dtype) if dstate is None else np.array(dstate, v.dtype)
    for j in reversed(range(len(kept))):
        t0, t1 = j * cp, min(T, (j + 1) * cp)
        steps, S = [], kept[j]
        for t in range(t0, t1):  # recompute this segment's steps from its kept state
            Sd, u, d, S, _ = _step(S, qe[:, t], ke[:, t], v[:, t], a[:, t], beta[:, t])
            steps.append((Sd, u, d, S))
        for t in reversed(range(t0, t1)):
            Sd, u, d, Sn = steps[t - t0]
            do_t, q_t, k_t, b_t = do[:, t], qe[:, t], ke[:, t], beta[:, t][:, :, None]
            dqe[:, t] = np.einsum("bhkv,bhv->bhk", Sn, do_t)
            Gt = dS + q_t[:, :, :, None] * do_t[:, :, None, :]
            dd = np.einsum("bhkv,bhk->bhv", Gt, k_t)
            dv[:, t] = b_t * dd
            dbeta[:, t] = np.sum((v[:, t] - u) * dd, axis=-1)
            du = -b_t * dd
            dke[:, t] = np.einsum("bhkv,bhv->bhk", Gt, d) + np.einsum("bhkv,bhv->bhk", Sd, du)
            dSd = Gt + k_t[:, :, :, None] * du[:, :, None, :]
            dg[:, t] = np.sum(dSd * Sd, axis=(-2, -1))
            dS = dSd * a[:, t][:, :, None, None]
    Hk = Hv // G
    dq = dqe.reshape(B, T, Hk, G, Dk).sum(axis=3)
    dk = dke.reshape(B, T, Hk, G, Dk).sum(axis=3)
    return dq, dk, dv, dg, dbeta, dS


def chunk_matrices(Kc, Qc, gc, bc):
    """The C × C matrices of one chunk, for every leading (batch, head) index: Kc, Qc (..., n, Dk), gc, bc
    (..., n) -> (γ (..., n) the chunk-local cumulative log decay, M, KK, QK, Tm, P (..., n, n)):

        M_ts  = exp(γ_t − γ_s) for s ≤ t, else 0      the decay from token s to token t (never overflows)
        A     = strictly lower part of diag(β) (M ∘ K Kᵀ)
        Tm    = (I + A)⁻¹                             unit lower triangular: the UT transform
        P     = M ∘ Q Kᵀ                               lower triangular, diagonal included
    """
    n = Kc.shape[-2]
    gam = np.cumsum(gc, axis=-1)
    lower = np.tril(np.ones((n, n), bool))
    M = np.where(lower, np.exp(np.where(lower, gam[..., :, None] - gam[..., None, :], 0.0)), 0.0)
    KK = Kc @ np.swapaxes(Kc, -1, -2)
    QK = Qc @ np.swapaxes(Kc, -1, -2)
    A = np.tril(bc[..., :, None] * M * KK, -1)
    eye = np.broadcast_to(np.eye(n, dtype=A.dtype), A.shape)
    Tm = np.linalg.solve(eye + A, eye)
    return gam, M, KK, QK, Tm, M * QK


def gated_delta_chunked_forward(q, k, v, g, beta, state=None, chunk=64):
    """The recurrence in matrix form over chunks of `chunk` tokens, as the GPU's chunked kernels compute it
    -> (o, final state, cache for `gated_delta_chunked_backward`); shapes as `gated_delta_forward`'s.

    Within a chunk of n tokens from state S₀ (per batch row and value head; γ, M, Tm, P from
    `chunk_matrices`, Γ = exp(γ), L = n − 1 its last token), unrolling the steps gives
    S_t = Γ_t S₀ + Σ_{s≤t} (Γ_t/Γ_s) k_s δ_sᵀ, whose corrections δ solve (I + A) Δ = R with

        X_K = K S₀,  X_Q = Q S₀                        what the chunk's start state recalls
        R   = diag(β) (V − diag(Γ) X_K)
        Δ   = Tm R                                     the corrections δ_t, one row per token
        O   = diag(Γ) X_Q + P Δ
        S_n = Γ_L S₀ + K̃ᵀ Δ,  K̃ = diag(exp(γ_L − γ)) K

    (the WY form of the chunk's transition ∏ e^{g_t}(I − β_t k_t k_tᵀ) = Γ_L I − K̃ᵀ Tm diag(βΓ) K, applied
    to S₀ before Tm rather than after). The cache keeps each chunk's start state and Δ; the C × C matrices
    are recomputed by the backward.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if Hv % Hk:
        raise ValueError(f"value heads {Hv} must be a multiple of key heads {Hk}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    G = Hv // Hk
    # (B, Hv, T, ·) so each (batch, head) is a stack of matrices
    Q = _expand_heads(q, G).transpose(0, 2, 1, 3)
    K = _expand_heads(k, G).transpose(0, 2, 1, 3)
    V = v.transpose(0, 2, 1, 3)
    gg, bb = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)  # (B, Hv, T)
    S = np.zeros((B, Hv, Dk, Dv), v.dtype) if state is None else np.array(state, v.dtype)
    O = np.empty_like(V)
    starts, deltas = [], []
    for c0 in range(0, T, chunk):
        sl = slice(c0, min(T, c0 + chunk))
        Qc, Kc, Vc, bc = Q[:, :, sl], K[:, :, sl], V[:, :, sl], bb[:, :, sl]
        gam, _, _, _, Tm, P = chunk_matrices(Kc, Qc, gg[:, :, sl], bc)
        Gam = np.exp(gam)[..., None]  # (B, Hv, n, 1)
        R = bc[..., None] * (Vc - Gam * (Kc @ S))
        D = Tm @ R
        O[:, :, sl] = Gam * (Qc @ S) + P @ D
        starts.append(S)
        deltas.append(D)
        Kt = Kc * np.exp(gam[..., -1:] - gam)[..., None]  # K̃
        S = np.exp(gam[..., -1])[..., None, None] * S + np.swapaxes(Kt, -1, -2) @ D
    cache = {"Q": Q, "K": K, "V": V, "g": gg, "beta": bb, "chunk": chunk, "starts": starts, "deltas": deltas,
             "G": G}  # fmt: skip
    return O.transpose(0, 2, 1, 3).astype(v.dtype, copy=False), S, cache


def gated_delta_chunked_backward(do, cache, dstate=None):
    """The backward of `gated_delta_chunked_forward`, chunk by chunk in reverse (what the GPU's chunked
    backward computes) -> (dq, dk, dv, dg, dbeta, dstate0) as `gated_delta_backward`'s.

    Per chunk, from dO and the gradient dS_n of its end state (the next chunk's dS₀; dstate for the last):

        dΔ  = Pᵀ dO + K̃ dS_n,   dR = Tmᵀ dΔ                       through O, S_n, then Δ = Tm R
        dS₀ = Γ_L dS_n + Kᵀ (−diag(βΓ) dR) + Qᵀ (diag(Γ) dO)       the sequential part (one state)
        Z = dR S₀ᵀ,  Y = dO S₀ᵀ,  dK̃ = Δ dS_nᵀ                      per token, given the chunk's states
        dP = dO Δᵀ (s ≤ t),  dA = −dR Δᵀ (s < t)                   since dTm = dΔ Rᵀ and dA = −Tmᵀ dTm Tmᵀ
        dq  = Γ Y + (dP ∘ M) K
        dk  = −βΓ Z + exp(γ_L − γ) dK̃ + (dP ∘ M)ᵀ Q + (D + Dᵀ) K,   D = dA ∘ diag(β) M
        dv  = β dR
        dβ  = (V − Γ X_K)·dR + Σ_s (dA ∘ M ∘ KK)_ts,   with (Γ X_K)·dR = Γ k·Z (no X_K needed)
        dγ  = Γ q·Y − βΓ k·Z − K̃·dK̃ + rows − columns of (dP ∘ P) and of (dA ∘ A);
              the last token adds Γ_L ⟨S₀, dS_n⟩ + Σ_t K̃_t·dK̃_t
        dg  = the reverse cumulative sum of dγ over the chunk (γ is g's cumulative sum)
    """
    Q, K, V, gg, bb = cache["Q"], cache["K"], cache["V"], cache["g"], cache["beta"]
    chunk, starts, deltas, G = cache["chunk"], cache["starts"], cache["deltas"], cache["G"]
    B, Hv, T, Dk = Q.shape
    Dv = V.shape[3]
    dO = do.transpose(0, 2, 1, 3)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    dg, dbeta = np.zeros_like(gg), np.zeros_like(bb)
    dS = np.zeros((B, Hv, Dk, Dv), V.dtype) if dstate is None else np.array(dstate, V.dtype)
    tr = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731
    for j in reversed(range(len(starts))):
        sl = slice(j * chunk, min(T, (j + 1) * chunk))
        Qc, Kc, Vc, bc, dOc = Q[:, :, sl], K[:, :, sl], V[:, :, sl], bb[:, :, sl], dO[:, :, sl]
        S0, D = starts[j], deltas[j]
        n = Kc.shape[2]
        gam, M, KK, QK, Tm, P = chunk_matrices(Kc, Qc, gg[:, :, sl], bc)
        Gam = np.exp(gam)
        tail = np.exp(gam[..., -1:] - gam)  # exp(γ_L − γ_t)
        Kt = Kc * tail[..., None]
        # the sequential part
        dD = tr(P) @ dOc + Kt @ dS
        dR = tr(Tm) @ dD
        dS0 = (np.exp(gam[..., -1])[..., None, None] * dS + tr(Kc) @ (-(bc * Gam)[..., None] * dR)
               + tr(Qc) @ (Gam[..., None] * dOc))  # fmt: skip
        # the per-token products with the chunk's states
        Z, Y, dKt = dR @ tr(S0), dOc @ tr(S0), D @ tr(dS)
        # the intra-chunk part
        lower = np.tril(np.ones((n, n), bool))
        dQK = np.where(lower, dOc @ tr(D), 0.0) * M
        dA = np.tril(-(dR @ tr(D)), -1)
        dKK = dA * bc[..., :, None] * M
        E = dQK * QK + dKK * KK  # dP ∘ P + dA ∘ A
        dgam = (np.sum(Gam[..., None] * Qc * Y, -1) - np.sum((bc * Gam)[..., None] * Kc * Z, -1)
                - np.sum(Kt * dKt, -1) + E.sum(-1) - E.sum(-2))  # fmt: skip
        last = np.exp(gam[..., -1]) * np.sum(S0 * dS, axis=(-2, -1)) + np.sum(Kt * dKt, axis=(-2, -1))
        dgam[..., -1] += last
        dQ[:, :, sl] = Gam[..., None] * Y + dQK @ Kc
        dK[:, :, sl] = (-(bc * Gam)[..., None] * Z + tail[..., None] * dKt + tr(dQK) @ Qc
                        + (dKK + tr(dKK)) @ Kc)  # fmt: skip
        dV[:, :, sl] = bc[..., None] * dR
        dbeta[:, :, sl] = np.sum(Vc * dR, -1) - Gam * np.sum(Kc * Z, -1) + np.sum(dA * M * KK, -1)
        dg[:, :, sl] = np.flip(np.cumsum(np.flip(dgam, -1), -1), -1)
        dS = dS0
    Hk = Hv // G
    dq = dQ.transpose(0, 2, 1, 3).reshape(B, T, Hk, G, Dk).sum(axis=3)
    dk = dK.transpose(0, 2, 1, 3).reshape(B, T, Hk, G, Dk).sum(axis=3)
    return dq, dk, dV.transpose(0, 2, 1, 3), dg.transpose(0, 2, 1), dbeta.transpose(0, 2, 1), dS


# ----------------------------------------------------------------------------------------------------------
# the gated RMSNorm of the value heads


def gated_rmsnorm_forward(x, z, w, eps):
    """x, z (..., Dv), w (Dv,) -> (w ⊙ x/√(mean(x²)+eps) ⊙ silu(z), cache). A plain w·x̂ norm in every norm
    style (Qwen3.5's gated norm is not zero-centred)."""
    n, c_norm = ops.rmsnorm_forward(x, w, eps, "standard")
    return n * ops.silu(z), (n, z, c_norm)


def gated_rmsnorm_backward(dout, cache):
    """-> (dx, dz, dw)."""
    n, z, c_norm = cache
    dz = dout * n * _silu_grad(z)
    dx, dw = ops.rmsnorm_backward(dout * ops.silu(z), c_norm)
    return dx, dz, dw


# ----------------------------------------------------------------------------------------------------------
# the whole mixer


def param_names(p: str) -> dict[str, str]:
    """The tensor names of block prefix p's Gated DeltaNet, by role."""
    q = p + "linear_attn."
    return {
        "qkv": q + "in_proj_qkv.weight",
        "z": q + "in_proj_z.weight",
        "b": q + "in_proj_b.weight",
        "a": q + "in_proj_a.weight",
        "conv": q + "conv1d.weight",
        "dt_bias": q + "dt_bias",
        "A_log": q + "A_log",
        "norm": q + "norm.weight",
        "out": q + "out_proj.weight",
    }


def gdn_forward(params, cfg: ModelConfig, p: str, h, state: GdnState | None = None, checkpoint: int = 64):
    """The Gated DeltaNet of block prefix `p` ("model.layers.{i}.") on the normalised input h (B, T, C)
    -> (out (B, T, C), cache); cache["state"] is the `GdnState` after the last token."""
    B, T, C = h.shape
    Hk, Hv, Dk, Dv = cfg.linear_k_heads, cfg.linear_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    n = param_names(p)
    qkv = ops.linear_forward(h, params[n["qkv"]])  # (B, T, Ch)
    z = ops.linear_forward(h, params[n["z"]]).reshape(B, T, Hv, Dv)
    braw = ops.linear_forward(h, params[n["b"]])  # (B, T, Hv)
    araw = ops.linear_forward(h, params[n["a"]])  # (B, T, Hv)
    c, c_conv = causal_conv_forward(qkv, params[n["conv"]], None if state is None else state.conv)
    kd = Hk * Dk
    qn, c_q = l2norm_forward(c[..., :kd].reshape(B, T, Hk, Dk))
    kn, c_k = l2norm_forward(c[..., kd : 2 * kd].reshape(B, T, Hk, Dk))
    vv = c[..., 2 * kd :].reshape(B, T, Hv, Dv)
    scale = float(Dk) ** -0.5
    g, beta, c_gates = gates_forward(araw, braw, params[n["A_log"]], params[n["dt_bias"]])  # (B, T, Hv) each
    o, S, c_delta = gated_delta_forward(
        qn * scale, kn, vv, g, beta, None if state is None else state.delta, checkpoint
    )
    y, c_gn = gated_rmsnorm_forward(o, z, params[n["norm"]], cfg.rms_eps)  # (B, T, Hv, Dv)
    y = y.reshape(B, T, Hv * Dv)
    out = ops.linear_forward(y, params[n["out"]])
    cache = {"h": h, "conv": c_conv, "q": c_q, "k": c_k, "gates": c_gates, "delta": c_delta, "gn": c_gn,
             "y": y, "scale": scale, "state": GdnState(conv_tail(c_conv), S)}  # fmt: skip
    return out, cache


def gdn_backward(params, cfg: ModelConfig, p: str, dout, cache, grads):
    """dout (B, T, C) w.r.t. the mixer output -> dh (B, T, C) w.r.t. its normalised input; the parameter
    gradients go into `grads` by name."""
    B, T, _ = dout.shape
    Hv, Dv = cfg.linear_v_heads, cfg.linear_v_dim
    n = param_names(p)
    h = cache["h"]
    dy, grads[n["out"]] = ops.linear_backward(dout, cache["y"], params[n["out"]])
    do, dz, grads[n["norm"]] = gated_rmsnorm_backward(dy.reshape(B, T, Hv, Dv), cache["gn"])
    dqs, dkn, dvv, dg, dbeta, _ = gated_delta_backward(do, cache["delta"])
    dx_dt, dbraw, grads[n["A_log"]], grads[n["dt_bias"]] = gates_backward(dg, dbeta, cache["gates"])
    dq = l2norm_backward(dqs * cache["scale"], cache["q"])
    dk = l2norm_backward(dkn, cache["k"])
    dc = np.concatenate([dq.reshape(B, T, -1), dk.reshape(B, T, -1), dvv.reshape(B, T, -1)], axis=-1)
    dqkv, grads[n["conv"]] = causal_conv_backward(dc, cache["conv"])
    dh_a, grads[n["a"]] = ops.linear_backward(dx_dt, h, params[n["a"]])
    dh_b, grads[n["b"]] = ops.linear_backward(dbraw, h, params[n["b"]])
    dh_z, grads[n["z"]] = ops.linear_backward(dz.reshape(B, T, Hv * Dv), h, params[n["z"]])
    dh_qkv, grads[n["qkv"]] = ops.linear_backward(dqkv, h, params[n["qkv"]])
    return dh_qkv + dh_z + dh_b + dh_a
