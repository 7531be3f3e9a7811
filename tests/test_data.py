import pytest

from pipeline.data import DEFAULT_CALIBRATION, DEFAULT_VALIDATION, read_texts, texts_digest
from pipeline.errors import InputError


def test_read_texts_shipped_sets_are_large_and_disjoint():
    validation = read_texts(DEFAULT_VALIDATION, "validation")
    calibration = read_texts(DEFAULT_CALIBRATION, "calibration")
    assert len(validation) >= 200 and len(calibration) >= 200
    assert not set(validation) & set(calibration)


def test_read_texts_reads_jsonl_and_folders(tmp_path):
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    (tmp_path / "b.jsonl").write_text('{"text": "three"}\n{"text": "four", "label": 1}\n')
    assert read_texts(tmp_path, "calibration") == ["one", "two", "three", "four"]


def test_read_texts_refuses_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n")
    with pytest.raises(InputError, match=r"validation data .*empty\.txt holds no examples"):
        read_texts(path, "validation")


def test_read_texts_names_line_when_not_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("fine\nalso fine\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(InputError, match=r"latin1\.txt, line 3: not UTF-8"):
        read_texts(path, "calibration")


def test_read_texts_names_line_when_jsonl_malformed(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(InputError, match=r"bad\.jsonl, line 2: expected an object with a \"text\" string"):
        read_texts(path, "calibration")


def test_read_texts_refuses_missing_path(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        read_texts(tmp_path / "nope.txt", "validation")


def test_texts_digest_depends_on_content_only():
    assert texts_digest(["a", "b"]) == texts_digest(["a", "b"])
    assert texts_digest(["a", "b"]) != texts_digest(["b", "a"])


def test_read_texts_reads_text_pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"text": "question?", "text_pair": "answer."}\n{"text": "alone"}\n')
    assert read_texts(path, "calibration") == [("question?", "answer."), "alone"]


def test_read_texts_refuses_non_string_pair(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"text": "q", "text_pair": 3}\n')
    with pytest.raises(InputError, match=r"pairs\.jsonl, line 1: \"text_pair\" must be a string"):
        read_texts(path, "calibration")
