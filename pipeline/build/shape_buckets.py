"""Shape buckets: the few padded lengths an encoder artifact pads its batches to.

Padded to its longest text, every batch of mixed lengths has a new sequence length, and OpenVINO (and ONNX
Runtime's kernels) pay a dynamic-shape dispatch for each new shape. Padded up to the next of a few fixed lengths,
the shapes repeat. The lengths are chosen from the calibration text's token lengths: the `count` multiples of 8
that pad those texts least (each text padded to the smallest that holds it), the longest text's among them; then
doublings up to the model's max_length, so that a text longer than any of the calibration text is padded at most
twice over; then max_length:

    token lengths 5 6 7 9 10 12 14 15 16 22 30 60     count 4, max_length 256
    padding least with 4 of 8 16 24 32 64              -> 8 16 32 64
    doublings, max_length last                         -> [8, 16, 32, 64, 128, 256]

Quantiles of the lengths would leave the tail to max_length: on the MiniLM calibration text (90% of it under 24
tokens, the longest 68) the quartiles and the 0.9 quantile round up to 16 and 24, and a tenth of the texts would
pad to 256.

The tune stage times the artifact with and without the plan; the published spec carries it only where it won
(pipeline.runtime.encoder pads to it).
"""

from __future__ import annotations

import math
from pathlib import Path

COUNT = 4
MULTIPLE = 8


def _least_padding(lengths: list[int], candidates: list[int], count: int) -> list[int]:
    """The at most `count` of `candidates` (ascending, the last holding every one of the ascending `lengths`)
    with the least total padding of `lengths`, each padded to the smallest chosen length that holds it; the
    fewest where several tie. Dynamic programming: cost[k][j] is the least padding of the lengths that fit in
    candidates[j] with k chosen lengths, the largest being candidates[j]."""
    import bisect

    prefix = [0]
    for n in lengths:
        prefix.append(prefix[-1] + n)
    ends = [bisect.bisect_right(lengths, c) for c in candidates]  # lengths[: ends[j]] fit in candidates[j]

    def padding(i: int, j: int) -> int:  # the lengths over candidates[i - 1], up to candidates[j], padded to it
        low = ends[i - 1] if i else 0
        return candidates[j] * (ends[j] - low) - (prefix[ends[j]] - prefix[low])

    m, never = len(candidates), math.inf
    cost = [[never] * m, [padding(0, j) for j in range(m)]]
    came: list[list[int]] = [[-1] * m, [-1] * m]
    for _ in range(2, count + 1):
        options = [[(cost[-1][i - 1] + padding(i, j), i - 1) for i in range(1, j + 1)] for j in range(m)]
        best = [min(row, default=(never, -1)) for row in options]
        cost.append([c for c, _ in best])
        came.append([i for _, i in best])
    k = min(range(1, len(cost)), key=lambda k: (cost[k][m - 1], k))
    chosen, j = [], m - 1
    while k > 0:
        chosen.append(candidates[j])
        j, k = came[k][j], k - 1
    return chosen[::-1]


def bucket_plan(lengths: list[int], max_length: int, count: int = COUNT, multiple: int = MULTIPLE) -> list[int]:
    """Ascending padded lengths for token `lengths`: the at most `count` multiples of `multiple` (capped at
    `max_length`) that pad them least, the longest's among them; doublings of the longest (rounded up to
    `multiple`) below `max_length`; then `max_length`. Pure; no lengths gives [max_length]."""
    if max_length < 1 or multiple < 1 or count < 1:
        raise ValueError(
            f"bucket_plan needs max_length, multiple and count >= 1, got {max_length}, {multiple}, {count}"
        )
    ordered = sorted(min(max(int(n), 1), max_length) for n in lengths)
    if not ordered:
        return [max_length]
    candidates = sorted({min(max_length, math.ceil(n / multiple) * multiple) for n in ordered})
    plan = _least_padding(ordered, candidates, count)
    while 2 * plan[-1] < max_length:
        plan.append(min(max_length, math.ceil(2 * plan[-1] / multiple) * multiple))
    return plan if plan[-1] == max_length else [*plan, max_length]


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
