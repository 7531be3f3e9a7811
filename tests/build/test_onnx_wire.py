"""Graphs counted and written a tensor at a time: the counted size bounds (or equals) the bytes protobuf writes."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.build.test_onnx_files import _graph  # y = x @ W + b


def test_serialized_size_counts_at_least_the_bytes_a_graph_serializes_to_a_part_at_a_time():
    from pipeline.build.onnx_wire import serialized_size

    model = _graph()
    model.graph.initializer.append(helper.make_tensor("listed", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0]))
    model.graph.node.append(helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.ones(300))))
    model.graph.value_info.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, 64]))
    exact = len(model.SerializeToString())
    assert exact <= serialized_size(model) <= exact + 70_000  # its fixed allowance for scalar fields is 64 KiB
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(100_000, np.float32), "big"))
    grown = len(model.SerializeToString())
    assert grown <= serialized_size(model) <= grown + 70_000


@pytest.mark.parametrize(
    "array",
    [
        np.zeros((3, 5), np.float32),
        np.ones(7, np.float16),
        np.arange(9, dtype=np.int64),
        np.array(2.5),
        np.zeros((2, 2), np.bool_),
        np.arange(4, dtype=np.uint8),
        np.zeros((0, 3), np.int8),
    ],
    ids=["float32", "float16", "int64", "scalar-double", "bool", "uint8", "empty-int8"],
)
def test_a_tensors_field_size_from_its_dims_is_its_exact_wire_size(array):
    from pipeline.build.onnx_wire import _field_size

    tensor = numpy_helper.from_array(array, "w")
    assert _field_size(tensor) == len(onnx.ModelProto(graph=onnx.GraphProto(initializer=[tensor])).SerializeToString())


def test_a_tensor_with_more_fields_is_written_and_sized_whole():
    from pipeline.build.onnx_wire import _field_size, _tensor_parts

    # ONNX Runtime's folded constants carry a doc string; loaded data leaves data_location set.
    tensor = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "folded")
    tensor.doc_string = "Constant folded"
    tensor.data_location = TensorProto.DEFAULT
    tensor.metadata_props.add(key="k", value="v")
    head, raw = _tensor_parts(tensor)
    assert raw and onnx.TensorProto.FromString(head + raw) == tensor
    assert _field_size(tensor) == len(onnx.ModelProto(graph=onnx.GraphProto(initializer=[tensor])).SerializeToString())


def test_a_packed_int4_tensors_field_size_is_its_exact_wire_size():
    from pipeline.build.onnx_wire import _field_size

    tensor = onnx.TensorProto(name="q", dims=[5], data_type=TensorProto.INT4, raw_data=bytes(3))
    assert _field_size(tensor) == len(onnx.ModelProto(graph=onnx.GraphProto(initializer=[tensor])).SerializeToString())
