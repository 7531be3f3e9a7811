"""Node counts of each graph pass on a tiny hand-made graph, and its outputs still close to the source's."""

import numpy as np
import onnx
import onnxruntime as ort

from pipeline.build.inputs.targets import load_target
from pipeline.build.passes.fp16 import fp16_from_fp32
from pipeline.build.passes.fusions import fused_from_onnx
from pipeline.build.passes.int8 import quantize_dynamic
from pipeline.build.passes.lm_head import last_token_logits
from pipeline.build.passes.smoothing import smooth
from pipeline.build.passes.weight_only import quantize_weight_only
from pipeline.build.stages.optimize import OptimizeConfig
from tests.build.passes.conftest import op_counts


def _run(path, **feeds):
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


X = np.random.default_rng(1).standard_normal((2, 5, 64)).astype(np.float32)


def test_last_token_logits_slices_before_the_head(two_matmuls, tmp_path):
    graph = onnx.load(str(two_matmuls))
    assert last_token_logits(graph) is True
    onnx.save(graph, str(tmp_path / "sliced.onnx"))
    assert op_counts(tmp_path / "sliced.onnx")["Slice"] == 1
    np.testing.assert_allclose(_run(tmp_path / "sliced.onnx", x=X), _run(two_matmuls, x=X)[:, -1:], atol=1e-5)


def test_fused_from_onnx_makes_skip_layer_norm_where_ort_knows_the_family(residual_norm, tmp_path):
    feeds = {"a": X, "b": X[::-1].copy()}
    (tmp_path / "f").mkdir()
    (tmp_path / "g").mkdir()
    fused = fused_from_onnx(
        residual_norm, OptimizeConfig(fusions=True, level=1, model_type="bert", packed=False), tmp_path / "f"
    )
    assert fused["op_counts_after"] == {"SkipLayerNormalization": 1} and fused["passes"].startswith("onnxruntime")
    np.testing.assert_allclose(_run(tmp_path / "f" / "model.onnx", **feeds), _run(residual_norm, **feeds), atol=1e-4)
    generic = fused_from_onnx(
        residual_norm, OptimizeConfig(fusions=True, level=1, model_type="", packed=False), tmp_path / "g"
    )
    assert generic["passes"] == "generic" and "SkipLayerNormalization" not in generic["op_counts_after"]


def test_fp16_from_fp32_keeps_sensitive_ops_in_fp32(residual_norm, two_matmuls, tmp_path):
    made = fp16_from_fp32(two_matmuls, tmp_path / "half.onnx")
    weights = onnx.load(str(tmp_path / "half.onnx")).graph.initializer
    assert {w.data_type for w in weights} == {onnx.TensorProto.FLOAT16} and made["casts"] == 2
    np.testing.assert_allclose(_run(tmp_path / "half.onnx", x=X), _run(two_matmuls, x=X), atol=2e-2)
    kept = fp16_from_fp32(residual_norm, tmp_path / "norm.onnx")
    assert kept["kept_fp32"] == {"LayerNormalization": 1}


def test_quantize_dynamic_makes_every_matmul_integer(two_matmuls, tmp_path):
    quantize_dynamic(two_matmuls, tmp_path / "int8.onnx", load_target("cpu-avx2-dynamic").quantize)
    counts = op_counts(tmp_path / "int8.onnx")
    assert counts["MatMulInteger"] == 2 and counts["MatMul"] == 0
    reference = _run(two_matmuls, x=X)
    assert np.abs(_run(tmp_path / "int8.onnx", x=X) - reference).max() < 0.2 * np.abs(reference).max()


def test_quantize_weight_only_makes_matmul_nbits_and_keeps_excluded_nodes(two_matmuls, tmp_path):
    settings = load_target("cpu-int8-weights").quantize
    quantize_weight_only(two_matmuls, tmp_path / "w8.onnx", settings)
    assert op_counts(tmp_path / "w8.onnx")["MatMulNBits"] == 2
    quantize_weight_only(two_matmuls, tmp_path / "w8x.onnx", settings, exclude=["first"])
    assert op_counts(tmp_path / "w8x.onnx")["MatMulNBits"] == 1 and op_counts(tmp_path / "w8x.onnx")["MatMul"] == 1
    assert np.abs(_run(tmp_path / "w8.onnx", x=X) - _run(two_matmuls, x=X)).max() < 0.05


def test_smooth_adds_one_mul_per_smoothed_matmul_and_keeps_the_function(two_matmuls, tmp_path):
    ranges = {"x": np.abs(X).max((0, 1)), "r": np.linspace(0.1, 8.0, 64).astype(np.float32)}  # by input tensor
    smoothed = smooth(two_matmuls, tmp_path / "smooth.onnx", ranges, ("MatMul",), alpha=0.5)
    assert sorted(smoothed) == ["first", "head"] and op_counts(tmp_path / "smooth.onnx")["Mul"] == 2
    np.testing.assert_allclose(_run(tmp_path / "smooth.onnx", x=X), _run(two_matmuls, x=X), rtol=1e-4, atol=1e-4)
