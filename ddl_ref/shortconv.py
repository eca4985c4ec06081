"""The d_v > 1 state's compressors and expanders, forward/backward pairs in numpy: the reference of
`shaders/shortconv.wgsl` (`ddl_wgpu/ops/shortconv.py`, tested in tests/test_kernel_shortconv.py).

- `tc_forward` / `tc_backward`: the token-conv compressor (causal depthwise conv over time, then a read over
  d_v), (B, T, C, dv) -> (B, T, C).
- `cc_forward` / `cc_backward`: the channel-conv compressor (depthwise conv along the d_v axis, non-causal,
  left pad (dv-1)//2, then a read over d_v), (..., C, dv) -> (..., C).
- `ec_forward` / `ec_backward`: the embedding expander (EC, causal depthwise conv over time),
  (B, T, C) -> (B, T, C, dv).
- `repeat_forward` / `repeat_backward`: the no-EC expansion X0 = e 1ᵀ.

Conv tap convention (TC and EC, PyTorch `Conv1d` with left pad k-1): the weight is (C*dv, k) and channel
i*dv + j is feature i, value channel j; tap m multiplies the input at time t - (k-1-m), so tap k-1 is the
current token and tap 0 the oldest. Positions before t = 0 read zeros. CC (PyTorch cross-correlation with
pad_left = (dv-1)//2 and output length dv): y[i, j] = sum_m w[i, m] * X[i, j + m - pad_left], zero outside
0..dv-1.
"""

from __future__ import annotations

import numpy as np

# ----------------------------------------------------------------------------------------------------------
# causal depthwise conv over time (shared by TC and EC)


def _causal_conv_forward(X, W):
    """X (B, T, C, dv), W (C, dv, k) -> Y (B, T, C, dv); Y[t] = sum_m W[..., m] X[t - (k-1-m)]."""
    K = W.shape[-1]
    T = X.shape[1]
    Xp = np.pad(X, ((0, 0), (K - 1, 0), (0, 0), (0, 0)))  # zeros before t = 0
    Y = np.zeros_like(X)
    for m in range(K):
        Y += W[..., m] * Xp[:, m : m + T]
    return Y


def _causal_conv_backward(dY, X, W):
    """-> (dX (B, T, C, dv), dW (C, dv, k))."""
    K = W.shape[-1]
    T = X.shape[1]
    Xp = np.pad(X, ((0, 0), (K - 1, 0), (0, 0), (0, 0)))
    dXp = np.zeros_like(Xp)
    dW = np.zeros_like(W)
    for m in range(K):
        dXp[:, m : m + T] += W[..., m] * dY
        dW[..., m] = np.sum(Xp[:, m : m + T] * dY, axis=(0, 1))
    return dXp[:, K - 1 :], dW


# ----------------------------------------------------------------------------------------------------------
# TC compressor: causal short conv over time on the C*dv channels, then the read over d_v


def tc_forward(X, conv_w, read_w):
    """X (B, T, C, dv), conv_w (C*dv, k), read_w (dv,) -> (x_in (B, T, C), cache).

    x_in[b, t, i] = sum_j read[j] sum_m conv[i*dv + j, m] X[b, t - (k-1-m), i, j] (zero before t = 0).
    """
    C, dv = X.shape[-2], X.shape[-1]
    W = conv_w.reshape(C, dv, -1)
    Y = _causal_conv_forward(X, W)
    return Y @ read_w, (X, W, Y, read_w)


def tc_backward(dx_in, cache):
    """-> (dX (B, T, C, dv), dconv_w (C*dv, k), dread_w (dv,))."""
    X, W, Y, read_w = cache
    dv = X.shape[-1]
    dread = dx_in.reshape(-1) @ Y.reshape(-1, dv)
    dY = dx_in[..., None] * read_w
    dX, dW = _causal_conv_backward(dY, X, W)
    return dX, dW.reshape(-1, W.shape[-1]), dread


# ----------------------------------------------------------------------------------------------------------
# CC compressor: depthwise conv along the d_v axis (kernel dv, non-causal), then the read over d_v


def _shift_dv(X, o):
    """S[..., j] = X[..., j + o] where 0 <= j + o < dv, else 0."""
    dv = X.shape[-1]
    S = np.zeros_like(X)
    lo, hi = max(0, -o), min(dv, dv - o)
    if lo < hi:
        S[..., lo:hi] = X[..., lo + o : hi + o]
    return S


def cc_forward(X, conv_w, read_w):
    """X (..., C, dv), conv_w (C, kc) (kc = dv), read_w (dv,) -> (x_in (..., C), cache).

    y[i, j] = sum_m conv[i, m] X[i, j + m - pad_left] (pad_left = (kc-1)//2), x_in[i] = sum_j read[j] y[i, j].
    """
    kc = conv_w.shape[-1]
    pl = (kc - 1) // 2
    Y = np.zeros_like(X)
    for m in range(kc):
        Y += conv_w[:, m : m + 1] * _shift_dv(X, m - pl)
    return Y @ read_w, (X, conv_w, Y, read_w)


def cc_backward(dx_in, cache):
    """-> (dX (..., C, dv), dconv_w (C, kc), dread_w (dv,))."""
    X, conv_w, Y, read_w = cache
    C, dv = X.shape[-2], X.shape[-1]
    kc = conv_w.shape[-1]
    pl = (kc - 1) // 2
    dread = dx_in.reshape(-1) @ Y.reshape(-1, dv)
    dY = dx_in[..., None] * read_w
    dX = np.zeros_like(X)
    dW = np.zeros_like(conv_w)
    for m in range(kc):
        o = m - pl
        # y[j] += w[m] X[j + o]  =>  dX[j'] += w[m] dY[j' - o]  and  dw[m] = sum_j X[j + o] dY[j]
        dX += conv_w[:, m : m + 1] * _shift_dv(dY, -o)
        dW[:, m] = np.sum((_shift_dv(X, o) * dY).reshape(-1, C, dv), axis=(0, 2))
    return dX, dW, dread


# ----------------------------------------------------------------------------------------------------------
# input expansion: EC (short conv) or plain repetition


def ec_forward(e, conv_w):
    """e (B, T, C), conv_w (C*dv, k) -> (X0 (B, T, C, dv), cache).

    X0[b, t, i, j] = sum_m conv[i*dv + j, m] e[b, t - (k-1-m), i]; the identity init (tap k-1 = 1) repeats e.
    """
    C = e.shape[-1]
    W = conv_w.reshape(C, -1, conv_w.shape[-1])
    E = np.broadcast_to(e[..., None], e.shape + (W.shape[1],))
    return _causal_conv_forward(E, W), (E, W)


def ec_backward(dX0, cache):
    """-> (de (B, T, C), dconv_w (C*dv, k))."""
    E, W = cache
    dE, dW = _causal_conv_backward(dX0, E, W)
    return np.sum(dE, axis=-1), dW.reshape(-1, W.shape[-1])


def repeat_forward(e, dv):
    """e (..., C) -> X0 (..., C, dv) = e 1ᵀ (no EC)."""
    return np.repeat(e[..., None], dv, axis=-1)


def repeat_backward(dX0):
    """-> de (..., C): the sum over d_v."""
    return np.sum(dX0, axis=-1)
