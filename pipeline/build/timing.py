"""The one timer: warm up every variant, then run them in turn, round after round, in one process.

The search, the tune stage, validation's generation speed and `make bench` all time this way, so one variant's
warm caches or idle thread pool never favours it over the next, and every figure comes with its spread.

    warm-up: a b c      rounds: a b c | a b c | a b c ...      -> per variant: [ms, ms, ms, ...]
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

# Session settings of every timed ONNX Runtime model: variants alternate, and a spinning pool would take the cores
# of the next one.
NO_SPINNING = {"allow_spinning": False}
# The seconds a search spends on each candidate, by row field: building and judging it (its screen and fallback
# included), timing it, its held-out check.
COST = ("build_seconds", "timing_seconds", "held_out_seconds")
PYTORCH = "pytorch-generate"
ARTIFACT = "artifact"


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile of a figure's runs."""
    return float(np.percentile(np.asarray(values), q))


def median_range(values: list[float]) -> tuple[float, float, float]:
    """(median, p10, p90) of a figure's runs."""
    return float(np.median(values)), percentile(values, 10), percentile(values, 90)


def relative_spread(values: list[float]) -> float:
    """(p90 - p10) / median: how far a figure moved between rounds."""
    return (percentile(values, 90) - percentile(values, 10)) / max(float(np.median(values)), 1e-12)


def alternate(
    runners: dict[str, Callable], work, rounds: int, warmups: int = 1, stop=None, settle_s: float = 0.0
) -> dict[str, list[float]]:
    """Milliseconds of `run(work)` for each runner, `warmups` times each first, then `rounds` rounds in turn.
    `stop(times, rounds_done)`, where given, ends the rounds early when it returns True. `settle_s`: an untimed
    pause before each timed run, so that the thread pools of the engine that ran before (which spin for a while
    after a call) have parked and do not take the cores of the one being timed."""
    for run in runners.values():
        for _ in range(warmups):
            run(work)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for done in range(1, rounds + 1):
        for name, run in runners.items():
            time.sleep(settle_s)
            started = time.perf_counter()
            run(work)
            times[name].append((time.perf_counter() - started) * 1000)
        if stop is not None and stop(times, done):
            break
    return times


def time_alternating(runners: dict, feeds, budget_s: float, min_reps: int, max_reps: int) -> dict:
    """Latencies in ms per variant: at least `min_reps` rounds (after two warm-ups each), at most `max_reps`, and no
    more once `budget_s` seconds have passed."""
    started = time.perf_counter()

    def spent(times, done):
        return done >= min_reps and time.perf_counter() - started > budget_s

    return alternate(runners, feeds, max_reps, warmups=2, stop=spent)


def time_until_stable(
    runners: dict,
    feeds,
    min_rounds: int,
    max_rounds: int,
    spread: float = 0.10,
    budget_s: float = 60.0,
    warmups: int = 2,
) -> dict:
    """Rounds (after `warmups` each) until every variant's p10-p90 spread is within `spread` of its median, or
    `max_rounds`, or (past `min_rounds`) `budget_s` seconds; returns {variant: {"ms": [...], "noisy": bool}}."""
    started = time.perf_counter()

    def settled(times, done):
        stable = all(relative_spread(v) <= spread for v in times.values())
        return done >= min_rounds and (stable or time.perf_counter() - started > budget_s)

    times = alternate(runners, feeds, max_rounds, warmups=warmups, stop=settled)
    return {name: {"ms": values, "noisy": relative_spread(values) > spread} for name, values in times.items()}


def relative_scores(latencies: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each variant's latency relative to the fastest variant at each workload, averaged over the workloads (1.0:
    fastest everywhere), so that every workload weighs the same."""
    workloads = next(iter(latencies.values()), {})
    best = {w: min(row[w] for row in latencies.values()) for w in workloads}
    return {name: sum(row[w] / best[w] for w in workloads) / max(len(workloads), 1) for name, row in latencies.items()}


def token_rows(model, texts: list[str], batch: int, length: int) -> dict:
    """`batch` rows of exactly `length` real tokens, cut from the concatenated validation text."""
    stream = [i for e in model.tokenizer.encode_batch(texts, add_special_tokens=False) for i in e.ids]
    if len(stream) < batch * length:
        stream = stream * (batch * length // max(len(stream), 1) + 1)
    cls_sep = model.tokenizer.encode("", add_special_tokens=True).ids
    rows = []
    for row in range(batch):
        body = stream[row * (length - 2) : (row + 1) * (length - 2)]
        rows.append(cls_sep[:1] + body + cls_sep[1:] if len(cls_sep) == 2 else (cls_sep + body)[:length])
    ids = np.asarray(rows, dtype=np.int64)
    arrays = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return {name: arrays[name] for name in model.input_names}


def artifact_runner(model):
    """run(batch, n) -> the perf_counter time its first tokens were chosen: the artifact's greedy generation of
    exactly n tokens per prompt, through the events generate() collects (no text is decoded per step)."""
    settings = {"do_sample": False}

    def run(batch: list[str], n: int) -> float:
        settings.update(max_new_tokens=n, min_new_tokens=n)
        first = None
        for _ in model._events(batch, len(batch), None, settings, "generate()", texts=False)[1]:
            first = first or time.perf_counter()
        return first

    return run


def generation_speed(runners: dict, prompts: list[str], batch_sizes, new_tokens: int, reps: int = 3) -> dict:
    """TTFT (ms) and decode tokens/s of each runner at each batch size, medians over `reps` alternating rounds,
    with each runner's ratio to PyTorch where it is among them. A runner is run(batch, n) -> the perf_counter time
    at which its first new tokens were chosen; TTFT and decode rate are taken from the same run."""
    from pipeline.build.console import progress

    results = {}
    for size in progress(batch_sizes, "generation speed: batch sizes"):
        batch = (prompts * (size // len(prompts) + 1))[:size]
        for run in runners.values():
            run(batch, 2)  # warm-up
        first = {name: [] for name in runners}
        rates = {name: [] for name in runners}
        for _ in range(reps):
            for name, run in runners.items():
                started = time.perf_counter()
                chosen = run(batch, new_tokens)
                ended = time.perf_counter()
                first[name].append(chosen - started)
                rates[name].append(size * (new_tokens - 1) / max(ended - chosen, 1e-9))
        row = {}
        for name in runners:
            row[name] = {
                "ttft_ms": statistics.median(first[name]) * 1000,
                "decode_tokens_per_s": statistics.median(rates[name]),
                "ttft_range_ms": [1000 * percentile(first[name], q) for q in (10, 90)],
                "decode_range_tokens_per_s": [percentile(rates[name], q) for q in (10, 90)],
            }
        if PYTORCH in row:
            base = row[PYTORCH]
            for values in row.values():
                values["ttft_speedup"] = base["ttft_ms"] / values["ttft_ms"]
                values["decode_speedup"] = values["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        results[f"batch_{size}"] = row
    return {"new_tokens": new_tokens, "prompts": len(prompts), "reps": reps, "batches": results}


def latency(model, texts: list[str], batch: int, reps: int = 5) -> dict:
    """Median milliseconds of one run at batch 1 and at `batch`, on calibration text, for the report."""
    timings = {}
    for name, chunk in (("latency_ms_batch_1", texts[:1]), (f"latency_ms_batch_{batch}", texts[:batch])):
        runs = alternate({name: model.run}, chunk, reps)[name]
        timings[name] = sorted(runs)[reps // 2]
    return timings
