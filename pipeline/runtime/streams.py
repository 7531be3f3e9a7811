"""Batch parallelism: one batch run as several requests at once, each on a share of the threads.

On a few cores one request with every thread leaves cores idle at each barrier between small ops; two halves of
a batch run side by side, one thread each, keep them busy. The session settings say how:

    streams          requests run at once (1: every chunk in turn, with all the threads)
    split_min_rows   a chunk of fewer rows is never split (a small one runs faster whole, with all the threads)

    bucketed chunks [32]                    -> plan [16] [16]        (streams 2: two requests of one thread each)
    bucketed chunks [12] [10] [6] (mixed)   -> plan [12] [10] [6]    (none over half the cost: the costliest first)
    bucketed chunks [3] [29]                -> plan [3] [15] [14]    ([29] held over half the cost)
    bucketed chunks [1]                     -> plan [1]              (one request, all the threads)
"""

from __future__ import annotations

import queue
from collections.abc import Callable

from pipeline.runtime.host import usable_cores

SPLIT_MIN_ROWS = 8


def stream_settings(session: dict | None) -> tuple[int, int, int]:
    """(streams, threads per stream, split_min_rows) from an artifact's session settings: the session's threads
    (0: every usable core) shared evenly, at least one each."""
    session = session or {}
    streams = max(1, int(session.get("streams", 1)))
    threads = int(session.get("intra_op_threads", 0) or 0) or usable_cores()
    return streams, max(1, threads // streams), int(session.get("split_min_rows", SPLIT_MIN_ROWS))


def chunk_cost(chunk: list[int], lengths: list[int] | None = None) -> int:
    """A chunk's padded size: its rows times its longest row (its rows alone where `lengths` is not given)."""
    return len(chunk) * (max(lengths[i] for i in chunk) if lengths and chunk else 1)


def chunk_plan(
    chunks: list[list[int]], streams: int, split_min_rows: int = SPLIT_MIN_ROWS, lengths: list[int] | None = None
) -> list[list[int]]:
    """The chunks to run on `streams` workers. The costliest chunk (`chunk_cost`) of at least `split_min_rows`
    (and 2) rows is split in halves in place, its rows kept in order, while there are fewer chunks than streams or
    it holds more than a stream's share of the whole batch's cost (one worker would finish long after the others).
    Pure: the input is not changed."""
    plan = [list(chunk) for chunk in chunks]
    while streams > 1:
        splittable = [i for i, chunk in enumerate(plan) if len(chunk) >= max(2, split_min_rows)]
        if not splittable:
            break
        index = max(splittable, key=lambda i: chunk_cost(plan[i], lengths))  # the first of the costliest
        share = sum(chunk_cost(chunk, lengths) for chunk in plan) / streams
        if len(plan) >= streams and chunk_cost(plan[index], lengths) <= share:
            break
        chunk = plan[index]
        half = (len(chunk) + 1) // 2
        plan[index : index + 1] = [chunk[:half], chunk[half:]]
    return plan


def stream_pool(session: dict | None, open_sessions: Callable[[], list]) -> StreamPool | None:
    """A StreamPool over `open_sessions()` where the session settings ask for more than one stream, else None."""
    streams, _, split_min_rows = stream_settings(session)
    return StreamPool(open_sessions(), split_min_rows) if streams > 1 else None


class StreamPool:
    """`streams` sessions (objects with `run(output_names, feeds)`; one object may appear more than once where it
    runs concurrent calls without sharing threads) and the worker threads that drive them. Each call holds one
    session from a queue of free ones, so a session is never run by two workers at once unless it was listed
    twice."""

    def __init__(self, sessions: list, split_min_rows: int = SPLIT_MIN_ROWS):
        from concurrent.futures import ThreadPoolExecutor

        self.sessions = list(sessions)
        self.split_min_rows = split_min_rows
        self._free: queue.Queue = queue.Queue()
        for session in self.sessions:
            self._free.put(session)
        self._executor = ThreadPoolExecutor(len(self.sessions), thread_name_prefix="stream")

    def __len__(self) -> int:
        return len(self.sessions)

    def map(self, work: Callable, chunks: list, costs: list | None = None) -> list:
        """[work(session, chunk) for each chunk], run on the free sessions concurrently, the costliest first (so a
        long chunk does not start last and leave the other workers idle), returned in the chunks' order."""

        def one(chunk):
            session = self._free.get()
            try:
                return work(session, chunk)
            finally:
                self._free.put(session)

        order = sorted(range(len(chunks)), key=lambda i: -costs[i]) if costs else list(range(len(chunks)))
        outs = dict(zip(order, self._executor.map(one, [chunks[i] for i in order]), strict=True))
        return [outs[i] for i in range(len(chunks))]
