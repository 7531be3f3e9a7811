"""Text in: the artifact's Rust tokenizer and the checks every runtime entry point applies to its inputs."""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Set
from pathlib import Path

from pipeline.errors import ArtifactError, InputError


def open_tokenizer(path: Path):
    """The artifact's Rust tokenizer, with padding and truncation off (the runtime pads and truncates itself); an
    ArtifactError naming the file where it cannot be read."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as err:  # the Rust side raises a bare Exception for a file it cannot parse
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ArtifactError(f"{path} is not a tokenizer the tokenizers library can read ({why}); rebuild it") from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


# Never turned into one request's error: they stop the process or unwind a generator or task on purpose.
FATAL = (KeyboardInterrupt, SystemExit, GeneratorExit)


def encode_batch(tokenizer, inputs: list, call: str, numbers: list[int] | None = None, **options) -> list:
    """`tokenizer.encode_batch(inputs, **options)`, where the tokenizer failing on an input is an InputError naming
    it (as input `numbers[i]`, default i). A Rust panic (pyo3's PanicException, a BaseException: a tokenizer.json
    pattern that backtracks without end on some text) is such a failure; the tokenizer stays usable after one."""
    try:
        return tokenizer.encode_batch(inputs, **options)
    except FATAL:
        raise
    except BaseException as err:  # a panic is no Exception
        failure = err
    # The batch failed as a whole: encode each input alone to name the one at fault.
    for i, item in zip(numbers or range(len(inputs)), inputs, strict=True):
        try:
            tokenizer.encode_batch([item], **options)
        except FATAL:
            raise
        except BaseException as err:
            raise _tokenizer_failed(f"{call} input {i}: the tokenizer failed on it", err) from None
    raise _tokenizer_failed(f"{call}: the tokenizer failed on these {len(inputs)} inputs together", failure) from None


def _tokenizer_failed(what: str, err: BaseException) -> InputError:
    why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return InputError(
        f"{what} ({why}); send other text, or rebuild the artifact from a checkpoint whose tokenizer.json has no "
        "pattern that backtracks without bound"
    )


def _valid_text(text: str) -> bool:
    """Whether a str can be encoded as UTF-8 (a lone surrogate cannot, and the tokenizer raises on it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_texts(texts, call: str, pairs: bool = False) -> list:
    """A list of strings (or, with `pairs`, of (text, text_pair) tuples), else an InputError naming the input and
    the fix."""
    if isinstance(texts, (str, bytes)):
        kind = type(texts).__name__
        raise InputError(f"{call} takes a list of strings, got a single {kind}; wrap it: model.{call[:-2]}([text])")
    if isinstance(texts, Mapping | Set):  # a dict would run its keys, a set in no defined order
        raise InputError(f"{call} takes a list of strings, got a {type(texts).__name__}; pass list(...) of the texts")
    try:
        texts = list(texts)
    except TypeError:
        raise InputError(f"{call} takes a list of strings, got {type(texts).__name__}") from None
    if not texts:
        raise InputError(f"{call} got an empty list; pass at least one string")
    for i, text in enumerate(texts):
        if pairs and isinstance(text, list) and len(text) == 2:
            raise InputError(f"{call} input {i} is a list; pass a pair as a (text, text_pair) tuple")
        parts = text if pairs and isinstance(text, tuple) and len(text) == 2 else (text,)
        bad = [t for t in parts if not isinstance(t, str)]
        if bad:
            what = f"{type(bad[0]).__name__} in a pair" if len(parts) == 2 else type(text).__name__
            fix = "strings, or (text, text_pair) tuples of two strings" if pairs else "text only"
            raise InputError(f"{call} input {i} is {what}, not str; pass {fix}")
        if not all(_valid_text(t) for t in parts):
            raise InputError(
                f"{call} input {i} is not valid Unicode text (it holds a lone surrogate); decode it with "
                "errors='replace' before passing it"
            )
    return texts


def check_batch_size(batch_size, call: str):
    """None (the artifact's default) or a positive int, else an InputError naming the argument."""
    if batch_size is None:
        return None
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise InputError(f"{call}: batch_size={batch_size!r} must be a positive int (or None for the default)")
    return int(batch_size)


def padded_rows(rows: list[list[int]], pad: int, width: int | None = None):
    """(ids, attention_mask) int64 arrays of token `rows` padded on the right with `pad` to `width` (the longest row
    where None); the mask is 0 on the padding."""
    import numpy as np

    width = max(len(r) for r in rows) if width is None else width
    ids = np.full((len(rows), width), pad, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return ids, mask


def check_lengths(rows: list[list[int]], limit: int, call: str) -> None:
    """An InputError naming the first row of token `rows` over the model's `limit`."""
    for i, row in enumerate(rows):
        if len(row) > limit:
            raise InputError(f"{call} input {i} is {len(row)} tokens, over the model's {limit}; shorten or split it")
