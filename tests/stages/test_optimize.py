import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from pipeline import onnx_files
from pipeline.manifest import Manifest
from pipeline.onnx_files import graph_files, load_graph
from pipeline.passes import fusions
from pipeline.stages import checkpoint, export, optimize
from pipeline.targets import load_target

from ..tiny import make_checkpoint, make_decoder

LAYERS = 2  # the tiny checkpoints' depth


def _optimized(folder, cache):
    target = load_target("cpu-avx2")
    manifest = Manifest("m", str(folder), str(cache), "", "", "")
    for stage in (checkpoint.run, export.run, optimize.run):
        manifest = stage(manifest, target)
    return manifest


def _outputs(path, batch=2, length=9):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for i in session.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = rng.integers(1000, 2000, (batch, length)).astype(np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((batch, length), np.int64)
        else:
            feeds[i.name] = np.zeros((batch, length), np.int64)
    return session.run(None, feeds)[0]


@pytest.mark.parametrize(
    "model_type, fused",
    [
        (
            "bert",
            {
                "Attention": LAYERS,
                "SkipLayerNormalization": 2 * LAYERS,
                "BiasGelu": LAYERS,
                "EmbedLayerNormalization": 1,
            },
        ),
        ("roberta", {"Attention": LAYERS, "SkipLayerNormalization": 2 * LAYERS, "BiasGelu": LAYERS}),
        # DistilBERT's attention is not a pattern onnxruntime's BERT fusion knows; its layer norms and Gelu are.
        ("distilbert", {"SkipLayerNormalization": 2 * LAYERS, "BiasGelu": LAYERS}),
    ],
)
def test_optimized_onnx_fuses_each_layer_and_keeps_outputs(model_type, fused, tmp_path):
    manifest = _optimized(make_checkpoint(tmp_path / model_type, model_type), tmp_path / "cache")
    metrics = manifest.stage("optimize").metrics
    for op, count in fused.items():
        assert metrics["fused"].get(op) == count, (op, metrics["fused"])
        assert metrics["op_counts_after"].get(op) == count
    assert metrics["nodes_after"] < metrics["nodes_before"] / (3 if "Attention" in fused else 2)
    assert ("Softmax" in metrics["op_counts_after"]) == ("Attention" not in fused)
    before = _outputs(manifest.stage("export").output("model.onnx"))
    after = _outputs(manifest.stage("optimize").output("model.onnx"))
    np.testing.assert_allclose(after, before, atol=1e-4)


def _graph(path):
    model = load_graph(path)
    nodes = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    return nodes, {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


@pytest.mark.parametrize(
    "model_type, inline_below, without_weights", [("llama", None, True), ("llama", 1, False), ("bert", None, False)]
)
def test_a_graph_over_the_single_file_limit_is_optimized_as_the_same_graph_under_it(
    model_type, inline_below, without_weights, tmp_path, monkeypatch
):
    # A decoder's fusions run on the structure alone (its weights stay in the data file). Where they would read a
    # weight that is not there, the graph is loaded and fused as one under the limit is: BERT's attention fusion
    # reads Q, K and V; shape inference reads the layer norms' weights where the structure leaves them out.
    make = make_decoder if model_type == "llama" else make_checkpoint
    folder = make(tmp_path / model_type, model_type)
    if inline_below:
        monkeypatch.setattr(fusions, "STRUCTURE_INLINE_BELOW", inline_below)
    fits = _optimized(folder, tmp_path / "fits").stage("optimize")
    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)
    over = _optimized(folder, tmp_path / "over").stage("optimize")
    assert len(graph_files(over.output("model.onnx"))) == 2
    assert not fits.metrics["fused_without_weights"]
    assert over.metrics["fused_without_weights"] == without_weights
    assert over.metrics["fused"] == fits.metrics["fused"] and fits.metrics["fused"]
    assert over.metrics["packed_matmuls"] == fits.metrics["packed_matmuls"] == (LAYERS if model_type == "llama" else 0)
    nodes, weights = _graph(over.output("model.onnx"))
    want_nodes, want_weights = _graph(fits.output("model.onnx"))
    assert nodes == want_nodes
    assert weights.keys() == want_weights.keys()
    for name, array in weights.items():
        np.testing.assert_array_equal(array, want_weights[name], err_msg=name)
