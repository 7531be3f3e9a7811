"""Extractive question answering over an encoder's start/end logits: a long context cut into windows as
transformers' question-answering pipeline cuts it, and the best answer span over them, scored as it scores one."""

from __future__ import annotations

from pipeline.errors import InputError
from pipeline.runtime.text import encode_batch


def best_span(
    logits, ids: list, sequence_ids: list, max_answer_length: int, paired: bool = True
) -> tuple[int, int, float] | None:
    """The (start, end, score) token span with the highest start + end logit among spans inside the context (the
    second sequence of a pair, or the only one where there is no pair: `paired`, never guessed from the tokens, since
    an empty context leaves none of its own), start <= end, at most `max_answer_length` tokens.
    The score is the product of the start and end probabilities of a softmax over the context tokens and the
    classifier token, as transformers' question-answering pipeline normalizes each window. None without context."""
    import numpy as np

    context = np.array([s == (1 if paired else 0) for s in sequence_ids])
    if not context.any():
        return None
    # transformers keeps the classifier token (the leading special token) in the softmax, since a model may point
    # at it for "no answer", but never picks it.
    normalized = context | (np.asarray(ids) == ids[0]) if sequence_ids[0] is None else context
    start, end = logits[:, 0].astype(np.float64), logits[:, 1].astype(np.float64)
    n = len(sequence_ids)
    offsets = np.arange(n)[None, :] - np.arange(n)[:, None]
    scores = np.where(context, start, -np.inf)[:, None] + np.where(context, end, -np.inf)[None, :]
    scores[(offsets < 0) | (offsets >= max_answer_length)] = -np.inf
    i, j = np.unravel_index(int(np.argmax(scores)), scores.shape)
    p_start = np.where(normalized, np.exp(start - start[normalized].max()), 0.0)
    p_end = np.where(normalized, np.exp(end - end[normalized].max()), 0.0)
    return int(i), int(j), float(p_start[i] / p_start.sum() * p_end[j] / p_end.sum())


def best_answer(windows: list, logits: list, context: str, max_answer_length: int) -> dict:
    """The answer over a context's windows, picked as transformers' question-answering pipeline picks it (with
    align_to_words=False): each window's `best_span`, scored within its window; the same text (ignoring case) found
    in several windows, as in their overlap, adds up its scores, and the highest score wins, the first on a tie.
    The dict holds answer (the context's text of the span, through the tokenizer's offsets), start and end
    (character offsets into the context) and score; no context token at all gives an empty answer with score 0."""
    found: dict[str, dict] = {}
    for enc, out in zip(windows, logits, strict=True):
        span = best_span(out, enc.ids, enc.sequence_ids, max_answer_length, paired=enc.n_sequences == 2)
        if span is None:
            continue
        first, last, score = span
        start, end = enc.offsets[first][0], enc.offsets[last][1]
        key = context[start:end].lower()
        if key in found:
            found[key]["score"] += score
        else:
            found[key] = {"answer": context[start:end], "start": start, "end": end, "score": score}
    return (
        max(found.values(), key=lambda a: a["score"]) if found else {"answer": "", "start": 0, "end": 0, "score": 0.0}
    )


def question_windows(
    tokenizer, max_length: int, questions: list[str], contexts: list[str], doc_stride: int | None
) -> list[list]:
    """Each (question, context) pair's encodings, one per window of `max_length` tokens: `tokenizer`'s only_second
    truncation with a stride, as transformers' question-answering pipeline cuts a long context. The tokenizer's
    truncation is changed: the caller holds it alone meanwhile."""
    added = tokenizer.num_special_tokens_to_add(True)
    tokenizer.no_truncation()
    strides = []
    for i, enc in enumerate(encode_batch(tokenizer, questions, "answer()", add_special_tokens=False)):
        room = max_length - added - len(enc.ids)
        if room < 1:
            raise InputError(
                f"answer() question {i} is {len(enc.ids)} tokens, which leaves no room for its context in "
                f"the model's {max_length} (with {added} special tokens); shorten the question"
            )
        if doc_stride is not None and doc_stride >= room:
            raise InputError(
                f"answer(doc_stride={doc_stride}) is not under the {room} tokens question {i} leaves for its "
                f"context in the model's {max_length}; pass doc_stride={room - 1} or less"
            )
        default = min(128, max_length // 2)
        strides.append(doc_stride if doc_stride is not None else default if default < room else room // 2)
    windows: list = [None] * len(questions)
    for stride in sorted(set(strides)):
        chosen = [i for i, s in enumerate(strides) if s == stride]
        tokenizer.enable_truncation(max_length, stride=stride, strategy="only_second")
        pairs = [(questions[i], contexts[i]) for i in chosen]
        encodings = encode_batch(tokenizer, pairs, "answer()", numbers=chosen)
        for i, enc in zip(chosen, encodings, strict=True):
            windows[i] = [enc, *enc.overflowing]
    return windows
