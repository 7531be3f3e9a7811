"""The candidate table both searches share (encoders in `search`, decoders in `search_decoder`): each candidate
built and scored in turn, one row each, whatever happens to it."""

from __future__ import annotations

import time

from pipeline.console import note, progress
from pipeline.errors import PipelineError
from pipeline.metrics import NOT_MEASURED, closeness, failures
from pipeline.recipes import ROW_COLUMNS, recipe_for
from pipeline.targets import Candidate

# Session settings of every timed candidate: they alternate, and a spinning ONNX Runtime pool would take the cores
# of the next one.
NO_SPINNING = {"allow_spinning": False}


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


def judge_candidates(candidates, flags, title: str, make) -> tuple[list[dict], dict]:
    """Build and score each candidate with `make(candidate) -> (built, model, stats, gate, extra row values)`. A
    candidate whose CPU flags the host lacks is a "skipped" row; one whose recipe cannot be made or run here, for
    whatever reason (ONNX Runtime refusing its graph, a missing package, a file it cannot write), is a "failed"
    row with the error's first line; one that misses its gate is a "missed" row. Returns (rows, {name: (built,
    model)}) for those built."""
    rows, built = [], {}
    for candidate in progress(candidates, title):
        missing = sorted(set(candidate.required_cpu_flags) - flags)
        if missing:
            rows.append(candidate_row(candidate, "skipped", reason=f"this host lacks {', '.join(missing)}"))
            continue
        started = time.perf_counter()
        try:
            made, model, stats, gate, extra = make(candidate)
        except Exception as err:  # noqa: BLE001 - one candidate's failure is its row; the others still run
            rows.append(candidate_row(candidate, "failed", reason=_one_line(err)))
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
        rows.append(row)
        built[candidate.name] = (made, model)
        figures = sorted((k, v) for k, v in stats.items() if k != NOT_MEASURED)
        note(f"  {candidate.name}: {row['status']}, " + ", ".join(f"{k} {v:.4f}" for k, v in figures))
    return rows, built


def _one_line(err: Exception) -> str:
    """The error's first line, at most 300 characters; others than the pipeline's own are named by their type
    (ONNX Runtime's Fail and InvalidArgument say little without it)."""
    lines = str(err).strip().splitlines()
    line = lines[0] if lines else ""
    if not isinstance(err, PipelineError):
        line = f"{type(err).__name__}: {line}" if line else type(err).__name__
    return line[:300]


def attach_timings(rows: list[dict], timings: dict) -> None:
    """Put each timed candidate's latency per shape (median, and its p10-p90 range) into its row."""
    for row in rows:
        timed = timings.get(row["name"])
        row["latency_ms"] = {shape: values[0] for shape, values in timed.items()} if timed else None
        row["latency_range_ms"] = {shape: values[1:] for shape, values in timed.items()} if timed else None
