"""int8: graph passes that quantize a graph's MatMuls (and fused attention) to int8 with ONNX Runtime's
quantizer, dynamic (activations quantized per batch at run time) or static (activation ranges calibrated on text,
QOperator or QDQ), and the calibration reader and range widening static int8 needs.

    X --MatMul(W fp32)--> Y      becomes      X --DynamicQuantizeLinear--> MatMulInteger(W int8) --> scale --> Y
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.build.console import silenced
from pipeline.build.onnx_files import graph_files, load_graph, save_graph, save_if_small
from pipeline.errors import QuantizationError


def quantizable_nodes(model, op_types) -> list:
    """Nodes of the given op types whose weight (input 1) is a constant initializer."""
    initializers = {i.name for i in model.graph.initializer}
    return [n for n in model.graph.node if n.op_type in op_types and len(n.input) > 1 and n.input[1] in initializers]


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
                str(source),
                str(out),
                per_channel=settings.per_channel,
                reduce_range=settings.reduce_range,
                weight_type=weight_type,
                op_types_to_quantize=list(settings.op_types),
                nodes_to_exclude=list(exclude),
                nodes_to_quantize=list(only or []),
                # Fused ops (SkipLayerNormalization...) have no ONNX shape inference; without this their
                # outputs' type is unknown and quantization stops with "Unable to find data type".
                extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
                use_external_data_format=large,
            )
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
    width = max(model.inputs.lengths(encodings))

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
            feeds = model.feeds(self.batches[index], buckets=False)  # padded to `width` below, not to a bucket
            if "input_ids" not in feeds:  # pictures come in one shape
                return feeds
            pad = width - feeds["input_ids"].shape[1]
            pad_ids = {"input_ids": int(model.spec["pad_id"])}
            return {k: np.pad(v, ((0, 0), (0, pad)), constant_values=pad_ids.get(k, 0)) for k, v in feeds.items()}

    return Reader()


def quantize_static(source: Path, out: Path, settings, reader, ranges_cache: Path, exclude=(), only=None) -> None:
    """ONNX Runtime static quantization; activation ranges are computed once into `ranges_cache` and reused."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType
    from onnxruntime.quantization import quantize_static as ort_quantize_static

    method = {
        "minmax": CalibrationMethod.MinMax,
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
    }[settings.calibration_method]
    with silenced():
        try:
            ort_quantize_static(
                str(source),
                str(out),
                None if ranges_cache.exists() else reader,
                quant_format=QuantFormat.QDQ if settings.format == "qdq" else QuantFormat.QOperator,
                op_types_to_quantize=list(settings.op_types),
                per_channel=settings.per_channel,
                reduce_range=settings.reduce_range,
                activation_type=QuantType.QInt8 if settings.activation_type == "int8" else QuantType.QUInt8,
                weight_type=QuantType.QInt8 if settings.weight_type == "int8" else QuantType.QUInt8,
                nodes_to_exclude=list(exclude),
                nodes_to_quantize=list(only or []),
                calibrate_method=method,
                calibration_cache_path=str(ranges_cache),
                extra_options={
                    "DefaultTensorType": onnx.TensorProto.FLOAT,
                    "CalibStridedMinMax": 1,  # one batch per collect: activations are never all held at once
                    "CalibPercentile": settings.percentile,
                    # Zero points of 0: TensorRT takes only symmetric int8 from Q/DQ nodes.
                    "ActivationSymmetric": settings.symmetric,
                    "WeightSymmetric": settings.symmetric or settings.weight_type == "int8",
                },
            )
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
