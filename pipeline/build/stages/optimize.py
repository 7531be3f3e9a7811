"""The optimize stage: the cached caller of pipeline/build/passes/fusions.py (ONNX Runtime's transformer fusions where
its optimizer knows the family, else the generic passes). Node counts by op type before and after go into the
stage's metrics."""

from __future__ import annotations

import dataclasses

from pipeline.build.cache import StageSpec, run_cached
from pipeline.build.inputs.architectures import ENCODER_DECODER_FAMILIES, architecture_of
from pipeline.build.inputs.targets import Target
from pipeline.build.manifest import Manifest
from pipeline.build.passes.fusions import fused_from_onnx
from pipeline.runtime.schema import GRAPH

VERSION = 4


@dataclasses.dataclass(frozen=True)
class OptimizeConfig:
    """The target's [optimize] settings and the ONNX Runtime optimizer model type of the architecture ("" where
    the optimizer does not know the family: then only the generic passes run, constant folding and dead-node
    removal); `packed`: MatMuls that read one input packed into one (decoders: a step at batch 1 makes one kernel
    call for them); `attention_fusion`: this project's attention fusion for the family, after ONNX Runtime's ("" for
    none; pipeline/build/passes/encoder_attention.py)."""

    fusions: bool
    level: int
    model_type: str
    packed: bool
    attention_fusion: str = ""


STAGE = StageSpec("optimize", VERSION, OptimizeConfig, packages=("onnxruntime", "onnx"))


def run(manifest: Manifest, target: Target) -> Manifest:
    """Optimize the exported graph (cached by the export's key and the declared optimize settings)."""
    source = manifest.stage("export")
    arch = architecture_of(manifest.checkpoint)
    if arch.family in ENCODER_DECODER_FAMILIES:  # two graphs; ONNX Runtime's session fusions run on them at load
        return manifest
    config = OptimizeConfig(
        fusions=target.optimize.fusions,
        level=target.optimize.level,
        model_type=arch.ort_model_type or "",
        packed=arch.family == "decoder",
        attention_fusion=arch.attention_fusion or "",
    )
    record = run_cached(
        manifest.cache_dir,
        STAGE,
        config,
        {"export": source.key},
        lambda out: fused_from_onnx(source.output(GRAPH), config, out),
    )
    return manifest.with_stage(record)
