"""The engine and precision search: a table of candidates, the fastest that passes, an honest all-fail, OpenVINO
artifacts that load and match PyTorch, and the host's kernel class on record."""

import json
import subprocess
import sys
import types

import numpy as np
import pytest

from pipeline.build.accuracy.reference import checkpoint_from_source, pytorch_outputs
from pipeline.build.inputs.targets import load_target, native_target
from pipeline.build.stages.publish import TIMED
from pipeline.build.stages.search import _no_winner, choose
from pipeline.errors import AccuracyError, ArtifactError, TargetError
from pipeline.runtime import load
from pipeline.runtime.host import cpu_flags, kernel_class
from tests.build.stages.conftest import assert_chosen_is_the_fastest_that_passed_held_out, build_into
from tests.conftest import REPO, SMALL_TEXTS, write_target

OPENVINO_FP32 = [{"name": "openvino-fp32", "engine": "openvino", "precision": "fp32"}]


@pytest.fixture(scope="module")
def searched(tiny_bert, texts_file, calibration_file, tmp_path_factory):
    """The tiny BERT built for cpu-avx2: every candidate of the target searched."""
    return build_into(tiny_bert, "cpu-avx2", texts_file, calibration_file, tmp_path_factory.mktemp("search"))


def test_search_reports_every_candidate_and_chooses_the_fastest_that_passed(searched):
    metrics = searched.stage("search").metrics
    rows = metrics["candidates"]
    assert [r["name"] for r in rows] == [c.name for c in load_target("cpu-avx2").family_candidates("encoder")]
    passed = [r for r in rows if r["status"] == "passed"]
    assert passed and all(set(r["latency_ms"]) == {"batch_1", "batch_32", "mixed_32"} for r in passed)
    assert all(r["latency_ms"] is None for r in rows if r["status"] != "passed")  # only what could win is timed
    assert all(r["build_seconds"] > 0 and r["timing_seconds"] > 0 for r in passed)
    assert_chosen_is_the_fastest_that_passed_held_out(rows)
    assert metrics["chosen"] == next(r["name"] for r in rows if r["chosen"])
    folder = REPO / searched.published.path
    published = json.loads((folder / "manifest.json").read_text())
    untimed = [{k: v for k, v in r.items() if k not in TIMED} for r in rows]
    assert published["candidates"] == untimed and published["backend"] == metrics["backend"]
    assert published["host"]["kernel_class"] == kernel_class()


def test_search_timings_go_to_the_report_with_their_spread_host_and_date(searched):
    report = json.loads((REPO / searched.published.path / "report.json").read_text())["build_speed"]
    assert report["host"]["kernel_class"] == kernel_class() and report["search"]["measured_at"]
    timed = {n: t for n, t in report["search"]["candidates"].items() if t["latency_ms"]}
    assert timed
    for figures in timed.values():
        for shape, median in figures["latency_ms"].items():
            low, high = figures["latency_range_ms"][shape]
            assert 0 < low <= median <= high


def test_choose_prefers_a_slower_passing_candidate_to_a_faster_failing_one():
    rows = [
        {"name": "fast-int8", "status": "missed", "latency_ms": {"b1": 1.0, "b32": 10.0}},
        {"name": "fp32", "status": "passed", "latency_ms": {"b1": 2.0, "b32": 30.0}},
        {"name": "bf16", "status": "passed", "latency_ms": {"b1": 1.5, "b32": 20.0}},
        {"name": "bf16-off", "status": "skipped", "latency_ms": None},
    ]
    assert choose(rows)["name"] == "bf16"
    assert [r["chosen"] for r in rows] == [False, False, True, False]
    assert choose([{**rows[0]}]) is None


def test_choose_falls_back_to_the_next_fastest_that_passes_on_held_out_text(tmp_path):
    rows = [
        {"name": "int8", "status": "passed", "latency_ms": {"b1": 1.0}},
        {"name": "bf16", "status": "passed", "latency_ms": {"b1": 2.0}},
        {"name": "fp32", "status": "passed", "latency_ms": {"b1": 3.0}},
    ]
    asked = []

    def held_out(name):
        asked.append(name)
        return {"cosine_min": 0.98 if name == "int8" else 0.9999}, ["cosine_min 0.98 < 0.995"] if name == "int8" else []

    assert choose(rows, held_out)["name"] == "bf16"
    assert asked == ["int8", "bf16"] and "held_out" not in rows[2]
    assert rows[0]["held_out"] == {"status": "missed", "missed": ["cosine_min 0.98 < 0.995"], "cosine_min": 0.98}
    assert [r["chosen"] for r in rows] == [False, True, False]
    none_pass = [{**r} for r in rows]
    assert choose(none_pass, lambda name: ({}, ["cosine_min 0.9 < 0.995"])) is None
    manifest = types.SimpleNamespace(model_name="m", validation_path=str(tmp_path / "v.txt"))
    message = str(_no_winner(manifest, load_target("cpu-avx2"), none_pass))
    assert "passed on the development split missed on the held-out text" in message
    assert "int8: cosine_min 0.9 < 0.995; bf16: " in message and "Nothing was published" in message


def test_build_fails_naming_the_closest_candidate_when_none_passes(tiny_bert, texts_file, calibration_file, tmp_path):
    target = write_target(tmp_path, "strict", base="cpu-avx2", accuracy__max_abs_diff=0.0)
    with pytest.raises(AccuracyError, match=r"no candidate of target strict passes .* the closest was [a-z0-9-]+: "):
        build_into(tiny_bert, target, texts_file, calibration_file, tmp_path)
    assert not list((tmp_path / "a").rglob("manifest.json"))


def test_openvino_artifact_loads_and_matches_pytorch(tiny_bert, texts_file, calibration_file, tmp_path):
    target = write_target(tmp_path, "ov", base="cpu-avx2", candidates=OPENVINO_FP32)
    manifest = build_into(tiny_bert, target, texts_file, calibration_file, tmp_path)
    folder = manifest.published.path
    published = json.loads(open(f"{folder}/manifest.json").read())
    assert published["backend"] == "openvino" and published["graph"] == "model.xml"
    assert {"model.xml", "model.bin"} <= set(published["files"])
    model = load(folder)
    assert model.backend == "openvino"
    expected = pytorch_outputs(checkpoint_from_source(published["source"]), SMALL_TEXTS)
    got = model.run(SMALL_TEXTS)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() > 0.9999
    code = f"import sys; sys.modules['openvino'] = None; from pipeline.runtime import load; load({folder!r})"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode != 0 and "pip install pipeline[openvino]" in result.stderr


# The target each kernel class builds, written out rather than read from the table under test.
EXPECTED_NATIVE = {"amx": "cpu-amx", "avx512-vnni": "cpu-avx512", "avx512": "cpu-avx2", "avx2": "cpu-avx2"}
AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl"}


def test_native_resolves_to_the_hosts_family():
    if kernel_class() in EXPECTED_NATIVE:
        assert load_target("native").name == EXPECTED_NATIVE[kernel_class()]
    amx = AVX512 | {"avx512_vnni", "amx_bf16", "amx_int8"}
    assert kernel_class(frozenset(amx)) == "amx"
    assert kernel_class(frozenset(amx - {"amx_bf16", "amx_int8"})) == "avx512-vnni"
    assert kernel_class(frozenset({"avx2", "fma"})) == "avx2"
    assert {c: native_target(c) for c in EXPECTED_NATIVE} == EXPECTED_NATIVE
    with pytest.raises(TargetError, match="lacks AVX2 and FMA"):
        native_target(kernel_class(frozenset({"sse4_2"})))


def test_native_target_of_an_avx512_host_without_vnni_is_cpu_avx2():
    assert kernel_class(frozenset(AVX512)) == "avx512"
    assert native_target(kernel_class(frozenset(AVX512))) == "cpu-avx2"


def test_target_of_another_class_records_where_it_was_measured(tiny_bert, texts_file, calibration_file, tmp_path):
    # The first CPU target whose kernel class is not this host's, whatever the host (AVX2, AVX-512 or AMX).
    target = next(t for t in ("cpu-amx", "cpu-avx512", "cpu-avx2") if load_target(t).kernel_class != kernel_class())
    spec = load_target(target)
    manifest = build_into(tiny_bert, target, texts_file, calibration_file, tmp_path)
    published = json.loads(open(manifest.published.path + "/manifest.json").read())
    assert published["measured_on"] == {
        "kernel_class": kernel_class(),
        "target_kernel_class": spec.kernel_class,
        "matches": False,
    }
    flags = cpu_flags() or frozenset()
    for row in published["candidates"]:
        needs = next(c for c in spec.candidates if c.name == row["name"]).required_cpu_flags
        assert (row["status"] == "skipped") == (not set(needs) <= flags), row["name"]
    lacking = sorted(set(spec.required_cpu_flags) - flags)
    if lacking:
        with pytest.raises(ArtifactError, match=f"lacks CPU flags .*{lacking[0]}"):
            load(manifest.published.path, strict=True)


def test_target_whose_candidates_all_need_missing_flags_is_refused_naming_them(
    tiny_bert, texts_file, calibration_file, tmp_path
):
    only = [{**OPENVINO_FP32[0], "name": "needs-flag", "required_cpu_flags": ["no_such_flag"]}]
    target = write_target(tmp_path, "unbuildable", base="cpu-avx2", candidates=only)
    with pytest.raises(TargetError, match=r"lack.* \(no_such_flag\); .* or build cpu-"):
        build_into(tiny_bert, target, texts_file, calibration_file, tmp_path)
