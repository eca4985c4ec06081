"""Checking utilities for tests against the reference: comparing a GPU result with `ddl_ref`, and checking a
reference backward against finite differences.

Comparing (llm.c's `validate_result`): `check` tests shape and dtype first, then values within
`atol + rtol*|ref|`, reporting the max abs diff and the first mismatches. Tolerances live in one table (TOL),
by kind of computation, for float32 on the GPU against float64 or float32 numpy; reductions over long axes
(matmul K, softmax over V) get the looser rows.

Gradient checks (llm.c `layernorm.py` style): a backward is checked on the scalar `fakeloss = sum(out * dout)`
for a fixed random `dout`: the analytic gradient of that scalar w.r.t. each input is exactly what the backward
returns, and central differences in float64 approximate it to within a truncation error of order eps^2 and a
rounding error of order u·|f|/eps (u = 2.2e-16). The second is absolute: for a loss of 5 and a tensor whose
gradients are 1e-4 it is 1e-5 of the gradient at eps=1e-6, and its bits depend on which BLAS kernel sums the
products (OpenBLAS picks one per CPU). So a check allows `rtol` of the tensor's largest gradient plus the
rounding floor `fd_floor` derived from the step and the function's magnitude (`assert_fd_grad`), and no
tolerance depends on the machine. `random_params` gives every tensor of a config signal.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ddl_ref.params import param_table

TOL = {
    # kind: (rtol, atol)
    "elementwise": (1e-5, 1e-6),
    "norm": (1e-4, 1e-5),
    "matmul": (1e-4, 1e-4),
    "attention": (2e-4, 2e-5),
    "loss": (1e-4, 1e-5),
    "optimizer": (1e-5, 1e-6),
    "model": (2e-3, 2e-4),
}


def f64(a) -> np.ndarray:
    """A float64 copy: the precision the reference is evaluated in."""
    return np.asarray(a, np.float64)


def check(name: str, got: np.ndarray, ref: np.ndarray, kind: str = "elementwise", rtol=None, atol=None):
    """Assert `got` (a GPU result) matches `ref` within TOL[kind] (or the given rtol/atol); -> max abs diff."""
    r, a = TOL[kind]
    rtol = r if rtol is None else rtol
    atol = a if atol is None else atol
    got = np.asarray(got)
    ref = np.asarray(ref)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != reference {ref.shape}"
    g = got.astype(np.float64)
    e = ref.astype(np.float64)
    assert np.all(np.isfinite(g)), f"{name}: non-finite values in GPU result"
    err = np.abs(g - e)
    bad = err > atol + rtol * np.abs(e)
    if bad.any():
        idx = np.argwhere(bad)[:5]
        pairs = ", ".join(
            f"{tuple(int(v) for v in i)}: gpu {g[tuple(i)]:.7g} ref {e[tuple(i)]:.7g}" for i in idx
        )
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.size} mismatches, max abs diff {err.max():.3g} "
            f"(rtol {rtol}, atol {atol}); first: {pairs}"
        )
    return float(err.max()) if err.size else 0.0


def numeric_grad(f: Callable[[], float], x: np.ndarray, eps: float = 1e-6, at=None) -> np.ndarray:
    """Central differences of the scalar f() w.r.t. x, perturbing x in place (restored afterwards). `at`: only
    these flat indices (the result is then their 1-D gradient), for models whose every entry costs too much."""
    assert x.dtype == np.float64, "finite differences need float64"
    flat = x.reshape(-1)  # a view: writing to it perturbs x
    idx = range(flat.size) if at is None else at
    g = np.zeros(len(idx))
    for j, i in enumerate(idx):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        g[j] = (fp - fm) / (2.0 * eps)
    return g.reshape(x.shape) if at is None else g


def rel_error(analytic: np.ndarray, numeric: np.ndarray) -> tuple[float, float]:
    """-> (max |a - n| / max(max |n|, 1e-8), max |a - n|). Robust where single entries are near zero."""
    diff = float(np.max(np.abs(analytic - numeric))) if analytic.size else 0.0
    scale = max(float(np.max(np.abs(numeric))) if numeric.size else 0.0, 1e-8)
    return diff / scale, diff


# f is a chain of float64 operations whose result carries a rounding error of a few ulps of the magnitude it
# is summed at; 32 ulps leaves room for long sums and for a BLAS kernel that rounds in another order. Run under
# each of OpenBLAS's Prescott, Nehalem, Sandybridge, Haswell, SkylakeX and Zen kernels (OPENBLAS_CORETYPE), the
# float64 checks' largest error was 0.54 of its tolerance, a truncation error with the same bits on every kernel
# (`make test-blas` repeats this).
ROUNDOFF_ULPS = 32


def fd_floor(magnitude: float, eps: float) -> float:
    """The absolute error that rounding alone puts into a central difference of step `eps` of a function
    evaluated at `magnitude` (|f|, or the sum of |terms| where terms cancel): 2 roundings over 2·eps."""
    return ROUNDOFF_ULPS * float(np.finfo(np.float64).eps) * max(abs(magnitude), 1.0) / eps


def assert_grad_close(
    name: str, analytic: np.ndarray, numeric: np.ndarray, rtol: float = 1e-6, atol: float = 0.0
) -> None:
    """max |analytic - numeric| < rtol · max |numeric| + atol (atol: the difference's rounding floor)."""
    assert analytic.shape == numeric.shape, f"{name}: shape {analytic.shape} != {numeric.shape}"
    rel, diff = rel_error(analytic, numeric)
    scale = max(float(np.max(np.abs(numeric))) if numeric.size else 0.0, 1e-8)  # rel_error's
    assert diff <= rtol * scale + atol, (
        f"{name}: relative error {rel:.3e} >= {rtol:.0e} (max abs diff {diff:.3e}, rounding floor {atol:.1e})"
    )


def assert_fd_grad(
    name: str,
    analytic: np.ndarray,
    f: Callable[[], float],
    x: np.ndarray,
    eps: float = 1e-6,
    at=None,
    rtol: float = 1e-6,
    magnitude: float | None = None,
) -> None:
    """Check `analytic` (the gradient of f w.r.t. x, x's shape) against central differences of f in float64,
    within rtol of the largest gradient plus the rounding floor of the step (`at`: only these flat indices).
    `magnitude`: what f's rounding scales with, where it is not |f| (a sum whose terms cancel)."""
    f0 = f() if magnitude is None else magnitude
    num = numeric_grad(f, x, eps=eps, at=at)
    want = np.asarray(analytic) if at is None else np.asarray(analytic).reshape(-1)[at]
    assert_grad_close(name, want, num, rtol=rtol, atol=fd_floor(f0, eps))


def fakeloss(out, dout) -> float:
    """sum(out * dout) over every output array (out and dout may be tuples of arrays)."""
    if isinstance(out, tuple | list):
        return float(sum(np.sum(o * d) for o, d in zip(out, dout, strict=True)))
    return float(np.sum(out * dout))


def check_grad(
    fwd: Callable[..., object],
    bwd: Callable[..., object],
    inputs: list[np.ndarray],
    wrt: list[int] | None = None,
    seed: int = 0,
    eps: float = 1e-6,
    rtol: float = 1e-6,
) -> dict[int, float]:
    """Check bwd against finite differences of fwd.

    fwd(*inputs) -> out (array or tuple of arrays); bwd(out, dout, *inputs) -> gradients, a tuple aligned
    with `wrt` (or a single array when one input is checked). `wrt` lists which inputs are differentiated
    (default: every float64 input). Returns {input index: relative error}.
    """
    if wrt is None:
        wrt = [i for i, x in enumerate(inputs) if isinstance(x, np.ndarray) and x.dtype == np.float64]
    rng = np.random.default_rng(seed)
    out = fwd(*inputs)
    if isinstance(out, tuple | list):
        dout = tuple(rng.standard_normal(np.shape(o)) for o in out)
    else:
        dout = rng.standard_normal(np.shape(out))
    grads = bwd(out, dout, *inputs)
    if len(wrt) == 1 and not isinstance(grads, tuple | list):
        grads = (grads,)
    assert len(grads) == len(wrt), f"backward returned {len(grads)} gradients for {len(wrt)} inputs"
    errors = {}
    # fakeloss sums terms of both signs: it is rounded at the size of the sum of their magnitudes
    magnitude = fakeloss(tuple(np.abs(o) for o in out) if isinstance(out, tuple | list) else np.abs(out),
                         tuple(np.abs(d) for d in dout) if isinstance(dout, tuple) else np.abs(dout))  # fmt: skip
    for idx, g in zip(wrt, grads, strict=True):
        num = numeric_grad(lambda: fakeloss(fwd(*inputs), dout), inputs[idx], eps=eps)
        assert_grad_close(f"input {idx}", np.asarray(g), num, rtol=rtol, atol=fd_floor(magnitude, eps))
        errors[idx] = rel_error(np.asarray(g), num)[0]
    return errors


def random_params(cfg, seed=0) -> dict:
    """float64 random values for every tensor of `cfg`'s parameter table (not the init), so that norm
    weights, offsets and every path carry signal in a gradient check."""
    rng = np.random.default_rng(seed)
    return {s.name: rng.standard_normal(s.shape) * 0.5 for s in param_table(cfg)}


def attention_inputs(shape, seed=0):
    """q, k, v and an upstream gradient dout for causal attention of `shape` = (B, T, H, K, D): H query heads
    over K key/value heads, standard normal float32 (the attention kernels' tests)."""
    B, T, H, K, D = shape
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, D)).astype(np.float32)
    k = rng.standard_normal((B, T, K, D)).astype(np.float32)
    v = rng.standard_normal((B, T, K, D)).astype(np.float32)
    dout = rng.standard_normal((B, T, H, D)).astype(np.float32)
    return q, k, v, dout
