"""int8 quantization with two guards on accuracy, for the quantize stage and the search's ort-int8 recipe (the
graph passes are in pipeline/build/passes/).

1. Smoothing (SmoothQuant-style, optional, `smooth_alpha`): activation outliers are moved into the weights.
2. Accuracy-aware fallback: if the int8 graph misses the target's thresholds (with headroom) against the fp32
   graph, each quantizable node's sensitivity is measured (the error it adds when it alone is quantized, by
   quantizing that node alone and running the development split; for dynamic int8 of an encoder too large for
   that, simulated from one fp32 pass, pipeline.build.passes.int8_error) and the most sensitive are kept in fp32: the
   widest budget first, then a bisection for the fewest that pass, up to `max_fp32_nodes`
   (pipeline/build/search/fallback.py).

Every candidate tried is recorded in the metrics returned.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import time
from pathlib import Path

from pipeline.build.accuracy.metrics import closeness, development_gate, failures, outputs, teacher_reference
from pipeline.build.console import note
from pipeline.build.inputs.targets import Target
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import Manifest, candidate_model
from pipeline.build.onnx_files import move_graph
from pipeline.build.passes.int8 import (
    calibration_reader,
    quantizable_nodes,
    quantize_dynamic,
    quantize_static,
    widen_ranges,
    with_shapes,
)
from pipeline.build.passes.smoothing import activation_absmax, smooth
from pipeline.build.passes.weight_only import quantize_weight_only
from pipeline.build.search.fallback import Judge, fewest_passing, sensitivity_ranked
from pipeline.build.timing import NO_SPINNING, latency
from pipeline.errors import AccuracyError
from pipeline.runtime.schema import GRAPH


def _quantizer(settings, source: Path, fp32_model, texts: list, work: Path):
    """quantize_one(path, exclude, only): the graph `source` quantized with `settings` into `path`."""
    if settings.mode == "static":
        shaped = with_shapes(source, work / "shaped.onnx")
        reader = calibration_reader(fp32_model, texts, settings.calibration_batch_size)
        ranges_cache = work / "ranges.json"

        if settings.range_margin != 1.0:  # ranges calibrated once, widened, then used by every attempt
            quantize_static(shaped, work / "ranges.onnx", settings, reader, ranges_cache)
            widen_ranges(ranges_cache, settings.range_margin)

        def quantize_one(path: Path, exclude=(), only=None) -> None:
            quantize_static(shaped, path, settings, reader, ranges_cache, exclude, only)

        return quantize_one

    if settings.mode == "weight_only":

        def quantize_one(path: Path, exclude=(), only=None) -> None:
            quantize_weight_only(source, path, settings, exclude, only)

        return quantize_one

    def quantize_one(path: Path, exclude=(), only=None) -> None:
        quantize_dynamic(source, path, settings, exclude, only)

    return quantize_one


def _smoothed(fp32_path: Path, settings, ranges, work: Path):
    """(the graph to quantize, the names of the nodes smoothed): `fp32_path` with activation outliers moved into
    the weights (SmoothQuant, `settings.smooth_alpha`; `ranges()` the activation ranges of the calibration text),
    or itself at alpha 0."""
    if settings.smooth_alpha <= 0:
        return fp32_path, []
    source = work / "smoothed.onnx"
    return source, smooth(fp32_path, source, ranges(), settings.op_types, settings.smooth_alpha)


def _alpha_scan(settings, judged) -> tuple[object, list[dict]]:
    """(`settings` with the alpha of `settings.smooth_alphas` whose int8 graph comes nearest its development gate,
    one row per alpha tried); `judged(alpha)` is that row, with its `closeness` (>= 0 passes). Settings without
    alphas to try come back as they are."""
    if not settings.smooth_alphas:
        return settings, []
    rows = [judged(alpha) for alpha in settings.smooth_alphas]
    best = max(rows, key=lambda row: row["closeness"])
    for row in rows:
        row["chosen"] = row is best
    return dataclasses.replace(settings, smooth_alpha=best["alpha"]), rows


def _smoothing(settings, fp32_path: Path, fp32, calibration: list, ranges, judge: Judge, excluded: list, work: Path):
    """(settings with the smoothing alpha kept, the alpha scan's rows, the graph to quantize, the nodes smoothed,
    its quantizer, and the kept alpha's int8 graph (`excluded` in fp32) with its statistics where the scan made
    it, else None). Each alpha of `settings.smooth_alphas` is smoothed, calibrated and judged in a folder of its
    own; only the kept one's stays."""
    if not settings.smooth_alphas:
        source, smoothed = _smoothed(fp32_path, settings, ranges, work)
        return settings, [], source, smoothed, _quantizer(settings, source, fp32, calibration, work), None
    made = {}  # alpha -> (its smoothed graph, the nodes smoothed, its quantizer, its int8 graph and statistics)

    def judged(alpha: float) -> dict:
        tried, folder = dataclasses.replace(settings, smooth_alpha=alpha), work / f"alpha-{alpha}"
        folder.mkdir()
        source, smoothed = _smoothed(fp32_path, tried, ranges, folder)
        quantize_one = _quantizer(tried, source, fp32, calibration, folder)
        quantize_one(folder / "int8.onnx", exclude=excluded)
        stats = judge.stats(judge.open(folder / "int8.onnx"))
        made[alpha] = (source, smoothed, quantize_one, (folder / "int8.onnx", stats))
        note(f"  smoothing alpha {alpha}: closeness to the development gate {closeness(stats, judge.gate):+.4f}")
        return {"alpha": alpha, "closeness": closeness(stats, judge.gate), **stats}

    settings, rows = _alpha_scan(settings, judged)
    for alpha in made.keys() - {settings.smooth_alpha}:
        shutil.rmtree(work / f"alpha-{alpha}")
    return settings, rows, *made[settings.smooth_alpha]


def int8_with_fallback(
    manifest: Manifest,
    target: Target,
    settings,
    texts: list,
    fp32_path: Path,
    out: Path,
    judge: list | None = None,
    strict: bool = True,
    could_win=None,
) -> dict:
    """Quantize `fp32_path` with `settings` into `out`/model.onnx (ranges and smoothing from `texts`), keeping the
    most sensitive nodes in fp32 as needed to meet the target's thresholds (with headroom) against the fp32 graph
    on `judge` (the development split; `texts` where None). Where the whole budget misses, an AccuracyError, or
    with `strict=False` the last graph tried (the search then judges it against the target's own thresholds).
    `could_win(model)`, where given (the search), may stop the fallback before it starts, raising; the search
    times its candidates itself, so then the attempts are not timed."""
    import onnx

    calibration, texts = texts, judge or texts
    metric = TASKS[manifest.checkpoint.task].metric
    batch, new_tokens = target.shapes.batch_size, target.generation.new_tokens
    fp32 = candidate_model(manifest, target, fp32_path)
    reference = outputs(fp32, texts, metric, batch, new_tokens)
    if metric == "generation":
        reference["teacher"] = teacher_reference(fp32, texts, batch)
    gate = development_gate(target.accuracy, len(texts), settings.fallback_headroom)
    judge = Judge(manifest, target, texts, reference, gate, metric)
    work = out / "work"
    work.mkdir()
    nodes = quantizable_nodes(onnx.load(str(fp32_path), load_external_data=False), settings.op_types)
    excluded = list(settings.exclude_nodes) + [n.name for n in nodes if n.op_type in settings.exclude_op_types]
    started = time.perf_counter()
    ranges = functools.cache(lambda: activation_absmax(fp32_path, nodes, fp32, calibration, batch))
    settings, alphas, source, smoothed, quantize_one, scanned = _smoothing(
        settings, fp32_path, fp32, calibration, ranges, judge, excluded, work
    )
    candidates, first = [], list(excluded)

    def attempt(exclude: list[str]) -> tuple[Path, list[str]]:
        begun, path = time.perf_counter(), work / f"int8-{len(exclude)}.onnx"
        if scanned is not None and exclude == first:  # the alpha scan made and judged this graph
            move_graph(scanned[0], path)
            model, stats = judge.open(path), scanned[1]
        else:
            quantize_one(path, exclude=exclude)
            model = judge.open(path)
            stats = judge.stats(model)
        missed = failures(stats, gate)
        seconds = round(time.perf_counter() - begun, 2)
        timed = latency(model, texts, batch) if could_win is None else {}
        candidates.append({"fp32_nodes": len(exclude), "passed": not missed, "seconds": seconds, **timed, **stats})
        note(f"  int8 with {len(exclude)} nodes in fp32: " + ("passed" if not missed else "; ".join(missed)))
        return path, missed

    chosen, missed = attempt(excluded)
    sensitivity, method = None, None
    if missed and settings.max_fp32_nodes > len(excluded):
        if could_win is not None:
            could_win(judge.open(chosen, session=NO_SPINNING))
        sensitivity, method = sensitivity_ranked(judge, quantize_one, source, nodes, excluded, fp32, settings, work)
        # The whole budget is tried, but one node at least stays int8: an int8 target that keeps every node in
        # fp32 would publish an fp32 graph under an int8 name.
        limit = min(settings.max_fp32_nodes, len(sensitivity) - 1)
        if limit >= 1:
            ranked = [s["node"] for s in sensitivity]
            chosen, missed, excluded = fewest_passing(attempt, excluded, ranked, limit)
    if missed and strict:
        raise AccuracyError(
            f"int8 {manifest.model_name} for {target.name} misses its thresholds on the development split even with "
            f"{len(excluded)} of {len(nodes)} quantizable nodes kept in fp32: {'; '.join(missed)}. "
            f"Raise quantize.max_fp32_nodes (now {settings.max_fp32_nodes}) or build an fp32 target (cpu-fp32)."
        )
    for row in candidates:
        row["chosen"] = row["fp32_nodes"] == len(excluded)
    move_graph(chosen, out / GRAPH)
    shutil.rmtree(work)
    static = settings.mode == "static"
    return {
        "mode": settings.mode,
        "format": settings.format if static else "qoperator",
        "calibration_method": settings.calibration_method if static else None,
        "seconds": round(time.perf_counter() - started, 2),
        "calibration_examples": len(calibration),
        "development_examples": len(texts),
        "fp32_latency": latency(fp32, texts, batch) if could_win is None else None,
        "quantized_nodes": len(nodes) - len(excluded),
        "fp32_nodes": excluded,
        "smoothed_nodes": len(smoothed),
        "smooth_alpha": settings.smooth_alpha,
        "smooth_alpha_scan": alphas,
        "met_headroom": not missed,
        "candidates": candidates,
        "sensitivity": sensitivity,
        "sensitivity_method": method if sensitivity else None,
    }
