"""The fp16 stage: the cached caller of pipeline/build/passes/fp16.py, for targets whose precision is fp16."""

from __future__ import annotations

import dataclasses

from pipeline.build.cache import StageSpec, run_cached
from pipeline.build.inputs.targets import Target
from pipeline.build.manifest import Manifest
from pipeline.build.passes.fp16 import KEEP_FP32, fp16_from_fp32
from pipeline.runtime.schema import GRAPH

VERSION = 1


@dataclasses.dataclass(frozen=True)
class Fp16Config:
    """The ops kept in fp32, and whether graph inputs and outputs keep their types."""

    keep_fp32: tuple[str, ...]
    keep_io_types: bool


STAGE = StageSpec("fp16", VERSION, Fp16Config, packages=("onnxruntime", "onnx"))


def run(manifest: Manifest, target: Target) -> Manifest:
    """Convert the latest graph to fp16 when the target asks for it; otherwise leave the manifest as it is."""
    if target.precision != "fp16":
        return manifest
    source = manifest.last_model()
    config = Fp16Config(keep_fp32=KEEP_FP32, keep_io_types=True)
    record = run_cached(
        manifest.cache_dir,
        STAGE,
        config,
        {"graph": source.key},
        lambda out: fp16_from_fp32(source.output(GRAPH), out / GRAPH),
    )
    return manifest.with_stage(record)
