"""Dynamic batching for a loaded model: concurrent callers' requests are gathered into one `Model.run`.

    callers --submit()--> bounded queue --worker thread--> model.run(batch) --> each caller's Future

A batch closes when it holds `max_batch_size` texts or `max_wait_ms` after its first request arrived. A full
queue rejects at once with OverloadedError rather than letting latency grow without bound. Every request that
submit() accepts is answered (its row or its own error); after close() begins, submit() refuses with InputError.
A batch that fails, on whatever it raises (a Rust panic is a BaseException), is retried request by request, so
the worker outlives any request. Standard library only, like the runtime.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from pipeline.errors import InputError, OverloadedError
from pipeline.runtime.text import FATAL

_STOP = object()
_BATCHER_TIMEOUT = object()  # __call__'s default: the Batcher's own timeout


def _check_settings(max_batch_size, max_wait_ms, max_queue, timeout) -> None:
    """A Batcher's settings, else an InputError naming the first bad one."""
    for name, value in (("max_batch_size", max_batch_size), ("max_queue", max_queue)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"Batcher: {name}={value!r} must be a positive int")
    number = (int, float)
    if isinstance(max_wait_ms, bool) or not isinstance(max_wait_ms, number) or not 0 <= max_wait_ms < float("inf"):
        raise InputError(f"Batcher: max_wait_ms={max_wait_ms!r} must be a finite number >= 0")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, number) or not timeout > 0):
        raise InputError(f"Batcher: timeout={timeout!r} must be a number of seconds > 0, or None for no limit")


class Batcher:
    """Gather concurrent single-text requests into batches for one model. Use as a context manager.

    `timeout` (seconds, default 30; None for no limit) is how long `batcher(text)` waits for its result before it
    raises TimeoutError; a call can pass its own `timeout`.
    """

    def __init__(
        self,
        model,
        max_batch_size: int = 32,
        max_wait_ms: float = 5.0,
        max_queue: int = 1024,
        timeout: float | None = 30.0,
    ):
        _check_settings(max_batch_size, max_wait_ms, max_queue, timeout)
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self.timeout = timeout
        # Unbounded underneath: submit() enforces max_queue under the lock, so the stop marker always fits and
        # nothing can be queued behind it.
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="pipeline-batcher", daemon=True)
        self._worker.start()

    def submit(self, text: str) -> Future:
        """Queue one text; the Future resolves to its row of the model's output (or to the error)."""
        if not isinstance(text, str):
            raise InputError(f"Batcher.submit takes one str, got {type(text).__name__}")
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise InputError("this Batcher is closed; make a new one")
            if self._queue.qsize() >= self.max_queue:
                raise OverloadedError(
                    f"the batcher's queue is full ({self.max_queue} requests waiting); retry later, "
                    "or raise max_queue / add workers"
                )
            self._queue.put_nowait((text, future))
        return future

    def __call__(self, text: str, timeout=_BATCHER_TIMEOUT):
        """Run one text through the batcher and wait for its result: up to `timeout` seconds (default: the
        batcher's `timeout`, 30 s; None waits without limit), then TimeoutError and the request is cancelled."""
        timeout = self.timeout if timeout is _BATCHER_TIMEOUT else timeout
        future = self.submit(text)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():  # the model's own TimeoutError, not ours
                raise
            future.cancel()  # the worker skips it if it has not started it yet
            raise TimeoutError(
                f"Batcher: no result within timeout={timeout} s; retry later, or pass a longer timeout"
            ) from None

    def _loop(self) -> None:
        live: list = []
        try:
            stopping = False
            while not stopping:
                item = self._queue.get()
                if item is _STOP:
                    return
                batch = [item]
                deadline = time.monotonic() + self.max_wait
                while len(batch) < self.max_batch_size:
                    left = deadline - time.monotonic()
                    try:
                        item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is _STOP:  # nothing is queued behind it: finish this batch, then stop
                        stopping = True
                        break
                    batch.append(item)
                live = [(text, future) for text, future in batch if future.set_running_or_notify_cancel()]
                if live:
                    self._answer(live)
        finally:
            self._refuse_the_rest(live)

    def _refuse_the_rest(self, live: list) -> None:
        """When the worker ends (after close(), or on KeyboardInterrupt/SystemExit raised in a model's run), no
        request may be left without an answer: close, and fail whatever is still queued or unanswered."""
        stopped = InputError("this Batcher's worker has stopped; make a new Batcher")
        with self._lock:
            self._closed = True
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP and item[1].set_running_or_notify_cancel():
                    live.append(item)
        for _, future in live:
            if not future.done():
                future.set_exception(stopped)

    def _answer(self, live: list) -> None:
        """Run a batch and resolve each caller's Future. When the batch fails, whatever it raised (one bad text's
        InputError, or a BaseException such as a tokenizer's Rust panic), each request is retried alone, so that
        every caller gets its own result or its own error and the worker lives on."""
        texts = [text for text, _ in live]
        try:
            outputs = self.model.run(texts)
            if len(outputs) != len(texts):
                raise RuntimeError(f"the model returned {len(outputs)} rows for a batch of {len(texts)} texts")
        except FATAL:  # ends the worker; _refuse_the_rest answers the callers
            raise
        except BaseException as err:  # a panic is no Exception, and must not end the worker either
            if len(live) == 1:
                live[0][1].set_exception(err)
            else:
                for request in live:
                    self._answer([request])
            return
        for (_, future), output in zip(live, outputs, strict=True):
            future.set_result(output)

    def close(self) -> None:
        """Refuse new requests, answer every queued one, then stop the worker."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put_nowait(_STOP)  # behind every accepted request; nothing can follow it
        if threading.current_thread() is not self._worker:
            self._worker.join()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
