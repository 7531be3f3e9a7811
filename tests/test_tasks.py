"""Every architecture in the table is built end to end; a row without a test fails here."""

import numpy as np
import pytest

from pipeline.build import build
from pipeline.runtime import load
from pipeline.tasks import ARCHITECTURES, TASKS

from .conftest import make_checkpoint

TESTED_ARCHITECTURES = ("bert", "roberta", "distilbert", "electra")
TESTED_TASKS = ("feature-extraction", "sequence-classification", "token-classification")


def test_every_table_row_has_a_test():
    assert set(TESTED_ARCHITECTURES) == set(ARCHITECTURES)
    assert set(TESTED_TASKS) == set(TASKS)


@pytest.mark.parametrize("model_type", TESTED_ARCHITECTURES)
def test_build_each_architecture_validates_and_runs(model_type, texts_file, tmp_path):
    task = "sequence-classification" if model_type == "roberta" else "feature-extraction"
    folder = make_checkpoint(tmp_path / f"tiny-{model_type}", model_type, task)
    manifest = build(
        folder, "cpu-avx2", validation=texts_file, calibration=texts_file,
        artifacts_dir=tmp_path / "artifacts", cache_dir=tmp_path / "cache",
    )  # fmt: skip
    model = load(manifest.published["path"])
    out = model.run(["first text", "and the second one"])
    assert out.shape == (2, 3 if task != "feature-extraction" else 32) and np.isfinite(out).all()
    assert manifest.checkpoint.model_type == model_type
