"""Batch parallelism: the chunk plan, and a batch run on two streams giving the outputs of one request, in order,
on ONNX Runtime and OpenVINO."""

import threading

import numpy as np
import pytest

from pipeline.errors import ArtifactError
from pipeline.runtime import load
from pipeline.runtime.artifact import verify_artifact
from pipeline.runtime.host import usable_cores
from pipeline.runtime.load import open_model
from pipeline.runtime.streams import StreamPool, chunk_cost, chunk_plan
from tests.conftest import SMALL_TEXTS


def test_chunk_plan_splits_the_costliest_chunk_in_halves_until_there_is_one_per_stream():
    assert chunk_plan([list(range(32))], 1) == [list(range(32))]
    assert chunk_plan([list(range(32))], 2) == [list(range(16)), list(range(16, 32))]
    assert chunk_plan([list(range(32))], 4, 8) == [list(range(i, i + 8)) for i in range(0, 32, 8)]
    assert chunk_plan([list(range(9))], 2, 8) == [list(range(5)), list(range(5, 9))]
    balanced = [list(range(10)), list(range(10, 20))]
    assert chunk_plan(balanced, 2) == balanced  # one chunk per stream, neither over half the cost


def test_chunk_plan_splits_a_chunk_over_a_streams_share_of_the_cost_when_there_are_enough_chunks():
    chunks = [[0, 1, 2], list(range(3, 35))]
    assert chunk_plan(chunks, 2) == [[0, 1, 2], list(range(3, 19)), list(range(19, 35))]
    # By padded size: 10 short rows (4 tokens) and 10 long ones (40): the long chunk holds 10/11 of the cost.
    lengths = [4] * 10 + [40] * 10
    mixed = [list(range(10)), list(range(10, 20))]
    assert chunk_cost(mixed[1], lengths) == 400
    assert chunk_plan(mixed, 2, 2, lengths) == [list(range(10)), list(range(10, 15)), list(range(15, 20))]
    assert chunk_plan(mixed, 2, 2) == mixed  # by rows alone they are even


def test_chunk_plan_never_splits_a_chunk_of_fewer_than_split_min_rows_rows():
    assert chunk_plan([list(range(7))], 2, 8) == [list(range(7))]
    assert chunk_plan([[0]], 2, 1) == [[0]]  # a batch of one runs whole, with all the threads
    # 16 rows split once into 8 + 8; a chunk of 8 rows is split again only where 8 rows are allowed to split.
    assert chunk_plan([list(range(16))], 4, 9) == [list(range(8)), list(range(8, 16))]
    chunks = [[0, 1], [2, 3, 4]]
    chunk_plan(chunks, 4, 2)
    assert chunks == [[0, 1], [2, 3, 4]]  # pure: its input is unchanged


class Recorded:
    """A real session that notes the thread of each run, to show which runs went through the streams."""

    def __init__(self, session, threads: list):
        self.session, self.threads = session, threads

    def run(self, names, feeds):
        self.threads.append(threading.current_thread().name)
        return self.session.run(names, feeds)


def _batches() -> dict:
    mixed = (SMALL_TEXTS * 4)[:37]
    return {"batch 1": SMALL_TEXTS[5:6], "batch 32 of one length": [SMALL_TEXTS[5]] * 32, "mixed 37": mixed}


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino"])
def test_two_streams_give_the_outputs_of_one_request_in_order(published_fp32, backend):
    manifest = verify_artifact(published_fp32)
    graph, tokenizer, spec = published_fp32 / "model.onnx", published_fp32 / "tokenizer.json", manifest["model"]
    one = open_model(graph, tokenizer, spec, session={"intra_op_threads": 2}, backend=backend)
    two = open_model(graph, tokenizer, spec, session={"intra_op_threads": 2, "streams": 2}, backend=backend)
    assert one.streams is None and len(two.streams) == 2 and two.streams.split_min_rows == 8
    threads: list = []
    two.streams = StreamPool([Recorded(s, threads) for s in two.streams.sessions], two.streams.split_min_rows)
    for name, texts in _batches().items():
        threads.clear()
        np.testing.assert_allclose(two.run(texts), one.run(texts), rtol=1e-5, atol=1e-5, err_msg=name)
        if name == "batch 1":
            assert threads == [], "a batch of one runs as one request, on the session with all the threads"
        else:
            assert len(threads) >= 2 and all(t.startswith("stream") for t in threads), name
    words = two.run(["a", "b"] * 16, batch_size=32)
    np.testing.assert_allclose(words[::2], np.repeat(one.run(["a"]), 16, axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(usable_cores() < 2, reason="a host of one core caps streams at 1")
def test_load_runs_a_published_session_with_streams_and_refuses_a_bad_count(artifact_copy):
    import json

    from pipeline.runtime.artifact import manifest_digest

    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    for streams, split in ((2, 4), (0, 4)):
        manifest["session"].update(streams=streams, split_min_rows=split)
        manifest["manifest_sha256"] = manifest_digest(manifest)
        path.write_text(json.dumps(manifest))
        if streams == 0:
            with pytest.raises(ArtifactError, match=r"session.streams = 0 is not a positive int"):
                load(artifact_copy)
            continue
        model = load(artifact_copy)
        assert len(model.streams) == 2 and model.streams.split_min_rows == 4
        assert model.run(SMALL_TEXTS).shape[0] == len(SMALL_TEXTS)
