"""The candidate table both searches share (encoders in the search stage, decoders in `decoders`): each candidate
built and scored in turn, one row each, whatever happens to it, and the screen that keeps a recipe from spending
its fallback on a candidate that could not win anyway.

Candidates whose recipe has a fallback (int8 with fp32 nodes or MatMul kinds kept, weight-only layer bisection) are
built after the others, so that the screen has the candidates that passed to compare them with."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from pipeline.build.accuracy.metrics import NOT_MEASURED, closeness, failures
from pipeline.build.console import note, progress
from pipeline.build.inputs.targets import Candidate
from pipeline.build.recipes import ROW_COLUMNS, recipe_for
from pipeline.build.timing import NO_SPINNING, alternate, median_range, time_until_stable
from pipeline.errors import PipelineError

__all__ = ["NO_SPINNING", "CannotWin", "Screen", "attach_timings", "candidate_row", "judge_candidates"]


def candidate_row(candidate: Candidate, status: str, **values) -> dict:
    """A candidate's row in the search table: what every row shows, the columns its recipe fills (the others
    None), its status and `values`."""
    shown = {column: None for column in ROW_COLUMNS} | recipe_for(candidate).row(candidate)
    return {
        "name": candidate.name,
        "engine": candidate.engine,
        "precision": candidate.precision,
        "quantize": candidate.quantize,
        **shown,
        "bisect_layers": candidate.bisect_layers,
        "status": status,
        **values,
    }


class CannotWin(PipelineError):
    """A candidate's fastest form was slower than a candidate that passed at every screened shape, so its recipe
    stopped before its fallback: a "dropped" row, not an error. `ratios`: {shape: its time over the other's}."""

    def __init__(self, message: str, ratios: dict):
        super().__init__(message)
        self.ratios = ratios


class Screen:
    """Whether a candidate could still beat those that passed: a few alternating runs of it and of each passed
    candidate at the searcher's screen shapes (`shapes_of(model)` -> {shape: (model -> a zero-argument run)}, made
    from the first model screened).

    A recipe asks before its fallback, with the fastest form the candidate can take (everything quantized): each
    node or layer the fallback keeps wide only adds time, so one slower than a passed candidate at every shape, by
    more than `margin`, cannot win, and its fallback would be spent for nothing."""

    def __init__(self, shapes_of: Callable, rounds: int = 3, margin: float = 1.05):
        self.shapes_of, self.rounds, self.margin = shapes_of, rounds, margin
        self.shapes: dict[str, Callable] = {}
        self.passed: dict[str, object] = {}

    def ratios(self, model) -> dict[str, dict[str, float]]:
        """{passed candidate: {shape: `model`'s median ms over its}}, alternating run by run."""
        self.shapes = self.shapes or self.shapes_of(model)
        ratios: dict[str, dict[str, float]] = {name: {} for name in self.passed}
        for shape, runner in self.shapes.items():
            runs = {name: runner(other) for name, other in self.passed.items()} | {None: runner(model)}
            times = alternate({name: (lambda _, run=run: run()) for name, run in runs.items()}, None, self.rounds)
            for name in self.passed:
                ratios[name][shape] = float(np.median(times[None]) / np.median(times[name]))
        return ratios

    def could_win(self, model) -> None:
        """Return quietly where `model` could still win; raise CannotWin naming the passed candidate it cannot beat."""
        for name, by_shape in self.ratios(model).items() if self.passed else ():
            if min(by_shape.values()) > self.margin:
                shapes = ", ".join(self.shapes)
                rounded = {shape: round(ratio, 3) for shape, ratio in by_shape.items()}
                raise CannotWin(f"its fastest form is slower than {name}, which passed, at {shapes}", rounded)


def _fallback_last(candidates) -> list:
    """The candidates in target order, those whose recipe has a fallback after the others."""
    return sorted(candidates, key=lambda c: recipe_for(c).fallback)


def judge_candidates(candidates, flags, title: str, make, screen: Screen | None = None) -> tuple[list[dict], dict]:
    """Build and score each candidate with `make(candidate) -> (built, model, stats, gate, extra row values)`. A
    candidate whose CPU flags the host lacks is a "skipped" row; one whose recipe cannot be made or run here, for
    whatever reason (ONNX Runtime refusing its graph, a missing package, a file it cannot write), is a "failed"
    row with the error's first line; one that misses its gate is a "missed" row; one whose recipe stopped because
    it could not win (`CannotWin`) a "dropped" row. Candidates that pass join `screen`. Rows come in target order,
    with each one's cost in seconds. Returns (rows, {name: (built, model)}) for those built, the model
    None for those that missed."""
    rows, built = {}, {}
    for candidate in progress(_fallback_last(candidates), title):
        missing = sorted(set(candidate.required_cpu_flags) - flags)
        if missing:
            rows[candidate.name] = candidate_row(candidate, "skipped", reason=f"this host lacks {', '.join(missing)}")
            continue
        started = time.perf_counter()
        try:
            made, model, stats, gate, extra = make(candidate)
        except Exception as err:  # noqa: BLE001 - one candidate's failure is its row; the others still run
            status, ratios = ("dropped", err.ratios) if isinstance(err, CannotWin) else ("failed", None)
            cost = {"build_seconds": round(time.perf_counter() - started, 2)}
            rows[candidate.name] = candidate_row(candidate, status, reason=_one_line(err), screen_ratios=ratios, **cost)
            continue
        missed = failures(stats, gate)
        row = candidate_row(
            candidate,
            "passed" if not missed else "missed",
            missed=missed,
            closeness=closeness(stats, gate),
            build_seconds=round(time.perf_counter() - started, 2),
            **extra,
            **stats,
        )
        rows[candidate.name] = row
        built[candidate.name] = (made, None if missed else model)
        if screen is not None and not missed:
            screen.passed[candidate.name] = model
        del model  # a missed candidate's session goes now, not at the search's end
        figures = sorted((k, v) for k, v in stats.items() if k != NOT_MEASURED and not isinstance(v, bool))
        note(f"  {candidate.name}: {row['status']}, " + ", ".join(f"{k} {v:.4f}" for k, v in figures))
    return [rows[c.name] for c in candidates], built


def _one_line(err: Exception) -> str:
    """The error's first line, at most 300 characters; others than the pipeline's own are named by their type
    (ONNX Runtime's Fail and InvalidArgument say little without it)."""
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else ""
    if not isinstance(err, PipelineError):
        line = f"{type(err).__name__}: {line}" if line else type(err).__name__
    return line[:300]


def time_shapes(calls: dict, total: int, max_rounds: int, budget_s: float) -> tuple[dict, dict]:
    """(each candidate's ms at each shape as [median, p10, p90], each candidate's seconds of timing, its warm-up
    included) of `calls` ({shape: {candidate: zero-argument call}}, which may be a generator of `total` shapes):
    candidates alternating run by run after a warm-up each, for 3 to `max_rounds` rounds, fewer where the spread
    settles within 5% or past `budget_s`."""
    timings: dict = {}
    seconds: dict = {}
    for shape, by_name in progress(calls, "search: timing", total=total):
        runners = {name: (lambda _, call=call: call()) for name, call in by_name.items()}
        runs = time_until_stable(runners, None, 3, max_rounds, spread=0.05, budget_s=budget_s, warmups=1)
        for name, run in runs.items():
            timings.setdefault(name, {})[shape] = [round(v, 3) for v in median_range(run["ms"])]
            seconds[name] = seconds.get(name, 0.0) + sum(run["ms"]) * (1 + 1 / len(run["ms"])) / 1000
    return timings, seconds


def attach_timings(rows: list[dict], timings: dict, seconds: dict | None = None) -> None:
    """Put each timed candidate's latency per shape (median, and its p10-p90 range) into its row, and the seconds
    its timing took."""
    for row in rows:
        timed = timings.get(row["name"])
        row["latency_ms"] = {shape: values[0] for shape, values in timed.items()} if timed else None
        row["latency_range_ms"] = {shape: values[1:] for shape, values in timed.items()} if timed else None
        if timed and seconds:
            row["timing_seconds"] = round(seconds[row["name"]], 2)
