"""Load: 8 threads share one loaded model for a minute; results stay identical and memory stays flat."""

import os
import threading
import time

import numpy as np
import psutil
import pytest

from pipeline.runtime import load
from tests.conftest import SMALL_TEXTS

pytestmark = pytest.mark.slow
SECONDS = float(os.environ.get("PIPELINE_SOAK_SECONDS", "60"))


def test_model_run_from_8_threads_is_identical_and_flat(published):
    model = load(published)
    batches = [SMALL_TEXTS[i : i + 3] for i in range(0, len(SMALL_TEXTS), 3)]
    expected = [model.run(b) for b in batches]
    process = psutil.Process()
    errors, calls, rss = [], [0], []
    stop = time.monotonic() + SECONDS

    def worker(offset: int) -> None:
        i = offset
        while time.monotonic() < stop and not errors:
            batch = i % len(batches)
            got = model.run(batches[batch])
            if not np.array_equal(got, expected[batch]):
                errors.append(f"thread {offset}: batch {batch} differs by {np.abs(got - expected[batch]).max()}")
            calls[0] += 1
            i += 1

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        rss.append(process.memory_info().rss)
        time.sleep(min(1.0, SECONDS / 10))
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]
    assert calls[0] > 8 * 10
    settled = rss[len(rss) // 4 :]  # after warm-up
    assert max(settled) - settled[0] < 64 * 1024 * 1024, [r >> 20 for r in settled]
