import numpy as np
import onnxruntime as ort
import pytest

from pipeline.manifest import Manifest
from pipeline.stages import checkpoint, export, optimize
from pipeline.targets import load_target

from ..tiny import make_checkpoint

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
