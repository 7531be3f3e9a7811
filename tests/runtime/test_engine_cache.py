"""The engine cache beside an artifact: lookup by GPU architecture and TensorRT version, and its refusals.

These run on real files with real sha256s; the plans are placeholder bytes, as building one needs a GPU (see the
gpu-marked test in test_engine.py)."""

import json

import pytest

from pipeline.errors import ArtifactError
from pipeline.runtime.engine_cache import (
    cached_engines,
    engine_cache_dir,
    engine_for_host,
    engine_name,
    find_engine,
    write_engine,
)

GRAPH_SHA = "a" * 64
MANIFEST = {"engine": {"profile_hash": "0123456789abcdef"}, "files": {"model.onnx": GRAPH_SHA}}
A100 = {"compute_capability": "8.0", "tensorrt": "10.3.0", "gpu": "NVIDIA A100"}
H100 = {"compute_capability": "9.0", "tensorrt": "10.3.0", "gpu": "NVIDIA H100"}


def _cache(tmp_path, host=A100, graph_sha=GRAPH_SHA):
    name = engine_name(host["compute_capability"], host["tensorrt"], "0123456789abcdef", "model.onnx")
    record = {"graph": "model.onnx", "graph_sha256": graph_sha, "profile_hash": "0123456789abcdef", **host}
    write_engine(tmp_path, name, b"plan bytes", record)
    return name


def test_engine_name_keys_architecture_version_profile_and_graph():
    assert engine_name("8.0", "10.3.0", "abc", "model.onnx") == "sm80-trt10.3.0-abc-model"
    assert engine_name("8.9", "11.0", "abc", "model.int8.onnx") == "sm89-trt11.0-abc-int8"


def test_engine_cache_dir_sits_beside_the_versions(tmp_path):
    artifact = tmp_path / "m" / "v3" / "a100"
    artifact.mkdir(parents=True)
    assert engine_cache_dir(artifact, {"version": "v3", "target": "a100"}) == tmp_path / "m" / "engines" / "v3-a100"


def test_find_engine_returns_the_plan_for_this_host(tmp_path):
    name = _cache(tmp_path)
    record = json.loads((tmp_path / f"{name}.json").read_text())
    assert record["name"] == name and len(record["plan_sha256"]) == 64
    assert not list(tmp_path.glob(".*"))  # no scratch files left
    assert find_engine(tmp_path, MANIFEST, "model.onnx", A100) == (tmp_path / f"{name}.plan", [])


def test_engine_for_host_refuses_other_architecture_naming_both(tmp_path):
    _cache(tmp_path, host=A100)
    plan, reason = engine_for_host(tmp_path, MANIFEST, "model.onnx", H100)
    assert plan is None
    assert "built for compute capability 8.0 with TensorRT 10.3.0, but this host has compute capability 9.0" in reason
    plan, reason = engine_for_host(tmp_path / "empty", MANIFEST, "model.onnx", H100)
    assert plan is None and "no engine of model.onnx for this host (compute capability 9.0" in reason


def test_find_engine_refuses_a_changed_plan(tmp_path):
    name = _cache(tmp_path)
    (tmp_path / f"{name}.plan").write_bytes(b"tampered")
    with pytest.raises(ArtifactError, match=r"\.plan is missing or does not match its sha256"):
        find_engine(tmp_path, MANIFEST, "model.onnx", A100)


def test_find_engine_refuses_an_engine_of_another_graph(tmp_path):
    _cache(tmp_path, graph_sha="b" * 64)
    with pytest.raises(ArtifactError, match="was built from another model.onnx than this artifact's"):
        find_engine(tmp_path, MANIFEST, "model.onnx", A100)


def test_find_engine_takes_a_hardware_compatible_engine_built_on_another_ampere(tmp_path):
    name = _cache(tmp_path, host={**A100, "hardware_compatibility": "ampere_plus"})
    assert find_engine(tmp_path, MANIFEST, "model.onnx", H100) == (tmp_path / f"{name}.plan", [])
    older = {"compute_capability": "7.5", "tensorrt": "10.3.0", "gpu": "T4"}
    plan, reason = engine_for_host(tmp_path, MANIFEST, "model.onnx", older)
    assert plan is None and "compute capability 7.5" in reason


def test_records_that_do_not_name_their_own_file_or_a_capability_are_skipped_not_followed(tmp_path):
    compatible = {**A100, "hardware_compatibility": "ampere_plus"}
    record = {"graph": "model.onnx", "graph_sha256": GRAPH_SHA, "profile_hash": "0123456789abcdef", **compatible}
    write_engine(tmp_path, "copied", b"plan bytes", record)  # this host's capability, under another file name
    write_engine(tmp_path, "odd", b"plan bytes", {**record, "compute_capability": "eight"})
    write_engine(tmp_path, "renamed", b"plan bytes", {**record, "compute_capability": "8.6"})
    (tmp_path / "renamed.json").rename(tmp_path / "elsewhere.json")
    assert cached_engines(tmp_path, MANIFEST, "model.onnx") == [
        (json.loads((tmp_path / "copied.json").read_text()), tmp_path / "copied.plan")
    ]
    plan, others = find_engine(tmp_path, MANIFEST, "model.onnx", A100)  # once looked itself up again, forever
    assert plan is None and [r["name"] for r in others] == ["copied"]
    plan, reason = engine_for_host(tmp_path, MANIFEST, "model.onnx", H100)
    assert plan is None and reason.startswith("no engine of model.onnx for this host (compute capability 9.0")
