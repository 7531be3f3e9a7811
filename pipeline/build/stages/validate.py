"""The validate stage: the built graph against PyTorch on held-out text; refuse to publish what misses.

The held-out text (`--validation`, default data/validation.txt) is never used for calibration. Each graph is run
at batch size 1 and at the target's batch size (dynamic int8 depends on what shares a batch) and the worse of the
two counts. Every threshold miss is collected, then raised as one AccuracyError; nothing is published.

Decoders are held to two things on each held-out prompt: their next-token logits (top-1 agreement, max abs and
probability differences) and greedy generation of `generation.new_tokens` tokens, which must equal transformers'
`generate(do_sample=False)` token for token on the target's share of prompts (`greedy_match`). Their time to
first token and decode tokens/s, against PyTorch generate, go into the report.
"""

from __future__ import annotations

import dataclasses
import datetime
from pathlib import Path

from pipeline.build.accuracy.measured import measured, measurement_key
from pipeline.build.accuracy.metrics import failures, measure, verdict
from pipeline.build.accuracy.reference import (
    checkpoint_from_source,
    generate_runner,
    generation_reference,
    load_hf_tokenizer,
    load_torch_model,
    pytorch_outputs,
)
from pipeline.build.cache import StageSpec, run_cached
from pipeline.build.inputs.data import DEFAULT_VALIDATION, read_texts, texts_digest
from pipeline.build.inputs.digest import checkpoint_digest
from pipeline.build.inputs.targets import Accuracy, Generation, Target
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import INT8_GRAPH, Manifest, candidate_model, examples, session_of
from pipeline.errors import AccuracyError, InputError
from pipeline.runtime.artifact import sha256_file, verify_artifact
from pipeline.runtime.load import load

VERSION = 6  # 6: the verdict names the digests of the files it measured


@dataclasses.dataclass(frozen=True)
class ValidateConfig:
    """The held-out text, the thresholds, and how the graph is run (batch size, session, overlong policy,
    generation)."""

    data: str
    accuracy: dict
    batch_size: int
    session: dict
    generation: dict | None
    overlong: str


# int8 and bf16 results depend on the host's kernels; validation measures through the runtime.
STAGE = StageSpec(
    "validate",
    VERSION,
    ValidateConfig,
    ("torch", "transformers", "sentence-transformers", "onnxruntime", "numpy", "tokenizers", "openvino"),
    host="kernels",
    runtime_code=True,
)


def _generation_reference(manifest: Manifest, target: Target, texts: list, candidate) -> tuple[dict, dict]:
    from pipeline.build.timing import ARTIFACT, PYTORCH, artifact_runner, generation_speed

    checkpoint = manifest.checkpoint
    tokenizer, model = load_hf_tokenizer(checkpoint), load_torch_model(checkpoint)
    reference = generation_reference(checkpoint, texts, target.generation.new_tokens, model)
    runners = {PYTORCH: generate_runner(model, tokenizer), ARTIFACT: artifact_runner(candidate)}
    speed_tokens = min(target.generation.speed_new_tokens, checkpoint.max_length // 2)
    speed = generation_speed(runners, texts, target.generation.speed_batch_sizes, speed_tokens)
    speed["measured_at"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return reference, speed


def _validate(manifest: Manifest, target: Target, texts: list[str]) -> dict:
    checkpoint = manifest.checkpoint
    metric = TASKS[checkpoint.task].metric
    # Hashed before they are loaded: publish refuses to publish other files under this verdict.
    measured_files = {name: sha256_file(path) for name, path in sorted(manifest.artifact_sources().items())}
    candidate = candidate_model(manifest, target)
    new_tokens = target.generation.new_tokens
    speed = None
    if metric == "generation":
        reference, speed = _generation_reference(manifest, target, texts, candidate)
    else:
        reference = pytorch_outputs(checkpoint, texts)
    chosen = manifest.chosen()
    graph = manifest.last_model().output(chosen.graph)
    key = measurement_key(manifest, target, graph, chosen.backend, chosen.session, texts, metric)
    stats, reused = measured(
        key, lambda: measure(candidate, texts, reference, metric, target.shapes.batch_size, new_tokens)
    )
    missed = failures(stats, target.accuracy)
    extra = {}
    graphs = manifest.graphs()
    if INT8_GRAPH in graphs:
        int8 = candidate_model(manifest, target, graphs[INT8_GRAPH])
        extra["int8_qdq"] = measure(int8, texts, reference, metric, target.shapes.batch_size, new_tokens)
        missed += [f"{INT8_GRAPH}: {m}" for m in failures(extra["int8_qdq"], target.accuracy)]
    if missed:
        raise AccuracyError(
            f"{manifest.model_name} for {target.name} missed its accuracy thresholds on {len(texts)} held-out "
            f"examples ({manifest.validation_path}): " + "; ".join(missed) + ". Nothing was published. "
            "Loosen the target's [accuracy] only if that is acceptable, or raise quantize.max_fp32_nodes."
        )
    result = {"examples": len(texts), "batch_sizes": [1, target.shapes.batch_size], **stats, **extra}
    # The search's held-out check measured this graph on these texts with these settings in this process.
    result["measured_by"] = "search held-out check" if reused else "validation"
    result["verdict"] = verdict(stats, target.accuracy)
    result["measured_files"] = measured_files
    if speed is not None:
        result.update(new_tokens=new_tokens, speed=speed)
    return result


def run(manifest: Manifest, target: Target) -> Manifest:
    """Validate the latest graph; raises AccuracyError listing every threshold it misses."""
    task = manifest.checkpoint.task
    texts = examples(read_texts(manifest.validation_path, "validation"), task, target.generation)
    config = ValidateConfig(
        data=texts_digest(texts),
        accuracy=target.to_dict()["accuracy"],
        batch_size=target.shapes.batch_size,
        session=session_of(target),
        generation=target.to_dict()["generation"] if task == "text-generation" else None,
        overlong=target.shapes.overlong,
    )
    inputs = {name: record.key for name, record in manifest.graph_records().items()}
    record = run_cached(manifest.cache_dir, STAGE, config, inputs, lambda out: _validate(manifest, target, texts))
    return manifest.with_stage(record)


def validate_artifact(path, data=None) -> dict:
    """Validate a published artifact again, on this host, against its source checkpoint and its thresholds;
    returns the statistics and the verdict rows (an AccuracyError if any threshold is missed)."""
    published = verify_artifact(path)
    source = published["source"]
    if not Path(source["path"]).is_dir():
        raise InputError(f"the source checkpoint {source['path']} of {path} is gone; validation needs it")
    if checkpoint_digest(Path(source["path"])) != source["digest"]:
        raise InputError(f"the checkpoint at {source['path']} has changed since {path} was built; rebuild instead")
    checkpoint = checkpoint_from_source(source)
    spec = published["target_spec"]
    settings = spec.get("generation", {})
    generation_spec = Generation(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})
    texts = examples(read_texts(data or DEFAULT_VALIDATION, "validation"), checkpoint.task, generation_spec)
    metric = TASKS[checkpoint.task].metric
    new_tokens = generation_spec.new_tokens
    reference = pytorch_outputs(checkpoint, texts, new_tokens)
    stats = measure(load(path), texts, reference, metric, published["model"]["batch_size"], new_tokens)
    accuracy = Accuracy(**spec["accuracy"])
    stats["verdict"] = verdict(stats, accuracy)
    missed = failures(stats, accuracy)
    if missed:
        raise AccuracyError(f"{path} misses its thresholds on this host: " + "; ".join(missed), stats)
    return stats
