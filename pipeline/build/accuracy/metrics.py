"""Comparisons, thresholds and the verdict: how a candidate's outputs are scored against a reference, and which
target thresholds it misses. Used by validate, quantize (the fallback and the search), engine and bench.

Every statistic is named; scores (cosine, agreement) pass at or above their threshold, differences at or below.
A statistic that could not be measured is listed, with the reason, under NOT_MEASURED; a threshold set on it is
missed, never skipped.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from pipeline.build.accuracy.tokens import greedy_stats
from pipeline.build.inputs.targets import Accuracy

# metric name -> (threshold field, True when higher is better)
CHECKS = {
    "cosine_min": ("cosine_min", True),
    "cosine_mean": ("cosine_mean", True),
    "top10_agreement": ("top10_agreement", True),
    "top1_agreement": ("top1_agreement", True),
    "max_probability_diff": ("max_probability_diff", False),
    "max_abs_diff": ("max_abs_diff", False),
    "greedy_match": ("greedy_match", True),
    "greedy_prefix_agreement": ("greedy_prefix_agreement", True),
    "teacher_top1_agreement": ("teacher_top1_agreement", True),
    "perplexity_ratio": ("perplexity_ratio", False),
    "word_error_rate": ("word_error_rate", False),
}
# stats[NOT_MEASURED]: {metric: why it could not be measured}, for the statistics a comparison owes but could not give.
NOT_MEASURED = "not_measured"
# Statistics that are an extreme over the examples: a small split sees less of the tail than held-out text will.
EXTREMES = ("cosine_min", "max_abs_diff", "max_probability_diff")
# The development gate's margin, as a share of the gap to a perfect score: DEV_MARGIN / sqrt(n), at most DEV_MARGIN_CAP.
DEV_MARGIN = 2.0
DEV_MARGIN_CAP = 0.5


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _top_k(vectors: np.ndarray, k: int) -> np.ndarray:
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True).clip(1e-12)
    sims = unit @ unit.T
    np.fill_diagonal(sims, -np.inf)
    return np.argsort(-sims, axis=1)[:, :k]


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def teacher_scores(logits, tokens) -> dict:
    """What the teacher-forced gate keeps of one text's logits along its continuation ([positions, vocabulary]):
    the top token at each position and the negative log-likelihood of the true next token (`tokens`). Whole rows
    are a vocabulary wide (262,144 floats a position for Gemma 3), and a build holds many texts' at once."""
    x = np.asarray(logits, dtype=np.float32)
    rows = np.arange(len(tokens))
    top = x.max(-1)
    log_total = top.astype(np.float64) + np.log(np.exp(x - top[:, None]).sum(-1, dtype=np.float64))
    return {"top1": x.argmax(-1).astype(np.int64), "nll": log_total - x[rows, list(tokens)].astype(np.float64)}


def teacher_forced_stats(reference: dict, candidate: list[dict]) -> dict:
    """Behaviour along held-out continuations (reference: `teacher_forced`'s prompts, continuations and each
    text's `teacher_scores`; candidate: its own scores along the same continuations): the share of positions where
    the candidate's top token is the reference's, and the candidate's perplexity on the true next tokens over the
    reference's (1.0: as sure of the real text as PyTorch)."""
    agree, nll_reference, nll_candidate = [], [], []
    for ref, cand in zip(reference["scores"], candidate, strict=True):
        agree.append(ref["top1"] == cand["top1"])
        nll_reference.append(ref["nll"])
        nll_candidate.append(cand["nll"])
    if not agree:
        reason = "no text has the 4 tokens a prompt and a held-out continuation need"
        return {NOT_MEASURED: {"teacher_top1_agreement": reason, "perplexity_ratio": reason}}
    gap = np.concatenate(nll_candidate).mean() - np.concatenate(nll_reference).mean()
    return {"teacher_top1_agreement": float(np.concatenate(agree).mean()), "perplexity_ratio": float(np.exp(gap))}


def _embedding_stats(reference: np.ndarray, candidate: np.ndarray) -> dict:
    cos = (reference * candidate).sum(1) / (np.linalg.norm(reference, axis=1) * np.linalg.norm(candidate, axis=1)).clip(
        1e-12
    )
    stats = {"cosine_min": float(cos.min()), "cosine_mean": float(cos.mean())}
    k = min(10, len(reference) - 1)
    if k > 0:
        ref, cand = _top_k(reference, k), _top_k(candidate, k)
        stats["top10_agreement"] = float(np.mean([len(set(a) & set(b)) / k for a, b in zip(ref, cand, strict=True)]))
    else:
        stats[NOT_MEASURED] = {"top10_agreement": "one example has no neighbours to agree on"}
    return stats


def _span_stats(reference: list, candidate: list) -> dict:
    """Question answering, per text [tokens, 2] start and end logits: the share of texts whose start (and end)
    token is PyTorch's, both counted in top1_agreement; the largest logit and probability differences (the
    probabilities taken over each text's tokens)."""
    if not all(np.isfinite(c).all() for c in candidate):
        return {"finite": False, "max_abs_diff": float("inf")}
    ref = [np.asarray(r, dtype=np.float64) for r in reference]
    cand = [np.asarray(c, dtype=np.float64) for c in candidate]
    start = np.mean([r[:, 0].argmax() == c[:, 0].argmax() for r, c in zip(ref, cand, strict=True)])
    end = np.mean([r[:, 1].argmax() == c[:, 1].argmax() for r, c in zip(ref, cand, strict=True)])
    return {
        "max_abs_diff": float(max(np.abs(r - c).max() for r, c in zip(ref, cand, strict=True))),
        "start_top1_agreement": float(start),
        "end_top1_agreement": float(end),
        "top1_agreement": float((start + end) / 2),
        "max_probability_diff": float(
            max(np.abs(_softmax(r.T) - _softmax(c.T)).max() for r, c in zip(ref, cand, strict=True))
        ),
    }


def compare(metric: str, reference, candidate) -> dict:
    """Accuracy statistics of `candidate` against `reference` for a task's metric kind (for generation, both are
    {"logits": next-token logits, "tokens": greedy continuations}; for fill-mask, the vocabulary logits at the
    masked positions, one row each, judged as classification; for span, question answering's per-text start and
    end logits)."""
    if metric == "generation":
        stats = compare("classification", reference["logits"], candidate["logits"])
        stats.update(greedy_stats(reference["tokens"], candidate["tokens"]))
        if "teacher" in candidate:
            stats.update(teacher_forced_stats(reference["teacher"], candidate["teacher"]))
        return stats
    if metric == "span":
        return _span_stats(reference, candidate)
    if metric == "transcription":
        from pipeline.build.speech.gate import speech_stats

        return speech_stats(reference, candidate)
    if metric == "text2text":
        from pipeline.build.text2text.gate import text2text_stats

        return text2text_stats(reference, candidate)
    if metric == "token-classification":
        reference, candidate = np.concatenate(reference), np.concatenate(candidate)
    reference = np.asarray(reference, dtype=np.float64)
    candidate = np.asarray(candidate, dtype=np.float64)
    if not np.isfinite(candidate).all():
        return {"finite": False, "max_abs_diff": float("inf")}
    stats = {"max_abs_diff": float(np.abs(reference - candidate).max())}
    if metric == "embedding":
        stats.update(_embedding_stats(reference, candidate))
    else:
        stats["top1_agreement"] = float((reference.argmax(-1) == candidate.argmax(-1)).mean())
        stats["max_probability_diff"] = float(np.abs(_softmax(reference) - _softmax(candidate)).max())
    return stats


def worst(a: dict, b: dict) -> dict:
    """Per statistic, the worse of two measurements."""
    merged = {}
    for key in a.keys() | b.keys():
        if key == NOT_MEASURED:
            merged[key] = {**a.get(key, {}), **b.get(key, {})}
            continue
        values = [d[key] for d in (a, b) if key in d]
        higher_better = CHECKS.get(key, (None, True))[1]
        merged[key] = min(values) if higher_better else max(values)
    return merged


def verdict(stats: dict, accuracy: Accuracy) -> list[dict]:
    """One row per threshold the target sets and the statistics hold or owe: metric, value, threshold, relation,
    passed. A gated statistic listed as not measured is a failed row with value None and the reason."""
    rows = []
    if stats.get("finite") is False:
        return [{"metric": "finite", "value": False, "threshold": True, "relation": "==", "passed": False}]
    unmeasured = stats.get(NOT_MEASURED, {})
    for name, (field, higher_better) in CHECKS.items():
        threshold = getattr(accuracy, field)
        if threshold is None:
            continue
        relation = ">=" if higher_better else "<="
        if name in unmeasured and name not in stats:
            rows.append(
                {
                    "metric": name,
                    "value": None,
                    "threshold": threshold,
                    "relation": relation,
                    "passed": False,
                    "reason": unmeasured[name],
                }
            )
            continue
        if name not in stats:
            continue
        value = stats[name]
        passed = value >= threshold if higher_better else value <= threshold
        rows.append(
            {"metric": name, "value": value, "threshold": threshold, "relation": relation, "passed": bool(passed)}
        )
    return rows


def failures(stats: dict, accuracy: Accuracy) -> list[str]:
    """One line per threshold missed; an empty list means the candidate passes."""
    if stats.get("finite") is False:
        return ["the candidate outputs NaN or inf"]
    return [
        f"{row['metric']} was not measured ({row['reason']}), needs {row['relation']} {row['threshold']!r}"
        if row["value"] is None
        else f"{row['metric']} = {float(row['value'])!r}, needs {row['relation']} {row['threshold']!r}"
        for row in verdict(stats, accuracy)
        if not row["passed"]
    ]


def closeness(stats: dict, accuracy: Accuracy) -> float:
    """How near a candidate came to its thresholds: the worst margin (value - threshold for scores, threshold -
    value for differences); >= 0 passes. Ranks failed candidates in an all-fail message."""
    rows = verdict(stats, accuracy)
    if not rows:
        return 0.0
    if rows[0]["metric"] == "finite" or any(r["value"] is None for r in rows):
        return float("-inf")
    return min((r["value"] - r["threshold"]) if r["relation"] == ">=" else (r["threshold"] - r["value"]) for r in rows)


def with_headroom(accuracy: Accuracy, headroom: float, fields=None) -> Accuracy:
    """Stricter thresholds: scores move `headroom` of the way to 1, differences shrink by `headroom` (only the
    thresholds named in `fields`, where given)."""
    changes = {}
    for field in dataclasses.fields(Accuracy):
        value = getattr(accuracy, field.name)
        if value is None or (fields is not None and field.name not in fields):
            continue
        # A ratio of at least 1 (perplexity_ratio) also tightens toward 1, as a score does.
        higher_is_better = not field.name.startswith("max_")
        changes[field.name] = value + (1 - value) * headroom if higher_is_better else value * (1 - headroom)
    return dataclasses.replace(accuracy, **changes)


def development_margin(examples: int) -> float:
    """The share of the gap to a perfect score by which a development split of `examples` must clear a threshold
    on an extreme statistic: DEV_MARGIN / sqrt(n), at most DEV_MARGIN_CAP (0.5 up to 16 examples, 0.25 at 64,
    0.125 at 256)."""
    return min(DEV_MARGIN_CAP, DEV_MARGIN / math.sqrt(max(examples, 1)))


def development_gate(accuracy: Accuracy, examples: int, headroom: float = 0.0) -> Accuracy:
    """The thresholds a graph must meet on a development split of `examples` to be chosen.

    Every threshold first moves `headroom` of the way to a perfect score (`with_headroom`). The extremes over the
    examples (EXTREMES: cosine_min, max_abs_diff, max_probability_diff) then move a further `development_margin(n)`
    of the remaining gap: the minimum over 15 examples is an optimistic estimate of the minimum over a few hundred
    held-out ones, and less so as the split grows, as a confidence bound narrows like 1/sqrt(n). With cosine_min
    0.99 and no headroom the split must reach 0.995 at 15 examples, 0.9975 with headroom 0.5; 0.99125 at 256.
    Means (cosine_mean, agreements, perplexity ratio) average over every example or position and keep their
    threshold with headroom."""
    margin = development_margin(examples)
    return with_headroom(with_headroom(accuracy, headroom), margin, EXTREMES)


def split_at_middle(rows: list[list[int]], max_length: int) -> list[tuple[list[int], list[int]]]:
    """Each token row (cut to `max_length`) as (first half, second half): a prompt and the held-out continuation
    it is teacher-forced along. Rows under 4 tokens are left out."""
    rows = [list(r)[:max_length] for r in rows]
    return [(r[: len(r) // 2], r[len(r) // 2 :]) for r in rows if len(r) >= 4]


def teacher_reference(model, texts: list[str], batch_size: int) -> dict:
    """A runtime decoder's own logits along the held-out halves of `texts` (tokenized by its tokenizer), as the
    reference a quantized graph of it is judged against."""
    pairs = split_at_middle([e.ids for e in model.encode(texts)], model.max_length)
    teacher = {"prompts": [p for p, _ in pairs], "continuations": [c for _, c in pairs]}
    teacher["scores"] = teacher_outputs(model, teacher, batch_size)
    return teacher


def teacher_outputs(model, teacher: dict, batch_size: int) -> list[dict]:
    """The model's `teacher_scores` along the reference's held-out continuations, computed in batches."""
    scores = []
    for start in range(0, len(teacher["prompts"]), batch_size):
        chunk = slice(start, start + batch_size)
        logits = model.teacher_forced_logits(teacher["prompts"][chunk], teacher["continuations"][chunk])
        scores += [teacher_scores(x, c) for x, c in zip(logits, teacher["continuations"][chunk], strict=True)]
    return scores


def outputs(model, texts: list[str], metric: str, batch_size: int, new_tokens: int = 0, teacher: dict | None = None):
    """What validation compares, from a runtime model: its outputs, or for generation its next-token logits, its
    greedy continuations of `new_tokens` tokens and, given the reference's `teacher` split, its logits along the
    held-out continuations. Fill-mask models give their logits at the masked positions (see `masked_row`)."""
    if metric == "fill-mask":
        return model.mask_logits(texts, batch_size=batch_size)
    if metric == "transcription":
        from pipeline.build.speech.gate import speech_outputs

        return speech_outputs(model, texts, batch_size, teacher)
    if metric == "text2text":
        from pipeline.build.text2text.gate import text2text_outputs

        return text2text_outputs(model, texts, batch_size, teacher)
    if metric != "generation":
        return model.run(texts, batch_size=batch_size)
    completions = model.generate(texts, batch_size=batch_size, max_new_tokens=new_tokens, do_sample=False)
    result = {"logits": model.run(texts, batch_size=batch_size), "tokens": [c.token_ids for c in completions]}
    if teacher:
        result["teacher"] = teacher_outputs(model, teacher, batch_size)
    return result


def measure(
    model, texts: list[str], reference, metric: str, batch_size: int, new_tokens: int = 0, batched_teacher=None
) -> dict:
    """Statistics of the model at batch size 1 and at `batch_size`, the worse of each; for embeddings also how far
    one text's vector moves between the two (`batch_spread_max_abs`: dynamic int8 depends on what shares a batch).
    `batched_teacher`: the model's `teacher_outputs` at `batch_size`, where the caller has them already."""
    along = metric in ("transcription", "text2text")  # the reference's own outputs are what the decoder is fed
    teacher = reference.get("teacher") if metric == "generation" else reference if along else None
    known = bool(teacher) and batched_teacher is not None
    single = outputs(model, texts, metric, 1, new_tokens, teacher)
    # An input's teacher-forced logits are one input's run whatever the batch: measured once, at batch size 1.
    once = known or along
    batched = outputs(model, texts, metric, batch_size, new_tokens, None if once else teacher)
    if known:
        batched["teacher"] = batched_teacher
    stats = worst(compare(metric, reference, single), compare(metric, reference, batched))
    if metric in ("embedding", "classification", "fill-mask"):
        stats["batch_spread_max_abs"] = float(np.abs(np.asarray(single) - np.asarray(batched)).max())
    return stats
