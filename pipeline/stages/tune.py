"""The tune stage: the ONNX Runtime session on the build host.

Times the validated graph under each candidate thread count and execution mode of the target, at batch 1 and at
the target's batch size (decoders: a short greedy generation at the target's generation batch sizes),
alternating candidates run by run, and records the fastest; the loader uses it unless
the caller overrides. Cached per graph and host (CPU flags and core count), since the answer is the host's.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics

from pipeline.cache import StageSpec, run_cached
from pipeline.data import read_texts
from pipeline.manifest import Manifest, runtime_spec
from pipeline.runtime.host import usable_cores
from pipeline.runtime.load import open_model
from pipeline.targets import Target
from pipeline.timing import alternate, relative_scores

VERSION = 2


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    """The session candidates to time, and the workloads they are timed on."""

    candidate_threads: tuple[int, ...]
    candidate_execution_modes: tuple[str, ...]
    batch_size: int
    generation_batch_sizes: tuple[int, ...] | None


# The answer is this machine's: its cores and flags are part of the key.
STAGE = StageSpec("tune", VERSION, TuneConfig, ("onnxruntime", "numpy"), host="machine", runtime_code=True)

REPS = 5
DECODE_STEPS = 8


def _tune(manifest: Manifest, target: Target, texts: list[str]) -> dict:
    export = manifest.stage("export")
    spec = runtime_spec(manifest, target)
    path = manifest.last_model().output("model.onnx")
    base = dataclasses.asdict(target.runtime)
    cores = usable_cores()
    # More threads than cores only contend; a tuned count must hold on the build host.
    threads = [t for t in target.runtime.candidate_threads if t <= cores] or (target.runtime.intra_op_threads,)
    modes = target.runtime.candidate_execution_modes or (target.runtime.execution_mode,)
    candidates = [{"intra_op_threads": t, "execution_mode": m} for t, m in itertools.product(threads, modes)]
    models = [open_model(path, export.output("tokenizer.json"), spec, session={**base, **c}) for c in candidates]
    if export.metrics["spec"]["task"] == "text-generation":
        sizes = target.generation.speed_batch_sizes

        # A short greedy generation: one prompt step and DECODE_STEPS - 1 single-token steps.
        def work(model, batch):
            return model.generate(batch, max_new_tokens=DECODE_STEPS, do_sample=False, eos=False)

    else:
        sizes = (1, target.shapes.batch_size)

        def work(model, batch):
            return model.run(batch)

    workloads = {f"batch_{n}": texts[:n] for n in sizes}
    tried = [{**c, "ms": {}} for c in candidates]
    for name, batch in workloads.items():
        runners = {index: (lambda b, model=model: work(model, b)) for index, model in enumerate(models)}
        times = alternate(runners, batch, REPS)
        for index, entry in enumerate(tried):
            entry["ms"][name] = statistics.median(times[index])
    scores = relative_scores({index: entry["ms"] for index, entry in enumerate(tried)})
    for index, entry in enumerate(tried):
        entry["score"] = scores[index]
    best = min(tried, key=lambda e: e["score"])
    return {
        "best": {k: best[k] for k in ("intra_op_threads", "execution_mode")},
        "tried": tried,
        "host_cores": cores,
    }


def run(manifest: Manifest, target: Target) -> Manifest:
    """Time the target's session candidates on this host and record the fastest (CPU targets only)."""
    if target.device != "cpu" or manifest.chosen()["backend"] != "onnxruntime":
        return manifest
    texts = read_texts(manifest.validation_path, "validation")
    decoder = manifest.checkpoint.task == "text-generation"
    config = TuneConfig(
        candidate_threads=target.runtime.candidate_threads,
        candidate_execution_modes=target.runtime.candidate_execution_modes,
        batch_size=target.shapes.batch_size,
        generation_batch_sizes=target.generation.speed_batch_sizes if decoder else None,
    )
    record = run_cached(
        manifest.cache_dir,
        STAGE,
        config,
        {"graph": manifest.last_model().key},
        lambda out: _tune(manifest, target, texts),
    )
    return manifest.with_stage(record)
