"""ONNX Runtime quantization, as library functions over graph files: dynamic and static int8, the calibration
reader, SmoothQuant-style smoothing, and the activation ranges it needs.

Smoothing: transformer activations have a few channels far larger than the rest, and a per-tensor activation
scale spends all of int8 on them. For each quantized node Y = X @ W, a per-input-channel factor s moves that range
into the weights, which are quantized per channel:

    X --MatMul(W)--> Y      becomes      X --Mul(1/s)--> X' --MatMul(diag(s) W)--> Y

s_j = max|X_j|^alpha / max|W_j|^(1-alpha), from activation ranges on the calibration text.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from pipeline.block_minimum import quantize_with_block_minimum
from pipeline.errors import QuantizationError
from pipeline.onnx_files import graph_files, load_graph, save_graph, save_if_small
from pipeline.progress import progress
from pipeline.quiet import silenced
from pipeline.timing import alternate


def quantizable_nodes(model, op_types) -> list:
    """Nodes of the given op types whose weight (input 1) is a constant initializer."""
    initializers = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type in op_types and len(n.input) > 1 and n.input[1] in initializers]


def activation_absmax(source: Path, nodes: list, model, texts: list[str], batch_size: int) -> dict[str, np.ndarray]:
    """Per-channel max |x| of each node's input 0 over the calibration text (padding excluded)."""
    import onnx
    import onnxruntime as ort

    graph = load_graph(source, load_data=False)
    names = sorted({n.input[0] for n in nodes})
    known = {o.name for o in graph.graph.output}
    for name in names:
        if name not in known:
            graph.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    # The graph is handed over from memory; weights in a data file are read from beside `source`.
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(source.parent))
    session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
    encodings = model.encode(texts)
    ranges: dict[str, np.ndarray] = {}
    for start in progress(range(0, len(encodings), batch_size), "calibration: activation ranges"):
        feeds = model.feeds(encodings[start : start + batch_size])
        mask = feeds["attention_mask"].astype(bool)
        for name, value in zip(names, session.run(names, feeds), strict=True):
            # Padding is left out where the activation has the mask's [batch, sequence] shape (a decoder's LM head
            # sees the last position only).
            value = np.abs(value[mask] if value.shape[:2] == mask.shape else value)
            peak = value.reshape(-1, value.shape[-1]).max(0)
            ranges[name] = np.maximum(ranges.get(name, 0.0), peak)
    return ranges


def smooth(source: Path, out: Path, ranges: dict[str, np.ndarray], op_types, alpha: float) -> list[str]:
    """Write a smoothed copy of `source` to `out`; returns the names of the nodes smoothed."""
    import onnx
    from onnx import numpy_helper

    graph = load_graph(source)
    initializers = {i.name: i for i in graph.graph.initializer}
    targets = {n.name for n in quantizable_nodes(graph, op_types)}
    nodes, smoothed, users = [], [], {}
    for node in graph.graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    for node in graph.graph.node:
        weight_name = node.input[1] if len(node.input) > 1 else None
        # A weight shared by two nodes cannot be rescaled for one of them alone.
        if node.name in targets and users.get(weight_name) == 1 and node.input[0] in ranges:
            weight = numpy_helper.to_array(initializers[weight_name])
            act = ranges[node.input[0]]
            if weight.ndim == 2 and act.shape[0] == weight.shape[0]:
                w_max = np.abs(weight).max(1)
                scale = (np.maximum(act, 1e-5) ** alpha / np.maximum(w_max, 1e-5) ** (1 - alpha)).astype(np.float32)
                initializers[weight_name].CopyFrom(numpy_helper.from_array(weight * scale[:, None], weight_name))
                scale_name = f"{node.name}_smooth_inv_scale"
                graph.graph.initializer.append(numpy_helper.from_array((1.0 / scale).astype(np.float32), scale_name))
                scaled = f"{node.input[0]}_smoothed_for_{node.name}"
                nodes.append(
                    onnx.helper.make_node("Mul", [node.input[0], scale_name], [scaled], name=f"{node.name}_smooth")
                )
                node.input[0] = scaled
                smoothed.append(node.name)
        nodes.append(node)
    del graph.graph.node[:]
    graph.graph.node.extend(nodes)
    save_graph(graph, out)
    return smoothed


def quantize_dynamic(source: Path, out: Path, settings, exclude=(), only=None) -> None:
    """ONNX Runtime dynamic quantization with the target's settings; `only` restricts it to those nodes."""
    import onnx
    from onnxruntime.quantization import QuantType
    from onnxruntime.quantization import quantize_dynamic as ort_quantize_dynamic

    weight_type = QuantType.QInt8 if settings.weight_type == "int8" else QuantType.QUInt8
    large = len(graph_files(source)) > 1
    with silenced():
        try:
            ort_quantize_dynamic(
                str(source), str(out), per_channel=settings.per_channel, reduce_range=settings.reduce_range,
                weight_type=weight_type, op_types_to_quantize=list(settings.op_types),
                nodes_to_exclude=list(exclude), nodes_to_quantize=list(only or []),
                # Fused ops (SkipLayerNormalization...) have no ONNX shape inference; without this their
                # outputs' type is unknown and quantization stops with "Unable to find data type".
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
                use_external_data_format=large,
            )  # fmt: skip
        except Exception as err:  # onnxruntime raises bare Exceptions here
            raise QuantizationError(f"dynamic quantization of {source} failed: {err}") from None
    if large:  # int8 weights are a quarter of the fp32 ones: one file again where they fit
        save_if_small(out)


def calibration_reader(model, texts: list[str], batch_size: int):
    """A CalibrationDataReader over the calibration text that holds token ids only, never activations.

    Every batch is padded to one length (the longest text's), since ONNX Runtime's histogram calibrators fail on
    batches of different shapes. `set_range` lets the calibrator consume it one batch at a time, so memory stays
    flat however many examples there are.
    """
    from onnxruntime.quantization import CalibrationDataReader

    encodings = model.encode(texts)
    width = max(len(e.ids) for e in encodings)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = [encodings[i : i + batch_size] for i in range(0, len(encodings), batch_size)]
            self.set_range(0, len(self.batches))

        def __len__(self) -> int:
            return len(self.batches)

        def set_range(self, start_index: int, end_index: int) -> None:
            self.pending = iter(range(start_index, min(end_index, len(self.batches))))

        def get_next(self):
            index = next(self.pending, None)
            if index is None:
                return None
            feeds = model.feeds(self.batches[index])
            pad = width - feeds["input_ids"].shape[1]
            pad_ids = {"input_ids": int(model.spec["pad_id"])}
            return {k: np.pad(v, ((0, 0), (0, pad)), constant_values=pad_ids.get(k, 0)) for k, v in feeds.items()}

    return Reader()


def quantize_static(source: Path, out: Path, settings, reader, ranges_cache: Path, exclude=(), only=None) -> None:
    """ONNX Runtime static quantization; activation ranges are computed once into `ranges_cache` and reused."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType
    from onnxruntime.quantization import quantize_static as ort_quantize_static

    method = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
              "percentile": CalibrationMethod.Percentile}[settings.calibration_method]  # fmt: skip
    with silenced():
        try:
            ort_quantize_static(
                str(source), str(out), None if ranges_cache.exists() else reader,
                quant_format=QuantFormat.QDQ if settings.format == "qdq" else QuantFormat.QOperator,
                op_types_to_quantize=list(settings.op_types), per_channel=settings.per_channel,
                reduce_range=settings.reduce_range,
                activation_type=QuantType.QInt8 if settings.activation_type == "int8" else QuantType.QUInt8,
                weight_type=QuantType.QInt8 if settings.weight_type == "int8" else QuantType.QUInt8,
                nodes_to_exclude=list(exclude), nodes_to_quantize=list(only or []), calibrate_method=method,
                calibration_cache_path=str(ranges_cache),
                extra_options={
                    "DefaultTensorType": onnx.TensorProto.FLOAT,
                    "CalibStridedMinMax": 1,  # one batch per collect: activations are never all held at once
                    "CalibPercentile": settings.percentile,
                    # Zero points of 0: TensorRT takes only symmetric int8 from Q/DQ nodes.
                    "ActivationSymmetric": settings.symmetric,
                    "WeightSymmetric": settings.symmetric or settings.weight_type == "int8",
                },
            )  # fmt: skip
        except Exception as err:  # onnxruntime raises bare Exceptions here
            raise QuantizationError(f"static quantization of {source} failed: {err}") from None


def widen_ranges(ranges_cache: Path, margin: float) -> None:
    """Widen every calibrated range in `ranges_cache` by `margin` (both ends scaled away from zero)."""
    from onnxruntime.quantization.calibrate import load_tensors_data, save_tensors_data

    ranges = load_tensors_data(ranges_cache)
    for data in ranges.values():
        data.lowest, data.highest = data.lowest * margin, data.highest * margin
    save_tensors_data(ranges, ranges_cache)


def with_shapes(source: Path, out: Path) -> Path:
    """A copy of `source` with symbolic shape inference run over it: fused ops have no ONNX shape inference, and
    static quantization needs every activation's type."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    with silenced():
        inferred = SymbolicShapeInference.infer_shapes(load_graph(source), auto_merge=True)
    save_graph(inferred, out)
    return out


def latency(model, texts: list[str], batch: int, reps: int = 5) -> dict:
    """Median milliseconds of one run at batch 1 and at `batch`, on calibration text, for the report."""
    timings = {}
    for name, chunk in (("latency_ms_batch_1", texts[:1]), (f"latency_ms_batch_{batch}", texts[:batch])):
        runs = alternate({name: model.run}, chunk, reps)[name]
        timings[name] = sorted(runs)[reps // 2]
    return timings


def quantize_weight_only(source: Path, dest: Path, settings, exclude=(), only=None, wide=()) -> None:
    """MatMul weights of `source` in `settings.bits`-bit blocks of `settings.block_size` (MatMulNBits at
    `settings.accuracy_level`; blocks symmetric, with integer zero points, or with float minimums as
    `settings.blocks` says), the LM head (the MatMul making `logits`) and the nodes in `wide` in
    `settings.head_bits`; the nodes in `exclude` (or, given `only`, all others) stay fp32."""
    import onnx

    graph = onnx.load(str(source), load_external_data=False).graph
    names = {n.name for n in graph.node if n.op_type == "MatMul"}
    fp32 = set(exclude) | (names - set(only) if only is not None else set())
    head = next((n.name for n in graph.node if n.op_type == "MatMul" and "logits" in n.output), None)
    wider = sorted({n for n in (*wide, head) if n is not None and n not in fp32})
    if not wider or settings.head_bits == settings.bits:
        _weight_only(source, dest, settings, sorted(fp32))
        return
    body = dest.with_name(f"{dest.stem}.body.onnx")
    _weight_only(source, body, settings, sorted(fp32 | set(wider)))
    blocks = "symmetric" if settings.blocks == "minimum" else settings.blocks  # minimum is 4-bit: its head is 8
    _weight_only(body, dest, dataclasses.replace(settings, bits=settings.head_bits, blocks=blocks), only=wider)
    for file in graph_files(body):
        file.unlink()


def _weight_only(source: Path, dest: Path, settings, exclude=(), only=None) -> None:
    """quantize_weight_only for every MatMul at `settings.bits`."""
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if settings.blocks == "minimum":
        quantize_with_block_minimum(source, dest, settings.block_size, settings.accuracy_level, exclude, only)
        return
    model = load_graph(source)  # the quantizer works on this one copy of the weights, replacing them node by node
    names = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    excluded = list(exclude) + ([n for n in names if n not in set(only)] if only is not None else [])
    config = DefaultWeightOnlyQuantConfig(
        block_size=settings.block_size, is_symmetric=settings.blocks == "symmetric", bits=settings.bits,
        accuracy_level=settings.accuracy_level,
    )  # fmt: skip
    quantizer = MatMulNBitsQuantizer(model, nodes_to_exclude=excluded, algo_config=config)
    # The quantizer logs every node at INFO, through the root logger it configures on import.
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.WARNING)
    try:
        quantizer.process()
    finally:
        logging.getLogger().setLevel(level)
    quantizer.model.topological_sort()
    save_graph(quantizer.model.model, dest)
