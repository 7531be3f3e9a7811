"""int4 blocks with a float minimum each: exact on weights already on such a grid, and run by ONNX Runtime's own
MatMulNBits kernel plus one small MatMul."""

from collections import Counter

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.build.passes.block_minimum import blocks_with_minimum, quantize_with_block_minimum

K, BLOCK = 80, 32  # K is not a whole number of blocks: the last one is partial


def _grid_weight(rng, n: int) -> np.ndarray:
    """A [K, n] weight whose every block of 32 along K is scale * q + minimum, q spanning 0..15 (GGUF Q4_1)."""
    blocks = -(-K // BLOCK)
    scale = rng.uniform(0.01, 0.1, size=(blocks, n)).astype(np.float32)
    low = rng.normal(size=(blocks, n)).astype(np.float32)
    codes = rng.integers(0, 16, size=(blocks * BLOCK, n))
    codes[0::BLOCK], codes[1::BLOCK] = 0, 15
    return (np.repeat(scale, BLOCK, 0) * codes + np.repeat(low, BLOCK, 0))[:K].astype(np.float32)


def _dequantized(weight: np.ndarray) -> np.ndarray:
    """The weight the scheme stores, as numpy reads it back from the packed codes."""
    packed, scale, offsets = blocks_with_minimum(weight, BLOCK)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*packed.shape[:2], BLOCK).astype(np.float32)
    steps = (scale[..., None] * (codes - 8)).reshape(weight.shape[1], -1)[:, :K].T
    return steps + np.repeat(offsets, BLOCK, 0)[:K]


@pytest.fixture
def graph(tmp_path):
    """x @ W1 and x @ W2 (one input, two weights), and x @ w with w a graph input, which must stay as it is."""
    rng = np.random.default_rng(0)
    weights = {"W1": _grid_weight(rng, 24), "W2": rng.normal(size=(K, 16)).astype(np.float32)}
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", K])
    w = helper.make_tensor_value_info("w", TensorProto.FLOAT, [K, 8])
    nodes = [helper.make_node("MatMul", ["x", n], [f"y{n[-1]}"], name=f"mm{n[-1]}") for n in weights]
    nodes.append(helper.make_node("MatMul", ["x", "w"], ["y3"], name="mm3"))
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in (1, 2, 3)]
    initializers = [numpy_helper.from_array(v, k) for k, v in weights.items()]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, w], outputs, initializers))
    model.opset_import[0].version = 17
    onnx.save(model, str(tmp_path / "fp32.onnx"))
    return tmp_path / "fp32.onnx", weights


def _run(path, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_grid_weights_come_back_exactly():
    weight = _grid_weight(np.random.default_rng(1), 40)
    assert np.abs(_dequantized(weight) - weight).max() < 1e-5


def test_any_weight_is_within_half_a_step():
    weight = np.random.default_rng(2).normal(size=(K, 40)).astype(np.float32)
    _, scale, _ = blocks_with_minimum(weight, BLOCK)
    error = np.abs(_dequantized(weight) - weight)
    assert error.max() <= scale.max() / 2 + 1e-6 and error.max() > 0


def test_onnx_runtime_runs_the_rewritten_graph_as_numpy_computes_it(graph, tmp_path):
    source, weights = graph
    out = tmp_path / "int4.onnx"
    assert quantize_with_block_minimum(source, out, BLOCK, accuracy_level=0) == 2
    model = onnx.load(str(out))
    ops = Counter(n.op_type for n in model.graph.node)
    # One block sum for the input both weights read, a MatMulNBits, an offset MatMul and an Add per weight.
    assert ops == {"MatMulNBits": 2, "MatMul": 1 + 2 + 1, "Add": 2}
    assert not {"W1", "W2"} & {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=(2, 5, K)).astype(np.float32), rng.normal(size=(K, 8)).astype(np.float32)
    y1, y2, y3 = _run(out, {"x": x, "w": w})
    np.testing.assert_allclose(y1, x @ weights["W1"], rtol=1e-4, atol=1e-4)  # on the grid: exact
    np.testing.assert_allclose(y2, x @ _dequantized(weights["W2"]), rtol=1e-4, atol=1e-4)
    assert np.abs(y2 - x @ weights["W2"]).max() > 1e-3  # off the grid it is int4, not a copy of fp32
    np.testing.assert_array_equal(y3, _run(source, {"x": x, "w": w})[2])


def test_int8_activations_stay_close_on_the_grid(graph, tmp_path):
    source, weights = graph
    quantize_with_block_minimum(source, tmp_path / "int4.onnx", BLOCK, accuracy_level=4)
    x = np.random.default_rng(4).normal(size=(1, 3, K)).astype(np.float32)
    y1 = _run(tmp_path / "int4.onnx", {"x": x, "w": np.zeros((K, 8), np.float32)})[0]
    reference = x @ weights["W1"]
    assert np.abs(y1 - reference).max() < 0.02 * np.abs(reference).max()


def test_excluded_and_unlisted_matmuls_stay_fp32(graph, tmp_path):
    source, _ = graph
    assert quantize_with_block_minimum(source, tmp_path / "a.onnx", BLOCK, 0, exclude=["mm2"]) == 1
    assert quantize_with_block_minimum(source, tmp_path / "b.onnx", BLOCK, 0, only=["mm2"]) == 1
    for name, kept in (("a", "W2"), ("b", "W1")):
        model = onnx.load(str(tmp_path / f"{name}.onnx"))
        assert kept in {t.name for t in model.graph.initializer}
        assert any(n.op_type == "MatMul" and n.input[1] == kept for n in model.graph.node)
