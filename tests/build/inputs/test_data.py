import pytest

from pipeline.build.inputs.data import DEFAULT_CALIBRATION, DEFAULT_VALIDATION, check_held_out, read_texts, texts_digest
from pipeline.build.table import build
from pipeline.errors import InputError
from tests.conftest import CALIBRATION_TEXTS, SMALL_TEXTS


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


def test_texts_digest_depends_on_content_only(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "label": 3}\n')
    same = [texts_digest(read_texts(tmp_path / name, "calibration")) for name in ("a.txt", "b.jsonl")]
    assert same[0] == same[1]  # the same examples in another file and format
    assert (
        len({same[0], texts_digest(["two", "one"]), texts_digest(["one", "two "]), texts_digest([("one", "two")])}) == 4
    )


def test_read_texts_reads_text_pairs(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"text": "question?", "text_pair": "answer."}\n{"text": "alone"}\n')
    assert read_texts(path, "calibration") == [("question?", "answer."), "alone"]


def test_read_texts_refuses_non_string_pair(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"text": "q", "text_pair": 3}\n')
    with pytest.raises(InputError, match=r"pairs\.jsonl, line 1: \"text_pair\" must be a string"):
        read_texts(path, "calibration")


def test_check_held_out_refuses_shared_examples_after_collapsing_whitespace_and_case(tmp_path):
    validation = ["The cat sat on the mat.", "Unique held-out line.", ("Q?", "A.")]
    calibration = ["  the CAT  sat on\tthe mat. ", "q?  a.", "Something else."]
    with pytest.raises(InputError, match=r"^validation data v\.txt and calibration data c\.txt share 2 example") as err:
        check_held_out(validation, calibration, "v.txt", "c.txt")
    assert "\n" not in str(err.value)
    check_held_out(validation, calibration[2:], "v.txt", "c.txt")


def _data(folder, validation: list, calibration: list) -> dict:
    folder.mkdir()
    (folder / "validation.txt").write_text("\n".join(validation) + "\n")
    (folder / "calibration.txt").write_text("\n".join(calibration) + "\n")
    return {"validation": folder / "validation.txt", "calibration": folder / "calibration.txt"}


def test_build_refuses_validation_text_that_is_calibration_text_before_any_stage(tiny_bert, tmp_path):
    shared = [SMALL_TEXTS[0].upper(), SMALL_TEXTS[3] + "  "]
    data = _data(tmp_path / "data", SMALL_TEXTS, CALIBRATION_TEXTS + shared)
    with pytest.raises(InputError, match=r"validation\.txt and calibration data .*calibration\.txt share 2 example"):
        build(tiny_bert, "cpu-avx2-dynamic", artifacts_dir=tmp_path / "a", cache_dir=tmp_path / "c", **data)
    assert not (tmp_path / "c").exists()  # refused before the first stage


def test_build_refuses_calibration_text_too_small_for_a_development_split(tiny_bert, tmp_path):
    data = _data(tmp_path / "data", SMALL_TEXTS, CALIBRATION_TEXTS[:3])
    with pytest.raises(InputError, match=r"calibration\.txt gives 3 example\(s\); the target needs at least 8,"):
        build(tiny_bert, "cpu-avx2", artifacts_dir=tmp_path / "a", cache_dir=tmp_path / "c", **data)
    assert not (tmp_path / "c").exists()


def test_read_texts_skips_a_folder_named_like_a_data_file(tmp_path):
    (tmp_path / "a.txt").write_text("one\ntwo\n")
    (tmp_path / "b.txt").mkdir()
    assert read_texts(tmp_path, "calibration") == ["one", "two"]
