"""The multi-turn chat bench on a tiny GroupQueryAttention decoder: each turn timed with prefix caching and without,
with the same tokens in both (greedy), written as JSON and Markdown."""

import json

import pytest

from pipeline.bench.turns import VARIANTS, bench_turns
from pipeline.errors import InputError
from tests.runtime.test_continuous import published_decoder


@pytest.fixture(scope="module")
def shared_decoder(tmp_path_factory, texts_file):
    return published_decoder(tmp_path_factory.mktemp("turns-llama"), "llama", texts_file)


def test_turns_bench_times_each_turn_both_ways_and_every_later_turn_hits(shared_decoder, tmp_path):
    results = bench_turns(shared_decoder, tmp_path, turns=3, message_tokens=12, new_tokens=4, reps=2)
    assert results["same_tokens"] is True and results["prefix_hits"] == 2 * 2  # turns 2 and 3, in each round
    assert len(results["per_turn"]) == 3
    for turn in results["per_turn"]:
        for name in VARIANTS:
            low, high = turn[name]["ttft_range_ms"]
            assert 0 < low <= turn[name]["ttft_ms"] <= high
        assert turn["speedup"] > 0
    assert json.loads((tmp_path / "bench.json").read_text())["per_turn"] == results["per_turn"]
    text = (tmp_path / "bench.md").read_text()
    assert "| 3 | 44 |" in text and "same tokens" in text and "Prefix hits: 4." in text


def test_turns_bench_refuses_an_encoder_and_a_chat_longer_than_the_model_holds(shared_decoder, published, tmp_path):
    with pytest.raises(InputError, match="benchmarks decoders"):
        bench_turns(published, tmp_path)
    with pytest.raises(InputError, match="ask for fewer turns"):
        bench_turns(shared_decoder, tmp_path, turns=1000)
