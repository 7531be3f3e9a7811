"""Every architecture in the table is built end to end; a row without a test fails here."""

import numpy as np
import pytest

from pipeline.architectures import ARCHITECTURES
from pipeline.build import build
from pipeline.runtime import load
from pipeline.tasks import TASKS

from .tiny import DECODERS, make_checkpoint, make_decoder

TESTED_ENCODERS = ("bert", "roberta", "distilbert", "electra")
TESTED_DECODERS = ("gpt2", "llama", "qwen2", "gpt_neox")
# What ORT's optimizer fuses in each 2-layer decoder: the residual Add with the next norm (GPT-NeoX's parallel
# residual leaves one per layer), RMSNorm as SimplifiedLayerNormalization, and the MLP's Gelu.
DECODER_FUSIONS = {
    "gpt2": {"SkipLayerNormalization": 4, "FastGelu": 2},
    "llama": {"SkipSimplifiedLayerNormalization": 4, "SimplifiedLayerNormalization": 1},
    "qwen2": {"SkipSimplifiedLayerNormalization": 4, "SimplifiedLayerNormalization": 1},
    "gpt_neox": {"SkipLayerNormalization": 2, "BiasGelu": 2},
}
TESTED_TASKS = ("feature-extraction", "sequence-classification", "token-classification", "text-generation")


def test_every_table_row_has_a_test():
    assert set(TESTED_ENCODERS) | set(TESTED_DECODERS) == set(ARCHITECTURES)
    assert {a for a in ARCHITECTURES if ARCHITECTURES[a].family == "decoder"} == set(TESTED_DECODERS) == set(DECODERS)
    assert set(TESTED_TASKS) == set(TASKS)


@pytest.mark.parametrize("model_type", TESTED_ENCODERS)
def test_build_each_architecture_validates_and_runs(model_type, texts_file, calibration_file, tmp_path):
    task = "sequence-classification" if model_type == "roberta" else "feature-extraction"
    folder = make_checkpoint(tmp_path / f"tiny-{model_type}", model_type, task)
    manifest = build(
        folder, "cpu-avx2", validation=texts_file, calibration=calibration_file,
        artifacts_dir=tmp_path / "artifacts", cache_dir=tmp_path / "cache",
    )  # fmt: skip
    model = load(manifest.published["path"])
    out = model.run(["first text", "and the second one"])
    assert out.shape == (2, 3 if task != "feature-extraction" else 32) and np.isfinite(out).all()
    assert manifest.checkpoint.model_type == model_type


@pytest.mark.parametrize("model_type", TESTED_DECODERS)
def test_build_each_decoder_generates_what_transformers_generates(model_type, texts_file, tmp_path):
    folder = make_decoder(tmp_path / f"tiny-{model_type}", model_type)
    manifest = build(
        folder, "cpu-fp32", validation=texts_file, calibration=texts_file,
        artifacts_dir=tmp_path / "artifacts", cache_dir=tmp_path / "cache",
    )  # fmt: skip
    validation = manifest.stage("validate").metrics
    assert validation["greedy_match"] == 1.0 and validation["new_tokens"] == 32 and validation["top1_agreement"] == 1
    assert manifest.stage("export").metrics["last_token_logits"]
    fused = manifest.stage("optimize").metrics["fused"]
    assert {op: fused.get(op) for op in DECODER_FUSIONS[model_type]} == DECODER_FUSIONS[model_type]
    model = load(manifest.published["path"])
    [completion] = model.generate(["The cat sat on"], max_new_tokens=8, eos=False)
    assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
