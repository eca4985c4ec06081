"""Spectral diagnostics of the Deep Delta residual (the reference trainer's `TrainingSpectralSnapshot`), from
a forward's caches.

Every DDL sublayer is one "layer" (two per block, in the order block0.attn, block0.mlp, block1.attn, ...). No
public source defines these diagnostics (docs/model.md#spectral-diagnostics-ddl_refspectralpy): the
definitions below are this project's choices, derived from the spectrum of the Delta operator A = I − β k kᵀ
(eigenvalue 1−β along k, 1 on k^⊥, det A = 1−β, and det(I_dv ⊗ A) = (1−β)^dv on the lifted d×d_v state). All
means are over the *real* tokens of the batch (position t < lengths[b]), pooled over batch rows:

- `beta_per_layer[l]` = mean_t β_t, the gate (β = 2σ(w_β·c + b_β) ∈ (0, 2)).
- `k_eigenvalue_per_layer[l]` = mean_t (1 − β_t): the eigenvalue of A along k.
- `spatial_determinant_per_layer[l]` = mean_t (1 − β_t): det A ([P1] Cor. 3.2); equal to the above by
  construction, kept as its own field because the reference trainer reports both.
- `lifted_determinant_per_layer[l]` = mean_t (1 − β_t)^dv: det of I_dv ⊗ A, the map on the whole d×d_v state
  (equal to the spatial one when d_v = 1).
- `regime_per_layer[l]` = `DeltaRegime.from_beta(beta_per_layer[l])`: the nearest of the anchors 0, 1, 2 —
  "identity" β < 0.5 ≤ "projection" < 1.5 ≤ "reflection".
- `beta_histogram` = `beta_histogram(beta_per_layer)`: 20 fixed bins of width 0.1 over [0, 2] of the
  per-layer mean betas (β = 2 goes into the last bin), plus the count of layers per regime; a JSON-able dict
  {"edges": 21 floats, "counts": 20 ints, "regimes": {regime: count}}.
- `k_coherence_per_layer[l]` = ‖mean_t k_t‖ with ‖k_t‖ ≈ 1: 1 when every token writes along the same
  direction, about 0 when the directions are spread isotropically (≈ 1/√N for N random directions).
- `correction_norm_per_layer[l]` = mean_t ‖β_t (v_t − X_tᵀ k_t)‖₂, the norm over the d_v vector of the
  written amount (|γ| for d_v = 1, [P1] Eq. 3.7); the Frobenius norm of the rank-1 update since ‖k‖ ≈ 1.

A snapshot is a plain dict with exactly these keys (lists of floats, regimes as strings), or None for a
baseline model. `SpectralAccumulator` averages snapshots over evaluation batches weighted by their prediction
count, then recomputes the regimes and the histogram from the averaged betas, as the reference trainer does.

What this file deliberately does not do: run the model (`ddl_ref.model.forward(..., spectral=True)` calls
`spectral_snapshot` on its own cache), or compute eigen-decompositions (the closed forms above are exact).
"""

from __future__ import annotations

import enum

import numpy as np

LAYER_KEYS = (
    "beta_per_layer",
    "k_eigenvalue_per_layer",
    "spatial_determinant_per_layer",
    "lifted_determinant_per_layer",
    "k_coherence_per_layer",
    "correction_norm_per_layer",
)
HIST_BINS = 20
HIST_EDGES = [round(0.1 * i, 10) for i in range(HIST_BINS + 1)]  # 0.0, 0.1, ..., 2.0


class DeltaRegime(enum.StrEnum):
    """The regime of a Delta operator by its β: the nearest of the anchors 0 (identity), 1, 2."""

    IDENTITY = "identity"  # β → 0: A = I, the shortcut is skipped
    PROJECTION = "projection"  # β → 1: A = I − kkᵀ, replace-along-k ("target match")
    REFLECTION = "reflection"  # β → 2: A = I − 2kkᵀ, a Householder reflection ("over-relaxed")

    @classmethod
    def from_beta(cls, beta: float) -> DeltaRegime:
        if beta < 0.5:
            return cls.IDENTITY
        if beta < 1.5:
            return cls.PROJECTION
        return cls.REFLECTION


def beta_histogram(betas) -> dict:
    """Fixed histogram of betas over [0, 2]: {"edges", "counts", "regimes"} (JSON-able)."""
    counts = [0] * HIST_BINS
    regimes = {r.value: 0 for r in DeltaRegime}
    for b in betas:
        b = float(b)
        counts[min(max(int(np.floor(b / 0.1)), 0), HIST_BINS - 1)] += 1
        regimes[DeltaRegime.from_beta(b).value] += 1
    return {"edges": list(HIST_EDGES), "counts": counts, "regimes": regimes}


def _layer_values(dc, mask, dv: int) -> dict[str, float]:
    """The per-layer means of one Delta update's cache (`ddl_ref.delta.delta_forward`) over mask (B, T)."""
    beta = dc["beta"][mask]  # (N,)
    k = dc["k"][mask]  # (N, C)
    gamma = beta[:, None] * dc["delta"][mask]  # (N, dv): β (v − Xᵀk)
    one_minus = 1.0 - beta
    return {
        "beta_per_layer": float(np.mean(beta)),
        "k_eigenvalue_per_layer": float(np.mean(one_minus)),
        "spatial_determinant_per_layer": float(np.mean(one_minus)),
        "lifted_determinant_per_layer": float(np.mean(one_minus**dv)),
        "k_coherence_per_layer": float(np.linalg.norm(np.mean(k, axis=0))),
        "correction_norm_per_layer": float(np.mean(np.linalg.norm(gamma, axis=-1))),
    }


def finish_snapshot(per_layer: dict[str, list[float]]) -> dict:
    """A snapshot from per-layer values (LAYER_KEYS lists): adds the regimes and the histogram."""
    snap = {key: list(per_layer[key]) for key in LAYER_KEYS}
    snap["regime_per_layer"] = [DeltaRegime.from_beta(b).value for b in snap["beta_per_layer"]]
    snap["beta_histogram"] = beta_histogram(snap["beta_per_layer"])
    return snap


def spectral_snapshot(cache, cfg, lengths=None) -> dict | None:
    """The snapshot of one forward (`ddl_ref.model.forward`'s cache), over tokens t < lengths[b].

    None for a baseline (residual "add") model or when no token is real.
    """
    if cfg.residual != "delta":
        return None
    B, T = np.asarray(cache["ids"]).shape
    lengths = np.full(B, T) if lengths is None else np.asarray(lengths).reshape(B)
    mask = np.arange(T)[None, :] < lengths[:, None]  # (B, T) real tokens
    if not mask.any():
        return None
    per_layer: dict[str, list[float]] = {key: [] for key in LAYER_KEYS}
    for block in cache["blocks"]:
        for s in ("attn", "mlp"):
            for key, value in _layer_values(block["ddl_" + s], mask, cfg.ddl_dv).items():
                per_layer[key].append(value)
    return finish_snapshot(per_layer)


class SpectralAccumulator:
    """Weighted average of snapshots over evaluation batches (the reference trainer's `SpectralAccumulator`).

    `observe(snapshot, weight)` with weight = the batch's prediction count (a None snapshot, from a baseline
    model, is ignored); `finish()` -> the averaged snapshot, with regimes and histogram recomputed from the
    averaged betas, or None when nothing was observed.
    """

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.total_weight = 0.0

    def observe(self, snapshot: dict | None, weight: float) -> None:
        if snapshot is None:
            return
        for key in LAYER_KEYS:
            values = np.asarray(snapshot[key], dtype=np.float64)
            if key not in self.sums:
                self.sums[key] = np.zeros_like(values)
            if self.sums[key].shape != values.shape:
                raise ValueError(f"{key} length must remain stable across spectral snapshots")
            self.sums[key] += values * float(weight)
        self.total_weight += float(weight)

    def finish(self) -> dict | None:
        if self.total_weight == 0.0:
            return None
        return finish_snapshot(
            {key: [float(v) for v in self.sums[key] / self.total_weight] for key in LAYER_KEYS}
        )
