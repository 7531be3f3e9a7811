"""The artifact is declared once, in pipeline/runtime/schema.py: its file names (no other module of the pipeline
spells one as a string of its own) and its manifest (what publish writes is exactly what the loader parses)."""

import ast
import dataclasses
import io
import json
import tokenize
from pathlib import Path

import pytest

from pipeline.errors import ArtifactError
from pipeline.runtime import schema

PIPELINE = Path(__file__).resolve().parents[2] / "pipeline"
NAMES = {value for key, value in vars(schema).items() if key.isupper() and value != schema.DATA_SUFFIX}


def spelled_names(path: Path) -> list[str]:
    """Each string literal in `path` that is exactly one of the artifact's file names, with its line."""
    found = []
    for token in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if token.type == tokenize.STRING and token.string[:1] in "\"'":
            try:
                value = ast.literal_eval(token.string)
            except (ValueError, SyntaxError):
                continue
            if value in NAMES:
                found.append(f"{path.relative_to(PIPELINE)}:{token.start[0]}: {value}")
    return found


def test_no_module_spells_an_artifact_file_name_but_the_schema():
    offenders = [
        hit for path in sorted(PIPELINE.rglob("*.py")) if path != Path(schema.__file__) for hit in spelled_names(path)
    ]
    assert not offenders, offenders


def test_the_spelling_check_finds_a_file_name_in_code(tmp_path):
    probe = PIPELINE / "runtime" / "_probe_for_test.py"
    probe.write_text('"""A docstring may say model.onnx."""\nGRAPH_FILE = "model.onnx"\n')
    try:
        assert spelled_names(probe) == ["runtime/_probe_for_test.py:2: model.onnx"]
    finally:
        probe.unlink()


def test_a_published_manifest_holds_the_declared_fields_and_parses_back_byte_for_byte(published):
    text = (published / schema.MANIFEST).read_text()
    parsed = schema.PublishedManifest.from_json(text, "manifest.json")
    assert parsed.to_json() == text
    assert set(json.loads(text)) == {f.name for f in dataclasses.fields(schema.PublishedManifest)}
    assert parsed.files[schema.GRAPH] and parsed.model["task"] == "feature-extraction"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"extra": 1}, "field 'extra' is not one this loader knows"),
        ({"files": []}, "field 'files' is a list, not a dict; rebuild it"),
        ({"precision": 16}, "field 'precision' is a int, not a str or null"),
        ({"schema": 1}, "manifest schema 1, but this loader reads schema 2"),
        ({"graph": None}, "field 'graph' is missing"),
    ],
)
def test_a_manifest_field_that_is_undeclared_mistyped_or_missing_is_refused_in_one_line(published, change, message):
    fields = json.loads((published / schema.MANIFEST).read_text()) | change
    fields = {k: v for k, v in fields.items() if not (k == "graph" and v is None)}
    with pytest.raises(ArtifactError, match=message) as err:
        schema.PublishedManifest.from_dict(fields, "manifest.json")
    assert "\n" not in str(err.value)
