"""Word error rate: how a speech model's transcripts are judged against a reference's.

Both sides are normalized the same plain way (lower case, punctuation and symbols dropped, numbers and words as
they are, whitespace collapsed) before their words are aligned by edit distance. This is not Whisper's
EnglishTextNormalizer (which spells out numbers and British spellings): the gate compares an artifact with the
same model in PyTorch, so both sides write numbers the same way.
"""

from __future__ import annotations

import re
import unicodedata

_DROPPED = re.compile(r"[^\w\s']|_")


def normalized_words(text: str) -> list[str]:
    """`text` as the words the error rate counts: lower case, NFKC, without punctuation."""
    text = unicodedata.normalize("NFKC", str(text)).lower()
    return [w.strip("'") for w in _DROPPED.sub(" ", text).split() if w.strip("'")]


def word_edits(reference: list[str], hypothesis: list[str]) -> int:
    """The fewest substitutions, deletions and insertions that turn `reference` into `hypothesis`."""
    previous = list(range(len(hypothesis) + 1))
    for i, ref in enumerate(reference, 1):
        current = [i]
        for j, hyp in enumerate(hypothesis, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref != hyp)))
        previous = current
    return previous[-1]


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Edits over reference words, summed over the pairs (the corpus WER); 0.0 where the references hold no word
    and neither do the hypotheses, 1.0 where only the hypotheses do."""
    if len(references) != len(hypotheses):
        raise ValueError(f"{len(references)} references but {len(hypotheses)} hypotheses")
    pairs = [(normalized_words(r), normalized_words(h)) for r, h in zip(references, hypotheses, strict=True)]
    words = sum(len(r) for r, _ in pairs)
    edits = sum(word_edits(r, h) for r, h in pairs)
    if words == 0:
        return 0.0 if edits == 0 else 1.0
    return edits / words
