import json

from pipeline.bench.encoder import bench


def test_bench_writes_table_json_and_plot_with_ratios(published, tmp_path):
    cache = published.parent.parent.parent.parent / "cache"
    results = bench(published, cache_dir=cache, out_dir=tmp_path, batch_sizes=(1, 2), seq_lens=(8, 16, 4096),
                    budget_s=0.05, min_reps=2, max_reps=3)  # fmt: skip
    variants = {row["variant"] for row in results["grid"]}
    assert variants == {"pytorch-eager", "onnx-unoptimized", "onnx-fp32-optimized", "artifact-int8"}
    assert {row["seq"] for row in results["grid"]} == {8, 16, 128}  # 4096 is capped at the model's 128
    for row in results["grid"]:
        assert row["p50_ms"] > 0 and row["p50_ms"] <= row["p99_ms"] + 1e-9
        assert row["tokens_per_s"] == row["sequences_per_s"] * row["seq"]
        if row["variant"] == "pytorch-eager":
            assert row["speedup_vs_pytorch"] == 1.0
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["grid"] == results["grid"]
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "bench.md").read_text()
    assert "| artifact-int8 | 2 | 16 |" in table and "Bucketing" in table and "Batcher" in table
    assert 0 < results["tokenization"]["share"] < 1
    assert results["concurrency"]["requests"] == 256


def test_bench_without_cache_measures_what_it_has(published, tmp_path):
    results = bench(published, cache_dir=tmp_path / "empty", out_dir=tmp_path, baseline=None,
                    batch_sizes=(1,), seq_lens=(8,), budget_s=0.01, min_reps=2, max_reps=2)  # fmt: skip
    assert results["missing_variants"] == ["onnx-unoptimized", "onnx-fp32-optimized"]
    assert {row["variant"] for row in results["grid"]} == {"artifact-int8"}
    assert "Not in the stage cache" in (tmp_path / "bench.md").read_text()


def test_calibration_memory_reports_each_count(published):
    from pipeline.bench.calibration import calibration_memory

    cache = published.parent.parent.parent.parent / "cache"
    rows = calibration_memory(published, cache, counts=(8, 40), method="entropy")
    assert [(r["examples"], r["streamed"]) for r in rows] == [(8, True), (40, True), (16, False)]
    assert all(r["exit_code"] == 0 and r["peak_rss_mb"] > 50 and r["seconds"] > 0 for r in rows)
