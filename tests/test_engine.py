import json

import onnx
import pytest

from pipeline import engine
from pipeline.build import build
from pipeline.errors import ArtifactError, TargetError
from pipeline.runtime import check_engine, engine_cache_key, load
from pipeline.targets import load_target

from .conftest import write_target

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
    assert len({key, engine_cache_key("9.0", "10.3.0", "abc"), engine_cache_key("8.0", "11.0", "abc"),
                engine_cache_key("8.0", "10.3.0", "abd")}) == 4  # fmt: skip
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


@pytest.mark.parametrize("target", ["a100", "h100", "l4"])
def test_build_gpu_target_publishes_validated_fp16_graph_with_pending_engine(target, tiny_bert, texts_file, build_dirs):
    manifest = build(tiny_bert, target, validation=texts_file, calibration=texts_file, **build_dirs)
    published = json.loads(open(manifest.published["path"] + "/manifest.json").read())
    assert published["engine"]["status"] == "pending" and published["engine"]["reason"]
    assert published["engine"]["compute_capability"] == load_target(target).tensorrt.compute_capability
    graph = onnx.load(manifest.published["path"] + "/model.onnx")
    ops = {n.op_type for n in graph.graph.node}
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    weights = {i.data_type for i in graph.graph.initializer if len(i.dims) == 2 and i.data_type in floats}
    assert weights == {onnx.TensorProto.FLOAT16}  # matrices in fp16
    assert "LayerNormalization" in ops and not ops & {"Attention", "SkipLayerNormalization", "BiasGelu"}
    assert manifest.stage("validate").metrics["cosine_min"] >= 0.99
    assert "tune" not in [r.name for r in manifest.stages] and "quantize" not in [r.name for r in manifest.stages]
    out = load(manifest.published["path"]).run(["runs on the CPU provider too"])
    assert out.shape == (1, 32)


@pytest.mark.gpu
def test_engine_builds_on_gpu_host():
    host, reason = engine.gpu_host()
    if host is None:
        pytest.skip(f"no GPU engine build here: {reason}")
    pytest.skip("building the engine on a GPU host is not implemented yet")
