"""Image encoders end to end: check, build (fp32, and a search on this host's target), validation against PyTorch on
held-out photographs, the published artifact's embed_images and classify_images, inspect and the CLI."""

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pipeline.build.inputs.image_data import default_image_data
from pipeline.build.table import build
from pipeline.errors import InputError
from pipeline.runtime import load
from tests.conftest import REPO, needs_triton, triton_answers
from tests.tiny import IMAGE_LABELS, make_image_model

pytest.importorskip("skimage", reason="the default images come from scikit-image (the dev and build extras)")
PHOTOS = Path(__import__("skimage").__file__).parent / "data"
HELD_OUT = [PHOTOS / name for name in ("chelsea.png", "rocket.jpg", "camera.png", "logo.png")]


def _reference(folder: Path, images: list) -> np.ndarray:
    """transformers' processor and model on `images`: the model's pooler output or logits, as the artifact's."""
    import torch
    import transformers
    from PIL import Image

    processor = transformers.AutoImageProcessor.from_pretrained(folder, use_fast=False)
    pictures = [Image.open(p).convert("RGB") for p in images]
    pixels = processor(images=pictures, return_tensors="pt")["pixel_values"]
    config = json.loads((folder / "config.json").read_text())
    with torch.inference_mode():
        if config.get("id2label") and len(config["id2label"]) == len(IMAGE_LABELS):
            return transformers.AutoModelForImageClassification.from_pretrained(folder)(pixel_values=pixels).logits
        out = transformers.AutoModel.from_pretrained(folder)(pixel_values=pixels)
        return (out.last_hidden_state[:, 0] if config["model_type"] == "vit" else out.pooler_output).numpy()


@pytest.fixture(scope="module")
def image_builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision")
    vit = make_image_model(root / "tiny-vit", "vit")
    dinov2 = make_image_model(root / "tiny-dinov2", "dinov2", "image-classification")
    dirs = {"artifacts_dir": root / "artifacts", "cache_dir": root / "cache"}
    fp32 = build(vit, "cpu-fp32", **dirs)
    searched = build(dinov2, "native", **dirs)
    return {"vit": (vit, fp32), "dinov2": (dinov2, searched), "root": root}


def test_build_publishes_an_image_embedding_model_equal_to_pytorch_on_held_out_photographs(image_builds):
    folder, manifest = image_builds["vit"]
    artifact = Path(manifest.published.path)
    assert sorted(p.name for p in artifact.iterdir()) == [
        "manifest.json",
        "model.onnx",
        "preprocessor_config.json",
        "report.json",
    ]
    validation = manifest.stage("validate").metrics
    assert validation["examples"] >= 40 and validation["cosine_min"] >= 0.9999
    got = load(artifact).embed_images([str(p) for p in HELD_OUT])
    expected = _reference(folder, HELD_OUT)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert got.shape == (len(HELD_OUT), 32) and cosine.min() >= 0.9999


def test_build_searches_an_image_classifier_and_its_labels_equal_pytorchs(image_builds):
    folder, manifest = image_builds["dinov2"]
    search = manifest.stage("search").metrics
    assert search["held_out_examples"] >= 40 and {r["status"] for r in search["candidates"]} <= {"passed", "missed"}
    assert manifest.stage("validate").metrics["top1_agreement"] >= 0.98
    model = load(manifest.published.path)
    predictions = model.classify_images([p.read_bytes() for p in HELD_OUT], top_k=3)
    expected = np.asarray(_reference(folder, HELD_OUT)).argmax(1)
    assert [p[0].label for p in predictions] == [IMAGE_LABELS[i] for i in expected]
    assert all(len(p) == 3 and p[0].score >= p[1].score >= p[2].score for p in predictions)
    with pytest.raises(InputError, match="embed_images\\(\\) needs a image-feature-extraction artifact"):
        model.embed_images([str(HELD_OUT[0])])


def test_cli_classify_and_inspect_an_image_artifact(image_builds):
    artifact = image_builds["dinov2"][1].published.path
    cli = [sys.executable, "-m", "pipeline"]
    out = subprocess.run([*cli, "classify", artifact, str(HELD_OUT[0]), "--top-k", "2"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    [line] = out.stdout.splitlines()
    assert line.startswith(f"{HELD_OUT[0]}: ") and len(line.split(", ")) == 2
    shown = subprocess.run([*cli, "inspect", artifact], capture_output=True, text=True, cwd=REPO)
    assert shown.returncode == 0 and "image-classification" in shown.stdout and "labels" in shown.stdout
    bad = subprocess.run([*cli, "classify", artifact, "/etc/hostname"], capture_output=True, text=True)
    assert bad.returncode == 3 and "is not an image Pillow can decode" in bad.stderr


def test_check_names_the_image_task_and_refuses_a_folder_without_an_image_processor(image_builds, tmp_path):
    import shutil

    cli = [sys.executable, "-m", "pipeline", "check"]
    folder = image_builds["dinov2"][0]
    out = subprocess.run([*cli, str(folder), "--target", "cpu-fp32"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and "task image-classification" in out.stdout, out.stderr
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "preprocessor_config.json").unlink()
    out = subprocess.run([*cli, str(bare)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 3 and "is an image model and needs an image processor (preprocessor_config.json)" in (
        out.stderr
    )
    assert "tokenizer" not in out.stderr


def test_build_refuses_text_data_for_an_image_model_in_one_line(image_builds, texts_file, tmp_path):
    folder = image_builds["vit"][0]
    dirs = {"artifacts_dir": tmp_path / "a", "cache_dir": tmp_path / "c"}
    with pytest.raises(
        InputError,
        match="holds other examples than image files, and tiny-vit is an image model; pass a folder of image files",
    ):
        build(folder, "cpu-fp32", validation=texts_file, **dirs)
    assert not (tmp_path / "a").exists() or not any((tmp_path / "a").rglob("manifest.json"))


def test_default_image_data_holds_out_whole_pictures(image_builds):
    from pipeline.build.inputs.data import normalized, read_texts

    validation, calibration = default_image_data(image_builds["root"] / "cache")
    held_out, calibrated = read_texts(validation, "validation"), read_texts(calibration, "calibration")
    assert len(held_out) >= 40 and len(calibrated) >= 40
    assert not {normalized(p) for p in held_out} & {normalized(p) for p in calibrated}
    source = {Path(p).name.rsplit("-", 1)[0].removesuffix("-top").removesuffix("-bottom") for p in held_out}
    assert not source & {
        Path(p).name.rsplit("-", 1)[0].removesuffix("-top").removesuffix("-bottom") for p in calibrated
    }


@pytest.mark.slow  # a live tritonserver
@needs_triton
def test_triton_serves_a_picture_as_the_runtime_embeds_it_and_refuses_bytes_that_are_none(image_builds, tmp_path):
    from PIL import Image

    artifact = image_builds["vit"][1].published.path
    picture = io.BytesIO()
    Image.fromarray(np.random.default_rng(4).integers(0, 256, size=(50, 30, 3), dtype=np.uint8)).save(picture, "JPEG")
    kind, answers = triton_answers(artifact, tmp_path, [picture.getvalue(), b"not a picture at all"])
    assert kind == "IMAGE"
    np.testing.assert_allclose(answers[0], load(artifact).run([picture.getvalue()])[0], atol=1e-4)
    assert answers[1].status() == "400" and "not a picture at all" not in answers[1].message()


def test_triton_export_of_an_image_classifier_writes_the_python_model_only(image_builds, tmp_path):
    from pipeline.errors import ServingError
    from pipeline.serving.triton import repository_from_artifact

    artifact = image_builds["dinov2"][1].published.path
    with pytest.raises(ServingError, match="exports only as the python variant .* pass --variant python"):
        repository_from_artifact(artifact, tmp_path / "graph", variants=("graph",))
    assert not (tmp_path / "graph").exists()
    said = []
    [config] = repository_from_artifact(artifact, tmp_path / "repo", notify=said.append)
    assert config.parent.name.endswith("_python") and "LOGITS" in config.read_text() and "IMAGE" in config.read_text()
    assert said and "decodes and preprocesses" in said[0]


@pytest.mark.slow  # a live Ray Serve deployment
def test_ray_serve_embeds_a_posted_picture_and_refuses_bytes_that_are_none(image_builds, tmp_path):
    pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")
    from PIL import Image

    from tests.conftest import served_answers

    artifact = image_builds["vit"][1].published.path
    picture = io.BytesIO()
    Image.fromarray(np.random.default_rng(3).integers(0, 256, size=(40, 60, 3), dtype=np.uint8)).save(picture, "PNG")
    answers = served_answers(artifact, [picture.getvalue(), b"not a picture at all"], "image/png")
    status, answer = answers[0]
    expected = load(artifact).run([picture.getvalue()])
    assert status == 200 and np.allclose(np.asarray(next(iter(answer.values()))), expected, atol=1e-4)
    assert answers[1][0] == 400 and "error" in answers[1][1]
