import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.build.table import build
from pipeline.errors import AccuracyError, ArtifactError, InputError, TargetError
from pipeline.runtime import load
from tests.conftest import CALIBRATION_TEXTS, write_target
from tests.tiny import make_checkpoint


def _timed_keys(tree) -> list[str]:
    """Keys anywhere in a JSON tree that hold a timing (latency, seconds, rates)."""
    if isinstance(tree, list):
        return [k for item in tree for k in _timed_keys(item)]
    if not isinstance(tree, dict):
        return []
    timed = [k for k in tree if any(w in k for w in ("latency", "seconds", "timings", "per_s", "_ms", "speed"))]
    return timed + [k for v in tree.values() for k in _timed_keys(v)]


def _build(checkpoint, texts_file, dirs, target="cpu-avx2-dynamic", **kwargs):
    calibration = dirs["cache_dir"].parent / "calibration.txt"  # shares no line with the held-out texts_file
    calibration.write_text("\n".join(CALIBRATION_TEXTS) + "\n")
    return build(checkpoint, target, validation=texts_file, calibration=calibration, **dirs, **kwargs)


def test_build_publishes_loadable_artifact(tiny_bert, texts_file, build_dirs):
    manifest = _build(tiny_bert, texts_file, build_dirs)
    published = manifest.published
    assert published.version == "v1" and not published.reused
    folder = build_dirs["artifacts_dir"] / "tiny-bert" / "v1" / "cpu-avx2-dynamic"
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "model.onnx", "report.json", "tokenizer.json"]
    saved = json.loads((folder / "manifest.json").read_text())
    for key in ("files", "source", "target_spec", "stages", "packages", "host", "validation"):
        assert saved[key], key
    figures = {k: v for k, v in saved.items() if k != "target_spec"}  # the target's settings are not figures
    assert not _timed_keys(figures), "build-host timings belong in report.json, not the immutable manifest"
    assert saved["source"]["digest"] == manifest.checkpoint.digest
    assert set(saved["stages"]) == {"checkpoint", "export", "optimize", "quantize", "validate", "tune"}
    assert saved["validation"]["cosine_min"] >= 0.99
    assert all(p.stat().st_mode & 0o222 == 0 for p in folder.iterdir())  # published files are read-only
    model = load(build_dirs["artifacts_dir"] / "tiny-bert" / "latest" / "cpu-avx2-dynamic")
    vectors = model.run(["hello world", "a second, longer sentence"])
    assert vectors.shape == (2, 32) and np.isfinite(vectors).all()


def test_build_reuses_every_stage_and_version_when_nothing_changed(tiny_bert, texts_file, build_dirs):
    _build(tiny_bert, texts_file, build_dirs)
    again = _build(tiny_bert, texts_file, build_dirs)
    assert [r.name for r in again.stages if not r.reused] == ["checkpoint"]  # the digest is always recomputed
    assert again.published.reused and again.published.version == "v1"
    assert sorted(p.name for p in (build_dirs["artifacts_dir"] / "tiny-bert").glob("v*")) == ["v1"]
    tokenizer = build_dirs["artifacts_dir"] / "tiny-bert" / "v1" / "cpu-avx2-dynamic" / "tokenizer.json"
    tokenizer.chmod(0o644)
    tokenizer.write_text(tokenizer.read_text().replace("[UNK]", "[UNKNOWN]"))  # damaged after publishing
    repaired = _build(tiny_bert, texts_file, build_dirs)
    assert not repaired.published.reused and repaired.published.version == "v2"
    assert load(build_dirs["artifacts_dir"] / "tiny-bert" / "latest" / "cpu-avx2-dynamic").run(["ok"]).shape == (1, 32)


def test_build_adds_version_and_moves_latest_when_target_changes(tiny_bert, texts_file, build_dirs, tmp_path):
    first = _build(tiny_bert, texts_file, build_dirs)
    target = write_target(tmp_path, "cpu-avx2-dynamic", accuracy__cosine_mean=0.999)
    second = _build(tiny_bert, texts_file, build_dirs, target=str(target))
    assert (first.published.version, second.published.version) == ("v1", "v2")
    assert [r.name for r in second.stages if r.reused] == ["export", "optimize"]
    latest = build_dirs["artifacts_dir"] / "tiny-bert" / "latest" / "cpu-avx2-dynamic"
    assert os.readlink(latest) == "../v2/cpu-avx2-dynamic"
    assert json.loads(
        (build_dirs["artifacts_dir"] / "tiny-bert" / "v1" / "cpu-avx2-dynamic" / "manifest.json").read_text()
    )


def test_build_publishes_nothing_when_validation_misses(tiny_bert, texts_file, build_dirs, tmp_path):
    target = write_target(tmp_path, "strict", accuracy__max_abs_diff=0.0, quantize__max_fp32_nodes=0)
    with pytest.raises(AccuracyError, match=r"max_abs_diff = .*needs <= 0\.0"):
        _build(tiny_bert, texts_file, build_dirs, target=str(target))
    assert not list((build_dirs["artifacts_dir"]).rglob("manifest.json"))


def test_build_refuses_unsupported_target(tiny_bert, texts_file, build_dirs, tmp_path):
    target = write_target(tmp_path, "someday", supported=False, unsupported_reason="no engine for it yet")
    with pytest.raises(TargetError, match="someday is not yet supported: no engine for it yet"):
        _build(tiny_bert, texts_file, build_dirs, target=str(target))


def test_build_cpu_avx512_target_builds_on_this_host(tiny_bert, texts_file, build_dirs):
    manifest = _build(tiny_bert, texts_file, build_dirs, target="cpu-avx512")
    assert manifest.published.path.endswith("v1/cpu-avx512")


def test_build_refuses_bad_artifact_name(tiny_bert, texts_file, build_dirs):
    with pytest.raises(InputError, match="artifact name '../x'"):
        _build(tiny_bert, texts_file, build_dirs, name="../x")


@pytest.mark.parametrize("task", ["sequence-classification", "token-classification"])
def test_build_classifier_tasks_publish_and_agree(task, texts_file, build_dirs, tmp_path):
    checkpoint = make_checkpoint(tmp_path / f"tiny-{task}", "bert", task)
    manifest = _build(checkpoint, texts_file, build_dirs)
    metrics = manifest.stage("validate").metrics
    assert metrics["top1_agreement"] >= 0.98
    model = load(manifest.published.path)
    out = model.run(["good", "this is bad news"])
    if task == "token-classification":
        assert [o.shape for o in out] == [(3, 3), (6, 3)]  # [CLS] good [SEP] / [CLS] this is bad news [SEP]
    else:
        assert out.shape == (2, 3)
    assert model.spec["labels"] == {"0": "neg", "1": "neu", "2": "pos"}


def test_build_pair_classifier_validates_on_text_pairs(texts_file, build_dirs, tmp_path):
    checkpoint = make_checkpoint(tmp_path / "tiny-pairs", "bert", "sequence-classification")
    pairs = tmp_path / "pairs.jsonl"
    rows = [
        {"text": t, "text_pair": u}
        for t, u in zip(
            texts_file.read_text().split("\n")[:-1:2], texts_file.read_text().split("\n")[1::2], strict=False
        )
    ]
    pairs.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    calibration = tmp_path / "calibration-pairs.jsonl"
    others = zip(CALIBRATION_TEXTS, reversed(CALIBRATION_TEXTS), strict=True)
    calibration.write_text("\n".join(json.dumps({"text": t, "text_pair": u}) for t, u in others) + "\n")
    manifest = build(checkpoint, "cpu-avx2-dynamic", validation=pairs, calibration=calibration, **build_dirs)
    assert manifest.stage("validate").metrics["top1_agreement"] >= 0.98
    out = load(manifest.published.path).run([("is it raining?", "yes, heavily"), "single text"])
    assert out.shape == (2, 3)


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "option, make, message",
    [
        ("validation", lambda p: p / "missing.txt", r"validation data .*missing.txt does not exist"),
        ("calibration", lambda p: _write(p / "empty.txt", "\n\n"), r"calibration data .*empty.txt holds no examples"),
        ("calibration", lambda p: _write(p / "bad.jsonl", "{not json\n"), r"bad.jsonl, line 1: not JSON"),
    ],
)
def test_build_checks_data_before_the_first_stage(option, make, message, tiny_bert, texts_file, build_dirs, tmp_path):
    data = {"validation": texts_file, "calibration": texts_file, option: make(tmp_path)}
    with pytest.raises(InputError, match=message):
        build(tiny_bert, "cpu-avx2-dynamic", **data, **build_dirs)
    assert not build_dirs["cache_dir"].exists()  # refused before any stage ran


def test_build_checks_the_artifacts_folder_before_the_first_stage(tiny_bert, texts_file, build_dirs, tmp_path):
    blocker = _write(tmp_path / "artifacts-file", "a file where the artifacts folder should be")
    with pytest.raises(ArtifactError, match=r"cannot publish to .*artifacts-file"):
        _build(tiny_bert, texts_file, {**build_dirs, "artifacts_dir": blocker}, target="cpu-avx2-dynamic")
    assert not build_dirs["cache_dir"].exists()


@pytest.mark.parametrize("option", ["artifacts_dir", "cache_dir"])
def test_build_refuses_folders_inside_a_published_artifact(option, tiny_bert, texts_file, published, tmp_path):
    before = sorted(p.name for p in published.iterdir())
    dirs = {"artifacts_dir": tmp_path / "a", "cache_dir": tmp_path / "c", option: published / "inside"}
    with pytest.raises(InputError, match="lies inside the published artifact") as err:
        build(tiny_bert, "cpu-fp32", validation=texts_file, calibration=texts_file, **dirs)
    assert "\n" not in str(err.value) and sorted(p.name for p in published.iterdir()) == before


@pytest.mark.parametrize("option", ["artifacts_dir", "cache_dir"])
def test_build_refuses_output_folders_inside_the_checkpoint(option, tiny_bert, texts_file, tmp_path):
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_bert, checkpoint)
    dirs = {"artifacts_dir": tmp_path / "a", "cache_dir": tmp_path / "c", option: checkpoint / "out"}
    with pytest.raises(InputError, match=r"lies inside the checkpoint folder .*Pass a folder outside") as err:
        build(checkpoint, "cpu-fp32", validation=texts_file, calibration=texts_file, **dirs)
    assert "\n" not in str(err.value) and not (checkpoint / "out").exists()


def test_build_refuses_to_publish_files_other_than_those_its_reused_verdict_measured(tiny_bert, texts_file, build_dirs):
    from pipeline.runtime.artifact import sha256_file

    first = _build(tiny_bert, texts_file, build_dirs, target="cpu-fp32")
    assert (
        first.stage("validate").metrics["measured_files"]
        == json.loads((Path(first.published.path) / "manifest.json").read_text())["validation"]["measured_files"]
    )
    # An edit to a cache entry that also fixes up its record (on shared storage, any node can).
    entry = Path(first.stage("export").output("tokenizer.json")).parent
    tokenizer = json.loads((entry / "tokenizer.json").read_text())
    tokenizer["normalizer"]["lowercase"] = not tokenizer["normalizer"]["lowercase"]
    (entry / "tokenizer.json").write_text(json.dumps(tokenizer))
    record = json.loads((entry / "record.json").read_text())
    record["files"]["tokenizer.json"] = sha256_file(entry / "tokenizer.json")
    (entry / "record.json").write_text(json.dumps(record))
    with pytest.raises(ArtifactError, match=r"measured on other files than those to publish \(tokenizer.json differ"):
        _build(tiny_bert, texts_file, build_dirs, target="cpu-fp32")
    assert not (build_dirs["artifacts_dir"] / "tiny-bert" / "v2").exists()


def test_build_removes_a_latest_link_left_by_a_killed_publish(tiny_bert, texts_file, build_dirs):
    first = _build(tiny_bert, texts_file, build_dirs, target="cpu-avx2-dynamic")
    latest = build_dirs["artifacts_dir"] / "tiny-bert" / "latest"
    stale = latest / ".cpu-avx2-dynamic.0123456789abcdef"
    stale.symlink_to(f"../{first.published.version}/cpu-avx2-dynamic")
    _build(tiny_bert, texts_file, build_dirs, target="cpu-avx2-dynamic")
    assert not stale.is_symlink() and sorted(p.name for p in latest.iterdir()) == ["cpu-avx2-dynamic"]
