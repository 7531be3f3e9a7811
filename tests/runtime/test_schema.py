"""The artifact's file names are declared once, in pipeline/runtime/schema.py: no other module of the pipeline
spells one as a string of its own."""

import ast
import io
import tokenize
from pathlib import Path

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
