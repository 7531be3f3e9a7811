"""Refuse tokenizer.json regex patterns that backtrack without bound, before they are built into an artifact.

A `Split` or `Replace` step of a tokenizer's normalizer, pre-tokenizer or decoder carries a regex that the
tokenizers library runs with Oniguruma. A quantified group that itself holds an unbounded quantifier, such as
`(a+)+b`, tries exponentially many ways to split a run of `a`s that no `b` follows; Oniguruma gives up at its
retry limit and the Rust side panics (a BaseException in Python). The library builds, saves and loads such a
tokenizer without complaint, so the build checks each pattern:

    (a+)+b       refused: `+` applies to a group that holds `+`
    (?:x*y)*     refused
    \\s+(?!\\S)    passes: no quantified group holds an unbounded quantifier
    (?i:'s|'t)   passes

The check is static, one pass over each pattern, and conservative: it refuses every unbounded quantifier
(`*`, `+`, `{n,}`) on a group holding one, even where the group's parts cannot overlap. The patterns of real
tokenizers (GPT-2, Llama 3, Qwen2, BERT's, SentencePiece's) hold none.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import InputError

_SECTIONS = ("normalizer", "pre_tokenizer", "decoder")
_STEPS = ("Split", "Replace")
_BRACED_ESCAPES = "pPxk"  # \p{L}, \P{N}, \x{41}, \k<name> or \k{name}: their braces are no quantifier


def check_tokenizer_patterns(tokenizer_json: str | dict, where: str | Path) -> None:
    """Raise an InputError naming the first `Split`/`Replace` regex of `tokenizer_json` (the text of a
    tokenizer.json, or its parsed dict) that nests unbounded quantifiers; `where` names the file in the message."""
    config = json.loads(tokenizer_json) if isinstance(tokenizer_json, str) else tokenizer_json
    for section in _SECTIONS:
        for step, pattern in _regex_steps(config.get(section)):
            nested = nested_unbounded(pattern)
            if nested is not None:
                raise InputError(
                    f"{where}: the {section}'s {step} pattern {pattern!r} repeats {nested!r}, a group that itself "
                    "repeats without bound; it backtracks without end on some text and the tokenizer panics. Rewrite "
                    "the pattern without nested repeats (e.g. (a+)+ as a+) or use a checkpoint without it"
                )


def _regex_steps(node) -> list[tuple[str, str]]:
    """(type, regex) of each Split/Replace step with a Regex pattern under `node`, in order, Sequences included."""
    found, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            pattern = item.get("pattern")
            if item.get("type") in _STEPS and isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
                found.append((item["type"], pattern["Regex"]))
            stack.extend(reversed([v for v in item.values() if isinstance(v, list | dict)]))
    return found


def nested_unbounded(pattern: str) -> str | None:
    """The first group of `pattern` with an unbounded quantifier (`*`, `+`, `{n,}`) that holds one itself, as
    written (e.g. "(a+)+"); None where there is none."""
    opened: list[tuple[int, bool]] = []  # per open group: where it starts, whether it holds an unbounded quantifier
    holds = False  # whether the group being read holds one
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i = _after_escape(pattern, i)
            continue
        if char == "[":
            i = _after_class(pattern, i)
            continue
        if char == "(":
            opened.append((i, holds))
            holds = False
            i += 1
            continue
        if char == ")" and opened:
            start, outer = opened.pop()
            end, unbounded = _quantifier(pattern, i + 1)
            if unbounded and holds:
                return pattern[start:end]
            holds = outer or holds or unbounded
            i = end
            continue
        end, unbounded = _quantifier(pattern, i)
        holds = holds or unbounded
        i = max(end, i + 1)
    return None


def _quantifier(pattern: str, i: int) -> tuple[int, bool]:
    """Where the quantifier at `i` ends (with its lazy `?` or possessive `+`), and whether it is unbounded; (i,
    False) where none starts there."""
    if i >= len(pattern):
        return i, False
    if pattern[i] in "*+?":
        end, unbounded = i + 1, pattern[i] != "?"
    elif pattern[i] == "{":
        close = pattern.find("}", i)
        low, comma, high = pattern[i + 1 : close].partition(",")
        if close < 0 or not (low or high) or not all(part.isdigit() for part in (low, high) if part):
            return i, False  # a literal brace: {n}, {n,}, {n,m} and {,m} are the quantifiers
        end, unbounded = close + 1, bool(comma) and not high
    else:
        return i, False
    return (end + 1 if end < len(pattern) and pattern[end] in "?+" else end), unbounded


def _after_escape(pattern: str, i: int) -> int:
    """Where the escape at `i` (a backslash) ends."""
    if i + 2 < len(pattern) and pattern[i + 1] in _BRACED_ESCAPES and pattern[i + 2] in "{<":
        close = pattern.find("}" if pattern[i + 2] == "{" else ">", i + 3)
        return len(pattern) if close < 0 else close + 1
    return i + 2


def _after_class(pattern: str, i: int) -> int:
    """Where the character class at `i` (its `[`) ends, nested classes (Oniguruma's [a-z&&[^x]]) included."""
    depth = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i = _after_escape(pattern, i)
            continue
        if char == "[":
            depth += 1
            i += 1
            if pattern.startswith("^", i):
                i += 1
            if pattern.startswith("]", i):  # a `]` first in a class is a literal
                i += 1
            continue
        if char == "]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return i
