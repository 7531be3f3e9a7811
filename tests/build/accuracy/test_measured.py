"""pipeline/build/accuracy/measured.py: validation takes the search's held-out measurement of the same graph, on
the same texts with the same settings, from the same process; anything that could change the result measures again."""

import dataclasses
import json

import onnx
import pytest

from pipeline.build.accuracy.measured import measured, measurement_key
from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Manifest
from pipeline.build.stages import checkpoint, export
from pipeline.build.stages.validate import validate_artifact
from tests.tiny import make_checkpoint


def test_validation_reuses_the_search_held_out_measurement_which_a_fresh_one_equals(published_openvino, texts_file):
    published_manifest = json.loads((published_openvino / "manifest.json").read_text())
    validation = published_manifest["validation"]
    assert validation["measured_by"] == "search held-out check"  # built in this process
    chosen = next(row for row in published_manifest["candidates"] if row.get("chosen"))
    for name in ("cosine_min", "cosine_mean", "max_abs_diff", "batch_spread_max_abs"):
        assert validation[name] == chosen["held_out"][name]
    fresh = validate_artifact(published_openvino, texts_file)  # the published artifact, loaded and measured again
    for name in ("cosine_min", "cosine_mean", "max_abs_diff"):
        assert fresh[name] == pytest.approx(validation[name], abs=1e-6)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("measured")
    manifest = Manifest("m", str(make_checkpoint(root / "bert")), str(root / "cache"), "", "", "")
    for stage in (checkpoint.run, export.run):
        manifest = stage(manifest, load_target("cpu-avx2"))
    return manifest


def test_the_key_changes_with_what_can_change_a_result_and_only_with_that(exported, tmp_path):
    target = load_target("cpu-avx2")
    graph = exported.stage("export").output("model.onnx")

    def key(graph=graph, session=None, texts=("a", "b"), target=target):
        return measurement_key(exported, target, graph, "onnxruntime", session or {}, list(texts), "embedding")

    assert key() == key(session={"allow_spinning": False})  # thread spinning changes the speed only
    assert key() != key(session={"intra_op_threads": 1})
    assert key() != key(texts=("a", "c"))
    assert key() != key(target=dataclasses.replace(target, shapes=dataclasses.replace(target.shapes, batch_size=4)))
    changed = onnx.load(str(graph))
    changed.doc_string = "another graph"
    onnx.save(changed, str(tmp_path / "model.onnx"))
    assert key() != key(graph=tmp_path / "model.onnx")


def test_a_measurement_is_answered_once_and_as_a_copy():
    calls = []

    def compute():
        calls.append(1)
        return {"cosine_min": 0.99, "rows": [1]}

    first, reused_first = measured("test-key", compute)
    first["rows"].append(2)
    second, reused_second = measured("test-key", compute)
    assert (reused_first, reused_second, len(calls)) == (False, True, 1)
    assert second == {"cosine_min": 0.99, "rows": [1]}
