"""Two-tower image-text models (CLIP, SigLIP) end to end: tiny random checkpoints through check, build (the image
tower searched and gated), publish, load, zero-shot labels, against transformers. Real parts: the exporter, ONNX
Runtime, transformers as the reference, scikit-image's photographs."""

import json

import numpy as np
import pytest

from pipeline.build.table import build
from pipeline.errors import ArtifactError, InputError
from pipeline.runtime import artifact_graphs, load
from tests.conftest import tampered_copy
from tests.tiny import decoder_tokenizer

LABELS = ["a photo of a cat", "a photo of an astronaut", "a cup of coffee", "a motorcycle", "a rocket"]
_TOWER = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
_PROCESSORS = {
    "clip": {
        "image_processor_type": "CLIPImageProcessor",
        "size": {"shortest_edge": 32},
        "crop_size": {"height": 32, "width": 32},
    },
    "siglip": {"image_processor_type": "SiglipImageProcessor", "size": {"height": 32, "width": 32}},
}


def make_two_tower(folder, model_type: str, seed: int = 0):
    """A tiny random CLIP or SigLIP with a byte-level BPE tokenizer (ending each text with </s>) and its image
    processor's preprocessor_config.json."""
    import torch
    import transformers
    from tokenizers import processors

    tokenizer = decoder_tokenizer(["<pad>", "<s>", "</s>", "<unk>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    vocab = tokenizer.get_vocab_size()
    text = {**_TOWER, "vocab_size": vocab, "max_position_embeddings": 24, "pad_token_id": 0, "eos_token_id": 2}
    vision = {**_TOWER, "image_size": 32, "patch_size": 8}
    if model_type == "clip":
        text["bos_token_id"] = 1
        config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    else:
        config = transformers.SiglipConfig(text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    transformers.AutoModel.from_config(config).eval().save_pretrained(folder)
    special = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special).save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(_PROCESSORS[model_type]))
    return folder


def _photographs() -> list[str]:
    import skimage

    root = skimage.data.__path__[0]
    return [f"{root}/{name}" for name in ("astronaut.png", "chelsea.png", "coffee.png", "motorcycle_left.png")]


def _transformers_scores(folder, model_type: str, pictures: list[str], labels: list[str]) -> np.ndarray:
    import torch
    import transformers
    from PIL import Image

    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="eager").eval()
    processor = transformers.AutoImageProcessor.from_pretrained(folder, use_fast=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    padding = {"padding": "max_length", "max_length": 24} if model_type == "siglip" else {"padding": True}
    text = tokenizer(labels, return_tensors="pt", return_token_type_ids=False, **padding)
    if model_type == "siglip":
        text.pop("attention_mask")
    images = [Image.open(p).convert("RGB") for p in pictures]
    with torch.inference_mode():
        out = model(pixel_values=processor(images=images, return_tensors="pt")["pixel_values"], **text)
    logits = out.logits_per_image
    return (torch.sigmoid(logits) if model_type == "siglip" else logits.softmax(-1)).numpy()


@pytest.fixture(scope="module", params=["clip", "siglip"])
def two_tower_build(request, tmp_path_factory):
    folder = make_two_tower(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}", request.param)
    dirs = tmp_path_factory.mktemp("build")
    manifest = build(folder, "cpu-avx2", artifacts_dir=dirs / "artifacts", cache_dir=dirs / "cache")
    return request.param, folder, manifest


def test_zero_shot_scores_and_labels_equal_transformers_on_photographs(two_tower_build):
    model_type, folder, manifest = two_tower_build
    model = load(manifest.published.path)
    assert model.task == "zero-shot-image-classification"
    pictures = _photographs()
    expected = _transformers_scores(folder, model_type, pictures, LABELS)
    got = model.scores(pictures, LABELS)
    chosen = manifest.stage("search").metrics["chosen"]
    np.testing.assert_allclose(got, expected, atol=1e-4 if "fp32" in chosen else 0.05)
    assert np.ptp(expected) > 0.01  # the pictures and labels score apart: a test of something
    if "fp32" in chosen:
        assert [p[0].label for p in model.classify_images(pictures, LABELS)] == [LABELS[i] for i in expected.argmax(-1)]
    [top] = model.classify_images(pictures[:1], LABELS, top_k=2)
    assert len(top) == 2 and top[0].score >= top[1].score


def test_the_artifact_holds_both_towers_verified_and_refuses_a_tampered_text_tower(two_tower_build, tmp_path):
    from pathlib import Path

    folder = Path(two_tower_build[2].published.path)
    published = json.loads((folder / "manifest.json").read_text())
    # the image tower is whichever engine's graph the search chose on this host; the text tower is no graph to load
    [image_tower] = artifact_graphs(published)
    assert image_tower in {"model.onnx", "model.xml"}
    assert {image_tower, "text.onnx", "tokenizer.json", "preprocessor_config.json"} <= set(published["files"])
    with pytest.raises(ArtifactError, match="text.onnx"):
        load(tampered_copy(folder, tmp_path, "text.onnx"))


def test_bad_labels_get_one_line_and_the_model_keeps_working(two_tower_build):
    model = load(two_tower_build[2].published.path)
    with pytest.raises(InputError, match="over the model's 24"):
        model.embed_texts(["word " * 40])
    with pytest.raises(InputError, match="takes a list of strings"):
        model.scores(_photographs()[:1], "a cat")
    assert model.embed_texts(LABELS[:2]).shape[0] == 2


def test_check_needs_a_tokenizer_beside_the_image_processor(two_tower_build, tmp_path):
    import shutil

    from pipeline.ops.check import check

    _, folder, _ = two_tower_build
    report = check(str(folder), "cpu-avx2")
    assert (report["task"], report["family"]) == ("zero-shot-image-classification", "encoder")
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(InputError, match="has no tokenizer"):
        check(str(bare), "cpu-avx2")


def test_the_search_gates_the_image_tower_on_photographs(two_tower_build):
    search = two_tower_build[2].stage("search").metrics
    rows = {r["name"]: r for r in search["candidates"]}
    assert search["chosen"] in rows and rows[search["chosen"]]["status"] == "passed"
    assert len(rows) > 1  # the encoder candidates of the target, each built and judged


@pytest.mark.slow  # a live Ray Serve deployment
def test_ray_serve_embeds_a_posted_picture(two_tower_build):
    pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")
    if two_tower_build[0] != "clip":
        pytest.skip("one two-tower family shows the serving path: Ray Serve runs the image tower alike for both")
    from pathlib import Path

    from tests.conftest import served_answers

    folder = two_tower_build[2].published.path
    picture = Path(_photographs()[1]).read_bytes()
    [(status, body)] = served_answers(folder, [picture], "image/png")
    assert status == 200
    np.testing.assert_allclose(body["embeddings"], load(folder).embed_images([picture]), atol=1e-5)
