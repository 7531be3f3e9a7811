"""Continuous batching for a loaded decoder (`pipeline.runtime.load` of a text-generation artifact): requests join
the running batch at the next engine iteration and leave it when they end, freeing their slot for the next one.

    submit() --> pending (bounded) --engine thread--> slots --> each Request's events (a queue the caller reads)

    one engine iteration:  drop cancelled requests -> admit pending ones into free slots
                           -> prefill: up to `prefill_chunk` prompt tokens (a long prompt takes several iterations)
                           -> decode: one token for every request whose prompt is in, in one run

With the "shared" cache layout (GroupQueryAttention graphs, right padding) each request owns a slot of
`kv_cache.SlotCache`: its prompt is written into its slot's slice of the per-layer buffers, and decode steps run the
block of slots up to the highest busy one, each row at its own length, so a request computes as it would alone and
its tokens do not depend on what it is batched with. Sampling draws from each request's own generator, seeded as
`Generator.generate` seeds a lone prompt ([seed, 0], or [seed, index] as `submit` is told): a request gives the
tokens `generate([prompt])` gives.

The "concat" layout (graphs without GroupQueryAttention) grows each step's cache by a Concat over the whole batch,
so rows cannot join or leave a running batch: there the engine runs requests one at a time, in order of arrival,
through `Generator`'s own decoding (`continuous` is False). Nothing is batched across requests in that case.

Imports only numpy, onnxruntime (through the runtime) and the runtime package: its requests and counters are in
submitted.py, its free slots and their cached prefixes in slot_pool.py.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np

from pipeline.errors import InputError, OverloadedError
from pipeline.runtime.chat import chat_prompts
from pipeline.runtime.generation import SETTINGS, token_event
from pipeline.runtime.kv_cache import SlotCache
from pipeline.runtime.sampling import Detokenizer, choose_tokens, is_int
from pipeline.runtime.slot_pool import SlotPool
from pipeline.runtime.submitted import END as _END
from pipeline.runtime.submitted import Request, Stats
from pipeline.runtime.text import FATAL

MAX_SLOTS = 256


@dataclasses.dataclass(eq=False)
class _Running:
    """A request in a slot: its prompt tokens in the cache so far, its tokens so far and the token to feed next."""

    request: Request
    slot: int
    rng: np.random.Generator
    detokenizer: Detokenizer
    context: list[int]
    filled: int = 0
    generated: int = 0
    next_token: int | None = None
    events: object = None  # the concat layout: Generator's own event iterator for this request


def _attempt(action, *args) -> tuple:
    """(what `action(*args)` returns, None), or (None, what it raised): a failure is one request's or one step's,
    never the engine's. A Rust panic is a BaseException; only FATAL ones end the engine."""
    try:
        return action(*args), None
    except FATAL:
        raise
    except BaseException as err:  # noqa: BLE001 - handed to the requests it concerns
        return None, err


def _positive(name: str, value, most: int | None = None) -> int:
    if not is_int(value) or value < 1 or (most is not None and value > most):
        limit = f"from 1 to {most}" if most is not None else ">= 1"
        raise InputError(f"ContinuousBatcher: {name}={value!r} must be an int {limit}")
    return int(value)


class ContinuousBatcher:
    """Continuous batching of generation requests over one loaded decoder (a `Generator`). Use as a context manager.

    batcher = ContinuousBatcher(model, max_slots=16, prefill_chunk=64)
    request = batcher.submit("Once upon a time", max_new_tokens=32, temperature=0.8, seed=0)
    for token in request:                        # Token events as they are made
        print(token.text, end="")
    batcher.submit(token_ids, max_new_tokens=8).result()    # a Completion, as generate() returns it

    `max_slots`: requests decoding together (each holds `capacity` tokens of cache: default the model's max_length);
    `prefill_chunk`: prompt tokens an engine iteration writes before the next decode step; `max_queue`: requests
    waiting for a slot before submit() refuses with OverloadedError; `prefix_caching`: a freed slot keeps its
    tokens' cache for a later prompt that begins with them (slot_pool.py). Settings are those of `Generator.generate`.
    """

    def __init__(
        self, model, max_slots=16, prefill_chunk=64, max_queue=256, capacity=None, prefix_caching: bool = True
    ):
        self.model = model
        self.max_queue = _positive("max_queue", max_queue)
        self.prefill_chunk = _positive("prefill_chunk", prefill_chunk)
        self.capacity = _positive("capacity", model.max_length if capacity is None else capacity, model.max_length)
        self.continuous = model.spec.get("cache") == "shared" and model.right_padded
        slots = _positive("max_slots", max_slots, MAX_SLOTS) if self.continuous else 1
        self.max_slots = slots
        self.cache = SlotCache(model, slots, self.capacity) if self.continuous else None
        vocab = model.session.get_outputs()[0].shape[-1]
        self.vocab = vocab if isinstance(vocab, int) else model.tokenizer.get_vocab_size()
        self._slots = SlotPool(slots, self.capacity)
        self.prefix_caching = bool(prefix_caching)
        self._pending: collections.deque = collections.deque()
        self._running: list[_Running] = []
        # Every key from the start: stats() copies it from another thread, and a new key would change its size.
        self._counts = collections.Counter({field.name: 0 for field in dataclasses.fields(Stats)})
        self._wake = threading.Condition()
        self._closed = False
        self._engine = threading.Thread(target=self._loop, name="pipeline-continuous", daemon=True)
        self._engine.start()

    @property
    def stats(self) -> Stats:
        """The engine's counters now."""
        return Stats(**self._counts)

    @property
    def queue(self) -> tuple[int, int]:
        """Requests waiting for a slot, and requests in a slot, now (read from any thread)."""
        return len(self._pending), len(self._running)

    def submit(
        self, prompt=None, *, messages=None, tools=None, seed: int | None = None, index: int = 0, **settings
    ) -> Request:
        """Queue one request: a prompt (a str, or a list of token ids) or a conversation (`messages`, a list of
        {"role", "content"} dicts rendered with the chat template, with `tools` as `Generator.generate` takes
        them), with the settings of `Generator.generate`.
        Its InputError (bad settings, a prompt too long for a slot) is raised here, to this caller alone.
        `index` names the request in its events, and seeds it as generate() seeds its prompt of that index."""
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise InputError(
                f"submit() got an unknown setting {unknown[0]!r}; it takes seed, index and {', '.join(SETTINGS)}. "
                "Fix the spelling or remove it"
            )
        if seed is not None and not (is_int(seed) and 0 <= seed < 2**64):
            raise InputError(f"submit(): seed={seed!r} must be an int from 0 to 2**64 - 1 (or None for no seed)")
        sampling = self.model.settings(**settings)
        if sampling.max_new_tokens >= self.capacity:
            raise InputError(
                f"submit(): max_new_tokens={sampling.max_new_tokens} does not fit a slot of {self.capacity} tokens; "
                "ask for fewer, or make the batcher with a larger capacity"
            )
        if not is_int(index) or index < 0:
            raise InputError(f"submit(): index={index!r} must be an int >= 0")
        ids = self._prompt_ids(prompt, messages, tools, sampling.max_new_tokens)
        request = Request(self, ids, sampling, seed, index)
        with self._wake:
            if self._closed:
                raise InputError("this ContinuousBatcher is closed; make a new one")
            if len(self._pending) >= self.max_queue:
                raise OverloadedError(
                    f"the batcher's queue is full ({self.max_queue} requests waiting for a slot); retry later, "
                    "or raise max_queue / max_slots"
                )
            self._pending.append(request)
            self._counts["submitted"] += 1
            self._wake.notify()
        return request

    def _prompt_ids(self, prompt, messages, tools, new_tokens: int) -> list[int]:
        """The prompt's token ids, cut from the left to what a slot holds besides the new tokens (or refused, per
        the target, as generate() does)."""
        if messages is not None or tools is not None or isinstance(prompt, str):
            texts = [prompt] if isinstance(prompt, str) else prompt
            conversations = None if messages is None else [messages]
            prompts = chat_prompts(self.model.spec, texts, conversations, "submit()", tools)
            ids = list(self.model.encode(prompts, "submit()")[0].ids)
        elif isinstance(prompt, list | tuple) and prompt and all(is_int(t) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab]
            if bad:
                raise InputError(f"submit(): token id {bad[0]} is outside the vocabulary (0 to {self.vocab - 1})")
        else:
            raise InputError(
                f"submit() takes a prompt (a str or a non-empty list of token ids) or messages, got {prompt!r:.60}"
            )
        room = self.capacity - new_tokens
        if len(ids) > room:
            if self.model.spec["overlong"] == "refuse":
                raise InputError(
                    f"submit(): the prompt is {len(ids)} tokens; with max_new_tokens={new_tokens}, {room} fit a slot "
                    f"of {self.capacity}. Shorten it, ask for fewer new tokens, or use a truncating target"
                )
            ids = ids[-room:]  # keep the end: it is what the continuation follows
        return ids

    def cancel(self, request: Request) -> None:
        """Cancel a request (see `Request.cancel`); a request that has ended is left as it is."""
        with self._wake:
            request.cancel_requested = True
            if request in self._pending:  # it ends now; one in a slot leaves at the engine's next iteration
                self._pending.remove(request)
                self._counts["cancelled"] += 1
                request._events.put(_END)
            self._wake.notify()

    def close(self) -> None:
        """Refuse new requests, finish every accepted one, then stop the engine."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if threading.current_thread() is not self._engine:
            self._engine.join()

    def __enter__(self) -> ContinuousBatcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # The engine thread.
    def _loop(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._pending or self._running or self._closed):
                        self._wake.wait()
                    if self._closed and not (self._pending or self._running):
                        return
                    admitted = self._admit()
                _, err = _attempt(self._iteration, admitted)
                for running in list(self._running) if err else ():  # the requests in flight fail, not the engine
                    self._fail(running, err)
        finally:
            self._refuse_the_rest()

    def _admit(self) -> list[Request]:
        """Pending requests that get a free slot now (under the lock)."""
        admitted = []
        while self._pending and len(self._running) + len(admitted) < self.max_slots:
            admitted.append(self._pending.popleft())
        return admitted

    def _iteration(self, admitted: list[Request]) -> None:
        # Joins first: once in `_running`, a request is answered whatever the rest of the iteration raises.
        for request in admitted:
            _, err = _attempt(self._join, request)
            if err:
                self._counts["failed"] += 1
                request._events.put(err)
        for running in [r for r in self._running if r.request.cancel_requested]:
            self._counts["cancelled"] += 1
            self._leave(running, _END)
        if not self.continuous:
            for running in list(self._running):
                self._serial_step(running)
            return
        self._prefill()
        self._decode()

    def _join(self, request: Request) -> None:
        if any(r.next_token is not None for r in self._running):
            self._counts["joined_running"] += 1
        # One generator a request, seeded as generate() seeds its prompt of that index (0 for a lone prompt).
        rng = np.random.default_rng(None if request.seed is None else [request.seed, request.index])
        sampling = request.sampling
        detokenizer = Detokenizer(self.model.tokenizer, list(request.prompt_ids), sampling.stop)
        slot, reused = self._slots.take(request.prompt_ids)
        running = _Running(request, slot, rng, detokenizer, list(request.prompt_ids), filled=reused)
        if reused:
            self._counts["prefix_hits"] += 1
            self._counts["prefix_tokens"] += reused
        if not self.continuous:
            rows = [list(request.prompt_ids)]
            running.events = self.model._stream_batch(rows, [request.index], sampling, [rng], True)
        self._running.append(running)

    def _serial_step(self, running: _Running) -> None:
        """The concat layout: the next event of a request that runs alone, through Generator's decoding."""
        event, err = _attempt(next, running.events)
        if err:
            self._fail(running, err)
            return
        running.request._events.put(event)
        if event.finish_reason:
            self._counts["finished"] += 1
            self._leave(running, _END)

    def _prefill(self) -> None:
        """Write up to `prefill_chunk` prompt tokens of the requests in their prompts, oldest first; a request whose
        prompt is all in gets its first token."""
        budget = self.prefill_chunk
        for running in [r for r in self._running if r.next_token is None]:
            if budget == 0:
                return
            prompt = running.request.prompt_ids
            take = min(len(prompt) - running.filled, budget)
            end = running.filled + take
            ids = np.array([prompt[running.filled : end]], dtype=np.int64)
            started = time.perf_counter()
            logits, err = _attempt(self.cache.run, running.slot, ids, np.array([end]))
            self._counts["prefill_seconds"] += time.perf_counter() - started
            if err:
                self._fail(running, err)
                continue
            self._counts["prefill_chunks"] += 1
            running.filled, budget = end, budget - take
            if end == len(prompt):
                self._emit(running, logits[0])

    def _decode(self) -> None:
        """One token for every request whose prompt is in: one run over the block of slots up to the highest busy
        one. A slot in that block with no decoding request is fed padding at a place its next write overwrites (a
        prompt's next position, or a free slot's first)."""
        decoding = [r for r in self._running if r.next_token is not None]
        if not decoding:
            return
        rows = max(r.slot for r in self._running) + 1
        ids = np.full((rows, 1), self.model.pad_id, dtype=np.int64)
        lengths = np.array([self._slots.padding_length(slot) for slot in range(rows)], dtype=np.int64)
        for running in self._running:
            lengths[running.slot] = running.filled + 1
        for running in decoding:
            ids[running.slot, 0] = running.next_token
            lengths[running.slot] = len(running.context)
        started = time.perf_counter()
        logits, err = _attempt(self.cache.run, 0, ids, lengths)
        self._counts["decode_seconds"] += time.perf_counter() - started
        if err:  # the requests of this step fail, not the engine
            for running in decoding:
                self._fail(running, err)
            return
        self._counts["decode_steps"] += 1
        self._counts["decoded_tokens"] += len(decoding)
        self._counts["most_decoding"] = max(self._counts["most_decoding"], len(decoding))
        for running in decoding:
            self._emit(running, logits[running.slot])

    def _emit(self, running: _Running, logits: np.ndarray) -> None:
        """Choose a request's next token from its logits [V] and send its event (generation.token_event, as
        Generator._stream_batch does)."""
        sampling = running.request.sampling
        token = int(choose_tokens(logits[None], [running.context], running.generated, sampling, [running.rng])[0])
        running.context.append(token)
        running.generated += 1
        event = token_event(running.request.index, token, running.detokenizer, sampling, running.generated)
        running.request._events.put(event)
        running.next_token = token
        if event.finish_reason:
            self._counts["finished"] += 1
            self._leave(running, _END)

    def _fail(self, running: _Running, err: BaseException) -> None:
        self._counts["failed"] += 1
        self._leave(running, err, cached=False)

    def _leave(self, running: _Running, last, cached: bool = True) -> None:
        """Free a request's slot and send its last event. Unless a run failed, the slot keeps the cache its prompt's
        prefill wrote, for a later prompt that starts with that prompt. Not the generated tokens' cache: a decode
        step writes it one row at a time, whose kernels can round otherwise than a prefill's (on SmolLM2's int8
        blocks it moved a near-tie token), and a hit must give the tokens a recompute gives."""
        self._running.remove(running)
        keep = cached and self.continuous and self.prefix_caching
        self._slots.give_back(running.slot, running.context[: running.filled] if keep else None)
        running.request._events.put(last)

    def _refuse_the_rest(self) -> None:
        """When the engine ends (close(), or KeyboardInterrupt/SystemExit), no accepted request is left unanswered."""
        stopped = InputError("this ContinuousBatcher's engine has stopped; make a new one")
        with self._wake:
            self._closed = True
            left = list(self._pending)
            self._pending.clear()
        for request in left:
            request._events.put(stopped)
        for running in list(self._running):
            self._leave(running, stopped)
