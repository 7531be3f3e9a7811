"""What every benchmark shares: alternating timing, where results go, and what identifies a run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def median_range(values: list[float]) -> tuple[float, float, float]:
    """(median, p10, p90) of a figure's runs."""
    return float(np.median(values)), percentile(values, 10), percentile(values, 90)


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


def time_until_stable(runners: dict, feeds, min_rounds: int, max_rounds: int, spread: float = 0.10,
                      budget_s: float = 60.0) -> dict:  # fmt: skip
    """Rounds alternate between the variants (after two warm-ups each) until every variant's p10-p90 spread is
    within `spread` of its median, or `max_rounds`, or (past `min_rounds`) `budget_s` seconds; returns
    {variant: {"ms": [...], "noisy": bool}}."""
    for run in runners.values():
        run(feeds)
        run(feeds)
    times: dict[str, list[float]] = {name: [] for name in runners}
    started = time.perf_counter()
    for rounds in range(1, max_rounds + 1):
        for name, run in runners.items():
            t0 = time.perf_counter()
            run(feeds)
            times[name].append((time.perf_counter() - t0) * 1000)
        stable = all(relative_spread(v) <= spread for v in times.values())
        if rounds >= min_rounds and (stable or time.perf_counter() - started > budget_s):
            break
    return {name: {"ms": values, "noisy": relative_spread(values) > spread} for name, values in times.items()}


def relative_spread(values: list[float]) -> float:
    """(p90 - p10) / median: how far a figure moved between rounds."""
    return (percentile(values, 90) - percentile(values, 10)) / max(float(np.median(values)), 1e-12)


def host_summary(threads: int) -> dict:
    """The host a benchmark ran on: CPU model, kernel class, the flags that pick kernels, threads, versions."""
    from importlib import metadata

    from pipeline.runtime.host import INT8_KERNEL_FLAGS, cpu_flags, cpu_model, kernel_class

    flags = cpu_flags() or frozenset()
    versions = {}
    for name in ("onnxruntime", "openvino", "torch", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    kernel_flags = [f for f in ("avx2", "fma", "avx512f", *INT8_KERNEL_FLAGS, "avx512_bf16", "amx_bf16") if f in flags]
    return {"cpu": cpu_model(), "kernel_class": kernel_class(flags), "flags": kernel_flags, "threads": threads,
            "versions": versions}  # fmt: skip


def identity(manifest: dict, real: Path, threads: int) -> dict:
    """What a benchmark measured: the artifact, the host and the thread count."""
    keys = ("model_name", "version", "target")
    return {"artifact": str(real), **{k: manifest[k] for k in keys}, "threads": threads, "host": host_summary(threads)}


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
