"""The concurrent-streams bench on a tiny GroupQueryAttention decoder: both variants measured at each stream count,
with the same tokens in each (greedy), written as JSON and Markdown."""

import json

import pytest

from pipeline.bench.streams import VARIANTS, bench_streams
from pipeline.errors import InputError
from tests.runtime.test_continuous import published_decoder


@pytest.fixture(scope="module")
def shared_decoder(tmp_path_factory, texts_file):
    return published_decoder(tmp_path_factory.mktemp("streams-llama"), "llama", texts_file)


def test_streams_bench_measures_both_variants_at_each_count_with_the_same_tokens(shared_decoder, tmp_path):
    results = bench_streams(shared_decoder, tmp_path, streams=(1, 3), prompt_tokens=12, new_tokens=5, reps=2)
    assert set(results["runs"]) == {"1", "3"}
    for run in results["runs"].values():
        assert run["same_tokens"] is True
        for name in VARIANTS:
            assert run[name]["tokens_per_s"] > 0 and 0 < run[name]["ttft_p50_ms"] <= run[name]["ttft_p99_ms"]
    assert json.loads((tmp_path / "bench.json").read_text())["runs"] == results["runs"]
    text = (tmp_path / "bench.md").read_text()
    assert "| 3 | continuous |" in text and "| 3 | one-at-a-time |" in text and "same tokens in both" in text


def test_streams_bench_refuses_an_encoder(published, tmp_path):
    with pytest.raises(InputError, match="benchmarks decoders"):
        bench_streams(published, tmp_path)
