"""Per-node times from the engines' own profilers, each node with its op class, FLOPs and compute precision.

ONNX Runtime: SessionOptions.enable_profiling writes a Chrome trace; each "Node" event (name "<node>_kernel_time")
carries `dur` in microseconds and `args` with op_name and input_type_shape / output_type_shape ([{type: shape}]),
and each "model_run" Session event spans one run. OpenVINO: PERF_COUNT makes request.profiling_info list the nodes
(node_type, exec_type, status, real_time and cpu_time as timedelta, each a mean since compiling); the runtime model
(the graph as the plugin executes it) gives each node's shapes of the last inference and its runtimePrecision.

    node record: {"node", "op", "class", "us", "flops", "precision"}; lists of them per run
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

CLASSES = ("gemm", "attention", "norm", "reorder", "quantize", "other")
_CLASS_OF = {
    "gemm": (
        "MatMul FusedMatMul Gemm MatMulInteger MatMulIntegerToFloat DynamicQuantizeMatMul QLinearMatMul MatMulNBits "
        "QGemm FullyConnected FullyConnectedCompressed"
    ),
    "attention": (
        "Attention QAttention MultiHeadAttention GroupQueryAttention ScaledDotProductAttention SDPA MHA Softmax "
        "SoftmaxCrossEntropy"
    ),
    "norm": (
        "LayerNormalization SkipLayerNormalization SimplifiedLayerNormalization SkipSimplifiedLayerNormalization "
        "EmbedLayerNormalization MVN RMS RMSNorm NormalizeL2 ReduceMean"
    ),
    "reorder": "Reorder Transpose Reshape Squeeze Unsqueeze Concat Gather GatherElements Split Slice Expand Identity "
    "Copy Memcpy StridedSlice ShapeOf",
    "quantize": "DynamicQuantizeLinear QuantizeLinear DequantizeLinear FakeQuantize Convert DynamicQuantize",
}
OP_CLASS = {op: cls for cls, ops in _CLASS_OF.items() for op in ops.split()}
# Ops whose int8 arithmetic is in the op itself, whatever their input type says (DynamicQuantizeMatMul takes fp32).
_INT8_OPS = {"MatMulInteger", "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QLinearMatMul", "QAttention", "QGemm"}
_PRECISION_OF_TYPE = {"float": "fp32", "f32": "fp32", "bf16": "bf16", "i8": "int8", "u8": "int8"}
_PRECISION_OF_TYPE.update({"int8": "int8", "uint8": "int8", "bfloat16": "bf16", "float16": "fp16", "f16": "fp16"})


_CLASS_BY_PART = (("MatMul", "gemm"), ("FullyConnected", "gemm"), ("Attention", "attention"), ("Norm", "norm"))
_CLASS_BY_PART += (("Quantize", "quantize"),)


def op_class(op: str) -> str:
    """The class of an op type of either engine: gemm, attention, norm, reorder, quantize or other. Types not in the
    table are classed by a telling part of their name (OpenVINO's FullyConnectedQuantizedLegacy is a GEMM)."""
    if op in OP_CLASS:
        return OP_CLASS[op]
    return next((cls for part, cls in _CLASS_BY_PART if part in op), "other")


def _numel(shape) -> int:
    return int(np.prod(shape, dtype=np.int64)) if shape else 1


def node_flops(op: str, inputs: list, outputs: list) -> int | None:
    """Multiply-add FLOPs (2 per multiply-accumulate) of one node from its input and output shapes: a GEMM-class
    node's 2*M*N*K, a fused attention node's projection and score products; None for other ops or missing shapes.

    A GEMM's K is read from its first input and its output (K = numel(A) * N / numel(out's trailing dims)), so it
    holds whether A is transposed or broadcast over batch dimensions."""
    if not inputs or not outputs or any(s is None for s in inputs[:2] + outputs[:1]):
        return None
    a, out = inputs[0], outputs[0]
    if op_class(op) == "gemm":
        if not a or not out:
            return None
        trailing = _numel(out[-len(a) :])
        return 2 * _numel(out) * (_numel(a) * out[-1] // max(trailing, 1))
    if op in ("Attention", "QAttention") and len(a) == 3 and len(inputs) > 1 and inputs[1]:
        batch, seq, hidden = a
        projection = 2 * _numel(a) * inputs[1][-1]
        return projection + 4 * batch * seq * seq * out[-1]
    if op in ("ScaledDotProductAttention", "SDPA") and len(inputs) > 1 and len(inputs[1]) >= 2:
        kv_len = inputs[1][-2]
        return 2 * _numel(a) * kv_len + 2 * _numel(out) * kv_len
    return None


def _ort_precision(op: str, input_types: list[str]) -> str | None:
    if op in _INT8_OPS:
        return "int8"
    if op == "MatMulNBits":  # int4 or int8 weights, multiplied in fp32 or int8 by its accuracy level
        return None
    return _PRECISION_OF_TYPE.get(input_types[0]) if input_types else None


def parse_ort_trace(events: list[dict], warmups: int) -> list[list[dict]]:
    """Node records per run from an ONNX Runtime profile's events, the first `warmups` runs left out."""
    runs = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e["name"] == "model_run"
    )
    per_run: list[list[dict]] = [[] for _ in runs]
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        index = next((i for i, (start, end) in enumerate(runs) if start <= event["ts"] <= end), None)
        if index is None:
            continue
        args = event.get("args", {})
        op = args.get("op_name", "")
        typed_in = [next(iter(t.items())) for t in args.get("input_type_shape", []) if t]
        typed_out = [next(iter(t.items())) for t in args.get("output_type_shape", []) if t]
        per_run[index].append(
            {
                "node": event["name"].removesuffix("_kernel_time"),
                "op": op,
                "class": op_class(op),
                "us": float(event["dur"]),
                "flops": node_flops(op, [s for _, s in typed_in], [s for _, s in typed_out]),
                "precision": _ort_precision(op, [t for t, _ in typed_in]),
            }
        )
    return per_run[warmups:]


def onnxruntime_node_times(model_or_path, options, feeds: dict, runs: int, warmups: int = 2) -> dict:
    """Profile an ONNX Runtime graph (a path or serialized bytes) in a new session with `options` (an
    ort.SessionOptions, profiling switched on in it): {"runs": node records per measured run, "run_us": the
    engine's own time of each measured run}."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory(prefix="ort-profile-") as folder:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(folder) / "profile")
        source = str(model_or_path) if isinstance(model_or_path, Path) else model_or_path
        session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        for _ in range(warmups + runs):
            session.run(None, feeds)
        events = json.loads(Path(session.end_profiling()).read_text())
    totals = sorted((e["ts"], e["dur"]) for e in events if e.get("cat") == "Session" and e["name"] == "model_run")
    return {"runs": parse_ort_trace(events, warmups), "run_us": [float(d) for _, d in totals[warmups:]]}


def _openvino_shapes(compiled) -> dict[str, dict]:
    """{node name: {"op", "inputs", "outputs", "precision"}} of the runtime model as of the last inference."""
    nodes = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()

        def shape(port):
            partial = port.get_partial_shape()
            return [d.get_length() for d in partial] if partial.is_static else None

        nodes[op.get_friendly_name()] = {
            "op": info["layerType"].astype(str),
            "inputs": [shape(p) for p in op.inputs()],
            "outputs": [shape(p) for p in op.outputs()],
            "precision": _PRECISION_OF_TYPE.get(info["runtimePrecision"].astype(str)),
        }
    return nodes


def openvino_node_times(model, config: dict, feeds: dict, runs: int, warmups: int = 2) -> dict:
    """Profile an OpenVINO model (an ov.Model or a graph path) compiled on the CPU with `config` plus PERF_COUNT:
    {"runs": one run of node records, each node's mean over the measured runs, "run_us": each measured inference's
    latency as OpenVINO times it}.

    The CPU plugin reports each node's mean time over every inference of the compiled model, warm-ups included,
    so a node's mean over the measured runs is (mean after all * all - mean after warm-ups * warm-ups) / runs."""
    import openvino as ov

    core = ov.Core()
    source = model if isinstance(model, ov.Model) else core.read_model(str(model))
    compiled = core.compile_model(source, "CPU", {**config, "PERF_COUNT": "YES"})
    request = compiled.create_infer_request()
    for _ in range(warmups):
        request.infer(feeds)
    before = {name: us for name, _, us in _executed(request)} if warmups else {}
    run_us = []
    for _ in range(runs):
        request.infer(feeds)
        run_us.append(request.latency * 1000)
    shapes = _openvino_shapes(compiled)
    rows = []
    for name, node_type, mean_us in _executed(request):
        us = (mean_us * (warmups + runs) - before.get(name, 0.0) * warmups) / max(runs, 1)
        node = shapes.get(name, {"inputs": [], "outputs": [], "precision": None})
        rows.append(
            {
                "node": name,
                "op": node_type,
                "class": op_class(node_type),
                "us": max(us, 0.0),
                "flops": node_flops(node_type, node["inputs"], node["outputs"]),
                "precision": node["precision"],
            }
        )
    return {"runs": [rows], "run_us": run_us}


def _executed(request) -> list[tuple[str, str, float]]:
    """(node name, node type, mean microseconds since compiling) of each node the last inference executed."""
    import openvino as ov

    executed = ov.ProfilingInfo.Status.EXECUTED
    return [
        (p.node_name, p.node_type, p.real_time.total_seconds() * 1e6)
        for p in request.profiling_info
        if p.status == executed
    ]
