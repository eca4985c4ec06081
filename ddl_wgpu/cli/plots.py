"""PNG plots of a sweep (`train --plots`): loss curves per variant, β per DDL sublayer over steps, and the
final β histogram. Needs matplotlib (the `plot` extra); the Agg backend, so no display is required.

A sweep over several seeds (`train --seeds`) has several reports per variant: each curve is then the mean over
the seeds, with the band between the lowest and the highest seed (training loss) or error bars of one standard
deviation (validation loss), and the histogram counts the sublayers of every seed."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddl_wgpu.files.safeio import write_atomic


def _save(fig, p: Path) -> None:
    """The figure as a PNG at `p`, written as every output is: a file of its own, then a rename."""
    write_atomic(p, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))


def by_variant(reports: list[dict]) -> dict[str, list[dict]]:
    """The reports of each variant (one per seed), in sweep order."""
    groups: dict[str, list[dict]] = {}
    for r in reports:
        groups.setdefault(r["variant"], []).append(r)
    return groups


def _spectral(e: dict):
    return e.get("validation_spectral") or e.get("train_spectral")


def _common_steps(reps: list[dict], has) -> list[int]:
    """The steps at which the history of every seed has an entry for which `has(entry)` holds."""
    steps = [{e["step"] for e in r["history"] if has(e)} for r in reps]
    return sorted(set.intersection(*steps)) if steps else []


def _at(r: dict, steps: list[int], value) -> np.ndarray:
    entries = {e["step"]: e for e in r["history"]}
    return np.array([value(entries[s]) for s in steps], dtype=np.float64)


def write_plots(comp: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = []
    groups = by_variant(comp["reports"])
    seeds = max((len(g) for g in groups.values()), default=1)
    over = f" (mean over {seeds} seeds)" if seeds > 1 else ""

    # 1. train (every step) and validation (every eval) loss per variant
    fig, ax = plt.subplots(figsize=(8, 5))
    for v, reps in groups.items():
        steps = _common_steps(reps, lambda e: True)
        train = np.stack([_at(r, steps, lambda e: e["train"]["loss"]) for r in reps])
        line = ax.plot(steps, train.mean(axis=0), label=f"{v} train", lw=1)
        if len(reps) > 1:
            ax.fill_between(steps, train.min(axis=0), train.max(axis=0), color=line[0].get_color(), alpha=0.2)
        vsteps = _common_steps(reps, lambda e: bool(e.get("validation")))
        val = [list(_at(r, vsteps, lambda e: e["validation"]["loss"])) for r in reps]
        if all(r.get("initial_validation") for r in reps):
            vsteps = [0, *vsteps]
            val = [[r["initial_validation"]["loss"], *x] for r, x in zip(reps, val, strict=True)]
        if vsteps:
            vals = np.array(val, dtype=np.float64)
            err = vals.std(axis=0, ddof=1) if len(reps) > 1 else None
            ax.errorbar(vsteps, vals.mean(axis=0), yerr=err, fmt="o--", color=line[0].get_color(),
                        label=f"{v} validation", ms=3, capsize=2)  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("training and validation loss" + over)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    p = out_dir / "loss.png"
    _save(fig, p)
    plt.close(fig)
    written.append(p)

    # 2. beta per DDL sublayer over the evaluation steps, one panel per DDL variant
    ddl = {
        v: reps for v, reps in groups.items() if all(any(_spectral(e) for e in r["history"]) for r in reps)
    }
    if ddl:
        fig, axes = plt.subplots(1, len(ddl), figsize=(6 * len(ddl), 4.5), squeeze=False)
        for ax, (v, reps) in zip(axes[0], ddl.items(), strict=True):
            steps = _common_steps(reps, lambda e: bool(_spectral(e)))
            betas = np.array([[_spectral(e)["beta_per_layer"] for e in _entries(r, steps)] for r in reps])
            mean = betas.mean(axis=0)  # (steps, sublayers)
            for i in range(mean.shape[1]):
                kind = "attn" if i % 2 == 0 else "mlp"
                ax.plot(steps, mean[:, i], label=f"block {i // 2} {kind}", lw=1)
            ax.axhline(1.0, color="grey", lw=0.5, ls=":")
            ax.set_title(f"{v}: mean β per DDL sublayer" + over)
            ax.set_xlabel("step")
            ax.set_ylabel("β")
            ax.set_ylim(0, 2)
            ax.legend(fontsize=6, ncol=2)
        p = out_dir / "beta.png"
        _save(fig, p)
        plt.close(fig)
        written.append(p)

        # 3. final β histogram (per-layer betas) per DDL variant, the sublayers of every seed counted
        fig, ax = plt.subplots(figsize=(7, 4))
        for v, reps in ddl.items():
            specs = [r.get("final_validation_spectral") or r.get("final_train_spectral") for r in reps]
            if not all(specs):
                continue
            edges = specs[0]["beta_histogram"]["edges"]
            counts = np.sum([s["beta_histogram"]["counts"] for s in specs], axis=0)
            centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
            ax.step(centers, counts, where="mid", label=v)
        ax.set_xlabel("β (per-sublayer mean)")
        ax.set_ylabel("sublayers" + (f" (all {seeds} seeds)" if seeds > 1 else ""))
        ax.set_xlim(0, 2)
        ax.set_title("final β histogram: identity < 0.5 ≤ projection < 1.5 ≤ reflection")
        ax.legend(fontsize=8)
        p = out_dir / "beta_histogram.png"
        _save(fig, p)
        plt.close(fig)
        written.append(p)
    return written


def _entries(r: dict, steps: list[int]) -> list[dict]:
    entries = {e["step"]: e for e in r["history"]}
    return [entries[s] for s in steps]
