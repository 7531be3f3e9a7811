"""Every architecture in the table is built end to end; a row without a test fails here."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from pipeline.build.inputs.architectures import ARCHITECTURES
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.table import build
from pipeline.runtime import artifact as artifact_schema
from pipeline.runtime import load
from tests.tiny import DECODERS, HEADS, make_checkpoint, make_decoder, make_sentence_transformer
from tests.tiny_text2text import FAMILIES as TEXT2TEXT_FAMILIES

# Families the table does not hold, built from a fresh process on the generic record that optimum-onnx's registry
# gives them (the registry fills only once its ONNX configs are imported: a fresh CLI process found none).
GENERIC = ("megatron-bert", "opt")
# What ORT's BERT optimizer fuses in each tiny 2-layer encoder; the families it does not know get the generic
# passes (constant folding, dead-node removal) and no fusion. DistilBERT's attention is fused by this project's own
# pass (ORT's leaves it decomposed), and ALBERT's first layer once its residual sum is reordered (ORT's fuses the
# second only).
ENCODER_FUSIONS = {
    "bert": {"EmbedLayerNormalization": 1, "Attention": 2, "SkipLayerNormalization": 4, "BiasGelu": 2},
    "electra": {"EmbedLayerNormalization": 1, "Attention": 2, "SkipLayerNormalization": 4, "BiasGelu": 2},
    "roberta": {"Attention": 2, "SkipLayerNormalization": 4, "BiasGelu": 2, "LayerNormalization": 1},
    "xlm-roberta": {"Attention": 2, "SkipLayerNormalization": 4, "BiasGelu": 2, "LayerNormalization": 1},
    "camembert": {"Attention": 2, "SkipLayerNormalization": 4, "BiasGelu": 2, "LayerNormalization": 1},
    "distilbert": {"Attention": 2, "SkipLayerNormalization": 4, "BiasGelu": 2, "LayerNormalization": 1},
    "albert": {"Attention": 2, "SkipLayerNormalization": 4, "FastGelu": 2, "LayerNormalization": 1},
    "mpnet": {},
    "deberta-v2": {},
    "modernbert": {},
}
TESTED_ENCODERS = tuple(ENCODER_FUSIONS)
TESTED_DECODERS = (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "granite",
    "olmo2",
    "smollm3",
    "gpt_neox",
)
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
TESTED_TASKS = (
    "feature-extraction",
    "sequence-classification",
    "token-classification",
    "fill-mask",
    "question-answering",
    "text-generation",
)


# Image encoders: tests/build/test_vision.py builds vit and dinov2 end to end; deit here, at fp32 (and beit, swin and
# convnext on generic records); tests/build/test_two_tower.py clip and siglip.
TESTED_IMAGE_ENCODERS = ("vit", "deit", "dinov2", "clip", "siglip")
TESTED_IMAGE_TASKS = ("image-feature-extraction", "image-classification", "zero-shot-image-classification")
# Tested in tests/build/speech/test_speech.py: a tiny random Whisper and Whisper tiny.en.
TESTED_SPEECH, TESTED_SPEECH_TASKS = ("whisper",), ("automatic-speech-recognition",)
# Tested in tests/build/text2text/test_text2text.py: a tiny random model of each.
TESTED_TEXT2TEXT, TESTED_TEXT2TEXT_TASKS = tuple(TEXT2TEXT_FAMILIES), ("text2text-generation",)


def test_every_table_row_has_a_test():
    tested = set(TESTED_ENCODERS) | set(TESTED_DECODERS) | set(TESTED_IMAGE_ENCODERS) | set(TESTED_SPEECH)
    tested |= set(TESTED_TEXT2TEXT)
    assert tested == set(ARCHITECTURES)
    decoders = {a for a in ARCHITECTURES if ARCHITECTURES[a].family == "decoder"}
    assert decoders == set(TESTED_DECODERS) == set(DECODERS) - set(GENERIC)
    assert not set(GENERIC) & set(ARCHITECTURES)
    assert set(TESTED_TASKS) | set(TESTED_IMAGE_TASKS) | set(TESTED_SPEECH_TASKS) | set(TESTED_TEXT2TEXT_TASKS) == set(
        TASKS
    )
    # The runtime's manifest schema lists the tasks apart (it imports nothing of the build): the two agree.
    assert set(artifact_schema.TASKS) == set(TASKS)


@pytest.mark.parametrize("model_type", ["deit", "beit", "swin", "convnext"])
def test_an_image_classifier_builds_at_fp32_and_equals_pytorch(model_type, tmp_path):
    from PIL import Image

    from tests.tiny import make_image_model

    folder = make_image_model(tmp_path / f"tiny-{model_type}", model_type, "image-classification")
    manifest = build(folder, "cpu-fp32", artifacts_dir=tmp_path / "a", cache_dir=tmp_path / "c")
    picture = np.random.default_rng(1).integers(0, 256, size=(50, 70, 3), dtype=np.uint8)
    got = load(manifest.published.path).run([picture])
    processor = transformers.AutoImageProcessor.from_pretrained(folder, use_fast=False)
    model = transformers.AutoModelForImageClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        expected = model(**processor(images=[Image.fromarray(picture)], return_tensors="pt")).logits.numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)


@pytest.mark.slow  # five builds of about 15 s
@pytest.mark.parametrize("model_type", ["vit", "deit", "beit", "swin", "convnext"])
def test_an_image_classifier_builds_with_int8_activations_judged_on_its_labels(model_type, tmp_path):
    """One quantized build per classifier family: dynamic int8 (the one candidate), gated on top-1 label agreement
    and probabilities against PyTorch on the development pictures, published, and run by the loader."""
    import onnx

    from tests.conftest import write_target
    from tests.tiny import make_image_model

    folder = make_image_model(tmp_path / f"tiny-{model_type}", model_type, "image-classification")
    candidate = {"name": "ort-int8-dynamic", "engine": "onnxruntime", "precision": "int8", "quantize": "dynamic"}
    # A random tiny classifier's logits sit close together, so int8 may move a label: a gate it can meet.
    target = write_target(
        tmp_path,
        "image-int8",
        "cpu-avx2",
        candidates=[candidate],
        accuracy={"top1_agreement": 0.5, "max_probability_diff": 0.2},
    )
    manifest = build(folder, str(target), artifacts_dir=tmp_path / "a", cache_dir=tmp_path / "c")
    [row] = manifest.stage("search").metrics["candidates"]
    assert row["status"] == "passed" and row["held_out"]["status"] == "passed"
    assert 0.5 <= row["top1_agreement"] <= 1.0 and row["max_probability_diff"] <= 0.2
    artifact = Path(manifest.published.path)
    ops = {n.op_type for n in onnx.load(str(artifact / "model.onnx")).graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger"} & ops, sorted(ops)  # the MatMuls run in int8
    picture = np.random.default_rng(1).integers(0, 256, size=(50, 70, 3), dtype=np.uint8)
    [labels] = load(artifact).classify_images([picture], top_k=2)
    assert len(labels) == 2 and labels[0].score >= labels[1].score


@pytest.mark.parametrize("model_type", GENERIC)
def test_a_family_the_table_lacks_builds_from_a_fresh_process_on_a_generic_record(model_type, texts_file, tmp_path):
    import subprocess
    import sys

    decoder = model_type in DECODERS
    folder = (make_decoder if decoder else make_checkpoint)(tmp_path / f"tiny-{model_type}", model_type)
    dirs = ["--artifacts-dir", str(tmp_path / "a"), "--cache-dir", str(tmp_path / "c")]
    data = ["--validation", str(texts_file), "--calibration", str(texts_file)]
    args = [sys.executable, "-m", "pipeline", "-q", "build", "--model", str(folder), "--target", "cpu-fp32"]
    out = subprocess.run(args + dirs + data, capture_output=True, text=True, cwd=Path(__file__).parents[3])
    assert out.returncode == 0, out.stderr
    artifact = tmp_path / "a" / f"tiny-{model_type}" / "latest" / "cpu-fp32"
    stages = json.loads((artifact / "report.json").read_text())["stages"]
    model = load(artifact)
    if decoder:
        assert stages["export"]["metrics"]["attention"]["op"] is None  # a generic record keeps it decomposed
        [completion] = model.generate(["The cat sat on"], max_new_tokens=4, eos=False)
        assert completion.token_ids == _hf_greedy(folder, ["The cat sat on"], 4)[0]
    else:
        assert stages["optimize"]["metrics"]["passes"] == "generic"
        torch_model, tokenizer = _torch(folder)
        expected = _forward(torch_model, tokenizer, ["a generic family"])[0].last_hidden_state[0].mean(0).numpy()
        np.testing.assert_allclose(model.run(["a generic family"])[0], expected, atol=1e-4)


def test_a_longrope_decoder_stops_where_its_rotary_would_switch_factors(texts_file, tmp_path):
    # transformers picks longrope's long factors per call, once a sequence passes original_max_position_embeddings;
    # a traced graph keeps the short ones, so the artifact's length stops there, where the two agree.
    rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0, 1.5, 2, 3, 4, 6, 8, 12]}
    folder = make_decoder(
        tmp_path / "tiny-phi3-longrope", "phi3", original_max_position_embeddings=64, rope_scaling=rope
    )
    manifest = _build_fp32(folder, (texts_file, texts_file), tmp_path)
    assert manifest.checkpoint.max_length == 64 and manifest.stage("export").metrics["spec"]["max_length"] == 64
    assert manifest.stage("validate").metrics["greedy_match"] == 1.0
    prompt = " ".join(["the cat sat on the mat"] * 3)  # 29 tokens: with 16 new ones, within the 64
    [completion] = load(manifest.published.path).generate([prompt], max_new_tokens=16, eos=False)
    assert completion.token_ids == _hf_greedy(folder, [prompt], 16)[0]


def _build_fp32(folder: Path, data: tuple[Path, Path], tmp_path: Path, task: str | None = None):
    return build(
        folder,
        "cpu-fp32",
        task=task,
        validation=data[0],
        calibration=data[1],
        artifacts_dir=tmp_path / "artifacts",
        cache_dir=tmp_path / "cache",
    )


def _torch(folder: Path, head: str = "AutoModel"):
    model = getattr(transformers, head).from_pretrained(folder, attn_implementation="eager").eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder)


def _forward(model, tokenizer, *texts):
    enc = tokenizer(*texts, return_tensors="pt", return_offsets_mapping=True)
    accepted = model.forward.__code__.co_varnames
    if getattr(model.config, "type_vocab_size", 2) < 2:
        enc.pop("token_type_ids", None)
    with torch.inference_mode():
        return model(**{k: v for k, v in enc.items() if k in accepted}), enc


@pytest.mark.parametrize("model_type", TESTED_ENCODERS)
def test_build_each_encoder_matches_transformers_at_fp32_and_reports_its_passes(
    model_type, texts_file, calibration_file, tmp_path
):
    folder = make_checkpoint(tmp_path / f"tiny-{model_type}", model_type)
    manifest = _build_fp32(folder, (texts_file, calibration_file), tmp_path)
    assert manifest.checkpoint.model_type == model_type
    texts = ["first text", "and the second one, a little longer than the first"]
    got = load(manifest.published.path).run(texts)
    model, tokenizer = _torch(folder)
    expected = np.stack([_forward(model, tokenizer, [t])[0].last_hidden_state[0].mean(0).numpy() for t in texts])
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() > 0.99999 and np.abs(got - expected).max() < 1e-4
    report = json.loads((Path(manifest.published.path) / "report.json").read_text())
    optimize = report["stages"]["optimize"]["metrics"]
    assert optimize["fused"] == ENCODER_FUSIONS[model_type]
    own = {
        "distilbert": ", then attention from its where-mask layout",
        "albert": ", then attention from its residual-first layout",
    }.get(model_type, "")
    assert optimize["passes"] == (f"onnxruntime bert fusions{own}" if ENCODER_FUSIONS[model_type] else "generic")
    assert optimize["nodes_after"] < optimize["nodes_before"]


@pytest.mark.parametrize(
    ("dense", "normalize"),
    [(((16, "Tanh"),), True), (((24, "GELU"), (16, "Identity")), False)],
    ids=["dense-tanh-normalize", "two-dense-unnormalized"],
)
def test_sentence_transformer_with_dense_modules_embeds_as_sentence_transformers_does(
    dense, normalize, texts_file, calibration_file, tmp_path
):
    from sentence_transformers import SentenceTransformer

    folder = make_sentence_transformer(tmp_path / "st-dense", dense=dense, normalize=normalize)
    manifest = _build_fp32(folder, (texts_file, calibration_file), tmp_path)
    assert [d["out_features"] for d in manifest.checkpoint.pooling["dense"]] == [out for out, _ in dense]
    texts = ["first text", "and the second one, a little longer than the first"]
    got = load(manifest.published.path).run(texts)
    expected = SentenceTransformer(str(folder), device="cpu").encode(texts, convert_to_numpy=True)
    assert got.shape == expected.shape == (2, dense[-1][0])
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() > 0.99999 and np.abs(got - expected).max() < 1e-4
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5) == normalize


def test_fill_mask_artifact_predicts_what_transformers_predicts(texts_file, calibration_file, tmp_path):
    folder = make_checkpoint(tmp_path / "tiny-bert-mlm", "bert", "fill-mask")
    manifest = _build_fp32(folder, (texts_file, calibration_file), tmp_path)
    assert manifest.checkpoint.task == "fill-mask"
    assert manifest.stage("validate").metrics["top1_agreement"] == 1.0
    model = load(manifest.published.path)
    [[masked]] = model.fill_mask(["The cat sat on the [MASK] all day."], top_k=3)
    pipe = transformers.pipeline("fill-mask", model=str(folder), tokenizer=str(folder), top_k=3)
    expected = pipe("The cat sat on the [MASK] all day.")
    assert [p["token_id"] for p in masked] == [e["token"] for e in expected]
    assert [p["token"] for p in masked] == [e["token_str"] for e in expected]
    np.testing.assert_allclose([p["score"] for p in masked], [e["score"] for e in expected], rtol=1e-4)
    [logits] = model.run(["a [MASK] b"])
    assert logits.shape == (5, 30522)


def test_question_answering_artifact_answers_the_span_transformers_logits_give(texts_file, calibration_file, tmp_path):
    folder = make_checkpoint(tmp_path / "tiny-roberta-qa", "roberta", "question-answering")
    manifest = _build_fp32(folder, (texts_file, calibration_file), tmp_path)
    assert manifest.checkpoint.task == "question-answering"
    assert manifest.stage("validate").metrics["top1_agreement"] == 1.0
    model = load(manifest.published.path)
    question = "Where did the cat sit?"
    context = "The cat sat on the mat by the door, and the dog slept in the garden all afternoon."
    [got] = model.answer([question], [context], max_answer_length=5)
    torch_model, tokenizer = _torch(folder, "AutoModelForQuestionAnswering")
    out, enc = _forward(torch_model, tokenizer, [question], [context])
    start, end = out.start_logits[0].numpy(), out.end_logits[0].numpy()
    in_context = [i for i, s in enumerate(enc.sequence_ids(0)) if s == 1]
    best = max(
        ((i, j) for i in in_context for j in in_context if i <= j < i + 5), key=lambda ij: start[ij[0]] + end[ij[1]]
    )
    offsets = enc["offset_mapping"][0].tolist()
    assert (got["start"], got["end"]) == (offsets[best[0]][0], offsets[best[1]][1])
    assert got["answer"] == context[got["start"] : got["end"]] and got["answer"]
    [logits] = model.run([(question, context)])
    np.testing.assert_allclose(logits, np.stack([start, end], -1), atol=1e-4)


@pytest.mark.parametrize("task", ["sequence-classification", "token-classification"])
def test_classifier_artifact_gives_transformers_logits(task, texts_file, calibration_file, tmp_path):
    folder = make_checkpoint(tmp_path / f"tiny-electra-{task}", "electra", task)
    manifest = _build_fp32(folder, (texts_file, calibration_file), tmp_path)
    assert manifest.checkpoint.task == task
    [got] = load(manifest.published.path).run(["A text to classify, token by token."])
    torch_model, tokenizer = _torch(folder, HEADS[task])
    expected = _forward(torch_model, tokenizer, ["A text to classify, token by token."])[0].logits[0].numpy()
    np.testing.assert_allclose(got, expected, atol=1e-4)


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
    from tests.conftest import SMALL_TEXTS

    folder = make_decoder(tmp_path / f"tiny-{model_type}", model_type)
    manifest = build(
        folder,
        "cpu-fp32",
        validation=texts_file,
        calibration=texts_file,
        artifacts_dir=tmp_path / "artifacts",
        cache_dir=tmp_path / "cache",
    )
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
    model = load(manifest.published.path)
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
