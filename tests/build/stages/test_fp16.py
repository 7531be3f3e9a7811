"""The fp16 stage's precision decisions: what goes to fp16, what stays fp32, and that the interface is unchanged."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Manifest
from pipeline.build.passes.fp16 import KEEP_FP32
from pipeline.build.stages import checkpoint, export, fp16, optimize
from tests.conftest import SMALL_TEXTS


@pytest.fixture(scope="module")
def graphs(tiny_bert, tmp_path_factory):
    target = load_target("a100")
    manifest = Manifest("m", str(tiny_bert), str(tmp_path_factory.mktemp("cache")), "", "", "")
    for stage in (checkpoint.run, export.run, optimize.run, fp16.run):
        manifest = stage(manifest, target)
    return manifest.stage("optimize").output("model.onnx"), manifest.stage("fp16").output("model.onnx"), manifest


def _input_types(model) -> dict:
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    types.update({v.name: v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)})
    types.update({i.name: i.data_type for i in model.graph.initializer})
    return types


def test_fp16_keeps_sensitive_ops_in_fp32_and_the_rest_in_fp16(graphs):
    _, fp16_path, manifest = graphs
    model = onnx.load(str(fp16_path))
    types = _input_types(model)
    sensitive = [n for n in model.graph.node if n.op_type in KEEP_FP32]
    assert {n.op_type for n in sensitive} >= {"LayerNormalization", "Softmax"}
    for node in sensitive:
        assert types[node.input[0]] == onnx.TensorProto.FLOAT, node.name
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul"]
    assert matmuls and all(types[n.input[0]] == onnx.TensorProto.FLOAT16 for n in matmuls)
    kept = manifest.stage("fp16").metrics["kept_fp32"]
    assert kept["LayerNormalization"] == sum(n.op_type == "LayerNormalization" for n in model.graph.node)


def test_fp16_keeps_the_graphs_interface_and_its_outputs(graphs):
    fp32_path, fp16_path, manifest = graphs
    fp32 = ort.InferenceSession(str(fp32_path), providers=["CPUExecutionProvider"])
    fp16 = ort.InferenceSession(str(fp16_path), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type) for i in fp16.get_inputs()] == [(i.name, i.type) for i in fp32.get_inputs()]
    assert [(o.name, o.type) for o in fp16.get_outputs()] == [("sentence_embedding", "tensor(float)")]
    from pipeline.build.manifest import candidate_model

    target = load_target("a100")
    reference = candidate_model(manifest, target, fp32_path).run(SMALL_TEXTS)
    got = candidate_model(manifest, target, fp16_path).run(SMALL_TEXTS)
    cos = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
    assert cos.min() > 0.999


def test_fp16_is_skipped_for_other_precisions(tiny_bert, tmp_path):
    manifest = Manifest("m", str(tiny_bert), str(tmp_path), "", "", "")
    assert fp16.run(manifest, load_target("cpu-avx2")) is manifest
