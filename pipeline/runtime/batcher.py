"""Dynamic batching for a loaded model: concurrent callers' requests are gathered into one `Model.run`.

    callers --submit()--> bounded queue --worker thread--> model.run(batch) --> each caller's Future

A batch closes when it holds `max_batch_size` texts or `max_wait_ms` after its first request arrived. A full
queue rejects at once with OverloadedError rather than letting latency grow without bound. Standard library
only, like the runtime.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

from pipeline.errors import InputError, OverloadedError

_STOP = object()


class Batcher:
    """Gather concurrent single-text requests into batches for one model. Use as a context manager."""

    def __init__(self, model, max_batch_size: int = 32, max_wait_ms: float = 5.0, max_queue: int = 1024):
        if max_batch_size < 1 or max_queue < 1 or max_wait_ms < 0:
            raise InputError("Batcher needs max_batch_size >= 1, max_queue >= 1 and max_wait_ms >= 0")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_wait = max_wait_ms / 1000.0
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._closed = False
        self._worker = threading.Thread(target=self._loop, name="pipeline-batcher", daemon=True)
        self._worker.start()

    def submit(self, text: str) -> Future:
        """Queue one text; the Future resolves to its row of the model's output (or to the error)."""
        if self._closed:
            raise InputError("this Batcher is closed; make a new one")
        if not isinstance(text, str):
            raise InputError(f"Batcher.submit takes one str, got {type(text).__name__}")
        future: Future = Future()
        try:
            self._queue.put_nowait((text, future))
        except queue.Full:
            raise OverloadedError(
                f"the batcher's queue is full ({self._queue.maxsize} requests waiting); retry later, "
                "or raise max_queue / add workers"
            ) from None
        return future

    def __call__(self, text: str, timeout: float | None = None):
        """Run one text through the batcher and wait for its result."""
        return self.submit(text).result(timeout)

    def _loop(self) -> None:
        while True:
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
                if item is _STOP:
                    self._queue.put(_STOP)  # finish this batch, then stop
                    break
                batch.append(item)
            live = [(text, future) for text, future in batch if future.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                outputs = self.model.run([text for text, _ in live])
            except Exception as err:  # every caller in the batch gets the error
                for _, future in live:
                    future.set_exception(err)
                continue
            for (_, future), output in zip(live, outputs, strict=True):
                future.set_result(output)

    def close(self) -> None:
        """Finish queued requests, then stop the worker."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._worker.join()

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
