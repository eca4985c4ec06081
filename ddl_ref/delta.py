"""Deep Delta Learning ops, forward/backward pairs in numpy (docs/model.md#deep-delta-learning).

- `delta_forward` / `delta_backward`: the Delta residual update of one sublayer, any d_v, per token,
  vectorised over leading axes. The state X is (..., C, dv); d_v = 1 is X of shape (..., C, 1).

The state's compressors and expanders (TC, CC, EC, repeat) are in `ddl_ref.shortconv`, the reference of
`shaders/shortconv.wgsl`.

What this file deliberately does not do: the surrounding sublayers (attention, MLP, RMSNorm; see
`ddl_ref.blocks`), mixed precision, or token caches for incremental decoding.
"""

from __future__ import annotations

import numpy as np

from ddl_ref.ops import sigmoid

# ----------------------------------------------------------------------------------------------------------
# the Delta update


def delta_forward(X, u, c, x_v, w_beta, b_beta, W_v, b_v, k_eps, v_scale):
    """One Delta residual update, X_new = X + k (β (v - Xᵀk))ᵀ.

    X (..., C, dv) the state; u (..., C) the sublayer output (k̃); c (..., C) the normalized context (β
    input); x_v (..., C) the v input (the raw stream when d_v = 1, the compressed readout x_in when d_v > 1);
    w_beta (C,), b_beta (1,), W_v (dv, C), b_v (dv,).

        k = u / sqrt(|u|² + ε²)             β = 2 σ(w_β·c + b_β) ∈ (0, 2)
        v = v_scale σ(W_v x_v + b_v)         p = Xᵀk (dv,),  δ = v - p
        X_new = X + k (β δ)ᵀ

    Returns (X_new (..., C, dv), cache). The cache holds every per-token quantity (k, β, v, p, ...), which
    the spectral diagnostics read too.
    """
    n = np.sqrt(np.sum(u * u, axis=-1, keepdims=True) + float(k_eps) ** 2)  # (..., 1)
    k = u / n  # (..., C)
    a = c @ w_beta + b_beta[0]  # (...,)
    beta = 2.0 * sigmoid(a)  # (...,)
    z = x_v @ W_v.T + b_v  # (..., dv)
    v = float(v_scale) * sigmoid(z)  # (..., dv)
    p = np.einsum("...cj,...c->...j", X, k)  # (..., dv)
    delta = v - p  # (..., dv)
    gamma = beta[..., None] * delta  # (..., dv)
    X_new = X + k[..., :, None] * gamma[..., None, :]
    cache = dict(X=X, c=c, x_v=x_v, w_beta=w_beta, W_v=W_v, n=n, k=k, beta=beta, v=v, p=p, delta=delta,
                 v_scale=float(v_scale))  # fmt: skip
    return X_new, cache


def delta_backward(dX_new, cache):
    """-> (dX, du, dc, dx_v, dw_beta, db_beta, dW_v, db_v) (the backward of docs/model.md#the-delta-residual).

    With G = dX_new and q = Gᵀk: dX = G - β k qᵀ, dv = β q, dβ = δ·q, dk = β (G δ - X q),
    du = (dk - k (k·dk)) / n. Parameter gradients sum over every leading axis.
    """
    X, k, n, beta = cache["X"], cache["k"], cache["n"], cache["beta"]
    v, delta, s = cache["v"], cache["delta"], cache["v_scale"]
    G = dX_new
    q = np.einsum("...cj,...c->...j", G, k)  # (..., dv)
    dX = G - beta[..., None, None] * k[..., :, None] * q[..., None, :]
    dv_ = beta[..., None] * q  # (..., dv)
    dbeta = np.sum(delta * q, axis=-1)  # (...,)
    dk = beta[..., None] * (np.einsum("...cj,...j->...c", G, delta) - np.einsum("...cj,...j->...c", X, q))
    du = (dk - k * np.sum(k * dk, axis=-1, keepdims=True)) / n
    da = dbeta * beta * (1.0 - 0.5 * beta)  # dβ/da = 2σ(1-σ) = β(1 - β/2)
    dz = dv_ * v * (1.0 - v / s)  # dv/dz = s σ(1-σ) = v(1 - v/s)
    C, dv = X.shape[-2], X.shape[-1]
    c2 = cache["c"].reshape(-1, C)
    xv2 = cache["x_v"].reshape(-1, cache["x_v"].shape[-1])
    dw_beta = da.reshape(-1) @ c2  # (C,)
    db_beta = np.array([np.sum(da)], dtype=X.dtype)  # (1,)
    dW_v = dz.reshape(-1, dv).T @ xv2  # (dv, C)
    db_v = np.sum(dz.reshape(-1, dv), axis=0)  # (dv,)
    dc = da[..., None] * cache["w_beta"]  # (..., C)
    dx_v = dz @ cache["W_v"]  # (..., C)
    return dX, du, dc, dx_v, dw_beta, db_beta, dW_v, db_v
