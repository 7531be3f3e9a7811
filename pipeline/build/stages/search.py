"""The search stage: engine and precision, for CPU targets that list [[candidates]] (encoders here; decoders in
pipeline.build.search.decoders).

Which engine and precision wins is measured, not assumed. Each candidate the target lists is built, scored against
PyTorch on the development split of the calibration text, and timed on the build host, alternating candidates
run by run, at the target's shapes:

    batch_1    one row of 128 tokens          batch_32   32 rows of 128 tokens
    mixed_32   32 texts of mixed length, end to end (tokenization and length bucketing included)

Candidates that pass the target's [accuracy] on the development split, with the margin a split of its size needs on
extreme statistics (`pipeline.build.accuracy.metrics.development_gate`), are then held, fastest first, to the
target's thresholds
on the held-out validation text; the first that passes there is chosen, and a faster one that missed there says so
in its row (`held_out`). Validation then holds the chosen one to its full gate. A candidate that misses, or that the
build host cannot run (bf16 without the flags), is a row in the table, not an error; the build fails only when none
passes, naming the closest. Candidates are timed with ONNX Runtime's spinning threads off: they alternate, and a
spinning pool would steal the cores of the next one.

Each candidate is built by the recipe of its kind (pipeline.build.recipes: ort-fp32, ort-int8-dynamic/static, openvino
fp32/bf16, openvino-int8 with NNCF and its fallback; weight-only for decoders).
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import time
from pathlib import Path

from pipeline.build.accuracy.measured import measured, measurement_key
from pipeline.build.accuracy.metrics import compare, development_gate, failures, measure, outputs
from pipeline.build.accuracy.reference import pytorch_outputs
from pipeline.build.cache import StageSpec, run_cached
from pipeline.build.inputs.architectures import architecture_of
from pipeline.build.inputs.data import read_texts, texts_digest
from pipeline.build.inputs.targets import Candidate, Target
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import Manifest, candidate_model, examples, session_of
from pipeline.build.recipes import Job, build_candidate
from pipeline.build.search.candidates import NO_SPINNING, Screen, attach_timings, judge_candidates, time_shapes
from pipeline.build.search.decoders import search_decoders
from pipeline.build.search.development import calibration_texts, development_split, filled_examples
from pipeline.build.speech.search import search_speech
from pipeline.build.text2text.search import search_text2text
from pipeline.build.timing import relative_scores, token_rows
from pipeline.errors import AccuracyError
from pipeline.runtime.host import cpu_flags, kernel_class

VERSION = 20  # 20: image encoders (pixel batches; no padding mask to leave out)
SEQUENCE = 128


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """The candidates, the int8 settings they use, the gate, the shapes they are timed at, the session settings
    they are run with (decoders: and the generation settings), the calibration and held-out text."""

    candidates: tuple
    quantize: dict
    accuracy: dict
    batch_size: int
    sequence: int
    calibration: str
    development: str
    held_out: str
    session: dict
    generation: dict | None


# The choice is a timing on this machine: its cores and flags are part of the key.
STAGE = StageSpec(
    "search",
    VERSION,
    SearchConfig,
    (
        "onnxruntime",
        "onnx",
        "openvino",
        "nncf",
        "numpy",
        "tokenizers",
        "torch",
        "transformers",
        "sentence-transformers",
    ),
    host="machine",
    runtime_code=True,
)


def family(manifest: Manifest) -> str:
    """The checkpoint's architecture family: "encoder" or "decoder"."""
    return architecture_of(manifest.checkpoint).family


def applies(manifest: Manifest, target: Target) -> bool:
    """Whether the search runs: a CPU target with candidates for the checkpoint's family (encoder or decoder)."""
    return bool(target.family_candidates(family(manifest)))


def chosen_target(manifest: Manifest, target: Target) -> Target:
    """The target as the rest of the build holds it: with the chosen candidate's thresholds, where a search ran."""
    record = manifest.ran("search")
    return target.with_candidate(record.metrics["chosen"]) if record else target


def _workloads(model, texts: list, batch: int) -> dict:
    """The feeds of each timed shape: rows of SEQUENCE tokens at batch 1 and `batch`, and a mixed-length batch (an
    image model's: pictures at batch 1 and `batch`)."""
    length = min(SEQUENCE, model.max_length)
    by_length = sorted(texts, key=len)
    mixed = (by_length * (batch // max(len(by_length), 1) + 1))[:batch]
    if getattr(model, "modality", "text") == "image":  # pixel batches; the mixed batch decodes its files too
        return {"batch_1": model.feeds(model.encode(mixed[:1])), f"batch_{batch}": model.feeds(model.encode(mixed))}
    return {
        "batch_1": token_rows(model, texts, 1, length),
        f"batch_{batch}": token_rows(model, texts, batch, length),
        f"mixed_{batch}": mixed,
    }


def _runner(work, batch: int):
    """model -> a zero-argument run of `work`: token rows through the session, or texts end to end."""

    def runner(model):
        if isinstance(work, list):
            return lambda: model.run(work, batch_size=batch)
        feeds = {k: work[k] for k in model.input_names}
        return lambda: model.session.run([model.output_name], feeds)

    return runner


def _time(models: dict, texts: list, batch: int) -> tuple[dict, dict]:
    """(each model's ms at each workload as [median, p10, p90], each model's seconds of timing): alternating
    models run by run after a warm-up each, for 3 to 7 rounds, fewer where the spread settles within 5%."""
    workloads = _workloads(next(iter(models.values())), texts, batch).items()
    calls = ((shape, {name: _runner(work, batch)(m) for name, m in models.items()}) for shape, work in workloads)
    return time_shapes(calls, 3, max_rounds=7, budget_s=20.0)


def screen_shapes(model, texts: list) -> dict:
    """The screen's shapes (pipeline.build.search.candidates.Screen): rows of SEQUENCE tokens at batch 1 and 8."""
    length = min(SEQUENCE, model.max_length)
    if getattr(model, "modality", "text") == "image":
        rows = (texts * (8 // max(len(texts), 1) + 1))[:8]
        return {f"batch_{n}": _runner(model.feeds(model.encode(rows[:n])), n) for n in (1, 8)}
    return {f"batch_{n}": _runner(token_rows(model, texts, n, length), n) for n in (1, 8)}


def _score(rows: list[dict]) -> None:
    """Each timed row's score: its latency relative to the fastest timed candidate, averaged over the shapes."""
    timed = {r["name"]: r for r in rows if r.get("latency_ms")}
    scores = relative_scores({name: r["latency_ms"] for name, r in timed.items()})
    for name, row in timed.items():
        row["score"] = round(scores[name], 3)


def choose(rows: list[dict], held_out=None) -> dict | None:
    """Score the timed rows and mark as chosen the fastest that passed and, where `held_out(name) -> (stats,
    missed)` is given, also passes on held-out text (the slower ones are not checked); returns it, or None."""
    _score(rows)
    winner = None
    for row in sorted((r for r in rows if r["status"] == "passed"), key=lambda r: r["score"]):
        if held_out is not None:
            started = time.perf_counter()
            stats, missed = held_out(row["name"])
            row["held_out_seconds"] = round(time.perf_counter() - started, 2)
            row["held_out"] = {"status": "missed" if missed else "passed", "missed": missed, **stats}
            if missed:
                continue
        winner = row
        break
    for row in rows:
        row["chosen"] = row is winner
    return winner


def _no_winner(manifest: Manifest, target: Target, rows: list[dict]) -> AccuracyError:
    held = [r for r in rows if r.get("held_out")]
    if held:
        misses = "; ".join(f"{r['name']}: {', '.join(r['held_out']['missed'])}" for r in held)
        return AccuracyError(
            f"every candidate of target {target.name} that passed on the development split missed on the held-out "
            f"text ({manifest.validation_path}): {misses}. Nothing was published. Calibrate on text closer to the "
            "held-out text, add an fp32 candidate, or loosen the target's [accuracy] only if that is acceptable."
        )
    scored = [r for r in rows if "closeness" in r]
    if not scored:
        reasons = "; ".join(f"{r['name']}: {r.get('reason', r['status'])}" for r in rows)
        return AccuracyError(f"no candidate of target {target.name} could be built on this host ({reasons})")
    best = max(scored, key=lambda r: r["closeness"])
    return AccuracyError(
        f"no candidate of target {target.name} passes its thresholds on the development split of the calibration "
        f"text for {manifest.model_name}; the closest was {best['name']}: {'; '.join(best['missed'])}. Nothing was "
        "published. Try a wider fallback (quantize.max_fp32_nodes), an fp32 candidate, or other thresholds."
    )


def _held_out(manifest: Manifest, target: Target, built: dict, texts: list):
    """`check(name) -> (stats, missed)`: candidate `name` (of `built`: name -> (Built, model)) against PyTorch on
    the held-out `texts`, at its own thresholds."""
    metric = TASKS[manifest.checkpoint.task].metric
    reference = pytorch_outputs(manifest.checkpoint, texts)

    def check(name: str):
        made, model = built[name]
        key = measurement_key(manifest, target, made.graph, made.backend, made.session, texts, metric)
        stats, _ = measured(key, lambda: measure(model, texts, reference, metric, target.shapes.batch_size))
        return stats, failures(stats, target.with_candidate(name).accuracy)

    return check


def _search_encoders(manifest: Manifest, target: Target, texts: dict, flags, out: Path):
    """Build, score and time every encoder candidate with its recipe; returns (rows, {name: Built}, held-out
    check)."""
    metric = TASKS[manifest.checkpoint.task].metric
    development = texts["development"]
    reference = pytorch_outputs(manifest.checkpoint, development)
    screen = Screen(lambda model: screen_shapes(model, development))

    def make(candidate: Candidate):
        job = Job(manifest, target, out / "work" / candidate.name, texts, reference, could_win=screen.could_win)
        made = build_candidate(candidate, job)
        model = candidate_model(manifest, target, made.graph, made.backend, {**made.session, **NO_SPINNING})
        stats = compare(metric, reference, outputs(model, development, metric, target.shapes.batch_size))
        return made, model, stats, development_gate(target.accuracy, len(development)), {"fallback": made.fallback}

    candidates = target.family_candidates("encoder")
    rows, built = judge_candidates(candidates, flags, "search: building candidates", make, screen)
    models = {name: model for name, (_, model) in built.items() if name in screen.passed}
    timed = _time(models, development + texts["calibration"], target.shapes.batch_size) if models else ({}, {})
    attach_timings(rows, *timed)
    check = _held_out(manifest, target, built, texts["held_out"])
    return rows, {name: made for name, (made, _) in built.items()}, check


def held_out_texts(manifest: Manifest, target: Target) -> list:
    """The validation stage's held-out examples, which the search also holds its fastest passing candidates to."""
    return examples(read_texts(manifest.validation_path, "validation"), manifest.checkpoint.task, target.generation)


def search(manifest: Manifest, target: Target, texts: list, split: tuple[list, list], out: Path) -> dict:
    """Build, score and time every candidate (calibrated on `texts`' `split`: calibration, development); write the
    winner's files into `out`; returns the table."""
    calibration, development = split
    split = {"calibration": calibration, "development": development, "held_out": held_out_texts(manifest, target)}
    flags = cpu_flags() or frozenset()
    searchers = {"decoder": search_decoders, "speech": search_speech, "text2text": search_text2text}
    searcher = searchers.get(family(manifest), _search_encoders)
    rows, built, check = searcher(manifest, target, split, flags, out)
    winner = choose(rows, check)
    if winner is None:
        raise _no_winner(manifest, target, rows)
    made = built[winner["name"]]
    for file in made.graph.parent.iterdir():
        if file.suffix in (".onnx", ".data", ".xml", ".bin"):  # a graph, its data file, OpenVINO's IR
            shutil.copyfile(file, out / file.name)
    shutil.rmtree(out / "work")
    return {
        "chosen": winner["name"],
        "backend": made.backend,
        "precision": winner["precision"],
        "graph": made.graph.name,
        "session": made.session,
        "candidates": rows,
        "calibration_examples": len(calibration),
        "development_examples": len(development),
        "development_filled": filled_examples(texts, development),
        "held_out_examples": len(split["held_out"]),
        "kernel_class": kernel_class(flags),
        "timed_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def run(manifest: Manifest, target: Target) -> Manifest:
    """Search the target's candidates for the checkpoint's family and record the chosen one."""
    if not applies(manifest, target):
        return manifest
    texts = calibration_texts(manifest, target, target.quantize)
    split = development_split(texts, manifest, target)  # read once: its filling reads two data files
    config = SearchConfig(
        candidates=tuple(dataclasses.asdict(c) for c in target.family_candidates(family(manifest))),
        quantize=dataclasses.asdict(target.quantize),
        accuracy=target.to_dict()["accuracy"],
        batch_size=target.shapes.batch_size,
        sequence=SEQUENCE,
        calibration=texts_digest(texts),
        development=texts_digest(split[1]),
        held_out=texts_digest(held_out_texts(manifest, target)),
        session=session_of(target),
        generation=target.to_dict()["generation"] if family(manifest) == "decoder" else None,
    )
    inputs = {r.name: r.key for r in manifest.stages if r.name in ("export", "optimize")}  # two graphs: no optimize
    record = run_cached(
        manifest.cache_dir, STAGE, config, inputs, lambda out: search(manifest, target, texts, split, out)
    )
    return manifest.with_stage(record)
