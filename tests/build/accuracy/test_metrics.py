"""Statistics and the gate: what was not measured fails a threshold set on it, and the development split's gate
narrows with the split's size."""

import numpy as np
import pytest

from pipeline.build.accuracy.metrics import (
    NOT_MEASURED,
    closeness,
    compare,
    development_gate,
    development_margin,
    failures,
    teacher_forced_stats,
    verdict,
    worst,
)
from pipeline.build.inputs.targets import Accuracy

TEACHER_GATE = Accuracy(teacher_top1_agreement=0.9, perplexity_ratio=1.03)


def test_teacher_forced_gate_fails_saying_why_when_no_text_was_long_enough():
    nothing = {"prompts": [], "continuations": [], "scores": []}  # split_at_middle left every text out
    stats = teacher_forced_stats(nothing, [])
    missed = failures(stats, TEACHER_GATE)
    assert missed == [
        "teacher_top1_agreement was not measured (no text has the 4 tokens a prompt and a held-out continuation "
        "need), needs >= 0.9",
        "perplexity_ratio was not measured (no text has the 4 tokens a prompt and a held-out continuation need), "
        "needs <= 1.03",
    ]
    assert [(r["metric"], r["value"], r["passed"]) for r in verdict(stats, TEACHER_GATE)] == [
        ("teacher_top1_agreement", None, False),
        ("perplexity_ratio", None, False),
    ]
    assert closeness(stats, TEACHER_GATE) == float("-inf")
    assert failures(stats, Accuracy(cosine_min=0.99)) == []  # nothing owed to a gate that does not ask for it


def test_generation_compare_fails_a_teacher_gate_it_could_not_measure():
    logits = np.eye(3)
    nothing = {"prompts": [], "continuations": [], "scores": []}
    reference = {"logits": logits, "tokens": [(1, 2)], "teacher": nothing}
    stats = compare("generation", reference, {"logits": logits, "tokens": [(1, 2)], "teacher": []})
    assert stats["greedy_prefix_agreement"] == 1.0
    assert [m.split(" ")[0] for m in failures(stats, TEACHER_GATE)] == ["teacher_top1_agreement", "perplexity_ratio"]


def test_embedding_neighbour_agreement_of_one_example_fails_its_gate_as_not_measured():
    one = np.ones((1, 4))
    stats = compare("embedding", one, one)
    assert failures(stats, Accuracy(top10_agreement=0.8)) == [
        "top10_agreement was not measured (one example has no neighbours to agree on), needs >= 0.8"
    ]


def test_worst_keeps_what_either_measurement_could_not_measure():
    merged = worst({"cosine_min": 0.99, NOT_MEASURED: {"a": "why"}}, {"cosine_min": 0.98, NOT_MEASURED: {"b": "so"}})
    assert merged == {"cosine_min": 0.98, NOT_MEASURED: {"a": "why", "b": "so"}}


def test_development_gate_margin_shrinks_like_one_over_sqrt_n_on_extremes_only():
    accuracy = Accuracy(cosine_min=0.99, cosine_mean=0.995, max_abs_diff=0.2, teacher_top1_agreement=0.9)
    small, medium, large = (development_gate(accuracy, n) for n in (16, 64, 256))
    assert small.cosine_min == pytest.approx(0.99 + 0.01 * 0.5)
    assert medium.cosine_min == pytest.approx(0.99 + 0.01 * 0.25)
    assert large.cosine_min == pytest.approx(0.99 + 0.01 * 0.125)
    assert large.max_abs_diff == pytest.approx(0.2 * (1 - 0.125))
    assert development_margin(4) == development_margin(1) == 0.5  # at most half the gap, however small the split
    for gate in (small, medium, large):  # means keep their threshold
        assert (gate.cosine_mean, gate.teacher_top1_agreement) == (0.995, 0.9)
    # A 15-example split must clear cosine min 0.99 by half its gap; its statistic of 0.994 is refused.
    assert failures({"cosine_min": 0.994}, development_gate(accuracy, 15)) == ["cosine_min = 0.994, needs >= 0.995"]
    assert not failures({"cosine_min": 0.994}, Accuracy(cosine_min=0.99))


def test_development_gate_adds_its_margin_to_the_headroom():
    gate = development_gate(Accuracy(cosine_min=0.99, cosine_mean=0.99), 15, headroom=0.7)
    assert gate.cosine_mean == pytest.approx(0.997)
    assert gate.cosine_min == pytest.approx(0.997 + 0.003 * 0.5)


def test_teacher_scores_keep_the_top_token_and_the_true_tokens_log_likelihood():
    from pipeline.build.accuracy.metrics import teacher_scores

    logits = np.random.default_rng(0).standard_normal((5, 1000)).astype(np.float32) * 4
    tokens = [3, 999, 0, 500, 7]
    scores = teacher_scores(logits, tokens)
    x = logits.astype(np.float64)
    log_softmax = x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))
    np.testing.assert_allclose(scores["nll"], -log_softmax[np.arange(5), tokens], rtol=1e-6)
    assert scores["top1"].tolist() == logits.argmax(-1).tolist()
    shifted = teacher_scores(logits + 3.0, tokens)  # a constant shift changes no probability
    np.testing.assert_allclose(shifted["nll"], scores["nll"], rtol=1e-5)
    same = teacher_forced_stats({"scores": [scores]}, [shifted])
    assert same["teacher_top1_agreement"] == 1.0 and abs(same["perplexity_ratio"] - 1.0) < 1e-5
