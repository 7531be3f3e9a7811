"""The quantize stage: int8 quantization, dynamic (activations quantized at run time) or static (activation ranges
calibrated on text), cached; the quantization itself, with its smoothing and its accuracy-aware fallback, is
pipeline.build.search.int8, judged on the development split of pipeline.build.search.development.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.build.cache import StageSpec, run_cached
from pipeline.build.inputs.data import texts_digest
from pipeline.build.inputs.targets import Target
from pipeline.build.manifest import INT8_GRAPH, Manifest, session_of
from pipeline.build.onnx_files import move_graph
from pipeline.build.search.development import calibration_texts, development_split, filled_examples
from pipeline.build.search.int8 import int8_with_fallback
from pipeline.errors import TargetError
from pipeline.runtime.schema import GRAPH

VERSION = 9  # 9: image encoders (no padding mask to leave out of the ranges)


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
    """The [quantize] settings used, the gate the fallback is held to, and the calibration text's digest."""

    settings: dict
    accuracy: dict
    batch_size: int
    calibration: str
    development: str  # what the fallback is judged on: the user's split, filled up where small
    generation: dict | None
    session: dict  # the fallback measures through the runtime, with the target's session settings


_PACKAGES = ("onnxruntime", "onnx", "numpy", "tokenizers")
# The fallback measures accuracy through the runtime on this host's int8 kernels.
STAGE = StageSpec("quantize", VERSION, QuantizeConfig, _PACKAGES, host="kernels", runtime_code=True)
INT8_QDQ_STAGE = StageSpec("int8_qdq", VERSION, QuantizeConfig, _PACKAGES, host="kernels", runtime_code=True)


def quantize_stage(manifest: Manifest, target: Target, stage: StageSpec, settings, source, output: str) -> Manifest:
    """Run quantization with `settings` over the graph of the `source` stage record, cached, as `stage`, writing
    the chosen graph as `output`."""
    task = manifest.checkpoint.task
    if task == "text-generation" and settings.mode == "static":
        raise TargetError(
            f"target {target.name} asks for static int8, which this pipeline does not do for decoders (their "
            "activation ranges move with the cache length); use a dynamic target such as cpu-avx2"
        )
    texts = calibration_texts(manifest, target, settings)
    calibration, development = development_split(texts, manifest, target)
    config = QuantizeConfig(
        settings=dataclasses.asdict(settings),
        accuracy=target.to_dict()["accuracy"],
        batch_size=target.shapes.batch_size,
        calibration=texts_digest(texts),
        development=texts_digest(development),
        generation=target.to_dict()["generation"] if task == "text-generation" else None,
        session=session_of(target),
    )

    def produce(out: Path) -> dict:
        graph = source.output(GRAPH)
        metrics = int8_with_fallback(manifest, target, settings, calibration, graph, out, development)
        move_graph(out / GRAPH, out / output)
        return {**metrics, "development_filled": filled_examples(texts, development)}

    record = run_cached(manifest.cache_dir, stage, config, {"graph": source.key}, produce)
    return manifest.with_stage(record)


def run(manifest: Manifest, target: Target) -> Manifest:
    """Quantize the optimized graph as the target asks (`mode = "none"` leaves it in fp32)."""
    if target.quantize.mode == "none" or manifest.last_model().name == "search":
        return manifest
    return quantize_stage(manifest, target, STAGE, target.quantize, manifest.last_model(), GRAPH)


def qdq_settings(target: Target):
    """The static settings of a TensorRT int8 graph: the target's [quantize] table, made Q/DQ, int8 and symmetric,
    as TensorRT requires."""
    return dataclasses.replace(
        target.quantize, mode="static", format="qdq", activation_type="int8", weight_type="int8", symmetric=True
    )


def run_int8_qdq(manifest: Manifest, target: Target) -> Manifest:
    """Stage int8_qdq: for TensorRT targets with `[tensorrt] int8 = true`, an int8 Q/DQ graph of the optimized fp32
    graph, calibrated on text, beside the target's main (fp16) graph. TensorRT takes int8 from these nodes."""
    if target.engine != "tensorrt" or not target.tensorrt.int8:
        return manifest
    stage = manifest.stage("optimize")
    return quantize_stage(manifest, target, INT8_QDQ_STAGE, qdq_settings(target), stage, INT8_GRAPH)
