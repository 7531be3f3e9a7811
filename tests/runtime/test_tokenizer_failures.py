import pytest

from pipeline.errors import InputError
from pipeline.runtime import load
from pipeline.runtime.text import encode_batch
from tests.runtime.backtracking import PANICS, backtracking_tokenizer


def test_the_backtracking_split_panics_in_the_tokenizers_library(published):
    # The premise of the tests below: the panic is a BaseException that `except Exception` lets through.
    tokenizer = backtracking_tokenizer(published / "tokenizer.json")
    with pytest.raises(BaseException) as raised:
        tokenizer.encode_batch(["ok", PANICS])
    assert not isinstance(raised.value, Exception) and "Panic" in type(raised.value).__name__


def test_encode_batch_raises_input_error_naming_the_input_when_the_tokenizer_panics(published):
    tokenizer = backtracking_tokenizer(published / "tokenizer.json")
    with pytest.raises(InputError) as raised:
        encode_batch(tokenizer, ["ok", "fine", PANICS], "generate()")
    message = str(raised.value)
    assert message.startswith("generate() input 2: the tokenizer failed on it (") and "\n" not in message
    pairs = [("q", "ok"), ("q", PANICS)]
    with pytest.raises(InputError, match=r"^answer\(\) input 7: the tokenizer failed on it"):
        encode_batch(tokenizer, pairs, "answer()", numbers=[3, 7])
    assert [len(e.ids) for e in encode_batch(tokenizer, ["ok"], "run()")] == [3]  # it stays usable


def test_run_raises_input_error_when_the_tokenizer_panics_and_the_model_keeps_running(backtracking):
    model = load(backtracking)
    with pytest.raises(InputError, match=r"^run\(\) input 1: the tokenizer failed on it \(") as raised:
        model.run(["The cat sat on the mat.", PANICS])
    assert "\n" not in str(raised.value)
    assert model.run(["The cat sat on the mat."]).shape == (1, 32)
