"""Decoding settings and token choice for the decoder runtime: setting checks, transformers' sampling order
(repetition penalty, then temperature, top-k and top-p; greedy takes the argmax), and incremental detokenization
with stop strings. Imports only the standard library and numpy."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

# Tokens of the prompt decoded with each new token, so that a word-initial space or a multi-byte character that
# depends on the token before it comes out right.
CONTEXT_TOKENS = 5
_LARGEST = np.finfo(np.float64).max


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
    generated, for the repetition penalty) and the number of tokens generated before this one. `rng`: a numpy
    Generator for the batch, or a list of one a row."""
    holding_eos = steps < settings.min_new_tokens and settings.eos
    if not settings.do_sample and settings.repetition_penalty == 1.0:
        # Greedy reads the logits in place: a copy of each 49k-entry row costs more than the rest of the step's
        # Python. End-of-sequence tokens held back by min_new_tokens only matter when one of them is the argmax.
        chosen = logits.argmax(-1)
        if not holding_eos or settings.eos.isdisjoint(chosen.tolist()):
            return chosen
    # float64, and every score made finite before the shift: a tiny penalty or temperature divides scores into
    # overflow, and inf - inf is NaN, which sampling would read as a token.
    scores = np.array(logits, dtype=np.float64)
    if settings.repetition_penalty != 1.0:
        for row, tokens in enumerate(context):
            seen = np.unique(np.asarray(tokens, dtype=np.int64))
            picked = scores[row, seen]
            penalty = settings.repetition_penalty
            scores[row, seen] = np.where(picked < 0, picked * penalty, picked / penalty)
        np.clip(scores, -_LARGEST, _LARGEST, out=scores)
    if holding_eos:
        scores[:, sorted(settings.eos)] = -np.inf
    if not settings.do_sample:
        return scores.argmax(-1)
    # Shifted by the row's best score before the division, so that the best token scores 0 at any temperature;
    # a tiny one sends the others to -inf, which is their probability (0) and no error.
    with np.errstate(over="ignore"):
        scores = (scores - scores.max(-1, keepdims=True)) / settings.temperature
    vocab = scores.shape[-1]
    if 0 < settings.top_k < vocab:
        kth = np.partition(scores, vocab - settings.top_k, axis=-1)[:, vocab - settings.top_k][:, None]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = np.exp(scores)
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
    uniform = (
        rng.random((len(probs), 1)) if isinstance(rng, np.random.Generator) else np.array([[r.random()] for r in rng])
    )
    draws = uniform * cumulative[:, -1:]
    return np.minimum((cumulative < draws).sum(-1), vocab - 1)


@functools.lru_cache(maxsize=8)  # a table holds an int per character: keep few
def _failure(stop: str) -> tuple[int, ...]:
    """Knuth-Morris-Pratt table of a stop string: for each prefix, the length of its longest proper prefix that
    is also its suffix. Built once per string (rows of a batch share it), in time linear in its length."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


class _StopMatcher:
    """Stop strings matched as text streams in: each new character is read once per string, so the work per step
    is the new text's length however long the strings are (a rescan of the tail would be quadratic in them)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.tables = [_failure(s) for s in stops]
        self.matched = [0] * len(stops)  # per string: its longest prefix that the text ends with

    def feed(self, piece: str) -> int | None:
        """Read new text. Where a stop string ends in `piece`, stops there and returns where in `piece` the string
        began (negative where it began in earlier text; of two ending at once, the longer), else returns None."""
        for offset, char in enumerate(piece):
            ended = 0
            for j, (stop, table) in enumerate(zip(self.stops, self.tables, strict=True)):
                k = self.matched[j]
                while k and char != stop[k]:
                    k = table[k - 1]
                self.matched[j] = k = k + 1 if char == stop[k] else 0
                if k == len(stop):
                    ended = max(ended, k)
            if ended:
                return offset + 1 - ended
        return None

    def held(self) -> int:
        """Characters at the end of the text that could be the start of a stop string."""
        return max(self.matched, default=0)


class Detokenizer:
    """Incremental text of one row: decodes a short window of tokens at each step and emits what is new, holding
    back an incomplete character, and any tail that could be the start of a stop string."""

    def __init__(self, tokenizer, prompt: list[int], stop: tuple[str, ...]):
        self.tokenizer = tokenizer
        self.ids = list(prompt[-CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)
        self.matcher = _StopMatcher(stop)
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
            piece = after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            begin = self.matcher.feed(piece)
            if begin is not None:
                self.text = (self.text + piece)[: len(self.text) + begin]
                return self._emit(len(self.text)), True
            self.text += piece
        if final:
            return self._emit(len(self.text)), False
        return self._emit(len(self.text) - self.matcher.held()), False

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.sent)
        piece, self.sent = self.text[self.sent : upto], upto
        return piece
