"""Every architecture in the table is built end to end; a row without a test fails here."""

import numpy as np
import pytest

from pipeline.architectures import ARCHITECTURES
from pipeline.build import build
from pipeline.runtime import load
from pipeline.tasks import TASKS

from .tiny import DECODERS, make_checkpoint, make_decoder

TESTED_ENCODERS = ("bert", "roberta", "distilbert", "electra")
TESTED_DECODERS = (
    "gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2", "gemma3_text", "granite", "olmo2",
    "smollm3", "gpt_neox",
)  # fmt: skip
# What ORT's optimizer fuses in each 2-layer decoder: the residual Add with the next norm (GPT-NeoX's parallel
# residual leaves one per layer), RMSNorm as SimplifiedLayerNormalization, and the MLP's Gelu.
DECODER_FUSIONS = {
    "gpt2": {"SkipLayerNormalization": 4, "FastGelu": 2},
    "llama": {"SkipSimplifiedLayerNormalization": 4, "SimplifiedLayerNormalization": 1},
    "qwen2": {"SkipSimplifiedLayerNormalization": 4, "SimplifiedLayerNormalization": 1},
    "gpt_neox": {"SkipLayerNormalization": 2, "BiasGelu": 2},
}
# Why a tiny decoder keeps its decomposed attention: 8 rotary dimensions a head (head size 16, rotary_pct 0.5).
DECODER_DECOMPOSED = {"gpt_neox": "8 rotary dimensions"}
# The GroupQueryAttention attributes each tiny decoder's layers get beyond the head counts (tests/tiny.py's
# configs): sliding windows of 8, Gemma's query_pre_attn_scalar of 24, Gemma 2's softcap, Granite's multiplier.
GEMMA_SCALE = 24**-0.5
DECODER_ATTENTION = {
    "mistral": [{"local_window_size": 8}] * 2,
    "gemma2": [{"scale": GEMMA_SCALE, "local_window_size": 8, "softcap": 5.0}, {"scale": GEMMA_SCALE, "softcap": 5.0}],
    "gemma3_text": [{"scale": GEMMA_SCALE, "local_window_size": 8}] * 2 + [{"scale": GEMMA_SCALE}],
    "granite": [{"scale": 0.3}] * 2,
}
TESTED_TASKS = ("feature-extraction", "sequence-classification", "token-classification", "text-generation")


def test_every_table_row_has_a_test():
    assert set(TESTED_ENCODERS) | set(TESTED_DECODERS) == set(ARCHITECTURES)
    assert {a for a in ARCHITECTURES if ARCHITECTURES[a].family == "decoder"} == set(TESTED_DECODERS) == set(DECODERS)
    assert set(TESTED_TASKS) == set(TASKS)


@pytest.mark.parametrize("model_type", TESTED_ENCODERS)
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


def _hf_greedy(folder, prompts: list[str], new_tokens: int) -> list[tuple]:
    """transformers' greedy continuation of each prompt alone (up to its end-of-sequence token, if it makes one)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")
        with torch.inference_mode():
            made = model.generate(**ids, do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
        out.append(tuple(made[0, ids["input_ids"].shape[1] :].tolist()))
    return out


@pytest.mark.parametrize("model_type", TESTED_DECODERS)
def test_build_each_decoder_generates_what_transformers_generates(model_type, texts_file, tmp_path):
    from .conftest import SMALL_TEXTS

    folder = make_decoder(tmp_path / f"tiny-{model_type}", model_type)
    manifest = build(
        folder, "cpu-fp32", validation=texts_file, calibration=texts_file,
        artifacts_dir=tmp_path / "artifacts", cache_dir=tmp_path / "cache",
    )  # fmt: skip
    validation = manifest.stage("validate").metrics
    assert validation["greedy_match"] == 1.0 and validation["new_tokens"] == 32 and validation["top1_agreement"] == 1
    assert manifest.stage("export").metrics["last_token_logits"]
    attention = manifest.stage("export").metrics["attention"]
    if model_type in DECODER_DECOMPOSED:
        assert attention["op"] is None and DECODER_DECOMPOSED[model_type] in attention["why"]
    else:
        assert attention["op"] == "GroupQueryAttention" and attention["cache"] == "shared"
        expected_attributes = DECODER_ATTENTION.get(model_type, [{}] * attention["layers"])
        rounded = [
            [{k: round(v, 6) for k, v in layer.items()} for layer in a]
            for a in (attention["attributes"], expected_attributes)
        ]
        assert rounded[0] == rounded[1]
    fused = manifest.stage("optimize").metrics["fused"]
    expected = DECODER_FUSIONS.get(model_type, {})
    assert {op: fused.get(op) for op in expected} == expected
    model = load(manifest.published["path"])
    [completion] = model.generate(["The cat sat on"], max_new_tokens=8, eos=False)
    assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
    # One right-padded batch of prompts of different lengths (longer than the sliding windows with what is
    # generated), and each prompt alone: transformers' greedy continuation of each prompt alone.
    prompts = SMALL_TEXTS[:6]
    expected_tokens = _hf_greedy(folder, prompts, 12)
    together = model.generate(prompts, max_new_tokens=12, batch_size=len(prompts), eos=False)
    alone = [model.generate([p], max_new_tokens=12, eos=False)[0] for p in prompts]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.token_ids[: len(e)] for c, e in zip(alone, expected_tokens, strict=True)] == expected_tokens
