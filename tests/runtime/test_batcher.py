import sys
import threading

import numpy as np
import pytest

from pipeline.errors import InputError, OverloadedError
from pipeline.runtime import load
from pipeline.runtime.batcher import Batcher
from tests.conftest import SMALL_TEXTS
from tests.runtime.backtracking import PANICS, backtracking_tokenizer


@pytest.fixture(scope="module")
def model(published):
    return load(published)


class Gated:
    """A model whose run waits until `gate` is set (at most 10 s): holds the Batcher's worker busy."""

    def __init__(self, model, gate: threading.Event):
        self.model, self.gate = model, gate

    def run(self, texts):
        self.gate.wait(10)
        return self.model.run(texts)


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

    batcher = Batcher(Gated(model, gate), max_batch_size=1, max_wait_ms=0, max_queue=2)
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


def test_submit_answers_or_refuses_every_request_when_racing_close(model):
    # Many rounds: a submit that passes the closed check just as close() runs is rare (a few % of rounds).
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, to hit the race
    try:
        for _ in range(200):
            batcher = Batcher(model, max_batch_size=4, max_wait_ms=0, max_queue=8)
            accepted, refused = [], []
            start = threading.Barrier(7)

            def client(batcher=batcher, accepted=accepted, refused=refused, start=start):
                start.wait()
                for _ in range(20):
                    try:
                        accepted.append(batcher.submit("race"))
                    except OverloadedError:
                        pass
                    except InputError as err:
                        refused.append(str(err))

            clients = [threading.Thread(target=client, daemon=True) for _ in range(6)]
            for thread in clients:
                thread.start()
            start.wait()
            closer = threading.Thread(target=batcher.close, daemon=True)
            closer.start()
            closer.join(10)
            for thread in clients:
                thread.join(10)
            assert not closer.is_alive(), "close() deadlocked"
            assert all("closed" in message for message in refused)
            assert all(future.done() for future in accepted), "an accepted request was dropped"
            assert all(future.result().shape == (32,) for future in accepted)
    finally:
        sys.setswitchinterval(switch)


def test_batcher_answers_each_request_alone_when_one_text_of_the_batch_is_bad(model):
    good, bad = "The cat sat on the mat.", "bad \ud800"
    batches = []

    class Recording:
        def run(self, texts):
            batches.append(list(texts))
            return model.run(texts)

    with Batcher(Recording(), max_batch_size=2, max_wait_ms=2000) as batcher:
        futures = [batcher.submit(good), batcher.submit(bad)]
        assert futures[0].result(timeout=30).shape == (32,)
        with pytest.raises(InputError, match="not valid Unicode text"):
            futures[1].result(timeout=30)
    assert batches[0] == [good, bad]  # they were one batch, then each ran alone
    np.testing.assert_allclose(futures[0].result(), model.run([good])[0], atol=1e-5)


def test_call_raises_timeout_error_after_the_batchers_default_timeout(model):
    gate = threading.Event()

    batcher = Batcher(Gated(model, gate), max_batch_size=1, max_wait_ms=0, timeout=0.2)
    try:
        busy = batcher.submit("one")  # holds the worker until the gate opens
        with pytest.raises(TimeoutError, match=r"no result within timeout=0\.2 s"):
            batcher("two")
    finally:
        gate.set()
        batcher.close()
    assert busy.result().shape == (32,)
    with Batcher(model) as default:
        assert default.timeout == 30.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size=0 must be a positive int"),
        ({"max_batch_size": 1.5}, "max_batch_size=1.5 must be a positive int"),
        ({"max_batch_size": True}, "max_batch_size=True must be a positive int"),
        ({"max_queue": -1}, "max_queue=-1 must be a positive int"),
        ({"max_wait_ms": float("nan")}, "max_wait_ms=nan must be a finite number >= 0"),
        ({"timeout": 0}, "timeout=0 must be a number of seconds > 0"),
    ],
)
def test_batcher_raises_input_error_naming_the_setting_when_it_is_bad(model, kwargs, message):
    with pytest.raises(InputError, match=message):
        Batcher(model, **kwargs)


def test_batcher_gives_only_the_text_the_tokenizer_panics_on_an_error_and_keeps_serving(backtracking):
    model = load(backtracking)
    good = "The cat sat on the mat."
    with Batcher(model, max_batch_size=3, max_wait_ms=2000, timeout=30) as batcher:
        futures = [batcher.submit(good), batcher.submit(PANICS), batcher.submit("ok")]
        with pytest.raises(InputError, match="the tokenizer failed on it"):
            futures[1].result(timeout=30)
        assert futures[0].result(timeout=30).shape == futures[2].result(timeout=30).shape == (32,)
        np.testing.assert_allclose(batcher(good), model.run([good])[0], atol=1e-5)


class Tokenizing:
    """A model whose run calls the tokenizers library straight, with no runtime check around it: a Rust panic
    (a BaseException) reaches the Batcher as it is."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def run(self, texts):
        return [len(e.ids) for e in self.tokenizer.encode_batch(texts)]


def test_batcher_retries_each_request_alone_and_lives_on_when_a_batch_raises_a_base_exception(published):
    batcher = Batcher(Tokenizing(backtracking_tokenizer(published / "tokenizer.json")), max_wait_ms=2000)
    try:
        futures = [batcher.submit("ok"), batcher.submit(PANICS), batcher.submit("the cat")]
        assert futures[0].result(timeout=30) == 3 and futures[2].result(timeout=30) == 4
        panic = futures[1].exception(timeout=30)
        assert isinstance(panic, BaseException) and not isinstance(panic, Exception)
        assert batcher("ok", timeout=30) == 3  # the worker lives on
    finally:
        batcher.close()


class Exiting:
    def run(self, texts):
        raise SystemExit(3)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # SystemExit ends the worker
def test_batcher_answers_its_callers_and_refuses_new_ones_when_a_run_raises_system_exit():
    batcher = Batcher(Exiting(), max_wait_ms=200)
    futures = [batcher.submit("one"), batcher.submit("two")]
    for future in futures:
        with pytest.raises(InputError, match="worker has stopped"):
            future.result(timeout=10)
    with pytest.raises(InputError, match="closed"):
        batcher.submit("three")
    batcher.close()
