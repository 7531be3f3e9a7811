"""matmuls_packed: sibling MatMuls (one input, their own constant weights) become one MatMul and a Split with the
same outputs; a decoder's optimize stage packs its q/k/v (where q/k norms keep them apart) and gate/up."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.build import onnx_files
from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Manifest
from pipeline.build.onnx_files import graph_files, load_graph, load_structure, save_graph
from pipeline.build.passes.fusions import fused_from_onnx
from pipeline.build.passes.packing import matmuls_packed, packable
from pipeline.build.stages import checkpoint, export, optimize
from pipeline.build.stages.optimize import OptimizeConfig
from tests.build.passes.conftest import op_counts
from tests.tiny import make_decoder

OUTPUTS = ["q", "k", "v", "shared", "other"]


def _siblings(opset: int = 17):
    """x [b, 16] read by q/k/v projections of widths 32, 8, 8 under one prefix; y read by a MatMul whose weight
    (`w_v`) v_proj reads too, and by one more."""
    rng = np.random.default_rng(0)
    widths = {"w_q": 32, "w_k": 8, "w_v": 8, "w_o": 4}
    weights = {name: rng.standard_normal((16, n)).astype(np.float32) for name, n in widths.items()}
    nodes = [
        helper.make_node("MatMul", ["x", f"w_{p}"], [p], name=f"/layers.0/attn/{p}_proj/MatMul") for p in "qkv"
    ] + [
        helper.make_node("MatMul", ["y", "w_v"], ["shared"], name="/layers.0/other/MatMul"),
        helper.make_node("MatMul", ["y", "w_o"], ["other"], name="/layers.0/o/MatMul"),
    ]
    graph = helper.make_graph(
        nodes,
        "siblings",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", 16]) for n in "xy"],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in OUTPUTS],
        [numpy_helper.from_array(w, name) for name, w in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _run(model_or_path) -> list:
    source = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    return session.run(OUTPUTS, {n: rng.standard_normal((3, 16)).astype(np.float32) for n in "xy"})


def test_sibling_matmuls_become_one_matmul_and_a_split_with_the_same_outputs():
    model = _siblings()
    expected = _run(model)
    assert packable(model) == 1
    assert matmuls_packed(model) == 1  # a tied weight (w_v) stays where it is: q and k only
    assert packable(model) == 0
    nodes = {n.name: n for n in model.graph.node}
    packed = nodes["/layers.0/attn/q_proj+k_proj/MatMul"]
    split = nodes["/layers.0/attn/q_proj+k_proj/MatMul/Split"]
    assert list(split.output) == ["q", "k"] and packed.input[0] == "x"
    assert sorted(n.op_type for n in model.graph.node) == ["MatMul"] * 4 + ["Split"]
    weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    assert weights[packed.input[1]].shape == (16, 40) and list(weights[split.input[1]]) == [32, 8]
    assert sorted(weights) == sorted([packed.input[1], split.input[1], "w_v", "w_o"])
    for got, want in zip(_run(model), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_graph_without_siblings_or_before_opset_13_is_left_as_it_is():
    old = _siblings(opset=12)
    before = old.SerializeToString()
    assert packable(old) == 0 and matmuls_packed(old) == 0 and old.SerializeToString() == before
    alone = _siblings()
    kept = [n for n in alone.graph.node if n.name in ("/layers.0/attn/q_proj/MatMul", "/layers.0/other/MatMul")]
    del alone.graph.node[:]
    alone.graph.node.extend(kept)  # one MatMul of x, one of y
    assert matmuls_packed(alone) == 0


def test_generic_optimization_packs_a_graph_whose_weights_are_in_a_data_file(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)
    model = _siblings()
    expected = _run(model)
    save_graph(model, tmp_path / "m.onnx")
    assert packable(load_structure(tmp_path / "m.onnx")) == 1  # told from the structure, without the weights
    (tmp_path / "out").mkdir()
    config = OptimizeConfig(fusions=False, level=1, model_type="", packed=True)
    metrics = fused_from_onnx(tmp_path / "m.onnx", config, tmp_path / "out")
    path = tmp_path / "out" / "model.onnx"
    assert metrics["packed_matmuls"] == 1 and metrics["op_counts_after"] == {"MatMul": 4, "Split": 1}
    assert graph_files(path) == [path, tmp_path / "out" / "model.onnx.data"]
    for got, want in zip(_run(load_graph(path)), expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type, packed_per_layer", [("llama", 1), ("qwen3", 3)])
def test_a_decoders_optimize_stage_packs_gate_and_up_and_the_projections_its_norms_keep_apart(
    model_type, packed_per_layer, tmp_path
):
    folder = make_decoder(tmp_path / model_type, model_type)
    manifest = Manifest("m", str(folder), str(tmp_path / "cache"), "", "", "")
    target = load_target("cpu-fp32")
    for stage in (checkpoint.run, export.run, optimize.run):
        manifest = stage(manifest, target)
    metrics = manifest.stage("optimize").metrics
    layers = 2
    assert metrics["packed_matmuls"] == packed_per_layer * layers
    assert metrics["op_counts_after"]["Split"] >= 1 * layers
    graph = onnx.load(str(manifest.stage("optimize").output("model.onnx"))).graph
    packed = {
        (n.name.rsplit("/", 3)[1], frozenset(n.name.rsplit("/", 2)[1].split("+")))
        for n in graph.node
        if n.op_type == "MatMul" and "+" in n.name and n.name.startswith("/model/layers.1/")
    }
    expected = {("mlp", frozenset({"gate_proj", "up_proj"}))}
    if model_type == "qwen3":
        expected.add(("self_attn", frozenset({"q_proj", "k_proj", "v_proj"})))
    assert packed == expected
    matmuls = op_counts(manifest.stage("optimize").output("model.onnx"))["MatMul"]
    assert matmuls == metrics["op_counts_before"]["MatMul"] - metrics["packed_matmuls"]
