"""The shape-bucket plan chosen from token lengths, and the request stream it is judged on."""

import itertools
import random

import pytest

from pipeline.build.shape_buckets import bucket_plan, request_stream
from pipeline.runtime.encoder import padded_width


def _padding(lengths: list[int], plan: list[int]) -> int:
    return sum(padded_width(n, plan) - n for n in lengths)


def test_bucket_plan_pads_the_lengths_least_then_doubles_up_to_max_length_last():
    lengths = [5, 6, 7, 9, 10, 12, 14, 15, 16, 22, 30, 60]
    assert bucket_plan(lengths, 256) == [8, 16, 32, 64, 128, 256]
    assert bucket_plan(list(reversed(lengths)), 256) == [8, 16, 32, 64, 128, 256]  # the texts' order is no matter
    crowd = [8] * 10 + [16] * 10 + [64]
    assert bucket_plan(crowd, 128, count=2) == [16, 64, 128]  # 10 texts padded by 8, not 10 by 48
    assert bucket_plan(crowd, 128, count=3) == [8, 16, 64, 128]
    assert bucket_plan(lengths, 256, multiple=16) == [16, 32, 64, 128, 256]


def test_bucket_plan_pads_no_less_than_any_other_choice_of_as_many_lengths():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(1, 14))]
        count = rng.randint(1, 4)
        plan = bucket_plan(lengths, 128, count=count)
        longest = -(-max(lengths) // 8) * 8
        chosen = [b for b in plan if b <= longest]
        assert chosen[-1] == longest and len(chosen) <= count, (lengths, count, plan)
        candidates = sorted({-(-n // 8) * 8 for n in lengths} - {longest})
        fewest = min(
            _padding(lengths, [*others, longest])
            for k in range(count)
            for others in itertools.combinations(candidates, k)
        )
        assert _padding(lengths, chosen) == fewest, (lengths, count, plan)


def test_bucket_plan_is_ascending_with_max_length_last_and_pads_longer_text_at_most_twice_over():
    short, long = [10, 12, 13, 15, 15, 16, 18, 20, 22, 23] * 9, [55, 60, 63, 68] * 2
    for lengths, max_length in ((short + long, 256), (short + long, 512), ([5] * 50, 512), ([3, 300], 256)):
        plan = bucket_plan(lengths, max_length)
        assert plan == sorted(set(plan)) and plan[-1] == max_length and all(0 < b <= max_length for b in plan)
        assert len(plan) <= 4 + 1 + (max_length // max(lengths)).bit_length(), plan
        for n in range(max(lengths) + 1, max_length + 1):
            assert padded_width(n, plan) <= 2 * n + 8, (plan, n)
    assert bucket_plan(short + long, 256) == [16, 24, 64, 72, 144, 256]
    assert bucket_plan([5] * 50, 512) == [8, 16, 32, 64, 128, 256, 512]
    assert bucket_plan([], 64) == [64]


def test_bucket_plan_caps_buckets_at_max_length_when_it_is_not_a_multiple():
    assert bucket_plan([99, 100, 100, 100], 100) == [100]
    assert bucket_plan([1, 2, 3, 4, 900], 20) == [8, 20]


def test_bucket_plan_refuses_a_zero_max_length():
    with pytest.raises(ValueError, match="max_length, multiple and count >= 1"):
        bucket_plan([3], 0)


def test_request_stream_is_seeded_and_its_batches_hold_1_to_max_batch_texts():
    texts = [f"text {i}" for i in range(10)]
    stream = request_stream(texts, 40, 64)
    assert stream == request_stream(texts, 40, 64) and stream != request_stream(texts, 40, 64, seed=1)
    assert len(stream) == 40 and all(1 <= len(batch) <= 64 for batch in stream)
    assert {len(batch) for batch in stream} != {len(stream[0])}  # sizes vary
    assert all(t in texts for batch in stream for t in batch)
