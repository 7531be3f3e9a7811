"""The engine stage: engine_from_onnx, for TensorRT targets; `pipeline engine ARTIFACT` builds it on a GPU host later.

Precision comes from the graph, not from builder flags (TensorRT 11 removed the FP16/INT8 flags and the INT8
calibrator): the network is strongly typed, so the fp16 graph's fp16 ops run in fp16 and the ops it keeps in
fp32 stay fp32, and the int8 graph's Q/DQ nodes say where int8 runs. The builder gets the target's optimization
profile (min/opt/max batch and sequence per input), workspace, optimization level, hardware compatibility and a
timing cache kept per (compute capability, TensorRT version), which makes rebuilds fast.

Where TensorRT and a GPU of the target's compute capability are present, the stage builds every published graph's
engine, validates each against PyTorch on the GPU, and records the GPU, driver, CUDA and TensorRT versions;
publish puts the engines in the artifact's engine cache (pipeline/runtime/engine_cache.py). Elsewhere (CI, CPU hosts) it
records the engine as pending, with the reason, and every other stage's output is still published; `pipeline
engine ARTIFACT` on a GPU host, or `load(..., build_engine=build_artifact_engine)`, builds it there and validates it
against the artifact's own graph on ONNX Runtime's CPU provider.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

from pipeline.build.accuracy.metrics import failures, measure, outputs
from pipeline.build.accuracy.reference import pytorch_outputs
from pipeline.build.cache import StageSpec, run_cached
from pipeline.build.engine_cache import engine_entry
from pipeline.build.inputs.data import DEFAULT_VALIDATION, read_texts, texts_digest
from pipeline.build.inputs.targets import Accuracy, Target, TensorRT
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import Manifest, StageRecord, runtime_spec
from pipeline.errors import AccuracyError, EngineError, TargetError
from pipeline.runtime.artifact import artifact_graphs, canonical_json, verify_artifact
from pipeline.runtime.engine_cache import engine_cache_dir, engine_name, find_engine, runs_on, write_engine
from pipeline.runtime.host import gpu_host
from pipeline.runtime.load import open_model
from pipeline.runtime.schema import GRAPH, TOKENIZER

VERSION = 1


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """What an engine is built from and validated with. The GPU is named by compute capability and the TensorRT and
    CUDA versions, not by its driver: a driver update does not change the engine."""

    tensorrt: dict
    profiles: dict
    gpu: dict
    data: str
    accuracy: dict
    batch_size: int


STAGE = StageSpec("engine", VERSION, EngineConfig, ("tensorrt", "torch", "transformers", "numpy"), runtime_code=True)

HARDWARE_COMPATIBILITY = {
    "none": "NONE",
    "ampere_plus": "AMPERE_PLUS",
    "same_compute_capability": "SAME_COMPUTE_CAPABILITY",
}


def profiles(target: Target, spec: dict) -> dict:
    """Optimization profile per input: {"min": [batch, seq], "opt": [...], "max": [...]}, capped at the model's
    maximum length; a profile out of order is a TargetError."""
    trt = target.tensorrt
    limit = int(spec["max_length"])
    max_seq = min(trt.max_sequence or limit, limit)
    opt_seq = min(trt.opt_sequence, max_seq)
    batches, seqs = (trt.min_batch, trt.opt_batch, trt.max_batch), (trt.min_sequence, opt_seq, max_seq)
    for name, (low, mid, high) in (("batch", batches), ("sequence", seqs)):
        if not 1 <= low <= mid <= high:
            raise TargetError(
                f"target {target.name}: [tensorrt] {name} profile min {low} <= opt {mid} <= max {high} does not hold"
            )
    shape = {k: [b, s] for k, b, s in zip(("min", "opt", "max"), batches, seqs, strict=True)}
    return {name: shape for name in spec["inputs"]}


def profile_hash(profile: dict) -> str:
    """A short digest of the profiles, part of the engine cache key."""
    return hashlib.sha256(canonical_json(profile)).hexdigest()[:16]


def engine_from_onnx(onnx_path: Path, profile: dict, settings: TensorRT, timing_cache: Path | None) -> bytes:
    """Build a serialized TensorRT engine of an ONNX graph, strongly typed, with one optimization profile; the
    timing cache file, if given, is read first and written back after."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    # TensorRT 10 needs the flag for a strongly typed network; TensorRT 11 is always strongly typed.
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT {trt.__version__} could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_mb << 20)
    config.builder_optimization_level = settings.builder_optimization_level
    level = getattr(trt.HardwareCompatibilityLevel, HARDWARE_COMPATIBILITY[settings.hardware_compatibility], None)
    if level is None:
        raise EngineError(
            f"TensorRT {trt.__version__} has no hardware compatibility level {settings.hardware_compatibility!r}; "
            "set [tensorrt] hardware_compatibility to one it has, or upgrade TensorRT"
        )
    config.hardware_compatibility_level = level
    optimization = builder.create_optimization_profile()
    for name, shapes in profile.items():
        optimization.set_shape(name, shapes["min"], shapes["opt"], shapes["max"])
    config.add_optimization_profile(optimization)
    cache = None
    if timing_cache is not None:
        cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.is_file() else b"")
        config.set_timing_cache(cache, False)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"TensorRT {trt.__version__} failed to build an engine of {onnx_path}; see its log above")
    if cache is not None:
        timing_cache.parent.mkdir(parents=True, exist_ok=True)
        scratch = timing_cache.with_name(f".{timing_cache.name}.{time.time_ns()}")
        scratch.write_bytes(bytes(cache.serialize()))
        scratch.replace(timing_cache)
    return bytes(plan)


def timing_cache_path(folder: Path, host: dict) -> Path:
    """One timing cache per GPU architecture and TensorRT version."""
    return Path(folder) / f"timing-sm{host['compute_capability'].replace('.', '')}-trt{host['tensorrt']}.cache"


def validate_engine(
    plan: Path,
    graph: Path,
    tokenizer: Path,
    spec: dict,
    texts: list,
    reference,
    metric: str,
    accuracy: Accuracy,
    batch_size: int,
) -> dict:
    """Run the engine through the runtime's Model on held-out text; every threshold missed is an AccuracyError."""
    model = open_model(graph, tokenizer, spec, engine=plan)
    stats = measure(model, texts, reference, metric, batch_size)
    missed = failures(stats, accuracy)
    if missed:
        raise AccuracyError(f"the TensorRT engine of {graph.name} misses its thresholds: " + "; ".join(missed))
    return stats


def _host_problem(host: dict | None, reason: str, settings: TensorRT) -> str:
    """Why this host cannot build the target's engine, or ""."""
    if host is None:
        return reason
    compute_capability = settings.compute_capability
    wanted = {"compute_capability": compute_capability, "hardware_compatibility": settings.hardware_compatibility}
    if not runs_on(wanted, host["compute_capability"]):
        return (
            f"this host's GPU ({host['gpu']}, compute capability {host['compute_capability']}) is not the "
            f"target's ({compute_capability})"
        )
    return ""


def _build_engines(manifest: Manifest, target: Target, profile: dict, host: dict, out: Path) -> dict:
    """Build and validate, against PyTorch, the engine of every graph this build publishes."""
    export = manifest.stage("export")
    texts = read_texts(manifest.validation_path, "validation")
    metric = TASKS[manifest.checkpoint.task].metric
    reference = pytorch_outputs(manifest.checkpoint, texts)
    engines = {}
    for graph, path in manifest.graphs().items():
        started = time.perf_counter()
        name = engine_name(host["compute_capability"], host["tensorrt"], profile_hash(profile), graph)
        plan = engine_from_onnx(path, profile, target.tensorrt, timing_cache_path(Path(manifest.cache_dir), host))
        (out / f"{name}.plan").write_bytes(plan)
        stats = validate_engine(
            out / f"{name}.plan",
            path,
            export.output(TOKENIZER),
            runtime_spec(manifest, target),
            texts,
            reference,
            metric,
            target.accuracy,
            target.shapes.batch_size,
        )
        engines[graph] = {"name": name, "seconds": round(time.perf_counter() - started, 2), "validation": stats}
    return {"engines": engines, "validated_against": "pytorch", "examples": len(texts)}


def _unbuilt(key: str, config: dict, metrics: dict, started: float) -> StageRecord:
    """The record of an engine stage that built nothing (pending, or not built for this model), saying why."""
    seconds = round(time.perf_counter() - started, 3)
    return StageRecord(
        name="engine", key=key, config=config, outputs={}, metrics=metrics, seconds=seconds, reused=False
    )


def run(manifest: Manifest, target: Target) -> Manifest:
    """Record the engine's profiles and cache key; build the engines where a matching GPU and TensorRT are."""
    if target.engine != "tensorrt":
        return manifest
    started = time.perf_counter()
    spec = runtime_spec(manifest, target)
    common = {"compute_capability": target.tensorrt.compute_capability, "graphs": sorted(manifest.graphs())}
    if spec["task"] == "text-generation":
        metrics = {
            **common,
            "status": "not built",
            "profiles": None,
            "profile_hash": None,
            "tensorrt": None,
            "reason": "TensorRT engines are not built for KV-cache decoders here; they run on ONNX Runtime's CUDA "
            "provider",
        }
        return manifest.with_stage(_unbuilt("decoder", {}, metrics, started))
    profile = profiles(target, spec)
    host, reason = gpu_host()
    reason = _host_problem(host, reason, target.tensorrt)
    metrics = {
        **common,
        "status": "pending",
        "reason": reason,
        "profiles": profile,
        "profile_hash": profile_hash(profile),
        "tensorrt": host["tensorrt"] if host else None,
    }
    if reason:
        config = {"tensorrt": target.to_dict()["tensorrt"]}
        return manifest.with_stage(_unbuilt(metrics["profile_hash"], config, metrics, started))
    config = EngineConfig(
        tensorrt=target.to_dict()["tensorrt"],
        profiles=profile,
        gpu={k: host[k] for k in ("compute_capability", "tensorrt", "cuda")},
        data=texts_digest(read_texts(manifest.validation_path, "validation")),
        accuracy=target.to_dict()["accuracy"],
        batch_size=target.shapes.batch_size,
    )
    # The engines are built from the published graphs: the stages that made them identify the input.
    inputs = {name: record.key for name, record in manifest.graph_records().items()}
    record = run_cached(
        manifest.cache_dir,
        STAGE,
        config,
        inputs,
        lambda out: {
            **metrics,
            **_build_engines(manifest, target, profile, host, out),
            "status": "built",
            "reason": "",
            "host": host,
        },
    )
    return manifest.with_stage(record)


def build_artifact_engine(artifact: str | Path, graph: str = GRAPH, data: str | Path | None = None) -> Path:
    """Build one graph's engine of a published artifact on this GPU host, into its engine cache, validated against
    the artifact's graph on ONNX Runtime's CPU provider; returns the engine's path (an existing one is reused)."""
    artifact = Path(artifact).resolve()  # once: the graph built from is the graph verified
    published = verify_artifact(artifact)
    engine = published.get("engine") or {}
    if engine.get("profiles") is None:
        raise EngineError(f"{artifact} is not a TensorRT target's artifact with engine profiles; nothing to build")
    if graph not in artifact_graphs(published):
        raise EngineError(f"{artifact} has no {graph}; its graphs: {', '.join(artifact_graphs(published))}")
    texts = read_texts(data or DEFAULT_VALIDATION, "validation")  # bad data is found before the engine is built
    host, reason = gpu_host()
    settings = TensorRT(**published["target_spec"]["tensorrt"])
    reason = _host_problem(host, reason, settings)
    if reason:
        raise EngineError(f"cannot build the engine of {artifact} here: {reason}")
    cache_dir = engine_cache_dir(artifact, published)
    existing, _ = find_engine(cache_dir, published, graph, host)
    if existing is not None:
        return existing
    plan = engine_from_onnx(artifact / graph, engine["profiles"], settings, timing_cache_path(cache_dir, host))
    name = engine_name(host["compute_capability"], host["tensorrt"], engine["profile_hash"], graph)
    scratch = cache_dir / f".{name}.validating.plan"
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch.write_bytes(plan)
    try:
        metric = TASKS[published["model"]["task"]].metric
        batch = published["model"]["batch_size"]
        reference_model = open_model(artifact / graph, artifact / TOKENIZER, published["model"])
        reference = outputs(reference_model, texts, metric, batch)
        accuracy = Accuracy(**published["target_spec"]["accuracy"])
        stats = validate_engine(
            scratch,
            artifact / graph,
            artifact / TOKENIZER,
            published["model"],
            texts,
            reference,
            metric,
            accuracy,
            batch,
        )
    finally:
        scratch.unlink(missing_ok=True)
    write_engine(cache_dir, name, plan, engine_entry(published, graph, host, engine["profiles"], stats))
    return cache_dir / f"{name}.plan"
