import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from pipeline.build import onnx_files
from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Manifest
from pipeline.build.onnx_files import graph_files, load_graph
from pipeline.build.passes import fusions
from pipeline.build.stages import checkpoint, export, optimize
from tests.tiny import make_checkpoint, make_decoder

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
        # onnxruntime's BERT fusion leaves DistilBERT's attention decomposed; pipeline/build/passes/encoder_attention.py
        # fuses it.
        ("distilbert", {"Attention": LAYERS, "SkipLayerNormalization": 2 * LAYERS, "BiasGelu": LAYERS}),
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


@pytest.mark.parametrize("over_the_limit", [False, True])
def test_a_decoders_fusions_on_its_structure_give_the_graph_they_give_on_the_loaded_graph(
    over_the_limit, tmp_path, monkeypatch
):
    folder = make_decoder(tmp_path / "llama", "llama")
    if over_the_limit:
        monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)
    structure = _optimized(folder, tmp_path / "structure").stage("optimize")
    # Left out of the structure, the norms' weights are read by shape inference: the fusions run on the loaded graph.
    monkeypatch.setattr(fusions, "STRUCTURE_INLINE_BELOW", 1)
    loaded = _optimized(folder, tmp_path / "loaded").stage("optimize")
    assert structure.metrics["fused_without_weights"] and not loaded.metrics["fused_without_weights"]
    assert len(graph_files(structure.output("model.onnx"))) == (2 if over_the_limit else 1)
    assert structure.metrics["fused"] == loaded.metrics["fused"] and loaded.metrics["fused"]
    assert structure.metrics["packed_matmuls"] == loaded.metrics["packed_matmuls"] == LAYERS
    nodes, weights = _graph(structure.output("model.onnx"))
    want_nodes, want_weights = _graph(loaded.output("model.onnx"))
    assert nodes == want_nodes
    assert weights.keys() == want_weights.keys()
    for name, array in weights.items():
        np.testing.assert_array_equal(array, want_weights[name], err_msg=name)


def test_fusions_that_read_weights_are_not_run_on_a_structure(tmp_path):
    # BERT's attention fusion joins Q, K and V: on a structure it finds no data, and the caller fuses the loaded graph.
    manifest = _optimized(make_checkpoint(tmp_path / "bert", "bert"), tmp_path / "cache")
    assert not manifest.stage("optimize").metrics["fused_without_weights"]
    config = optimize.OptimizeConfig(fusions=True, level=1, model_type="bert", packed=False)
    (tmp_path / "out").mkdir()
    assert (
        fusions._structure_fused(manifest.stage("export").output("model.onnx"), config, tmp_path / "out" / "m.onnx")
        is None
    )
    assert not any((tmp_path / "out").iterdir())  # its scratch folder went with it


def _prompt_logits(path, length=7):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {
        "input_ids": np.arange(3, 3 + length, dtype=np.int64)[None],
        "attention_mask": np.ones((1, length), np.int64),
    }
    for i in session.get_inputs():
        if i.name.startswith("past_key_values."):
            feeds[i.name] = np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32)
    return session.run(["logits"], feeds)[0]


@pytest.mark.parametrize("passes", [1, fusions.MAX_SESSION_PASSES])
def test_reshape_shapes_of_every_layer_become_constants_past_ten_layers(passes, tmp_path, monkeypatch):
    # ONNX Runtime fuses one layer's Reshape shapes a transformer step, and stops after 10 steps: the stage runs its
    # session pass again while that leaves fewer (Qwen3's per-head q/k norms reshape by shapes built at run time).
    monkeypatch.setattr(fusions, "MAX_SESSION_PASSES", passes)
    manifest = _optimized(make_decoder(tmp_path / "qwen3", "qwen3", num_hidden_layers=12), tmp_path / "cache")
    exported, optimized = (manifest.stage(s).output("model.onnx") for s in ("export", "optimize"))
    assert fusions._built_reshapes(exported) >= 2 * 12
    assert (fusions._built_reshapes(optimized) == 0) == (passes > 1)
    np.testing.assert_allclose(_prompt_logits(optimized), _prompt_logits(exported), atol=1e-4)
