"""What every benchmark shares: alternating timing, where results go, and what identifies a run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def time_alternating(runners: dict, feeds: dict, budget_s: float, min_reps: int, max_reps: int) -> dict:
    """Run every variant in turn, repeatedly, after two warm-ups each; returns latencies in ms per variant."""
    for run in runners.values():
        run(feeds)
        run(feeds)
    times: dict[str, list[float]] = {name: [] for name in runners}
    started = time.perf_counter()
    while True:
        for name, run in runners.items():
            t0 = time.perf_counter()
            run(feeds)
            times[name].append((time.perf_counter() - t0) * 1000)
        reps = len(next(iter(times.values())))
        if reps >= max_reps or (reps >= min_reps and time.perf_counter() - started > budget_s):
            return times


def identity(manifest: dict, real: Path, threads: int) -> dict:
    """What a benchmark measured: the artifact and the thread count."""
    keys = ("model_name", "version", "target")
    return {"artifact": str(real), **{k: manifest[k] for k in keys}, "threads": threads}


def bench_folder(real: Path, manifest: dict) -> Path:
    """Where an artifact's benchmark results go: beside it, since a published artifact is immutable."""
    return real.parent.parent / "bench" / f"{manifest['version']}-{manifest['target']}"


def write_results(results: dict, text: str, out: str | Path) -> Path:
    """Write the results (bench.json) and their Markdown `text` (bench.md) into `out`; returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(text)
    return out
