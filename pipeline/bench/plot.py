"""The benchmark's picture."""

from __future__ import annotations

from pathlib import Path


def plot(results: dict, path: Path) -> None:
    """Latency (p50) against batch size, one line per variant, one panel per sequence length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["seq"] for r in results["grid"]})
    fig, axes = plt.subplots(1, len(seqs), figsize=(5 * len(seqs), 4), squeeze=False)
    for ax, seq in zip(axes[0], seqs, strict=True):
        for variant in dict.fromkeys(r["variant"] for r in results["grid"]):
            rows = [r for r in results["grid"] if r["variant"] == variant and r["seq"] == seq]
            ax.plot([r["batch"] for r in rows], [r["p50_ms"] for r in rows], marker="o", label=variant)
        ax.set(title=f"seq {seq}", xlabel="batch size", ylabel="p50 latency (ms)", xscale="log", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"{results['model_name']} {results['version']} {results['target']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
