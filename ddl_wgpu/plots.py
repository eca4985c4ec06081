"""PNG plots of a sweep (`train --plots`): loss curves per variant, β per DDL sublayer over steps, and the
final β histogram. Needs matplotlib (the `plot` extra); the Agg backend, so no display is required."""

from __future__ import annotations

from pathlib import Path


def write_plots(comp: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    written = []

    # 1. train (every step) and validation (every eval) loss per variant
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in comp["reports"]:
        h = r["history"]
        line = ax.plot(
            [e["step"] for e in h], [e["train"]["loss"] for e in h], label=f"{r['variant']} train", lw=1
        )
        vs = [(e["step"], e["validation"]["loss"]) for e in h if e.get("validation")]
        if r.get("initial_validation"):
            vs.insert(0, (0, r["initial_validation"]["loss"]))
        if vs:
            ax.plot(
                *zip(*vs, strict=True),
                "o--",
                color=line[0].get_color(),
                label=f"{r['variant']} validation",
                ms=3,
            )
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("training and validation loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    p = out_dir / "loss.png"
    fig.savefig(p, dpi=120, bbox_inches="tight")
    plt.close(fig)
    written.append(p)

    # 2. beta per DDL sublayer over the evaluation steps, one panel per DDL variant
    ddl = [
        r
        for r in comp["reports"]
        if any(e.get("validation_spectral") or e.get("train_spectral") for e in r["history"])
    ]
    if ddl:
        fig, axes = plt.subplots(1, len(ddl), figsize=(6 * len(ddl), 4.5), squeeze=False)
        for ax, r in zip(axes[0], ddl, strict=True):
            pts = [
                (e["step"], (e.get("validation_spectral") or e.get("train_spectral"))["beta_per_layer"])
                for e in r["history"]
                if e.get("validation_spectral") or e.get("train_spectral")
            ]
            steps = [s for s, _ in pts]
            n_layers = len(pts[0][1])
            for i in range(n_layers):
                kind = "attn" if i % 2 == 0 else "mlp"
                ax.plot(steps, [b[i] for _, b in pts], label=f"block {i // 2} {kind}", lw=1)
            ax.axhline(1.0, color="grey", lw=0.5, ls=":")
            ax.set_title(f"{r['variant']}: mean β per DDL sublayer")
            ax.set_xlabel("step")
            ax.set_ylabel("β")
            ax.set_ylim(0, 2)
            ax.legend(fontsize=6, ncol=2)
        p = out_dir / "beta.png"
        fig.savefig(p, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(p)

        # 3. final β histogram (per-layer betas) per DDL variant
        fig, ax = plt.subplots(figsize=(7, 4))
        for r in ddl:
            spec = r.get("final_validation_spectral") or r.get("final_train_spectral")
            if not spec:
                continue
            hist = spec["beta_histogram"]
            edges, counts = hist["edges"], hist["counts"]
            centers = [(a + b) / 2 for a, b in zip(edges[:-1], edges[1:], strict=True)]
            ax.step(centers, counts, where="mid", label=r["variant"])
        ax.set_xlabel("β (per-sublayer mean)")
        ax.set_ylabel("sublayers")
        ax.set_xlim(0, 2)
        ax.set_title("final β histogram: identity < 0.5 ≤ projection < 1.5 ≤ reflection")
        ax.legend(fontsize=8)
        p = out_dir / "beta_histogram.png"
        fig.savefig(p, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(p)
    return written
