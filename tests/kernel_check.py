"""Compare a GPU result with the `ddl_ref` result: shape and dtype first, then values within
`atol + rtol*|ref|`, reporting the max abs diff and the first mismatches (llm.c's `validate_result`).

Tolerances live in one table, by kind of computation, for float32 on the GPU against float64 or float32
numpy. Reductions over long axes (matmul K, softmax over V) get the looser rows.
"""

import numpy as np

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


def check(name: str, got: np.ndarray, ref: np.ndarray, kind: str = "elementwise", rtol=None, atol=None):
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
