import dataclasses
import json

from pipeline.build.inputs.targets import load_target
from pipeline.build.shape_buckets import bucket_plan, token_lengths
from pipeline.build.stages import publish
from pipeline.build.table import build
from pipeline.runtime import load
from pipeline.runtime.host import usable_cores
from pipeline.runtime.streams import SPLIT_MIN_ROWS
from tests.conftest import CALIBRATION_TEXTS, write_target

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
    buckets = metrics["shape_buckets"]["plan"] if metrics["shape_buckets"]["chosen"] else None
    expected = {**{k: best[k] for k in plan}, "split_min_rows": SPLIT_MIN_ROWS, "shape_buckets": buckets}
    assert metrics["best"] == expected
    with open(manifest.published.path + "/manifest.json") as handle:
        saved = json.load(handle)
    session = {k: v for k, v in metrics["best"].items() if k != "shape_buckets"}
    assert manifest.tuned().session == session and manifest.tuned().shape_buckets == buckets
    assert {k: saved["session"][k] for k in session} == session and "shape_buckets" not in saved["session"]
    assert not {"ms", "score", "tried"} & set(saved["session"])  # timings go to report.json, not the manifest
    model = load(manifest.published.path)
    assert model.session.get_session_options().intra_op_num_threads == metrics["best"]["intra_op_threads"]
    assert (model.streams is None) == (metrics["best"]["streams"] == 1)
    override = load(manifest.published.path, intra_op_threads=3)
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
    with open(manifest.published.path + "/manifest.json") as handle:
        saved = json.load(handle)
    assert saved["backend"] == "openvino"
    assert saved["session"]["streams"] == metrics["best"]["streams"]
    assert saved["session"]["split_min_rows"] == SPLIT_MIN_ROWS
    model = load(manifest.published.path)
    assert model.backend == "openvino" and (model.streams is None) == (metrics["best"]["streams"] == 1)


def test_tune_times_the_calibration_texts_bucket_plan_and_the_published_spec_carries_it_only_where_it_won(
    tiny_bert, texts_file, calibration_file, build_dirs, tmp_path
):
    target = write_target(tmp_path, "buckets", base="cpu-fp32", runtime__candidate_threads=[2])
    manifest = build(tiny_bert, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    record = manifest.stage("tune").metrics["shape_buckets"]
    tokenizer = manifest.stage("export").output("tokenizer.json")
    plan = bucket_plan(token_lengths(tokenizer, CALIBRATION_TEXTS), 128)
    assert record["plan"] == plan and plan[-1] == 128 and len(plan) > 1
    assert set(record["ms"]) == {"padded", "bucketed"}
    assert all(set(ms) == {"mixed_32", "request_stream"} and min(ms.values()) > 0 for ms in record["ms"].values())
    assert record["chosen"] == (record["score"]["bucketed"] < record["score"]["padded"])
    best = manifest.stage("tune").metrics["best"]
    assert best["shape_buckets"] == (plan if record["chosen"] else None)
    with open(manifest.published.path + "/manifest.json") as handle:
        saved = json.load(handle)
    assert saved["model"].get("shape_buckets") == best["shape_buckets"]  # the tune's record, whichever won
    assert load(manifest.published.path).spec.get("shape_buckets") == best["shape_buckets"]
    # Either outcome, as publish writes it: the plan goes to the model spec, never the session or the identity.
    for chosen in (plan, None):
        tune = next(r for r in manifest.stages if r.name == "tune")
        metrics = {**tune.metrics, "best": {**tune.metrics["best"], "shape_buckets": chosen}}
        stages = tuple(dataclasses.replace(r, metrics=metrics) if r is tune else r for r in manifest.stages)
        other = dataclasses.replace(manifest, stages=stages)
        content = publish._content(other, load_target(str(target)), {})
        assert "shape_buckets" not in content["model"]
        assert publish._model_spec(other, content).get("shape_buckets") == chosen
        tuned = other.tuned()
        assert tuned.shape_buckets == chosen and "shape_buckets" not in tuned.session
        assert tuned.session == {k: v for k, v in best.items() if k != "shape_buckets"}


def test_tune_workloads_mixed_batch_spans_the_texts_lengths_when_there_are_more_texts_than_rows():
    from pipeline.build.stages.tune import workloads

    texts = ["x" * n for n in range(100, 0, -1)]  # 100 texts, longest first
    mixed = workloads(texts, 4)["mixed_4"]
    assert [len(t) for t in mixed] == [1, 26, 51, 76]  # not the 4 shortest
    few = workloads(texts[:3], 8)["mixed_8"]
    assert sorted(set(few)) == sorted(texts[:3], key=len) and len(few) == 8  # every text, repeated
