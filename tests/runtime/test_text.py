"""Text in: the artifact's tokenizer, and the checks every runtime entry point applies to its inputs."""

import numpy as np
import pytest

from pipeline.errors import ArtifactError, InputError
from pipeline.runtime.text import check_batch_size, check_texts, open_tokenizer


def test_open_tokenizer_turns_padding_and_truncation_off(tiny_bert, tmp_path):
    from tokenizers import Tokenizer

    configured = Tokenizer.from_file(str(tiny_bert / "tokenizer.json"))
    configured.enable_padding(length=64)
    configured.enable_truncation(max_length=4)
    saved = tmp_path / "tokenizer.json"
    configured.save(str(saved))
    tokenizer = open_tokenizer(saved)
    assert tokenizer.padding is None and tokenizer.truncation is None
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog").ids
    assert len(configured.encode("the quick brown fox").ids) == 64  # as saved: padded to 64, cut at 4
    assert 4 < len(ids) < 64 and ids[0] == 101 and ids[-1] == 102 and 0 not in ids  # [CLS] ... [SEP], no [PAD]


@pytest.mark.parametrize("content", ["", "{not json", '{"model": {"type": "NoSuchModel"}}'])
def test_open_tokenizer_refuses_an_unreadable_file_in_one_line_naming_it(content, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(
        ArtifactError, match=r"tokenizer\.json is not a tokenizer the tokenizers library can read"
    ) as err:
        open_tokenizer(path)
    assert "\n" not in str(err.value) and str(err.value).endswith("rebuild it")


def test_check_texts_takes_any_iterable_of_strings_and_returns_a_list():
    assert check_texts(("a", "b"), "run()") == ["a", "b"]
    assert check_texts(iter(["a"]), "run()") == ["a"]
    assert check_texts([("a question", "a context")], "run()", pairs=True) == [("a question", "a context")]


@pytest.mark.parametrize(
    ("texts", "pairs", "message"),
    [
        ("one text", False, r"got a single str; wrap it: model\.run\(\[text\]\)"),
        (b"bytes", False, r"got a single bytes"),
        (42, False, r"takes a list of strings, got int"),
        ([], False, r"got an empty list"),
        (["fine", 3], False, r"input 1 is int, not str"),
        (["fine", None], True, r"input 1 is NoneType, not str"),
        ([("a", None)], True, r"input 0 is NoneType in a pair, not str"),
        ([("a", "b")], False, r"input 0 is tuple, not str"),  # a pair where pairs are not taken
        ([("a", 1)], True, r"input 0 is int in a pair, not str; pass strings, or \(text, text_pair\) tuples"),
        ([["a", "b"]], True, r"input 0 is a list; pass a pair as a \(text, text_pair\) tuple"),
        ({"a": 1}, False, r"got a dict; pass list\(\.\.\.\) of the texts"),
        ({"a", "b"}, True, r"got a set; pass list"),
        (["fine", "bad \ud800 surrogate"], False, r"input 1 is not valid Unicode text .*errors='replace'"),
        ([("ok", "\udfff")], True, r"input 0 is not valid Unicode text"),
    ],
)
def test_check_texts_refuses_bad_input_in_one_line_naming_it(texts, pairs, message):
    with pytest.raises(InputError, match=message) as err:
        check_texts(texts, "run()", pairs=pairs)
    assert str(err.value).startswith("run() ") and "\n" not in str(err.value)


@pytest.mark.parametrize("size", [None, 1, 64, np.int64(4)])
def test_check_batch_size_takes_none_or_a_positive_int(size):
    assert check_batch_size(size, "run()") == size and type(check_batch_size(size, "run()")) in (type(None), int)


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "8"])
def test_check_batch_size_refuses_anything_else_naming_it(size):
    with pytest.raises(InputError, match=rf"run\(\): batch_size={size!r} must be a positive int"):
        check_batch_size(size, "run()")
