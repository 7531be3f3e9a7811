"""Decoding settings and token choice for the decoder runtime: setting checks, transformers' sampling order
(repetition penalty, then temperature, top-k and top-p; greedy takes the argmax), and incremental detokenization
with stop strings. Imports only the standard library and numpy."""

from __future__ import annotations

import dataclasses
import math
import numbers

import numpy as np

# Tokens of the prompt decoded with each new token, so that a word-initial space or a multi-byte character that
# depends on the token before it comes out right.
CONTEXT_TOKENS = 5


def is_number(value) -> bool:
    """A finite real number, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value) -> bool:
    """An integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def setting_problems(values: dict, max_length: int) -> list[str]:
    """One message per bad generation setting in `values` (a call's settings, defaults filled in)."""
    problems = []
    new, least = values["max_new_tokens"], values["min_new_tokens"]
    if not is_int(new) or not 1 <= new < max_length:
        problems.append(f"max_new_tokens={new!r} must be an int from 1 to {max_length - 1}")
    if not is_int(least) or least < 0:
        problems.append(f"min_new_tokens={least!r} must be an int >= 0")
    if values["do_sample"] is not None and not isinstance(values["do_sample"], bool | np.bool_):
        problems.append(f"do_sample={values['do_sample']!r} must be True, False or None")
    temperature, top_p = values["temperature"], values["top_p"]
    if temperature is not None and not (is_number(temperature) and temperature >= 0):
        problems.append(f"temperature={temperature!r} must be a finite number >= 0 (0 is greedy)")
    if top_p is not None and not (is_number(top_p) and 0 < top_p <= 1):
        problems.append(f"top_p={top_p!r} must be a number in (0, 1]")
    top_k, penalty = values["top_k"], values["repetition_penalty"]
    if top_k is not None and not (is_int(top_k) and top_k >= 0):
        problems.append(f"top_k={top_k!r} must be an int >= 0 (0 turns it off)")
    if penalty is not None and not (is_number(penalty) and penalty > 0):
        problems.append(f"repetition_penalty={penalty!r} must be a finite number > 0 (1 turns it off)")
    return problems


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Resolved generation settings for one call."""

    max_new_tokens: int
    min_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    eos: frozenset[int]
    stop: tuple[str, ...]


def choose_tokens(logits: np.ndarray, context: list[list[int]], steps: int, settings: Sampling, rng) -> np.ndarray:
    """The next token of each row from its logits [b, V], given each row's tokens so far (prompt and
    generated, for the repetition penalty) and the number of tokens generated before this one."""
    holding_eos = steps < settings.min_new_tokens and settings.eos
    if not settings.do_sample and settings.repetition_penalty == 1.0:
        # Greedy reads the logits in place: a copy of each 49k-entry row costs more than the rest of the step's
        # Python. End-of-sequence tokens held back by min_new_tokens only matter when one of them is the argmax.
        chosen = logits.argmax(-1)
        if not holding_eos or settings.eos.isdisjoint(chosen.tolist()):
            return chosen
    scores = np.array(logits, dtype=np.float32)
    if settings.repetition_penalty != 1.0:
        for row, tokens in enumerate(context):
            seen = np.unique(np.asarray(tokens, dtype=np.int64))
            picked = scores[row, seen]
            penalty = np.float32(settings.repetition_penalty)
            scores[row, seen] = np.where(picked < 0, picked * penalty, picked / penalty)
    if holding_eos:
        scores[:, sorted(settings.eos)] = -np.inf
    if not settings.do_sample:
        return scores.argmax(-1)
    scores = scores / np.float32(settings.temperature)
    vocab = scores.shape[-1]
    if 0 < settings.top_k < vocab:
        kth = np.partition(scores, vocab - settings.top_k, axis=-1)[:, vocab - settings.top_k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if settings.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (always at least one): drop a token
        # when the tokens more likely than it already hold top_p.
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, -1)
        drop = np.zeros(probs.shape, dtype=bool)
        np.put_along_axis(drop, order, (np.cumsum(ranked, -1) - ranked) >= settings.top_p, -1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(-1, keepdims=True)
    cumulative = np.cumsum(probs, -1)
    draws = rng.random((len(probs), 1)) * cumulative[:, -1:]
    return np.minimum((cumulative < draws).sum(-1), vocab - 1)


class Detokenizer:
    """Incremental text of one row: decodes a short window of tokens at each step and emits what is new, holding
    back an incomplete character, and any tail that could be the start of a stop string."""

    def __init__(self, tokenizer, prompt: list[int], stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.ids = list(prompt[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.stop = stop
        self.text = ""  # decoded so far
        self.sent = 0  # characters of self.text already emitted

    def add(self, token: int) -> tuple[str, bool]:
        """Add a token; returns (the text to emit now, whether a stop string was reached)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> tuple[str, bool]:
        """The row has ended: (all the text not emitted yet, whether it reached a stop string). A trailing
        incomplete character comes out as the decoder shows it ("\ufffd"), so that the row's text equals the
        tokenizer's decode of its tokens."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, bool]:
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        for stop in self.stop:
            at = self.text.find(stop, max(0, self.sent - len(stop)))
            if at >= 0:
                self.text = self.text[:at]
                return self._emit(len(self.text)), True
        if final:
            return self._emit(len(self.text)), False
        held = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
        return self._emit(len(self.text) - held), False

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.sent)
        piece, self.sent = self.text[self.sent : upto], upto
        return piece
