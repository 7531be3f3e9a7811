"""The tune stage: the session of the chosen backend (ONNX Runtime or OpenVINO) on the build host.

Times the validated graph under each candidate (threads, streams, execution mode) of the target, alternating
candidates run by run, and records the fastest; the loader uses it unless the caller overrides. Encoders are timed
end to end at batch 1, at the target's batch size in one length and on a mixed-length batch of that size (the
shapes batch parallelism is for: see pipeline.runtime.streams); decoders on a short greedy generation at the
target's generation batch sizes, on one stream. Streams of 2 are tried where the host has 2 usable cores or more,
each stream with an equal share of the candidate's threads. Cached per graph and host (CPU flags and core count),
since the answer is the host's.

Encoders then time the fastest session with and without the shape-bucket plan chosen from the calibration text
(pipeline.build.shape_buckets) on the mixed-length batch, run again and again in the same shapes, and on a request
stream whose batches (1 to the batch size, lengths drawn from the validation text) are new at each call, as a
service sees them; the plan is kept (`best["shape_buckets"]`, which publish moves into the model spec) only where
it scored better.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics

from pipeline.build.cache import StageSpec, run_cached
from pipeline.build.inputs.architectures import ENCODER_DECODER_FAMILIES
from pipeline.build.inputs.data import read_texts, texts_digest
from pipeline.build.inputs.targets import Target
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import Manifest, runtime_spec
from pipeline.build.shape_buckets import bucket_plan, request_stream, token_lengths
from pipeline.build.timing import alternate, relative_scores
from pipeline.runtime.host import usable_cores
from pipeline.runtime.load import open_model
from pipeline.runtime.schema import TOKENIZER
from pipeline.runtime.streams import SPLIT_MIN_ROWS

VERSION = 4
BACKENDS = ("onnxruntime", "openvino")
CANDIDATE_STREAMS = (1, 2)


@dataclasses.dataclass(frozen=True)
class TuneConfig:
    """The session candidates to time, and the workloads they are timed on."""

    backend: str
    candidate_threads: tuple[int, ...]
    candidate_execution_modes: tuple[str, ...]
    candidate_streams: tuple[int, ...]
    split_min_rows: int
    batch_size: int
    generation_batch_sizes: tuple[int, ...] | None
    shape_buckets: tuple[int, ...] | None  # the plan to time against none (encoders), from the calibration text
    data: str  # the validation text the workloads are drawn from


# The answer is this machine's: its cores and flags are part of the key.
STAGE = StageSpec("tune", VERSION, TuneConfig, ("onnxruntime", "openvino", "numpy"), host="machine", runtime_code=True)

REPS = 5
DECODE_STEPS = 8
STREAM_BATCHES = 4  # requests in each round's stream of the shape-bucket timing
# What the published session takes from the winner, beside split_min_rows.
PLAN = ("intra_op_threads", "execution_mode", "streams")


def candidates(config: TuneConfig, default_threads: int, default_mode: str, cores: int) -> list[dict]:
    """The (threads, execution mode, streams) sessions to time on a host of `cores` usable cores: no more threads
    than cores (they only contend), no more streams than threads (each stream runs on one thread at least; 0
    threads is every core), execution modes for ONNX Runtime only (OpenVINO has none)."""
    threads = [t for t in config.candidate_threads if t <= cores] or [default_threads]
    modes = config.candidate_execution_modes if config.backend == "onnxruntime" else ()
    found = []
    for t, m, s in itertools.product(threads, modes or (default_mode,), config.candidate_streams):
        if s <= (t or cores):
            found.append({"intra_op_threads": t, "execution_mode": m, "streams": s})
    return found


def workloads(texts: list[str], batch: int) -> dict:
    """The encoder workloads: batch 1; `batch` rows of one length (the median text repeated, so one chunk that
    streams can split); and a mixed-length batch of `batch` texts spread evenly over the texts' lengths, shortest
    to longest (bucketed into chunks of different lengths)."""
    by_length = sorted(texts, key=len)
    mixed = [by_length[i * len(by_length) // batch] for i in range(batch)]
    return {"batch_1": texts[:1], f"batch_{batch}": [by_length[len(by_length) // 2]] * batch, f"mixed_{batch}": mixed}


def _tune(manifest: Manifest, target: Target, config: TuneConfig, texts: list[str]) -> dict:
    spec = runtime_spec(manifest, target)
    chosen = manifest.chosen()
    path = manifest.graphs()[chosen.graph]
    base = {**dataclasses.asdict(target.runtime), **chosen.session, "split_min_rows": config.split_min_rows}
    cores = usable_cores()
    tried = candidates(config, target.runtime.intra_op_threads, target.runtime.execution_mode, cores)
    preprocessor = manifest.preprocessor()[1]
    models = [open_model(path, preprocessor, spec, session={**base, **c}, backend=config.backend) for c in tried]
    if config.generation_batch_sizes is not None:
        # A short greedy generation: one prompt step and DECODE_STEPS - 1 single-token steps.
        def work(model, batch):
            return model.generate(batch, max_new_tokens=DECODE_STEPS, do_sample=False, eos=False)

        loads = {f"batch_{n}": texts[:n] for n in config.generation_batch_sizes}
    else:

        def work(model, batch):
            return model.run(batch)

        loads = workloads(texts, config.batch_size)
    for entry in tried:
        entry["ms"] = {}
    for name, batch in loads.items():
        runners = {index: (lambda b, model=model: work(model, b)) for index, model in enumerate(models)}
        times = alternate(runners, batch, REPS)
        for index, entry in enumerate(tried):
            entry["ms"][name] = statistics.median(times[index])
    scores = relative_scores({index: entry["ms"] for index, entry in enumerate(tried)})
    for index, entry in enumerate(tried):
        entry["score"] = scores[index]
    best = min(tried, key=lambda e: e["score"])
    record = {
        "best": {**{k: best[k] for k in PLAN}, "split_min_rows": config.split_min_rows},
        "tried": tried,
        "host_cores": cores,
        "backend": config.backend,
    }
    if config.shape_buckets is not None:
        bucketed = {**spec, "shape_buckets": list(config.shape_buckets)}
        session = {**base, **{k: best[k] for k in PLAN}}
        with_plan = open_model(path, preprocessor, bucketed, session=session, backend=config.backend)
        models = {"padded": models[tried.index(best)], "bucketed": with_plan}
        record["shape_buckets"] = _bucket_choice(models, texts, config)
        record["best"]["shape_buckets"] = list(config.shape_buckets) if record["shape_buckets"]["chosen"] else None
    return record


def _bucket_choice(models: dict, texts: list[str], config: TuneConfig) -> dict:
    """The "padded" and "bucketed" models (the fastest session without and with the plan) timed alternately on
    the mixed-length batch and on a request stream drawn anew for each round (both models run the same streams);
    "chosen": whether the plan scored better."""
    mixed_name = f"mixed_{config.batch_size}"
    mixed = workloads(texts, config.batch_size)[mixed_name]
    streams = [request_stream(texts, STREAM_BATCHES, config.batch_size, seed) for seed in range(REPS + 1)]

    def stream_runner(model):
        drawn = iter(streams)  # the warm-up takes the first stream, each round the next

        def run(_):
            for batch in next(drawn):
                model.run(batch)

        return run

    ms: dict = {name: {} for name in models}
    for workload, runners in (
        (mixed_name, {name: model.run for name, model in models.items()}),
        ("request_stream", {name: stream_runner(model) for name, model in models.items()}),
    ):
        times = alternate(runners, mixed, REPS)
        for name in models:
            ms[name][workload] = statistics.median(times[name])
    scores = relative_scores(ms)
    return {
        "plan": list(config.shape_buckets),
        "ms": ms,
        "score": scores,
        "chosen": scores["bucketed"] < scores["padded"],
    }


def run(manifest: Manifest, target: Target) -> Manifest:
    """Time the target's session candidates on this host and record the fastest (CPU targets on ONNX Runtime or
    OpenVINO)."""
    backend = manifest.chosen().backend
    two_graphs = TASKS[manifest.checkpoint.task].family in ENCODER_DECODER_FAMILIES  # one token a step: not tuned
    if target.device != "cpu" or backend not in BACKENDS or two_graphs:
        return manifest
    texts = read_texts(manifest.validation_path, "validation")
    decoder = manifest.checkpoint.task == "text-generation"
    plan = None
    if not decoder and TASKS[manifest.checkpoint.task].modality == "text":  # pictures come in one shape
        tokenizer = manifest.stage("export").output(TOKENIZER)
        lengths = token_lengths(tokenizer, read_texts(manifest.calibration_path, "calibration"))
        plan = tuple(bucket_plan(lengths, int(runtime_spec(manifest, target)["max_length"])))
    config = TuneConfig(
        backend=backend,
        candidate_threads=target.runtime.candidate_threads,
        candidate_execution_modes=target.runtime.candidate_execution_modes,
        # Decoders run one request at a time (a KV cache per sequence); streams are for encoder batches.
        candidate_streams=(1,) if decoder or usable_cores() < 2 else CANDIDATE_STREAMS,
        split_min_rows=SPLIT_MIN_ROWS,
        batch_size=target.shapes.batch_size,
        generation_batch_sizes=target.generation.speed_batch_sizes if decoder else None,
        shape_buckets=plan,
        data=texts_digest(texts),
    )
    record = run_cached(
        manifest.cache_dir,
        STAGE,
        config,
        {"graph": manifest.last_model().key},
        lambda out: _tune(manifest, target, config, texts),
    )
    return manifest.with_stage(record)
