"""The image benchmark's structure and accuracy columns (never its timings): a tiny ViT artifact against OpenVINO's
default compile of its export and PyTorch fp32, quick."""

import json

import pytest

from pipeline.bench import markdown, run
from pipeline.bench.images import OPENVINO_DEFAULT, PYTORCH
from pipeline.build.table import build
from pipeline.build.timing import ARTIFACT
from pipeline.errors import InputError
from tests.tiny import make_image_model


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    folder = make_image_model(tmp_path_factory.mktemp("vit") / "tiny-vit", "vit")
    dirs = tmp_path_factory.mktemp("build")
    manifest = build(folder, "cpu-fp32", artifacts_dir=dirs / "artifacts", cache_dir=dirs / "cache")
    out = tmp_path_factory.mktemp("bench")
    return run(manifest.published.path, dirs / "cache", out, quick=True), out, manifest


@pytest.mark.slow  # a build and a bench of three variants
def test_every_variant_is_timed_at_each_batch_and_matches_pytorch(quick_results):
    results, out, _ = quick_results
    assert results["variants"] == [ARTIFACT, OPENVINO_DEFAULT, PYTORCH]
    assert set(results["batches"]) == {"1", "4"}
    for size, row in results["batches"].items():
        for variant, figures in row.items():
            low, high = figures["images_per_s"]["range"]
            assert 0 < low <= figures["images_per_s"]["median"] <= high
            assert figures["cosine"] > 0.999, (size, variant)  # an fp32 artifact and the default compile agree
            assert ("artifact_speedup" in figures) == (variant != ARTIFACT)
    written = json.loads((out / "bench.json").read_text())
    assert written["batches"].keys() == results["batches"].keys() and "host" in written
    text = (out / "bench.md").read_text()
    assert text == markdown(results) and "## batch 4" in text and OPENVINO_DEFAULT in text


def test_a_text_artifact_is_refused_by_the_image_benchmark(published_fp32):
    from pipeline.bench.images import bench_images

    with pytest.raises(InputError, match="the image benchmark takes image ones"):
        bench_images(published_fp32)
