"""Stage: fp16_from_onnx, for targets whose precision is fp16 (TensorRT's strongly typed fp16 graphs).

Weights and most ops go to fp16; the numerically sensitive ones stay fp32, with casts around them:
LayerNorm and Softmax (their sums of exponentials and variances overflow or lose bits in fp16), the reductions
and the ops of pooling and L2 normalization. Inputs and outputs keep their types, so the runtime is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

from pipeline.cache import StageSpec, run_cached
from pipeline.manifest import Manifest
from pipeline.onnx_files import load_graph, save_graph
from pipeline.targets import Target

KEEP_FP32 = (
    "LayerNormalization", "Softmax", "ReduceMean", "ReduceSum", "ReduceL2", "ReduceMax", "Pow", "Sqrt", "Div",
    "Erf", "Clip",
)  # fmt: skip
VERSION = 1


@dataclasses.dataclass(frozen=True)
class Fp16Config:
    """The ops kept in fp32, and whether graph inputs and outputs keep their types."""

    keep_fp32: tuple[str, ...]
    keep_io_types: bool


STAGE = StageSpec("fp16", VERSION, Fp16Config, packages=("onnxruntime", "onnx"))


def fp16_from_onnx(source: Path, out: Path) -> dict:
    """Write an fp16 copy of `source` to `out`; returns counts of the ops left in fp32 and of the casts added."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = load_graph(source)
    converted = convert_float_to_float16(model, keep_io_types=True, op_block_list=list(KEEP_FP32))
    ops = Counter(n.op_type for n in converted.graph.node)
    save_graph(converted, out)
    return {"kept_fp32": {op: ops[op] for op in KEEP_FP32 if ops[op]}, "casts": ops["Cast"], "nodes": sum(ops.values())}


def run(manifest: Manifest, target: Target) -> Manifest:
    """Convert the latest graph to fp16 when the target asks for it; otherwise leave the manifest as it is."""
    if target.precision != "fp16":
        return manifest
    source = manifest.last_model()
    config = Fp16Config(keep_fp32=KEEP_FP32, keep_io_types=True)
    record = run_cached(
        manifest.cache_dir, STAGE, config, {"graph": source.key},
        lambda out: fp16_from_onnx(source.output("model.onnx"), out / "model.onnx"),
    )  # fmt: skip
    return manifest.with_stage(record)
