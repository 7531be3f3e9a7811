"""Continuous batching on a tiny GroupQueryAttention decoder ("shared" cache) with real ONNX Runtime: requests that
join a running batch get the tokens they get alone."""

import math
import threading
from concurrent.futures import CancelledError

import numpy as np
import pytest

from pipeline.errors import InputError
from pipeline.runtime import load
from pipeline.runtime.continuous import ContinuousBatcher
from pipeline.runtime.kv_cache import Decoding
from tests.conftest import SMALL_TEXTS
from tests.runtime.test_kv_cache import fp32_decoder

# Prompts of 2 to about 100 tokens: several are longer than the chunks the tests prefill.
PROMPTS = SMALL_TEXTS + [" ".join(SMALL_TEXTS[i : i + 3]) for i in range(4)]


def published_decoder(root, model_type: str, texts_file):
    """A tiny random decoder of `model_type` built for cpu-fp32 under `root`; its published artifact's path."""
    return fp32_decoder(root, model_type, texts_file)[1]


def _build(root, model_type: str, texts_file):
    return load(published_decoder(root, model_type, texts_file))


@pytest.fixture(scope="module")
def llama(tmp_path_factory, texts_file):
    model = _build(tmp_path_factory.mktemp("continuous-llama"), "llama", texts_file)
    assert model.spec["cache"] == "shared" and model.spec["padding"] == "right"  # the GroupQueryAttention graph
    return model


def _staggered(batcher, prompts, settings_of) -> list:
    """Submit request i from its own thread once request i - 1 has its first token, so that each joins a running
    batch; each thread reads its tokens as they come. The Completions, in order."""
    started = [threading.Event() for _ in prompts]
    results: list = [None] * len(prompts)

    def client(i: int) -> None:
        try:
            if i:
                started[i - 1].wait()
            request = batcher.submit(prompts[i], **settings_of(i))
            for _ in request:
                started[i].set()
            results[i] = request.result()
        except BaseException as err:  # noqa: BLE001 - the test reads it
            results[i] = err
        finally:
            started[i].set()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _sixteen() -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(16)]


@pytest.mark.parametrize(
    ("slots", "sampled"),
    [(16, False), (4, False), (16, True), (5, True)],
    ids=["greedy", "greedy-4-slots", "seeded", "seeded-5-slots"],
)
def test_sixteen_staggered_requests_each_get_the_tokens_they_get_alone(llama, slots, sampled):
    prompts = _sixteen()
    assert len({len(e.ids) for e in llama.encode(prompts)}) > 8  # prompts of many lengths

    def settings_of(i: int) -> dict:
        sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 100 + i} if sampled else {}
        # They leave at different steps, each long after the next one joins (it joins at this one's first token).
        return {"max_new_tokens": 30 + 5 * (i % 5), "eos": False, **sampling}

    with ContinuousBatcher(llama, max_slots=slots, prefill_chunk=16) as batcher:
        got = _staggered(batcher, prompts, settings_of)
        stats = batcher.stats
    for i, prompt in enumerate(prompts):
        settings = settings_of(i)
        [alone] = llama.generate([prompt], seed=settings.pop("seed", None), **settings)
        assert got[i] == alone, f"request {i}"
    if sampled:  # it samples: not the greedy tokens
        assert got[0].token_ids != llama.generate([prompts[0]], max_new_tokens=6, eos=False)[0].token_ids
    assert stats.finished == 16 and stats.failed == stats.cancelled == 0
    assert stats.joined_running > 0 and stats.most_decoding > 1  # joined mid-batch, and decoded together
    assert stats.prefill_chunks > 16  # the long prompts took several chunks


def test_index_names_a_request_and_seeds_it_as_generate_seeds_its_prompt_of_that_index(llama):
    prompts = PROMPTS[:3]
    settings = {"max_new_tokens": 10, "temperature": 1.0, "seed": 7, "eos": False}
    batched = llama.generate(prompts, batch_size=3, **settings)
    with ContinuousBatcher(llama) as batcher:
        requests = [batcher.submit(p, index=i, **settings) for i, p in enumerate(prompts)]
        assert [{t.index for t in r} for r in requests] == [{0}, {1}, {2}]
        assert [r.result() for r in requests] == batched
        with pytest.raises(InputError, match=r"index=-1 must be an int >= 0"):
            batcher.submit("Hi", index=-1)
    assert len({c.token_ids for c in batched}) == 3


def test_a_prompt_longer_than_the_chunk_is_prefilled_in_chunks(llama):
    prompt = PROMPTS[-1]
    length = len(llama.encode([prompt])[0].ids)
    assert length > 40
    [alone] = llama.generate([prompt], max_new_tokens=5, eos=False)
    for chunk in (7, 16, length):
        with ContinuousBatcher(llama, max_slots=2, prefill_chunk=chunk) as batcher:
            assert batcher.submit(prompt, max_new_tokens=5, eos=False).result() == alone
            assert batcher.stats.prefill_chunks == math.ceil(length / chunk)
            assert batcher.stats.decode_steps == 4  # the first token comes from the prompt's last chunk


def test_each_request_writes_its_cache_in_place_into_its_own_slot_of_the_one_buffer(llama):
    prompts = [PROMPTS[5], PROMPTS[1]]
    with ContinuousBatcher(llama, max_slots=3, prefill_chunk=8) as batcher:
        addresses = batcher.cache.addresses()
        first = batcher.submit(prompts[0], max_new_tokens=200, eos=False)
        head = next(first)
        second = batcher.submit(prompts[1], max_new_tokens=6, eos=False)  # joins while the first decodes
        made = [None, second.result().token_ids]
        first.cancel()  # after the second ended: the slots' contents are all the requests' own
        made[0] = (head.token_id, *(t.token_id for t in first))
        assert batcher.cache.addresses() == addresses and batcher.stats.joined_running == 1
        buffers = [layer[-1].numpy() for layer in batcher.cache.layers]
    assert 6 < len(made[0]) < 200
    for slot, (request, tokens) in enumerate(zip([first, second], made, strict=True)):
        written = len(request.prompt_ids) + len(tokens) - 1  # the last token is never fed back
        alone = Decoding(llama, [list(request.prompt_ids)], written + 1)
        alone.step()
        for token in tokens[:-1]:
            alone.step(np.array([token]))
        for buffer, value in zip(buffers, alone.past.values(), strict=True):
            np.testing.assert_allclose(buffer[slot, :, :written], value.numpy()[0, :, :written], rtol=1e-5, atol=1e-6)


def test_a_cancelled_request_frees_its_slot_for_the_next(llama):
    with ContinuousBatcher(llama, max_slots=1) as batcher:
        first = batcher.submit("Once upon a time", max_new_tokens=240, eos=False)
        assert [next(first).finish_reason for _ in range(3)] == [None] * 3
        first.cancel()  # the client went away
        made = 3 + len(list(first))  # the events made before the engine saw the cancel
        [alone] = llama.generate(["The cat"], max_new_tokens=8, eos=False)
        # With one slot, this runs only once the first request's slot is free.
        assert batcher.submit("The cat", max_new_tokens=8, eos=False).result() == alone
        stats = batcher.stats
    assert made < 240 and stats.cancelled == 1 and stats.finished == 1
    assert stats.decode_steps == (made - 1) + 7  # the second ran as soon as the first left, not at its end
    with pytest.raises(CancelledError):
        first.result()


def test_a_request_cancelled_while_queued_never_runs(llama):
    with ContinuousBatcher(llama, max_slots=1) as batcher:
        running = batcher.submit("Once upon a time", max_new_tokens=200, eos=False)
        waiting = batcher.submit("The cat", max_new_tokens=30, eos=False)
        waiting.cancel()
        assert list(waiting) == []  # at once, while the first still runs
        assert len(running.result().token_ids) == 200
    assert batcher.stats.cancelled == 1 and batcher.stats.decode_steps == 199


@pytest.mark.parametrize(
    ("prompt", "settings", "message"),
    [
        ("Hi", {"temperature": -1}, r"temperature=-1 must be"),
        ([3, 10**6], {}, r"token id 1000000 is outside the vocabulary"),
        ("Hi", {"max_new_tokens": 256}, r"max_new_tokens=256 must be an int from 1 to 255"),
        ("Hi", {"max_new_token": 4}, r"unknown setting 'max_new_token'"),
        (None, {}, r"takes a prompt"),
        ("Hi", {"seed": -3}, r"seed=-3 must be"),
    ],
)
def test_a_bad_request_fails_alone_while_the_others_complete(llama, prompt, settings, message):
    good = PROMPTS[:4]
    alone = [llama.generate([p], max_new_tokens=12, eos=False)[0] for p in good]
    with ContinuousBatcher(llama, max_slots=4) as batcher:
        requests = [batcher.submit(p, max_new_tokens=12, eos=False) for p in good]
        next(requests[0])  # they are decoding
        with pytest.raises(InputError, match=message) as err:
            batcher.submit(prompt, **settings)
        assert "\n" not in str(err.value)
        assert [r.result() for r in requests] == alone
        assert batcher.submit(good[0], max_new_tokens=12, eos=False).result() == alone[0]  # it serves on
        assert batcher.stats.failed == 0


def test_bounds_are_one_line_input_errors_naming_the_fix(llama):
    from pipeline.errors import OverloadedError

    for bad, message in [
        ({"max_slots": 0}, r"max_slots=0 must be an int from 1 to 256"),
        ({"prefill_chunk": 1.5}, r"prefill_chunk=1.5 must be an int >= 1"),
        ({"capacity": 10**6}, r"capacity=1000000 must be an int from 1 to 256"),
    ]:
        with pytest.raises(InputError, match=message):
            ContinuousBatcher(llama, **bad)
    with ContinuousBatcher(llama, max_slots=1, max_queue=1, capacity=40) as batcher:
        with pytest.raises(InputError, match=r"the prompt is \d+ tokens; with max_new_tokens=8, 32 fit a slot of 40"):
            llama.spec["overlong"] = "refuse"
            try:
                batcher.submit(PROMPTS[-1], max_new_tokens=8)
            finally:
                llama.spec["overlong"] = "truncate"
        with pytest.raises(InputError, match=r"max_new_tokens=40 does not fit a slot of 40 tokens"):
            batcher.submit("Hi", max_new_tokens=40)
        truncated = batcher.submit(PROMPTS[-1], max_new_tokens=8, eos=False)  # the target keeps the prompt's end
        assert len(truncated.prompt_ids) == 32 and len(truncated.result().token_ids) == 8
    with pytest.raises(InputError, match="closed; make a new one"):
        batcher.submit("Hi")
    with ContinuousBatcher(llama, max_slots=1, max_queue=1) as batcher:
        running = batcher.submit("Hi", max_new_tokens=250, eos=False)
        next(running)  # in the one slot, for 249 steps more
        batcher.submit("Hi", max_new_tokens=8)  # waits for the slot
        assert batcher.queue == (1, 1)
        with pytest.raises(OverloadedError, match=r"queue is full \(1 requests waiting for a slot\); retry later"):
            batcher.submit("Hi", max_new_tokens=8)
        running.cancel()


def test_the_concat_layout_runs_requests_one_at_a_time_with_the_same_tokens(tmp_path, texts_file):
    model = _build(tmp_path, "gpt_neox", texts_file)  # 8 rotary dimensions a head: no GroupQueryAttention
    assert model.spec["cache"] == "concat"
    prompts = PROMPTS[:5]
    with ContinuousBatcher(model, max_slots=16) as batcher:
        assert not batcher.continuous and batcher.max_slots == 1
        got = _staggered(batcher, prompts, lambda i: {"max_new_tokens": 5 + i, "eos": False})
        assert batcher.stats.most_decoding == 0 and batcher.stats.finished == len(prompts)
    assert got == [model.generate([p], max_new_tokens=5 + i, eos=False)[0] for i, p in enumerate(prompts)]
