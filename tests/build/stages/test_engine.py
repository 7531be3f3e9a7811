import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from pipeline.build.inputs.targets import load_target
from pipeline.build.stages import engine
from pipeline.build.table import build
from pipeline.errors import ArtifactError, InputError, TargetError
from pipeline.runtime import EngineFallbackWarning, load
from pipeline.runtime.engine_cache import check_engine, engine_cache_key
from pipeline.runtime.host import gpu_host
from tests.conftest import write_target

SPEC = {"inputs": ["input_ids", "attention_mask"], "max_length": 256}


def test_profiles_cap_sequence_at_model_limit():
    profile = engine.profiles(load_target("a100"), SPEC)
    assert set(profile) == {"input_ids", "attention_mask"}
    assert profile["input_ids"] == {"min": [1, 1], "opt": [8, 128], "max": [32, 256]}
    short = engine.profiles(load_target("a100"), {**SPEC, "max_length": 64})
    assert short["input_ids"]["opt"] == [8, 64] and short["input_ids"]["max"] == [32, 64]


def test_profiles_refuse_out_of_order(tmp_path):
    target = load_target(write_target(tmp_path, "bad", base="a100", tensorrt__opt_batch=64))
    with pytest.raises(TargetError, match=r"batch profile min 1 <= opt 64 <= max 32 does not hold"):
        engine.profiles(target, SPEC)


def test_engine_cache_key_changes_with_each_part():
    key = engine_cache_key("8.0", "10.3.0", "abc")
    assert key == "sm80-trt10.3.0-abc"
    assert (
        len(
            {
                key,
                engine_cache_key("9.0", "10.3.0", "abc"),
                engine_cache_key("8.0", "11.0", "abc"),
                engine_cache_key("8.0", "10.3.0", "abd"),
            }
        )
        == 4
    )
    assert engine.profile_hash(engine.profiles(load_target("a100"), SPEC)) != engine.profile_hash(
        engine.profiles(load_target("a100"), {**SPEC, "max_length": 128})
    )


def test_check_engine_refuses_other_architecture_naming_both():
    built = {"compute_capability": "8.0", "tensorrt": "10.3.0"}
    check_engine(built, "8.0", "10.3.0")
    both = r"built for compute capability 8\.0 with TensorRT 10\.3\.0, but this host has compute capability 9\.0"
    with pytest.raises(ArtifactError, match=both):
        check_engine(built, "9.0", "10.3.0")
    with pytest.raises(ArtifactError, match="TensorRT 11.0"):
        check_engine(built, "8.0", "11.0")


@pytest.mark.parametrize(
    "target", ["a100", pytest.param("h100", marks=pytest.mark.slow), pytest.param("l4", marks=pytest.mark.slow)]
)
def test_build_gpu_target_publishes_validated_fp16_graph_with_pending_engine(
    target, tiny_bert, texts_file, calibration_file, build_dirs
):
    manifest = build(tiny_bert, target, validation=texts_file, calibration=calibration_file, **build_dirs)
    published = json.loads(open(manifest.published.path + "/manifest.json").read())
    assert published["engine"]["status"] == "pending" and published["engine"]["reason"]
    assert published["engine"]["compute_capability"] == load_target(target).tensorrt.compute_capability
    graph = onnx.load(manifest.published.path + "/model.onnx")
    ops = {n.op_type for n in graph.graph.node}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    weights = {i.data_type for i in graph.graph.initializer if len(i.dims) == 2 and i.data_type in floats}
    assert weights == {onnx.TensorProto.FLOAT16}  # matrices in fp16
    assert "LayerNormalization" in ops and not ops & {"Attention", "SkipLayerNormalization", "BiasGelu"}
    assert manifest.stage("validate").metrics["cosine_min"] >= 0.99
    assert "tune" not in [r.name for r in manifest.stages] and "quantize" not in [r.name for r in manifest.stages]
    assert manifest.published.engines == []
    with pytest.warns(EngineFallbackWarning, match="TensorRT is not installed on this host; running model.onnx"):
        model = load(manifest.published.path)
    assert model.backend == "onnxruntime" and model.run(["runs on the CPU provider too"]).shape == (1, 32)
    int8 = load_target(target).tensorrt.int8
    assert ("model.int8.onnx" in published["files"]) == int8 == ("int8_qdq" in published["validation"])


def test_build_int8_target_publishes_symmetric_qdq_graph_beside_fp16(
    tiny_bert, texts_file, calibration_file, build_dirs
):
    manifest = build(tiny_bert, "l4", validation=texts_file, calibration=calibration_file, **build_dirs)
    path = manifest.published.path
    graph = onnx.load(path + "/model.int8.onnx")
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("QuantizeLinear") > 0 and ops.count("DequantizeLinear") > ops.count("QuantizeLinear")
    assert "MatMulInteger" not in ops and "QLinearMatMul" not in ops  # Q/DQ format: TensorRT fuses it itself
    initializers = {i.name: i for i in graph.graph.initializer}
    zero_points = [initializers[n.input[2]] for n in graph.graph.node if n.op_type == "QuantizeLinear"]
    assert zero_points and all(z.data_type == onnx.TensorProto.INT8 for z in zero_points)
    assert all(not numpy_helper.to_array(z).any() for z in zero_points)  # symmetric: TensorRT's requirement
    metrics = manifest.stage("validate").metrics
    assert metrics["int8_qdq"]["cosine_min"] >= 0.99 and metrics["cosine_min"] >= 0.99
    assert manifest.stage("engine").metrics["graphs"] == ["model.int8.onnx", "model.onnx"]
    with pytest.warns(EngineFallbackWarning):
        assert load(path, graph="model.int8.onnx").run(["int8 on the CPU provider"]).shape == (1, 32)
    with pytest.raises(InputError, match=r"has no graph 'model.fp8.onnx'; its graphs: model.int8.onnx, model.onnx"):
        load(path, graph="model.fp8.onnx")


def test_load_on_tensorrt_backend_without_gpu_says_why(tiny_bert, texts_file, build_dirs, published):
    manifest = build(tiny_bert, "a100", validation=texts_file, calibration=texts_file, **build_dirs)
    with pytest.raises(ArtifactError, match="cannot run .* on TensorRT: TensorRT is not installed on this host"):
        load(manifest.published.path, backend="tensorrt")
    with pytest.raises(
        ArtifactError, match=r"is built for cpu-avx2-dynamic \(onnxruntime\); it has no TensorRT engine"
    ):
        load(published, backend="tensorrt")
    model = load(manifest.published.path, backend="onnxruntime")  # no warning: asked for
    assert model.backend == "onnxruntime"


def test_load_builds_a_missing_engine_only_with_the_builder_it_is_passed(
    tiny_bert, texts_file, build_dirs, monkeypatch
):
    # The engine stage is imported above and registers nothing: build_engine=True alone says what to pass.
    manifest = build(tiny_bert, "a100", validation=texts_file, calibration=texts_file, **build_dirs)
    path = manifest.published.path
    monkeypatch.setattr(
        "pipeline.runtime.host.gpu_host", lambda: ({"compute_capability": "8.0", "tensorrt": "10.3"}, "")
    )
    with pytest.raises(
        ArtifactError, match=r"pass build_engine=pipeline\.build\.stages\.engine\.build_artifact_engine"
    ):
        load(path, backend="tensorrt", build_engine=True)
    calls = []
    with pytest.raises(ArtifactError, match="no engine of model.onnx for this host"):
        load(path, backend="tensorrt", build_engine=lambda artifact, graph: calls.append((artifact, graph)))
    assert calls == [(Path(path).resolve(), "model.onnx")]


def test_engine_command_refuses_without_gpu_naming_the_reason(tiny_bert, texts_file, build_dirs):
    manifest = build(tiny_bert, "a100", validation=texts_file, calibration=texts_file, **build_dirs)
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "engine", manifest.published.path], capture_output=True, text=True
    )
    assert out.returncode == 9
    assert "cannot build the engine of" in out.stderr and "TensorRT is not installed on this host" in out.stderr


def test_decoder_on_gpu_target_validates_fp16_and_runs_on_onnxruntime(tiny_gpt2, texts_file, build_dirs):
    manifest = build(tiny_gpt2, "a100", validation=texts_file, calibration=texts_file, **build_dirs)
    engine_metrics = manifest.stage("engine").metrics
    assert engine_metrics["status"] == "not built" and "KV-cache decoders" in engine_metrics["reason"]
    assert manifest.stage("validate").metrics["top1_agreement"] >= 0.98
    with pytest.warns(EngineFallbackWarning, match="KV-cache decoders"):
        model = load(manifest.published.path)
    assert len(model.generate(["hello"], max_new_tokens=4, eos=False)[0].token_ids) == 4


@pytest.mark.gpu
def test_engine_builds_validates_and_loads_on_gpu_host(tiny_bert, texts_file, calibration_file, build_dirs):
    host, reason = gpu_host()
    if host is None:
        pytest.skip(f"no GPU engine build here: {reason}")
    target = next(
        (t for t in ("a100", "h100", "l4") if load_target(t).tensorrt.compute_capability == host["compute_capability"]),
        None,
    )
    if target is None:
        pytest.skip(f"no target for compute capability {host['compute_capability']} ({host['gpu']})")
    manifest = build(tiny_bert, target, validation=texts_file, calibration=calibration_file, **build_dirs)
    metrics = manifest.stage("engine").metrics
    assert metrics["status"] == "built" and metrics["host"]["tensorrt"] == host["tensorrt"]
    assert all(e["validation"]["cosine_min"] >= 0.99 for e in metrics["engines"].values())
    model = load(manifest.published.path, backend="tensorrt")
    reference = load(manifest.published.path, backend="onnxruntime", providers=["CPUExecutionProvider"])
    texts = ["an engine on the GPU", "and a second, longer sentence for the batch"]
    assert model.backend == "tensorrt"
    np.testing.assert_allclose(model.run(texts), reference.run(texts), atol=2e-2)
