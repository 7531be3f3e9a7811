"""The engine and precision search for decoders: the target's decoder [[candidates]] (fp32, int8 and int4
weight-only MatMulNBits) built, judged and timed side by side.

Each candidate is judged on the development split of the calibration text against PyTorch at the candidate's own
thresholds, on everything validation holds it to: a teacher-forced pass (top-1 agreement, perplexity ratio), the
next-token logits, and greedy continuations of `generation.new_tokens` tokens (exact match, prefix agreement), at
batch size 1 and at the target's, the worse counting. It is timed on the build host, candidates alternating run
by run, at three shapes:

    ttft_1x128   time to first token of one 128-token prompt
    decode_1     ms per generated token, one row
    decode_8     ms per step, eight rows (16-token prompts)

Those that pass are held, fastest first, to the same gate on the held-out prompts, and the first that passes there
is chosen; validation then holds it to that gate again. A candidate that misses is a row in the table.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from pipeline.build.accuracy.measured import measured, measurement_key
from pipeline.build.accuracy.metrics import (
    NOT_MEASURED,
    development_gate,
    failures,
    measure,
    teacher_forced_stats,
    teacher_outputs,
)
from pipeline.build.accuracy.reference import generation_reference, load_torch_model
from pipeline.build.console import progress
from pipeline.build.inputs.targets import Candidate, Target
from pipeline.build.manifest import Manifest, candidate_model
from pipeline.build.memory import release_freed
from pipeline.build.recipes import Job, recipe_for
from pipeline.build.search.candidates import NO_SPINNING, Screen, attach_timings, judge_candidates
from pipeline.build.timing import median_range, relative_spread
from pipeline.runtime.kv_cache import Decoding
from pipeline.runtime.schema import GRAPH

PROMPT = 128
DECODE_STEPS = 16
DECODE_BATCH = 8


def _rows(model, texts: list[str]) -> tuple[list[int], list[list[int]]]:
    """A prompt of PROMPT tokens (the texts run together), and DECODE_BATCH prompts of 16 tokens."""
    ids = [i for e in model.encode(texts) for i in e.ids]
    ids = (ids * (PROMPT // max(len(ids), 1) + 1))[: min(PROMPT, model.max_length - DECODE_STEPS - 1)]
    short = [(ids[k:] + ids)[:16] for k in range(DECODE_BATCH)]
    return ids, short


def _once(model, rows: list[list[int]], steps: int) -> tuple[float, float]:
    """(seconds to the first token, seconds per later step) of greedy decoding of `rows`."""
    state = Decoding(model, rows, max(map(len, rows)) + steps + 1)
    started = time.perf_counter()
    logits = state.step()
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(steps):
        logits = state.step(logits.argmax(-1))
    return first, (time.perf_counter() - started) / max(steps, 1)


def _time(models: dict, texts: list[str], reps: tuple[int, int] = (3, 5), spread: float = 0.10) -> dict:
    """Each model's ms per shape as [median, p10, p90], alternating models run by run after a warm-up each: at
    least reps[0] rounds, then until every figure's p10-p90 spread is within `spread` of its median, or reps[1]."""
    long, short = _rows(next(iter(models.values())), texts)
    runs = {name: {"ttft_1x128": [], "decode_1": [], f"decode_{DECODE_BATCH}": []} for name in models}
    for model in models.values():
        _once(model, [long], 2)
    for done in progress(range(1, reps[1] + 1), "search: timing decoders"):
        for name, model in models.items():
            runs[name]["ttft_1x128"].append(_once(model, [long], 0)[0] * 1000)
            runs[name]["decode_1"].append(_once(model, [short[0]], DECODE_STEPS)[1] * 1000)
            runs[name][f"decode_{DECODE_BATCH}"].append(_once(model, short, DECODE_STEPS)[1] * 1000)
        figures = [values for times in runs.values() for values in times.values()]
        if done >= reps[0] and all(relative_spread(values) <= spread for values in figures):
            break
    return {name: {k: [round(v, 3) for v in median_range(t)] for k, t in times.items()} for name, times in runs.items()}


def screen_shapes(model, texts: list[str]) -> dict:
    """The screen's shapes (pipeline.build.search.candidates.Screen): time to the first token of a PROMPT-token prompt,
    and a few decode steps of one row."""
    long, short = _rows(model, texts)
    return {
        "ttft_1x128": lambda other: lambda: _once(other, [long], 0),
        "decode_1": lambda other: lambda: _once(other, [short[0]], 4),
    }


def _judge(manifest, target, made, split: tuple, gate) -> tuple[object, dict]:
    """The built candidate's runtime model and its row's statistics against PyTorch on `split` (texts,
    reference), judged against `gate`."""
    model = candidate_model(manifest, target, made.graph, made.backend, {**made.session, **NO_SPINNING})
    return model, _stats(model, split, target, gate)


def _stats(model, split: tuple, target: Target, gate) -> dict:
    """Statistics of `model` on `split` (texts, PyTorch's `generation_outputs` for them), as validation measures
    them, with `finite: False` where any is not finite.

    The teacher-forced pass at the target's batch size comes first: where it already misses `gate`, so would the
    full measurement (which keeps the worse of batch 1 and that batch), and the greedy continuations are not run.
    Those statistics alone are returned then, with `teacher_only: True`; else the full measurement reuses that
    pass."""
    texts, reference = split
    batch = target.shapes.batch_size
    scores = None
    if reference.get("teacher"):
        scores = teacher_outputs(model, reference["teacher"], batch)
        quick = teacher_forced_stats(reference["teacher"], scores)
        if _finite(quick) and failures(quick, gate):
            return {**quick, "teacher_only": True}
    stats = measure(model, texts, reference, "generation", batch, target.generation.new_tokens, scores)
    if not _finite(stats):
        stats["finite"] = False
    return stats


def _finite(stats: dict) -> bool:
    return all(np.isfinite(v) for k, v in stats.items() if k != NOT_MEASURED and not isinstance(v, bool))


def _layers(graph: Path) -> list[list[str]]:
    """The graph's MatMul names, grouped by decoder layer (`.../layers.3/...`, `.../h.3/...`) in layer order."""
    import onnx

    grouped: dict[int, list[str]] = {}
    for node in onnx.load(str(graph), load_external_data=False).graph.node:
        found = re.search(r"/(?:layers|layer|h)\.(\d+)/", node.name)
        if node.op_type == "MatMul" and found:
            grouped.setdefault(int(found.group(1)), []).append(node.name)
    return [grouped[i] for i in sorted(grouped)]


def _bisect(manifest, target, candidate, direction: str, split: tuple, gate, work: Path, missed) -> tuple:
    """Bisection over layers for a candidate that missed its development `gate` (`missed`: its (built, model,
    stats)): the fewest leading or trailing layers (`direction`) its recipe keeps at head_bits with which it
    passes, one measurement of the development split a try. Returns the passing try's (built, model, stats) and
    every try, or `missed` where even all layers wide miss."""
    layers = _layers(manifest.stage("optimize").output(GRAPH))
    if direction == "trailing":
        layers.reverse()
    recipe = recipe_for(candidate)
    config = recipe.config(candidate, target)
    tries, best = [], None

    def attempt(count: int):
        wide = tuple(name for layer in layers[:count] for name in layer)
        made = recipe.build(config, Job(manifest, target, work / f"wide-{count}", wide=wide))
        model, stats = _judge(manifest, target, made, split, gate)
        tries.append({"wide_layers": count, "passed": not failures(stats, gate), **stats})
        return (made, model, stats), tries[-1]["passed"]

    low, high = 0, len(layers)  # the candidate as built (no layer wide) missed
    for _ in progress(range(len(layers).bit_length() + 1), f"search: bisecting {candidate.name} over layers"):
        count = high if best is None else (low + high) // 2
        if best is not None and count == low:
            break
        built, passed = attempt(count)
        if passed:
            high, best = count, (built, count)
        elif best is None:
            break  # all layers wide still miss
        else:
            low = count
    if best is None:
        return missed, tries, None
    return best[0], tries, best[1]


def search_decoders(manifest: Manifest, target: Target, texts: dict, flags, out: Path) -> tuple:
    """Build (with its recipe), judge and time every decoder candidate on `texts["development"]`; returns (rows,
    {name: Built} for the built ones, `check(name) -> (stats, missed)` on `texts["held_out"]`)."""
    checkpoint = manifest.checkpoint
    torch_model = load_torch_model(checkpoint)

    development, held_out = (
        (split, generation_reference(checkpoint, split, target.generation.new_tokens, model=torch_model))
        for split in (texts["development"], texts["held_out"])
    )
    del torch_model
    release_freed()  # PyTorch's freed temporaries, before the candidates' sessions

    screen = Screen(lambda model: screen_shapes(model, texts["development"]))

    def make(candidate: Candidate):
        work = out / "work" / candidate.name
        recipe = recipe_for(candidate)
        config = recipe.config(candidate, target)
        made = recipe.build(config, Job(manifest, target, work))
        gate = development_gate(target.with_candidate(candidate.name).accuracy, len(texts["development"]))
        model, stats = _judge(manifest, target, made, development, gate)
        direction = recipe.bisection(config)
        if direction == "none" or not failures(stats, gate):
            return made, model, stats, gate, {}
        screen.could_win(model)  # the candidate as built is the fastest its bisection can give
        missed = (made, model, stats)
        (made, model, stats), tries, wide = _bisect(
            manifest, target, candidate, direction, development, gate, work, missed
        )
        return made, model, stats, gate, {"wide_layers": wide, "bisection": tries}

    rows, built = judge_candidates(
        target.family_candidates("decoder"), flags, "search: building decoder candidates", make, screen
    )
    models = {name: model for name, (_, model) in built.items() if name in screen.passed}
    timings = _time(models, texts["development"]) if models else {}
    attach_timings(rows, timings)

    def check(name: str):
        (made, model), accuracy = built[name], target.with_candidate(name).accuracy
        key = measurement_key(manifest, target, made.graph, made.backend, made.session, held_out[0], "generation")
        stats, _ = measured(key, lambda: _stats(model, held_out, target, accuracy))
        return stats, failures(stats, accuracy)

    return rows, {name: made for name, (made, _) in built.items()}, check
