import json
import time

import pytest

from pipeline.bench.generation import bench_generation, exact_prompts, genai_runner
from pipeline.build.inputs.data import DEFAULT_VALIDATION, read_texts
from pipeline.build.timing import ARTIFACT, PYTORCH, generation_speed
from pipeline.errors import InputError
from pipeline.runtime import load


def test_bench_generation_writes_ttft_and_decode_rates_with_ratios_per_prompt_length(published_gpt2, tmp_path):
    results = bench_generation(
        published_gpt2, out_dir=tmp_path, batch_sizes=(1, 3), new_tokens=6, reps=1, prompt_tokens=(16, 40)
    )
    assert set(results["runs"]) == {"16", "40"}
    for speed in results["runs"].values():
        assert set(speed["batches"]) == {"batch_1", "batch_3"} and speed["new_tokens"] == 6
        assert 0 < speed["loop"]["overhead_ms_per_step"] and 0 < speed["loop"]["session_ms_per_step"]
        for row in speed["batches"].values():
            assert set(row) == {PYTORCH, ARTIFACT}
            artifact = row[ARTIFACT]
            assert artifact["ttft_ms"] > 0 and artifact["decode_tokens_per_s"] > 0
            assert artifact["decode_speedup"] == artifact["decode_tokens_per_s"] / row[PYTORCH]["decode_tokens_per_s"]
            assert artifact["ttft_speedup"] == row[PYTORCH]["ttft_ms"] / artifact["ttft_ms"]
    accuracy = results["accuracy"][ARTIFACT]  # the gate's teacher-forced measure, against PyTorch fp32
    assert 0 < accuracy["teacher_top1_agreement"] <= 1 and 0.5 < accuracy["perplexity_ratio"] < 2
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["runs"] == results["runs"] and saved["prompt_tokens"] == [16, 40]
    assert saved["accuracy"] == results["accuracy"]
    text = (tmp_path / "bench.md").read_text()
    assert "## Prompts of 40 tokens, 6 new tokens" in text and "ms a step outside ONNX Runtime" in text
    assert "| artifact | 3 |" in text and "Host: " in text and "## Accuracy against PyTorch fp32" in text
    for length in (16, 40):
        png = (tmp_path / f"bench-prompt{length}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 20_000  # three panels, not an empty figure


def test_exact_prompts_tokenize_to_the_length_asked(published_gpt2):
    model = load(published_gpt2)
    texts = read_texts(DEFAULT_VALIDATION, "benchmark")
    for length in (16, 128):
        prompts = exact_prompts(model.tokenizer, texts, length, 8)
        assert len(set(prompts)) == 8 and {len(model.tokenizer.encode(p).ids) for p in prompts} == {length}
    with pytest.raises(InputError, match="too few tokens for 8 prompts of 100000 tokens"):
        exact_prompts(model.tokenizer, texts, 100_000, 8)


def test_a_genai_peer_without_its_package_or_config_is_an_input_error_naming_the_fix(published_gpt2, tmp_path):
    model = load(published_gpt2)
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError:
        with pytest.raises(InputError, match=r"pip install pipeline\[genai\]"):
            genai_runner(tmp_path, model.tokenizer)
        return
    with pytest.raises(InputError, match="has no genai_config.json"):
        genai_runner(tmp_path, model.tokenizer)


def test_generation_speed_takes_ttft_and_decode_rate_from_the_same_run_of_every_runner(tmp_path):
    calls = []

    def runner(name, prefill, step):
        def run(batch, n):
            calls.append((name, len(batch), n))
            time.sleep(prefill)
            first = time.perf_counter()
            time.sleep(step * (n - 1))
            return first

        return run

    runners = {"a": runner("a", 0.02, 0.001), "b": runner("b", 0.001, 0.004)}
    speed = generation_speed(runners, ["p", "q"], (1, 4), new_tokens=5, reps=2)
    assert sorted(set(calls)) == [(n, b, t) for n in "ab" for b in (1, 4) for t in (2, 5)]
    assert calls.count(("a", 4, 5)) == calls.count(("b", 4, 5)) == 2
    a, b = speed["batches"]["batch_4"]["a"], speed["batches"]["batch_4"]["b"]
    assert a["ttft_ms"] > 15 > 5 > b["ttft_ms"]  # a is slow to its first token and fast after it, b the reverse
    assert a["decode_tokens_per_s"] > 2 * b["decode_tokens_per_s"] and b["decode_tokens_per_s"] < 4 * 4 / 0.016


def test_generation_speed_gives_each_runner_its_ratios_to_pytorch():
    def runner(prefill, step):
        def run(batch, n):
            time.sleep(prefill)
            first = time.perf_counter()
            time.sleep(step * (n - 1))
            return first

        return run

    # The artifact is 10x faster to its first token and 4x faster after it; the third runner as slow as PyTorch.
    runners = {PYTORCH: runner(0.02, 0.004), ARTIFACT: runner(0.002, 0.001), "peer": runner(0.02, 0.004)}
    row = generation_speed(runners, ["p"], (1,), new_tokens=5, reps=2)["batches"]["batch_1"]
    artifact = row[ARTIFACT]
    assert artifact["ttft_speedup"] == row[PYTORCH]["ttft_ms"] / artifact["ttft_ms"] > 3
    assert artifact["decode_speedup"] == artifact["decode_tokens_per_s"] / row[PYTORCH]["decode_tokens_per_s"] > 2
    assert 0.3 < row["peer"]["ttft_speedup"] < 3 and 0.3 < row["peer"]["decode_speedup"] < 3


def test_a_genai_peers_cache_gets_at_least_its_sliding_window(tmp_path):
    from pipeline.bench.generation import _window

    decoder = {"filename": "model.onnx", "sliding_window": {"window_size": 512, "layers": [0, 1]}}
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": decoder}}))
    assert _window(tmp_path) == 512
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"filename": "model.onnx"}}}))
    assert _window(tmp_path) == 0
