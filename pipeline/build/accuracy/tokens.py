"""How far two models' token outputs agree: the statistics the generators' gates (decoders, speech, text-to-text)
share."""

from __future__ import annotations

import numpy as np


def greedy_stats(reference: list, candidate: list) -> dict:
    """How far greedy continuations agree: the share of prompts that match token for token, and the mean share
    of each reference continuation reproduced before the first differing token."""
    exact, prefix = [], []
    for ref, cand in zip(reference, candidate, strict=True):
        ref, cand = list(ref), list(cand)
        same = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=False)) if a != b), min(len(ref), len(cand)))
        exact.append(ref == cand)
        prefix.append(1.0 if ref == cand else same / max(len(ref), 1))  # two empty continuations agree
    return {"greedy_match": float(np.mean(exact)), "greedy_prefix_agreement": float(np.mean(prefix))}


def top1_along(reference: list, candidate: list) -> float:
    """The share of positions, over all outputs, where the candidate's teacher-forced top-1 token along the
    reference's output is the reference's (1.0 where the outputs are empty)."""
    positions = np.concatenate([r == c for r, c in zip(reference, candidate, strict=True)] or [[]])
    return float(positions.mean()) if positions.size else 1.0
