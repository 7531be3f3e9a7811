"""What the continuous batcher (pipeline/runtime/continuous.py) hands its callers: a submitted `Request`, which
they iterate for its tokens or wait on for its `Completion`, and the engine's `Stats`."""

from __future__ import annotations

import dataclasses
import queue
from concurrent.futures import CancelledError

from pipeline.runtime.generation import Completion, Token

END = object()  # the last item of a request's event queue after its tokens


@dataclasses.dataclass(frozen=True)
class Stats:
    """Counters of a batcher's engine since it started: requests submitted, admitted into a slot while others were
    decoding (`joined_running`), finished, cancelled and failed; prompt chunks run (`prefill_chunks`), decode steps,
    and the most requests one decode step ran together (`most_decoding`); the tokens decode steps made
    (`decoded_tokens`), the seconds spent in prefill and decode runs, and the requests whose prompt began with a free
    slot's cached tokens (`prefix_hits`, with the prompt tokens they did not run: `prefix_tokens`)."""

    submitted: int = 0
    joined_running: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    prefill_chunks: int = 0
    decode_steps: int = 0
    most_decoding: int = 0
    decoded_tokens: int = 0
    prefix_hits: int = 0
    prefix_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


class Request:
    """A submitted request. Iterate it for its `Token` events as the engine makes them; `result()` waits for the
    rest and returns its `Completion`. A caller that stops reading (a client that went away) calls `cancel()` to free
    its slot."""

    def __init__(self, batcher, prompt_ids: list[int], sampling, seed, index: int):
        self.prompt_ids = tuple(prompt_ids)
        self.sampling, self.seed, self.index = sampling, seed, index
        self._batcher = batcher
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self.cancel_requested = False
        self._tokens: list[int] = []
        self._pieces: list[str] = []
        self._reason: str | None = None
        self._error: BaseException | None = None
        self._over = False  # the end (or an error) has been read

    def __iter__(self) -> Request:
        return self

    def __next__(self) -> Token:
        """The next event, waiting for the engine to make it; the request's error where it failed."""
        if not self._over:
            item = self._events.get()
            if item is not END and not isinstance(item, BaseException):
                self._tokens.append(item.token_id)
                self._pieces.append(item.text)
                self._reason = item.finish_reason
                return item
            self._over, self._error = True, None if item is END else item
        if self._error is not None:
            raise self._error
        raise StopIteration

    def cancel(self) -> None:
        """Stop generating: the engine frees the request's slot (or drops it from the queue) at its next iteration,
        and the iteration ends after the events already made."""
        self._batcher.cancel(self)

    def result(self) -> Completion:
        """Wait for the end; the text (cut before any stop string), the token ids and why it ended. Raises the
        request's error, or CancelledError for a request cancelled before its end."""
        for _ in self:
            pass
        if self._reason is None:
            raise CancelledError("the request was cancelled before it ended")
        return Completion("".join(self._pieces), tuple(self._tokens), self._reason)
