"""The benchmark's picture: how much faster the artifact is than each peer, and throughput against batch size."""

from __future__ import annotations

from pathlib import Path


def _finish(fig, results: dict, path: Path) -> None:
    """Title the figure with the artifact and the host, and write it to `path`."""
    import matplotlib.pyplot as plt

    host = results["host"]
    fig.suptitle(
        f"{results['model_name']} {results['version']} {results['target']} on {host['cpu']} "
        f"({host['kernel_class']}, {results['threads']} threads)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


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
    _finish(fig, results, path)


def plot_generation(results: dict, path: Path, baseline: str, artifact: str) -> None:
    """A decoder benchmark's picture. Left: the artifact's speed-up over `baseline` in time to first token and in
    decode tokens/s at each batch size, bars with p10-p90 error bars. Middle and right: decode tokens/s and time to
    first token against batch size on linear ticks, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    batches = results["batches"]
    sizes = [int(b.removeprefix("batch_")) for b in batches]
    variants = list(next(iter(batches.values())))
    fig, (bars, decode, first) = plt.subplots(1, 3, figsize=(16, 5.5))
    if baseline in variants:
        for i, (label, key, ranges, faster) in enumerate(
            [
                ("time to first token", "ttft_ms", "ttft_range_ms", "lower"),
                ("decode tokens/s", "decode_tokens_per_s", "decode_range_tokens_per_s", "higher"),
            ]
        ):
            mids, lows, highs = [], [], []
            for row in batches.values():
                mine, base = row[artifact], row[baseline]
                ratio = (lambda a, b: b / a) if faster == "lower" else (lambda a, b: a / b)
                mid = ratio(mine[key], base[key])
                spread = [ratio(m, b) for m in mine[ranges] for b in base[ranges]]
                mids.append(mid)
                lows.append(max(mid - min(spread), 0))
                highs.append(max(max(spread) - mid, 0))
            x = np.arange(len(sizes)) + (i - 0.5) * 0.4
            bars.bar(x, mids, 0.4, yerr=[lows, highs], capsize=3, label=label)
        bars.axhline(1.0, color="black", linewidth=0.8)
        bars.set_xticks(range(len(sizes)), [f"batch {s}" for s in sizes])
        bars.legend(fontsize=8)
    bars.set(ylabel="artifact speed-up (x, higher is faster)", title=f"speed-up over {baseline}")
    for ax, key, ranges, label in [
        (decode, "decode_tokens_per_s", "decode_range_tokens_per_s", "decode tokens/s"),
        (first, "ttft_ms", "ttft_range_ms", "time to first token, ms"),
    ]:
        for variant in variants:
            values = [row[variant][key] for row in batches.values()]
            low = [v - row[variant][ranges][0] for v, row in zip(values, batches.values(), strict=True)]
            high = [row[variant][ranges][1] - v for v, row in zip(values, batches.values(), strict=True)]
            style = {"linewidth": 2.5, "color": "black"} if variant == artifact else {}
            ax.errorbar(
                sizes,
                values,
                yerr=[np.maximum(low, 0), np.maximum(high, 0)],
                marker="o",
                capsize=3,
                label=variant,
                **style,
            )
        ax.set_xticks(sizes)
        ax.set(title=label, xlabel="batch size", ylabel=label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    _finish(fig, results, path)
