"""Shape buckets at run time: each chunk padded to the spec's bucket for it, with the outputs of padding to the
longest text (pooled embeddings and per-token logits alike), on ONNX Runtime and OpenVINO; no plan, no change."""

import json

import numpy as np
import pytest

from pipeline.errors import ArtifactError
from pipeline.runtime import load
from pipeline.runtime.artifact import manifest_digest, verify_artifact
from pipeline.runtime.encoder import padded_width
from pipeline.runtime.load import open_model
from tests.conftest import SMALL_TEXTS, _publish
from tests.tiny import make_checkpoint

PLAN = [8, 16, 24, 128]


class Widths:
    """A real session that notes the padded width of each batch it runs."""

    def __init__(self, session):
        self.session, self.widths = session, []

    def run(self, names, feeds):
        self.widths.append(feeds["input_ids"].shape[1])
        return self.session.run(names, feeds)

    def __getattr__(self, name):
        return getattr(self.session, name)


@pytest.fixture(scope="module")
def published_tokens(texts_file, calibration_file, tmp_path_factory):
    """A tiny BERT token classifier built for cpu-fp32."""
    folder = tmp_path_factory.mktemp("ckpt-tokens")
    checkpoint = make_checkpoint(folder / "tiny-token-classification", "bert", "token-classification")
    return _publish(checkpoint, texts_file, calibration_file, tmp_path_factory.mktemp("published-tokens"), "cpu-fp32")


def test_padded_width_is_the_smallest_bucket_that_holds_the_longest_text():
    assert [padded_width(n, PLAN) for n in (1, 8, 9, 17, 24, 25, 128)] == [8, 8, 16, 24, 24, 128, 128]
    assert padded_width(130, PLAN) == 130  # longer than every bucket: its own length
    assert padded_width(13, None) == 13 and padded_width(13, []) == 13


def _pair(artifact, backend):
    manifest = verify_artifact(artifact)
    graph, tokenizer, spec = artifact / "model.onnx", artifact / "tokenizer.json", manifest["model"]
    spec = {k: v for k, v in spec.items() if k != "shape_buckets"}
    session = {"intra_op_threads": 2}
    plain = open_model(graph, tokenizer, spec, session=session, backend=backend)
    bucketed = open_model(graph, tokenizer, {**spec, "shape_buckets": PLAN}, session=session, backend=backend)
    plain.session, bucketed.session = Widths(plain.session), Widths(bucketed.session)
    return plain, bucketed


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
@pytest.mark.parametrize("task", ["feature-extraction", "token-classification"])
def test_shape_buckets_pad_each_chunk_to_its_bucket_and_give_the_unbucketed_outputs(
    published_fp32, published_tokens, backend, task
):
    plain, bucketed = _pair(published_fp32 if task == "feature-extraction" else published_tokens, backend)
    texts = SMALL_TEXTS * 3
    longest = [len(e.ids) for e in plain.encode(texts)]
    for batch_size in (1, 4, 32):
        ours, theirs = bucketed.run(texts, batch_size=batch_size), plain.run(texts, batch_size=batch_size)
        if task == "feature-extraction":
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5, err_msg=f"batch {batch_size}")
        else:
            assert [o.shape[0] for o in ours] == longest  # each text sliced back to its own tokens
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"batch {batch_size}")
    assert set(bucketed.session.widths) <= set(PLAN) and len(set(bucketed.session.widths)) > 1
    assert not set(plain.session.widths) <= set(PLAN)  # without the plan: the texts' own lengths
    plain_widths = list(bucketed.session.widths)
    bucketed.run(texts, shape_buckets=False)
    assert not set(bucketed.session.widths[len(plain_widths) :]) <= set(PLAN)


def test_load_pads_to_the_manifests_shape_buckets_and_refuses_a_plan_out_of_order(artifact_copy):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    for plan in (PLAN, [16, 8, 128], [0, 128]):
        manifest["model"]["shape_buckets"] = plan
        manifest["manifest_sha256"] = manifest_digest(manifest)
        path.write_text(json.dumps(manifest))
        if plan != PLAN:
            with pytest.raises(ArtifactError, match=r"model.shape_buckets = .* is not a list of ascending positive"):
                load(artifact_copy)
            continue
        model = load(artifact_copy)
        assert model.spec["shape_buckets"] == PLAN
        feeds = model.feeds(model.encode(SMALL_TEXTS[:2]))
        assert feeds["input_ids"].shape[1] == 16 and feeds["attention_mask"][:, 10:].sum() == 0
        assert model.feeds(model.encode(SMALL_TEXTS[:2]), buckets=False)["input_ids"].shape[1] < 16
