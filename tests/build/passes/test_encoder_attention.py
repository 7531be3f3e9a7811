"""attention_from_where_mask: DistilBERT's Where-masked attention, which ONNX Runtime's optimizer leaves decomposed,
becomes one Attention node a layer with the outputs of the decomposed graph; a layer that differs is left alone.
attention_from_residual_first: ALBERT's first layer, which ONNX Runtime's optimizer leaves decomposed, is fused by
it once its residual sum is reordered."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper
from onnxruntime.transformers.onnx_model import OnnxModel

from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Manifest
from pipeline.build.passes.encoder_attention import attention_from_residual_first, attention_from_where_mask
from pipeline.build.passes.fusions import fused_from_onnx
from pipeline.build.stages import checkpoint, export
from pipeline.build.stages.optimize import OptimizeConfig
from tests.build.passes.conftest import op_counts
from tests.tiny import make_checkpoint

LAYERS = 2  # the tiny checkpoint's depth


def _exported(tmp, model_type: str):
    """The export stage's graph file of a tiny random `model_type` checkpoint made in `tmp`."""
    manifest = Manifest("m", str(make_checkpoint(tmp / "ckpt", model_type)), str(tmp / "cache"), "", "", "")
    for stage in (checkpoint.run, export.run):
        manifest = stage(manifest, load_target("cpu-avx2"))
    return manifest.stage("export").output("model.onnx")


def _optimized(tmp, model_type: str, layout: str) -> dict:
    """The tiny `model_type`'s export optimized by ONNX Runtime's BERT fusions, without and with `layout`'s pass:
    {layout: (graph file, the optimize metrics)}."""
    source = _exported(tmp, model_type)
    graphs = {}
    for fusion in ("", layout):
        out = tmp / (fusion or "ort")
        out.mkdir()
        config = OptimizeConfig(fusions=True, level=2, model_type="bert", packed=False, attention_fusion=fusion)
        graphs[fusion] = (out / "model.onnx", fused_from_onnx(source, config, out))
    return graphs


@pytest.fixture(scope="module")
def optimized(tmp_path_factory) -> dict:
    """The tiny DistilBERT, without and with the where-mask pass."""
    return _optimized(tmp_path_factory.mktemp("distilbert"), "distilbert", "where-mask")


def _feeds(batch: int = 3, length: int = 11) -> dict:
    rng = np.random.default_rng(0)
    mask = np.ones((batch, length), np.int64)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    return {"input_ids": rng.integers(1000, 2000, (batch, length)).astype(np.int64), "attention_mask": mask}


def _run(model, feeds: dict) -> np.ndarray:
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(source, providers=["CPUExecutionProvider"])
    inputs = {i.name for i in session.get_inputs()}
    zeros = {"token_type_ids": np.zeros_like(feeds["input_ids"])}  # segment ids, where the graph takes them
    return session.run(None, {k: v for k, v in {**zeros, **feeds}.items() if k in inputs})[0]


def test_each_layer_becomes_one_attention_node_with_the_decomposed_graphs_outputs(optimized):
    (plain, plain_metrics), (fused, metrics) = optimized[""], optimized["where-mask"]
    assert "Attention" not in plain_metrics["fused"] and op_counts(plain)["Softmax"] == LAYERS
    assert metrics["fused"]["Attention"] == op_counts(fused)["Attention"] == LAYERS
    assert not {"Softmax", "Where", "Expand", "Transpose"} & set(op_counts(fused))
    assert metrics["passes"] == "onnxruntime bert fusions, then attention from its where-mask layout"
    feeds = _feeds()
    want, got = _run(plain, feeds), _run(fused, feeds)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # The mask is read: a padded row is the row alone, and unmasking it changes it.
    alone = _run(fused, {name: array[2:3, :3] for name, array in feeds.items()})
    np.testing.assert_allclose(alone[0], got[2], atol=1e-5)
    unmasked = _run(fused, {**feeds, "attention_mask": np.ones_like(feeds["attention_mask"])})
    assert np.abs(unmasked[2] - got[2]).max() > 1e-3


def _constant_of(model: onnx.ModelProto, op_type: str) -> onnx.TensorProto:
    """The constant the first `op_type` node reads, as an initializer of `model`."""
    node = next(n for n in model.graph.node if n.op_type == op_type)
    names = {i.name: i for i in model.graph.initializer}
    return next(names[i] for i in node.input if i in names)


@pytest.mark.parametrize(
    "change",
    [
        "the mask compares with 1",  # attention_mask == 1 is not "padding"
        "the scores are read elsewhere",  # another output reads them
        "the fill value is positive",
        "the softmax is opset 11's, over axis 1",  # its default axis: the flattened heads and positions
    ],
)
def test_a_layer_that_differs_from_the_pattern_is_left_decomposed(change, optimized):
    model = onnx.load(str(optimized[""][0]))
    if change == "the mask compares with 1":
        tensor = _constant_of(model, "Equal")
        tensor.CopyFrom(numpy_helper.from_array(np.ones_like(numpy_helper.to_array(tensor)), tensor.name))
    elif change == "the fill value is positive":
        for node in (n for n in model.graph.node if n.op_type == "Where"):
            fill = next(i for i in model.graph.initializer if i.name == node.input[1])
            fill.CopyFrom(numpy_helper.from_array(np.ones_like(numpy_helper.to_array(fill)), fill.name))
    elif change == "the softmax is opset 11's, over axis 1":
        for node in (n for n in model.graph.node if n.op_type == "Softmax"):
            del node.attribute[:]
        next(o for o in model.opset_import if o.domain in ("", "ai.onnx")).version = 11
    else:
        for node in (n for n in model.graph.node if n.op_type == "Where"):
            model.graph.output.append(onnx.helper.make_value_info(node.input[2], onnx.TypeProto()))
    before = _run(model, _feeds()) if "opset 11" not in change else None
    wrapped = OnnxModel(model)
    assert attention_from_where_mask(wrapped) == 0
    assert not any(n.op_type == "Attention" for n in model.graph.node)
    if before is not None:  # the opset-11 graph is not run: its other nodes are of later opsets
        np.testing.assert_array_equal(_run(model, _feeds()), before)


def test_albert_first_layer_is_fused_once_its_residual_comes_second(tmp_path_factory):
    graphs = _optimized(tmp_path_factory.mktemp("albert"), "albert", "residual-first")
    (plain, plain_metrics), (fused, metrics) = graphs[""], graphs["residual-first"]
    assert plain_metrics["fused"]["Attention"] == op_counts(plain)["Attention"] == LAYERS - 1  # ORT's alone
    assert op_counts(plain)["Softmax"] == 1
    assert metrics["fused"]["Attention"] == op_counts(fused)["Attention"] == LAYERS and "Softmax" not in op_counts(
        fused
    )
    assert metrics["passes"] == "onnxruntime bert fusions, then attention from its residual-first layout"
    feeds = _feeds()
    got = _run(fused, feeds)
    np.testing.assert_allclose(got, _run(plain, feeds), atol=1e-5)
    alone = _run(fused, {name: array[1:2, :7] for name, array in feeds.items()})
    np.testing.assert_allclose(alone[0], got[1], atol=1e-5)


def test_a_model_whose_attention_output_comes_first_is_left_as_it_is(tmp_path):
    """BERT adds its attention output first: ONNX Runtime fused every layer, and the pass changes nothing."""
    from onnxruntime.transformers.optimizer import optimize_model

    model = optimize_model(str(_exported(tmp_path, "bert")), model_type="bert", num_heads=0, hidden_size=0)
    before = model.model.SerializeToString()
    assert len(model.get_nodes_by_op_type("Attention")) == LAYERS
    assert attention_from_residual_first(model) == 0 and model.model.SerializeToString() == before
