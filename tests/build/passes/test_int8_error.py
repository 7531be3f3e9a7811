"""The simulated error of dynamic int8 at each node, against what ONNX Runtime's dynamic int8 really does."""

import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.build.passes.int8 import quantizable_nodes, quantize_dynamic
from pipeline.build.passes.int8_error import dynamic_int8_errors
from pipeline.runtime.host import cpu_flags

# The host's flags: the simulation multiplies as this host's int8 kernel does, saturating or not.
FLAGS = cpu_flags() or frozenset()
SETTINGS = types.SimpleNamespace(
    per_channel=False, reduce_range=False, weight_type="int8", op_types=("MatMul",), exclude_nodes=()
)


def _parallel_matmuls(path):
    """x [b, 64] -> MatMul(smooth) -> y_smooth, x -> MatMul(outlier) -> y_outlier: the second weight has one large
    entry, so per-tensor int8 rounds the rest of it coarsely."""
    rng = np.random.default_rng(0)
    smooth = rng.standard_normal((64, 32)).astype(np.float32) * 0.1
    outlier = rng.standard_normal((64, 32)).astype(np.float32) * 0.1
    outlier[3, 5] = 40.0
    nodes = [
        helper.make_node("MatMul", ["x", "w_smooth"], ["y_smooth"], name="smooth"),
        helper.make_node("MatMul", ["x", "w_outlier"], ["y_outlier"], name="outlier"),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 64])
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", 32]) for n in ("y_smooth", "y_outlier")]
    weights = [numpy_helper.from_array(w, n) for n, w in (("w_smooth", smooth), ("w_outlier", outlier))]
    model = helper.make_model(
        helper.make_graph(nodes, "g", [x], outputs, weights), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _run(path, feed):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip(("y_smooth", "y_outlier"), session.run(["y_smooth", "y_outlier"], feed), strict=True))


def test_simulated_errors_rank_and_match_onnx_runtimes_dynamic_int8(tmp_path):
    graph = _parallel_matmuls(tmp_path / "fp32.onnx")
    feeds = [{"x": np.random.default_rng(i).standard_normal((8, 64)).astype(np.float32)} for i in range(3)]
    nodes = quantizable_nodes(onnx.load(str(graph)), ("MatMul",))
    simulated = dynamic_int8_errors(graph, nodes, feeds, SETTINGS, FLAGS)
    assert [s["node"] for s in simulated] == ["outlier", "smooth"] and simulated[0]["error"] > 3 * simulated[1]["error"]
    quantize_dynamic(graph, tmp_path / "int8.onnx", SETTINGS)
    real = {name: [] for name in ("smooth", "outlier")}
    for feed in feeds:
        exact, rounded = _run(graph, feed), _run(tmp_path / "int8.onnx", feed)
        for name in real:
            out = f"y_{name}"
            real[name].append(np.linalg.norm(rounded[out] - exact[out]) / np.linalg.norm(exact[out]))
    for row in simulated:
        assert abs(row["error"] - np.mean(real[row["node"]])) < 0.25 * np.mean(real[row["node"]])


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("reduce_range", [True, False])
def test_simulated_error_matches_onnx_runtime_per_channel_and_reduced_range(tmp_path, per_channel, reduce_range):
    settings = types.SimpleNamespace(**{**vars(SETTINGS), "per_channel": per_channel, "reduce_range": reduce_range})
    graph = _parallel_matmuls(tmp_path / "fp32.onnx")
    feed = {"x": np.random.default_rng(7).standard_normal((16, 64)).astype(np.float32)}
    nodes = quantizable_nodes(onnx.load(str(graph)), ("MatMul",))
    simulated = {s["node"]: s["error"] for s in dynamic_int8_errors(graph, nodes, [feed], settings, FLAGS)}
    quantize_dynamic(graph, tmp_path / "int8.onnx", settings)
    exact, rounded = _run(graph, feed), _run(tmp_path / "int8.onnx", feed)
    for name, error in simulated.items():
        real = np.linalg.norm(rounded[f"y_{name}"] - exact[f"y_{name}"]) / np.linalg.norm(exact[f"y_{name}"])
        assert abs(error - real) < 0.1 * real, (name, error, real)


@pytest.mark.parametrize("saturate", [True, False])
def test_integer_products_sum_as_the_kernels_do_whatever_the_host(saturate):
    """Both sums, on every host: AVX2's 16-bit pair sums saturate (255 * 127 twice is past 32767), VNNI's 32-bit
    ones do not; an odd inner size pads one zero."""
    from pipeline.build.passes.int8_error import _integer_product

    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 256, (4, 7)), rng.integers(-127, 128, (7, 5))
    a[0], b[:, 0] = 255, 127  # row 0 x column 0: three saturated pairs and one lone product
    want = np.zeros((4, 5))
    for i in range(4):
        for j in range(5):
            products = [int(a[i, k]) * int(b[k, j]) for k in range(7)] + [0]
            pairs = [products[k] + products[k + 1] for k in range(0, 8, 2)]
            want[i, j] = sum(min(max(p, -32768), 32767) for p in pairs) if saturate else sum(products)
    got = _integer_product(a, b, saturate)
    assert np.array_equal(got, want)
    assert (got[0, 0] == 3 * 32767 + 255 * 127) == saturate
