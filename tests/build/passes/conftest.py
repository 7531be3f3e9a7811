"""Tiny hand-made graphs for the graph passes: each pass's node counts are checked on a graph of a few nodes."""

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper


def op_counts(path) -> Counter:
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def _save(nodes, inputs, outputs, weights, path):
    graph = helper.make_graph(
        nodes, "tiny", inputs, outputs, [numpy_helper.from_array(w, name) for name, w in weights.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.fixture
def two_matmuls(tmp_path):
    """x [b, s, 64] -> MatMul(W1) -> Relu -> MatMul(W2) -> logits [b, s, 64]."""
    rng = np.random.default_rng(0)
    weights = {f"w{i}": rng.standard_normal((64, 64)).astype(np.float32) * 0.1 for i in (1, 2)}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
        helper.make_node("Relu", ["h"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["logits"], name="head"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 64])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 64])
    return _save(nodes, [x], [y], weights, tmp_path / "two_matmuls.onnx")


@pytest.fixture
def residual_norm(tmp_path):
    """a + b -> LayerNormalization: the pattern ONNX Runtime's optimizer fuses into SkipLayerNormalization."""
    weights = {"gamma": np.ones(64, np.float32), "beta": np.zeros(64, np.float32)}
    nodes = [
        helper.make_node("Add", ["a", "b"], ["sum"], name="residual"),
        helper.make_node("LayerNormalization", ["sum", "gamma", "beta"], ["y"], name="norm", axis=-1, epsilon=1e-5),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", "s", 64]) for n in "ab"]
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", 64])
    return _save(nodes, inputs, [y], weights, tmp_path / "residual_norm.onnx")
