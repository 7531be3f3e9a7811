"""fp16_from_fp32: a graph pass for targets whose precision is fp16 (TensorRT's strongly typed fp16 graphs).

Weights and most ops go to fp16; the numerically sensitive ones stay fp32, with casts around them:
LayerNorm and Softmax (their sums of exponentials and variances overflow or lose bits in fp16), the reductions
and the ops of pooling and L2 normalization. Inputs and outputs keep their types, so the runtime is unchanged.

    X --LayerNorm--> --MatMul(W fp32)-->      becomes      X --LayerNorm (fp32)--> Cast --MatMul(W fp16)--> Cast
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pipeline.build.onnx_files import load_graph, save_graph

KEEP_FP32 = (
    "LayerNormalization",
    "Softmax",
    "ReduceMean",
    "ReduceSum",
    "ReduceL2",
    "ReduceMax",
    "Pow",
    "Sqrt",
    "Div",
    "Erf",
    "Clip",
)


def fp16_from_fp32(source: Path, out: Path) -> dict:
    """Write an fp16 copy of `source` to `out`; returns counts of the ops left in fp32 and of the casts added."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    model = load_graph(source)
    converted = convert_float_to_float16(model, keep_io_types=True, op_block_list=list(KEEP_FP32))
    ops = Counter(n.op_type for n in converted.graph.node)
    save_graph(converted, out)
    return {"kept_fp32": {op: ops[op] for op in KEEP_FP32 if ops[op]}, "casts": ops["Cast"], "nodes": sum(ops.values())}
