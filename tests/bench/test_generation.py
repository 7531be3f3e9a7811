import json

from pipeline.bench.generation import ARTIFACT, PYTORCH, bench_generation, generation_speed


def test_bench_generation_writes_ttft_and_decode_rates_with_ratios(published_gpt2, tmp_path):
    results = bench_generation(published_gpt2, out_dir=tmp_path, batch_sizes=(1, 3), new_tokens=6, reps=1)
    assert set(results["batches"]) == {"batch_1", "batch_3"}
    for row in results["batches"].values():
        assert set(row) == {PYTORCH, ARTIFACT}
        assert row[PYTORCH]["decode_speedup"] == 1.0 and row[PYTORCH]["ttft_speedup"] == 1.0
        artifact = row[ARTIFACT]
        assert artifact["ttft_ms"] > 0 and artifact["decode_tokens_per_s"] > 0
        assert artifact["decode_speedup"] == artifact["decode_tokens_per_s"] / row[PYTORCH]["decode_tokens_per_s"]
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["batches"] == results["batches"] and saved["new_tokens"] == 6
    text = (tmp_path / "bench.md").read_text()
    assert "| artifact | 3 |" in text and "Host: " in text and "median [p10, p90]" in text
    png = (tmp_path / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000  # three panels, not an empty figure


def test_generation_speed_runs_every_runner_the_same_number_of_tokens(tmp_path):
    calls = []

    def runner(name):
        def run(batch, n):
            calls.append((name, len(batch), n))

        return run

    speed = generation_speed({"a": runner("a"), "b": runner("b")}, ["p", "q"], (1, 4), new_tokens=5, reps=2)
    assert speed["batches"]["batch_4"]["a"]["decode_tokens_per_s"] > 0
    assert sorted(set(calls)) == [(n, b, t) for n in "ab" for b in (1, 4) for t in (1, 2, 5)]
    assert calls.count(("a", 4, 5)) == calls.count(("b", 4, 5)) == 2
