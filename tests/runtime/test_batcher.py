import threading

import numpy as np
import pytest

from pipeline.errors import InputError, OverloadedError
from pipeline.runtime import load
from pipeline.runtime.batcher import Batcher

from ..conftest import SMALL_TEXTS


@pytest.fixture(scope="module")
def model(published):
    return load(published)


def test_batcher_gives_each_caller_its_own_row(model):
    expected = {t: model.run([t])[0] for t in SMALL_TEXTS}
    results, batches = {}, []
    original = model.run

    def counting(texts, **kwargs):
        batches.append(len(texts))
        return original(texts, **kwargs)

    with Batcher(model, max_batch_size=8, max_wait_ms=50) as batcher:
        batcher.model = type("Counting", (), {"run": staticmethod(counting)})()
        threads = [
            threading.Thread(target=lambda t=t: results.update({t: batcher(t, timeout=30)})) for t in SMALL_TEXTS
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    for text in SMALL_TEXTS:
        np.testing.assert_allclose(results[text], expected[text], atol=2e-2)
    assert sum(batches) == len(SMALL_TEXTS) and max(batches) <= 8 and len(batches) < len(SMALL_TEXTS)


def test_batcher_rejects_when_queue_full(model):
    gate = threading.Event()

    class Slow:
        def run(self, texts):
            gate.wait(10)
            return model.run(texts)

    batcher = Batcher(Slow(), max_batch_size=1, max_wait_ms=0, max_queue=2)
    first = batcher.submit("one")  # taken by the worker, which then blocks
    while first.running() is False:
        pass
    batcher.submit("two")
    batcher.submit("three")
    with pytest.raises(OverloadedError, match=r"queue is full \(2 requests waiting\)"):
        batcher.submit("four")
    gate.set()
    batcher.close()
    assert first.result().shape == (32,)


def test_batcher_passes_model_errors_to_callers(model):
    class Broken:
        def run(self, texts):
            raise InputError("boom")

    with Batcher(Broken()) as batcher, pytest.raises(InputError, match="boom"):
        batcher("x", timeout=10)


def test_batcher_refuses_non_string_and_use_after_close(model):
    batcher = Batcher(model)
    with pytest.raises(InputError, match="takes one str"):
        batcher.submit(["a list"])
    batcher.close()
    with pytest.raises(InputError, match="closed"):
        batcher.submit("late")
