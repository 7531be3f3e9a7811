"""The shape-bucket plan chosen from token lengths, and the request stream it is judged on."""

import pytest

from pipeline.shape_buckets import bucket_plan, request_stream


def test_bucket_plan_rounds_quantiles_up_to_multiples_of_8_with_max_length_last():
    lengths = [7, 9, 12, 14, 18, 21, 25, 40, 57, 88]
    assert bucket_plan(lengths, 128) == [16, 24, 40, 64, 128]
    assert bucket_plan(list(reversed(lengths)), 128) == [16, 24, 40, 64, 128]  # the order of the texts is no matter
    assert bucket_plan(lengths, 128, multiple=16) == [16, 32, 48, 64, 128]


def test_bucket_plan_is_ascending_unique_and_at_most_one_more_than_the_quantiles():
    for lengths, max_length in (([5] * 50, 512), (list(range(1, 600)), 512), ([3, 300], 256), ([], 64)):
        plan = bucket_plan(lengths, max_length)
        assert plan == sorted(set(plan)) and plan[-1] == max_length and len(plan) <= 5, (lengths, plan)
        assert all(0 < b <= max_length for b in plan)
    assert bucket_plan([5] * 50, 512) == [8, 512]  # one length: one bucket for it, and the model's limit
    assert bucket_plan([], 64) == [64]


def test_bucket_plan_caps_buckets_at_max_length_when_it_is_not_a_multiple():
    assert bucket_plan([99, 100, 100, 100], 100) == [100]
    assert bucket_plan([1, 2, 3, 4, 900], 20) == [8, 20]


def test_bucket_plan_refuses_a_zero_max_length():
    with pytest.raises(ValueError, match="max_length >= 1"):
        bucket_plan([3], 0)


def test_request_stream_is_seeded_and_its_batches_hold_1_to_max_batch_texts():
    texts = [f"text {i}" for i in range(10)]
    stream = request_stream(texts, 40, 64)
    assert stream == request_stream(texts, 40, 64) and stream != request_stream(texts, 40, 64, seed=1)
    assert len(stream) == 40 and all(1 <= len(batch) <= 64 for batch in stream)
    assert {len(batch) for batch in stream} != {len(stream[0])}  # sizes vary
    assert all(t in texts for batch in stream for t in batch)
