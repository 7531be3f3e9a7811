"""The benchmark's picture: how much faster the artifact is than each peer, and throughput against batch size."""

from __future__ import annotations

from pathlib import Path


def plot(results: dict, path: Path) -> None:
    """Left: the artifact's speed-up over each peer at each measured shape, as grouped bars with p10-p90 error bars
    (1.0 = as fast). Right: sequences/s against batch size on linear ticks at the batch sizes run, one panel per
    sequence length, sharing one y scale. The host and the artifact are in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = results["grid"]
    seqs = sorted({r["seq"] for r in grid})
    batches = sorted({r["batch"] for r in grid})
    variants = list(dict.fromkeys(r["variant"] for r in grid))
    peers = [v for v in variants if v != "artifact"]
    fig = plt.figure(figsize=(6 + 4 * len(seqs), 5.5))
    bars = fig.add_subplot(1, 1 + len(seqs), 1)
    shapes = [(s, b) for s in seqs for b in batches]
    width = 0.8 / max(len(peers), 1)
    for i, peer in enumerate(peers):
        mids, lows, highs = [], [], []
        for seq, batch in shapes:
            mine = next(r for r in grid if r["variant"] == "artifact" and (r["seq"], r["batch"]) == (seq, batch))
            other = next(r for r in grid if r["variant"] == peer and (r["seq"], r["batch"]) == (seq, batch))
            mid = other["p50_ms"] / mine["p50_ms"]
            mids.append(mid)
            lows.append(mid - other["p10_ms"] / mine["p90_ms"])
            highs.append(other["p90_ms"] / mine["p10_ms"] - mid)
        x = np.arange(len(shapes)) + (i - (len(peers) - 1) / 2) * width
        bars.bar(x, mids, width, yerr=[np.maximum(lows, 0), np.maximum(highs, 0)], capsize=2, label=f"vs {peer}")
    bars.axhline(1.0, color="black", linewidth=0.8)
    bars.set_xticks(range(len(shapes)), [f"b{b}\ns{s}" for s, b in shapes])
    bars.set(ylabel="artifact speed-up (x, higher is faster)", title="speed-up over each peer")
    if peers:
        bars.legend(fontsize=8)
    first = None
    for j, seq in enumerate(seqs):
        ax = fig.add_subplot(1, 1 + len(seqs), 2 + j, sharey=first)
        first = first or ax
        for variant in variants:
            rows = sorted((r for r in grid if r["variant"] == variant and r["seq"] == seq), key=lambda r: r["batch"])
            style = {"linewidth": 2.5, "color": "black"} if variant == "artifact" else {}
            ax.plot(
                [r["batch"] for r in rows], [r["sequences_per_s"] for r in rows], marker="o", label=variant, **style
            )
        ax.set_xticks(batches)
        ax.set(title=f"throughput, sequence {seq}", xlabel="batch size", ylabel="sequences/s")
        ax.grid(True, alpha=0.3)
    first.legend(fontsize=8)
    host = results["host"]
    fig.suptitle(
        f"{results['model_name']} {results['version']} {results['target']} on {host['cpu']} "
        f"({host['kernel_class']}, {results['threads']} threads)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
