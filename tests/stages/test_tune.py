import json

from pipeline.build import build
from pipeline.runtime import load

from ..conftest import write_target


def test_tune_records_fastest_candidate_and_loader_uses_it(
    tiny_bert, texts_file, calibration_file, build_dirs, tmp_path
):
    target = write_target(
        tmp_path,
        "tuned",
        base="cpu-avx2-dynamic",
        runtime__candidate_threads=[1, 2],
        runtime__candidate_execution_modes=["sequential", "parallel"],
    )
    manifest = build(tiny_bert, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    metrics = manifest.stage("tune").metrics
    assert len(metrics["tried"]) == 4
    best = min(metrics["tried"], key=lambda t: t["score"])
    assert metrics["best"] == {k: best[k] for k in ("intra_op_threads", "execution_mode")}
    with open(manifest.published["path"] + "/manifest.json") as handle:
        saved = json.load(handle)
    assert saved["session"]["intra_op_threads"] == metrics["best"]["intra_op_threads"]
    model = load(manifest.published["path"])
    assert model.session.get_session_options().intra_op_num_threads == metrics["best"]["intra_op_threads"]
    override = load(manifest.published["path"], intra_op_threads=3)
    assert override.session.get_session_options().intra_op_num_threads == 3


def test_tune_never_tries_more_threads_than_the_host_has_and_load_caps_a_tuned_count(
    tiny_bert, texts_file, calibration_file, build_dirs, tmp_path
):
    from pipeline.runtime.host import usable_cores
    from pipeline.runtime.load import session_settings

    target = write_target(tmp_path, "many", base="cpu-avx2-dynamic", runtime__candidate_threads=[1, 1024])
    manifest = build(tiny_bert, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    metrics = manifest.stage("tune").metrics
    assert [t["intra_op_threads"] for t in metrics["tried"]] == [1] and metrics["host_cores"] == usable_cores()
    built_elsewhere = {"session": {"intra_op_threads": usable_cores() + 8}}
    assert session_settings(built_elsewhere, None)["intra_op_threads"] == usable_cores()
    assert session_settings(built_elsewhere, 3)["intra_op_threads"] == 3
