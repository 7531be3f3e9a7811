"""Shape buckets: the few padded lengths an encoder artifact pads its batches to.

Padded to its longest text, every batch of mixed lengths has a new sequence length, and OpenVINO (and ONNX
Runtime's kernels) pay a dynamic-shape dispatch for each new shape. Padded up to the next of a few fixed lengths,
the shapes repeat. The lengths are chosen from the calibration text's token lengths: quantiles of them, rounded
up to a multiple of `multiple`, then the model's max_length (a chunk is never longer):

    token lengths 7 9 12 14 18 21 25 40 57 88     quantiles (0.25, 0.5, 0.75, 0.9) -> 12 18 40 57
    rounded up to 8, max_length 128 last                                        -> [16, 24, 40, 64, 128]

The tune stage times the artifact with and without the plan; the published spec carries it only where it won
(pipeline.runtime.encoder pads to it).
"""

from __future__ import annotations

import math
from pathlib import Path

QUANTILES = (0.25, 0.5, 0.75, 0.9)
MULTIPLE = 8


def bucket_plan(
    lengths: list[int], max_length: int, quantiles: tuple[float, ...] = QUANTILES, multiple: int = MULTIPLE
) -> list[int]:
    """Ascending padded lengths for token `lengths` (nearest-rank quantiles, each rounded up to a multiple of
    `multiple` and capped at `max_length`, duplicates dropped), `max_length` last: at most len(quantiles) + 1.
    Pure; no lengths gives [max_length]."""
    if max_length < 1 or multiple < 1:
        raise ValueError(f"bucket_plan needs max_length >= 1 and multiple >= 1, got {max_length} and {multiple}")
    ordered = sorted(min(max(int(n), 1), max_length) for n in lengths)
    plan = set()
    for q in quantiles if ordered else ():
        at = ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
        plan.add(min(max_length, math.ceil(at / multiple) * multiple))
    plan.add(max_length)
    return sorted(plan)


def token_lengths(tokenizer_path: Path, texts: list) -> list[int]:
    """Each text's length in tokens (special tokens included) under the artifact's tokenizer: strings, or
    (text, text_pair) tuples."""
    from pipeline.runtime.text import open_tokenizer

    return [len(e.ids) for e in open_tokenizer(tokenizer_path).encode_batch(list(texts))]


def request_stream(texts: list, batches: int, max_batch: int, seed: int = 0) -> list[list]:
    """`batches` requests of 1 to `max_batch` texts each, drawn with replacement from `texts` (seeded, so every
    variant timed on it runs the same stream): the sizes and lengths a service sees, in new shapes at each call."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, max_batch + 1, batches)
    return [[texts[int(i)] for i in rng.integers(0, len(texts), int(n))] for n in sizes]
