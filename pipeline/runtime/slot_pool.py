"""The continuous batcher's free slots, and the prefix each still holds (prefix caching).

A request that leaves its slot leaves there the cache its prompt's prefill wrote. A new request whose prompt starts
with those tokens (the next turn of a chat: the conversation so far, the last answer, then a new message) takes that
slot, and its prefill starts after the shared prefix instead of at its first token. A hit computes the same attention
over the same keys and values as a recompute: the prefix's cache was written by a prefill of the same graph, at the
same positions. (The generated tokens' cache is not kept: decode steps wrote it a row at a time, and on int8 blocks
those kernels round otherwise than a prefill's.)

    pool = SlotPool(slots=16, capacity=512)
    slot, reused = pool.take(prompt_ids)      # the slot to fill, and how many leading prompt tokens it already holds
    pool.give_back(slot, tokens)              # the tokens whose cache the slot holds now (None: none)
"""

from __future__ import annotations

import heapq


def _common_prefix(a, b) -> int:
    """How many leading items `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SlotPool:
    """Free slots, lowest first (busy slots stay in a short block), each with the tokens its cache holds."""

    def __init__(self, slots: int, capacity: int):
        self.capacity = capacity
        self._free = list(range(slots))  # a heap
        self._held: dict[int, tuple[int, ...]] = {}  # free slot -> the tokens its cache holds, from position 0

    def __len__(self) -> int:
        return len(self._free)

    def take(self, prompt) -> tuple[int, int]:
        """A free slot for `prompt` (token ids) and how many of its leading tokens that slot's cache already holds:
        the slot sharing the longest prefix with it, else the lowest free slot. At least the prompt's last token is
        left to run, since its logits choose the first new token."""
        best, reused = None, 0
        for slot, tokens in self._held.items():
            shared = min(_common_prefix(tokens, prompt), len(prompt) - 1)
            if shared > reused or (shared == reused and shared > 0 and slot < best):
                best, reused = slot, shared
        if best is None:
            best = heapq.heappop(self._free)
        else:
            self._free.remove(best)
            heapq.heapify(self._free)
        self._held.pop(best, None)
        return best, reused

    def give_back(self, slot: int, tokens=None) -> None:
        """Free `slot`; `tokens`: those whose cache it holds from position 0 (None where a failed run may have left
        it half written). The last position is kept free for the padding a decode step writes into free slots."""
        heapq.heappush(self._free, slot)
        if tokens:
            self._held[slot] = tuple(tokens[: self.capacity - 1])

    def padding_length(self, slot: int) -> int:
        """The length to run a free `slot` at in a decode step: its padding token lands just after what it holds."""
        return len(self._held.get(slot, ())) + 1

    def held(self, slot: int) -> int:
        """How many tokens a free slot's cache holds."""
        return len(self._held.get(slot, ()))
