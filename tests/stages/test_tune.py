import json

from pipeline.build import build
from pipeline.runtime import load
from pipeline.runtime.host import usable_cores
from pipeline.runtime.streams import SPLIT_MIN_ROWS

from ..conftest import write_target

MODES = ("sequential", "parallel")


def test_tune_records_fastest_candidate_and_loader_uses_it(
    tiny_bert, texts_file, calibration_file, build_dirs, tmp_path
):
    target = write_target(
        tmp_path,
        "tuned",
        base="cpu-avx2-dynamic",
        runtime__candidate_threads=[1, 2],
        runtime__candidate_execution_modes=list(MODES),
    )
    manifest = build(tiny_bert, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    metrics = manifest.stage("tune").metrics
    streams = (1, 2) if usable_cores() >= 2 else (1,)
    expected = {(1, m, 1) for m in MODES} | {(2, m, s) for m in MODES for s in streams}
    assert {(t["intra_op_threads"], t["execution_mode"], t["streams"]) for t in metrics["tried"]} == expected
    assert all(set(t["ms"]) == {"batch_1", "batch_32", "mixed_32"} for t in metrics["tried"])
    best = min(metrics["tried"], key=lambda t: t["score"])
    plan = ("intra_op_threads", "execution_mode", "streams")
    assert metrics["best"] == {**{k: best[k] for k in plan}, "split_min_rows": SPLIT_MIN_ROWS}
    with open(manifest.published["path"] + "/manifest.json") as handle:
        saved = json.load(handle)
    assert {k: saved["session"][k] for k in metrics["best"]} == metrics["best"]
    assert not {"ms", "score", "tried"} & set(saved["session"])  # timings go to report.json, not the manifest
    model = load(manifest.published["path"])
    assert model.session.get_session_options().intra_op_num_threads == metrics["best"]["intra_op_threads"]
    assert (model.streams is None) == (metrics["best"]["streams"] == 1)
    override = load(manifest.published["path"], intra_op_threads=3)
    assert override.session.get_session_options().intra_op_num_threads == 3


def test_tune_never_tries_more_threads_than_the_host_has_and_load_caps_a_tuned_count(
    tiny_bert, texts_file, calibration_file, build_dirs, tmp_path
):
    from pipeline.runtime.load import session_settings

    target = write_target(tmp_path, "many", base="cpu-avx2-dynamic", runtime__candidate_threads=[1, 1024])
    manifest = build(tiny_bert, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    metrics = manifest.stage("tune").metrics
    assert [t["intra_op_threads"] for t in metrics["tried"]] == [1] and metrics["host_cores"] == usable_cores()
    built_elsewhere = {"session": {"intra_op_threads": usable_cores() + 8}}
    assert session_settings(built_elsewhere, None)["intra_op_threads"] == usable_cores()
    assert session_settings(built_elsewhere, 3)["intra_op_threads"] == 3


def test_tune_times_streams_for_an_openvino_artifact_and_the_manifest_session_carries_them(
    tiny_bert, texts_file, calibration_file, build_dirs, tmp_path
):
    openvino_fp32 = [{"name": "openvino-fp32", "engine": "openvino", "precision": "fp32"}]
    target = write_target(
        tmp_path, "ov-tuned", base="cpu-avx2", candidates=openvino_fp32, runtime__candidate_threads=[2]
    )
    manifest = build(tiny_bert, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    metrics = manifest.stage("tune").metrics
    assert metrics["backend"] == "openvino"
    streams = [1, 2] if usable_cores() >= 2 else [1]
    assert sorted(t["streams"] for t in metrics["tried"]) == streams
    with open(manifest.published["path"] + "/manifest.json") as handle:
        saved = json.load(handle)
    assert saved["backend"] == "openvino"
    assert saved["session"]["streams"] == metrics["best"]["streams"]
    assert saved["session"]["split_min_rows"] == SPLIT_MIN_ROWS
    model = load(manifest.published["path"])
    assert model.backend == "openvino" and (model.streams is None) == (metrics["best"]["streams"] == 1)
