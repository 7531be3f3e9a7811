import numpy as np
import pytest

from pipeline.build.accuracy.metrics import compare, failures, worst
from pipeline.build.inputs.targets import Accuracy
from pipeline.build.stages.validate import validate_artifact
from pipeline.errors import AccuracyError
from tests.conftest import edit_manifest


def test_compare_embedding_identical_is_perfect():
    vectors = np.random.default_rng(0).normal(size=(20, 8))
    stats = compare("embedding", vectors, vectors)
    assert stats == {
        "max_abs_diff": 0.0,
        "cosine_min": pytest.approx(1.0),
        "cosine_mean": pytest.approx(1.0),
        "top10_agreement": 1.0,
    }


def test_compare_embedding_measures_known_rotation():
    reference = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    candidate = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])  # row 1 rotated by 45 degrees
    stats = compare("embedding", reference, candidate)
    assert stats["cosine_min"] == pytest.approx(np.sqrt(0.5))
    assert stats["cosine_mean"] == pytest.approx((2 + np.sqrt(0.5)) / 3)
    assert stats["max_abs_diff"] == 1.0


def test_compare_classification_counts_flipped_labels():
    reference = np.array([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 2.0]])
    candidate = reference.copy()
    candidate[3] = [2.0, 0.0]
    stats = compare("classification", reference, candidate)
    assert stats["top1_agreement"] == 0.75
    assert stats["max_probability_diff"] == pytest.approx(1 / (1 + np.exp(-2)) - 1 / (1 + np.exp(2)))


def test_compare_token_classification_flattens_ragged_outputs():
    reference = [np.eye(3)[:2], np.eye(3)]
    stats = compare("token-classification", reference, [r.copy() for r in reference])
    assert stats["top1_agreement"] == 1.0


def test_compare_flags_nan_candidate():
    stats = compare("embedding", np.ones((2, 2)), np.array([[1.0, np.nan], [1.0, 1.0]]))
    assert failures(stats, Accuracy()) == ["the candidate outputs NaN or inf"]


def test_failures_lists_every_missed_threshold():
    stats = {"cosine_min": 0.98, "cosine_mean": 0.999, "max_abs_diff": 0.2}
    missed = failures(stats, Accuracy(cosine_min=0.99, cosine_mean=0.995, max_abs_diff=0.1))
    assert missed == ["cosine_min = 0.98, needs >= 0.99", "max_abs_diff = 0.2, needs <= 0.1"]


def test_failures_show_a_value_apart_from_its_threshold_when_they_differ_past_four_decimals():
    missed = failures({"max_abs_diff": 3e-05, "cosine_min": 0.98999}, Accuracy(max_abs_diff=0.0, cosine_min=0.99))
    assert missed == ["cosine_min = 0.98999, needs >= 0.99", "max_abs_diff = 3e-05, needs <= 0.0"]


def test_worst_takes_lower_score_and_higher_difference():
    merged = worst({"cosine_min": 0.99, "max_abs_diff": 0.1}, {"cosine_min": 0.98, "max_abs_diff": 0.05})
    assert merged == {"cosine_min": 0.98, "max_abs_diff": 0.1}


def test_validate_artifact_passes_published_artifact(published, texts_file):
    stats = validate_artifact(published, texts_file)
    assert stats["cosine_min"] >= 0.99


def test_validate_artifact_raises_when_thresholds_missed(artifact_copy, texts_file):
    edit_manifest(artifact_copy, lambda m: m["target_spec"]["accuracy"].update(max_abs_diff=0.0))
    with pytest.raises(AccuracyError, match="misses its thresholds on this host: max_abs_diff"):
        validate_artifact(artifact_copy, texts_file)


def test_validation_records_how_far_a_text_moves_between_batch_compositions(published):
    import json

    validation = json.loads((published / "manifest.json").read_text())["validation"]
    assert 0 <= validation["batch_spread_max_abs"] < 0.1  # dynamic int8: measured, recorded, small
