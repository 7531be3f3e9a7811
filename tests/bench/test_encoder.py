import json

import numpy as np
import pytest

from pipeline.bench.encoder import (
    ARTIFACT,
    PYTORCH,
    UNBUCKETED,
    _request_stream,
    _stream_markdown,
    _variants,
    bench,
    cosines_against_pytorch,
)
from pipeline.build.shape_buckets import request_stream
from pipeline.runtime.artifact import verify_artifact
from tests.conftest import SMALL_TEXTS


@pytest.mark.slow  # a whole encoder bench, plot included
def test_bench_writes_table_json_and_plot_with_ratios(published, tmp_path):
    cache = published.parent.parent.parent.parent / "cache"
    results = bench(
        published,
        cache_dir=cache,
        out_dir=tmp_path,
        batch_sizes=(1, 2),
        seq_lens=(8, 16, 4096),
        min_rounds=2,
        max_rounds=3,
        servers=False,
        serving_seconds=0.3,
    )
    variants = {row["variant"] for row in results["grid"]}
    assert variants == {
        "pytorch-fp32",
        "pytorch-bf16",
        "openvino-default",
        "onnx-unoptimized",
        "onnx-fp32-optimized",
        "artifact",
    }
    cosines = results["accuracy_cosine_min"]
    assert set(cosines) == variants  # every variant is measured against PyTorch fp32
    assert 0.9 < cosines["artifact"] < 1.0  # dynamic int8: close to fp32, and not fp32 itself
    assert {row["seq"] for row in results["grid"]} == {8, 16, 128}  # 4096 is capped at the model's 128
    for row in results["grid"]:
        assert 0 < row["p10_ms"] <= row["p50_ms"] <= row["p90_ms"] + 1e-9
        assert row["tokens_per_s"] == row["sequences_per_s"] * row["seq"]
        if row["variant"] == "artifact" and "best_peer" in row:
            assert row["speedup_low"] <= row["speedup_vs_best_peer"] <= row["speedup_high"]
    mixed = {row["variant"]: row for row in results["mixed"]}
    assert set(mixed) == variants and all(row["seq"] == "mixed" and row["batch"] == 2 for row in mixed.values())
    assert mixed["artifact"]["speedup_vs_best_peer"] > 0
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["grid"] == results["grid"] and saved["mixed"] == results["mixed"]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "bench.md").read_text()
    assert "| artifact | 2 | 16 |" in table and "| artifact | 2 | mixed |" in table and "Host:" in table
    assert "Bucketing" in table and "| batcher | 32 |" in table
    assert 0 < results["tokenization"]["share"] < 1
    rows = results["concurrency"]["rows"]
    assert [(r["variant"], r["callers"]) for r in rows] == [(v, n) for v in ("direct", "batcher") for n in (1, 8, 32)]
    assert all(r["requests"] > 0 and r["errors"] == 0 and r["p50_ms"] <= r["p99_ms"] for r in rows)


def test_bench_without_cache_measures_what_it_has(published, tmp_path):
    results = bench(
        published,
        cache_dir=tmp_path / "empty",
        out_dir=tmp_path,
        baseline=None,
        batch_sizes=(1,),
        seq_lens=(8,),
        min_rounds=2,
        max_rounds=2,
        servers=False,
        serving_seconds=0.3,
    )
    assert results["missing_variants"] == ["onnx-unoptimized", "onnx-fp32-optimized"]
    assert {row["variant"] for row in results["grid"]} == {"artifact"}
    assert "Not in the stage cache" in (tmp_path / "bench.md").read_text()


def test_bench_refuses_an_out_folder_inside_an_artifact_or_unwritable_before_running(published, tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    cases = ((published / "bench", "lies inside the published artifact"), (blocker / "x", "cannot be written"))
    for out, says in cases:
        result = CliRunner().invoke(main, ["bench", str(published), "--out", str(out), "--quick", "--profile"])
        assert result.exit_code != 0 and says in result.output and "Traceback" not in result.output
    assert not (published / "bench").exists()


def test_calibration_memory_reports_each_count(published):
    from pipeline.bench.calibration import calibration_memory

    cache = published.parent.parent.parent.parent / "cache"
    rows = calibration_memory(published, cache, counts=(8, 40), method="entropy")
    assert [(r["examples"], r["streamed"]) for r in rows] == [(8, True), (40, True), (16, False)]
    assert all(r["exit_code"] == 0 and r["peak_rss_mb"] > 50 and r["seconds"] > 0 for r in rows), [
        r.get("error") for r in rows
    ]


def test_time_until_stable_marks_a_deliberately_noisy_variant_noisy():
    import time

    from pipeline.build.timing import time_until_stable

    calls = {"n": 0}

    # Sleeps of tens of milliseconds: a busy host's scheduler adds a few to any sleep, which would make 2 ms noisy.
    def steady(_):
        time.sleep(0.02)

    def noisy(_):
        calls["n"] += 1
        time.sleep(0.01 if calls["n"] % 2 else 0.08)  # alternately fast and 8x slower

    times = time_until_stable({"steady": steady, "noisy": noisy}, None, min_rounds=5, max_rounds=12)
    assert times["noisy"]["noisy"] and len(times["noisy"]["ms"]) == 12
    assert not times["steady"]["noisy"]


def testcosines_against_pytorch_is_each_variants_worst_row_cosine_against_pytorch():
    reference = np.array([[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]])
    turned = np.array([[1.0, 1.0], [0.0, 5.0], [3.0, 4.0]])  # row 0 at 45 degrees: cosine 1/sqrt(2)
    runners = {PYTORCH: lambda feeds: reference, ARTIFACT: lambda feeds: turned, "scaled": lambda feeds: 2 * reference}
    cosines = cosines_against_pytorch(runners, {})
    assert cosines[ARTIFACT] == pytest.approx(2**-0.5) and cosines["scaled"] == pytest.approx(1.0)
    assert cosines_against_pytorch({ARTIFACT: lambda feeds: turned}, {}) == {}  # no PyTorch: nothing to compare with


def test_request_stream_gives_a_row_per_variant_with_positive_totals_and_the_artifacts_ratio(published):
    manifest = verify_artifact(published)
    manifest = {**manifest, "model": {**manifest["model"], "shape_buckets": [8, 16, 32, 128]}}
    cache = published.parent.parent.parent.parent / "cache"
    runners, _, missing = _variants(manifest, published.resolve(), cache, 2, None)
    assert not missing
    shipped = runners[ARTIFACT].model
    rows = _request_stream(runners, shipped, SMALL_TEXTS, set(runners), (2, 3), batches=4, max_batch=8)
    by_variant = {row["variant"]: row for row in rows}
    assert set(by_variant) == {*runners, UNBUCKETED}  # the artifact also without its shape buckets
    texts = sum(len(batch) for batch in request_stream(SMALL_TEXTS, 4, 8))
    for row in rows:
        assert row["seq"] == "stream" and row["batches"] == 4 and row["texts"] == texts and row["max_batch"] == 8
        assert 0 < row["p10_ms"] <= row["p50_ms"] <= row["p90_ms"] + 1e-9
        assert row["texts_per_s"] == pytest.approx(texts / row["p50_ms"] * 1000)
    artifact = by_variant[ARTIFACT]
    assert artifact["best_peer"] in runners and artifact["best_peer"] not in (ARTIFACT, UNBUCKETED)
    assert artifact["speedup_low"] <= artifact["speedup_vs_best_peer"] <= artifact["speedup_high"]
    table = "\n".join(_stream_markdown(rows))
    assert f"Request stream: 4 batches of 1 to 8 texts drawn from the validation text ({texts} texts)" in table
    assert f"| {UNBUCKETED} |" in table and f"over {artifact['best_peer']}" in table
