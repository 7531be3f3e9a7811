"""Prefix caching in the continuous batcher (pipeline/runtime/slot_pool.py): a prompt that begins with the tokens a
free slot still holds (a chat's next turn) starts its prefill after them, and gets the tokens a recompute gets."""

import pytest

from pipeline.runtime.continuous import ContinuousBatcher
from pipeline.runtime.slot_pool import SlotPool
from tests.runtime.test_continuous import PROMPTS, llama  # noqa: F401 - the module's tiny decoder fixture


def test_the_pool_gives_the_slot_sharing_the_longest_prefix_and_leaves_one_token_to_run():
    pool = SlotPool(slots=4, capacity=8)
    assert [pool.take([1, 2])[0] for _ in range(3)] == [0, 1, 2]  # nothing held: the lowest free slot
    pool.give_back(2, [1, 2, 3, 4])
    pool.give_back(0, [1, 2, 9])
    assert pool.take([1, 2, 3, 4, 5]) == (2, 4)
    assert pool.take([1, 2, 3]) == (0, 2)  # the held 9 differs: two tokens reused
    pool.give_back(0, [5, 6, 7])
    assert pool.take([5, 6, 7]) == (0, 2)  # the prompt's last token still runs: its logits pick the next token
    pool.give_back(0, list(range(20)))
    assert pool.held(0) == 7 and pool.padding_length(0) == 8  # the last position stays free for decode padding
    pool.give_back(1, None)  # a failed run: nothing held
    assert pool.take([0, 1]) == (0, 1) and pool.take([0, 1]) == (1, 0)


def _turns(batcher, first: str, follow_ups: list[str], **settings) -> tuple[list, list]:
    """A chat of several turns as one growing prompt: each turn's prompt is the last prompt, its answer and a new
    message (as token ids, so the cached tokens are exactly the prompt's start). Each turn's prompt and Completion."""
    prompts = [list(batcher.model.encode([first], "test")[0].ids)]
    completions = [batcher.submit(prompts[0], max_new_tokens=12, **settings).result()]
    for message in follow_ups:
        message_ids = list(batcher.model.encode([message], "test")[0].ids)
        prompts.append(prompts[-1] + list(completions[-1].token_ids) + message_ids)
        completions.append(batcher.submit(prompts[-1], max_new_tokens=12, **settings).result())
    return prompts, completions


@pytest.mark.parametrize("settings", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}], ids=["greedy", "seeded"])
def test_a_chats_next_turn_reuses_the_cached_prefix_and_gets_the_tokens_of_a_recompute(llama, settings):  # noqa: F811
    with ContinuousBatcher(llama, max_slots=4, prefill_chunk=16) as cached:
        prompts, got = _turns(cached, PROMPTS[0], [PROMPTS[1], PROMPTS[2]], **settings)
        stats = cached.stats
    assert stats.prefix_hits == 2 and stats.prefix_tokens > 2 * len(prompts[0])
    for prompt, completion in zip(prompts, got, strict=True):  # each turn alone in a fresh batcher: a recompute
        with ContinuousBatcher(llama, max_slots=4, prefill_chunk=16) as fresh:
            assert fresh.submit(prompt, max_new_tokens=12, **settings).result().token_ids == completion.token_ids
            assert fresh.stats.prefix_hits == 0


def test_a_slot_whose_prefix_another_prompt_shares_only_in_part_reuses_that_part(llama):  # noqa: F811
    with ContinuousBatcher(llama, max_slots=2, prefill_chunk=8) as batcher:
        first = list(llama.encode([PROMPTS[3]], "t")[0].ids)
        batcher.submit(first, max_new_tokens=4).result()
        other = first[:5] + list(llama.encode([PROMPTS[4]], "t")[0].ids)
        got = batcher.submit(other, max_new_tokens=8).result()
        assert batcher.stats.prefix_tokens == 5
    with ContinuousBatcher(llama, max_slots=2, prefill_chunk=8) as fresh:
        assert fresh.submit(other, max_new_tokens=8).result().token_ids == got.token_ids
