"""Property-based tests of the manifest check and a fuzz run over the loader's input handling."""

import json
import shutil

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.errors import ArtifactError, InputError
from pipeline.runtime import load, verify_artifact
from pipeline.runtime.artifact import manifest_digest

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
    max_leaves=6,
)
FIELDS = ["schema", "version", "target", "files", "model", "session", "target_spec", "host", "content_id"]


@pytest.fixture(scope="module")
def model(published):
    return load(published)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(field=st.sampled_from(FIELDS), value=json_values, reseal=st.booleans())
def test_load_accepts_or_refuses_any_manifest_field(published, tmp_path_factory, field, value, reseal):
    folder = tmp_path_factory.mktemp("fuzz") / "tiny-bert" / "v1" / "cpu-avx2"
    shutil.copytree(published, folder)
    path = folder / "manifest.json"
    path.chmod(0o644)
    manifest = json.loads(path.read_text())
    manifest[field] = value
    if reseal:
        manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    try:
        load(folder)
    except ArtifactError as err:
        assert str(folder) in str(err) or "target" in str(err)
    else:
        assert verify_artifact(folder)[field] == value


@pytest.mark.parametrize(
    "field, value",
    [("session", {"intra_op_threads": "many"}), ("target_spec", {"required_cpu_flags": 5}), ("model", {"task": 1})],
)
def test_load_refuses_resealed_manifest_with_bad_settings(artifact_copy, field, value):
    path = artifact_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest[field] = {**manifest[field], **value}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="manifest.json"):
        load(artifact_copy)


@pytest.mark.parametrize("garbage", [b"", b"{", b"\xff\xfe", b"[]", b'{"schema": 1}'])
def test_load_refuses_garbage_manifest(artifact_copy, garbage):
    (artifact_copy / "manifest.json").write_bytes(garbage)
    with pytest.raises(ArtifactError, match="manifest.json"):
        load(artifact_copy)


text_like = st.text(alphabet=st.characters(codec="utf-8"), max_size=200)
items = st.one_of(text_like, text_like, text_like, st.integers(), st.none(), st.binary(max_size=8), st.floats())


@settings(max_examples=150, deadline=None)
@given(inputs=st.lists(items, max_size=6))
def test_model_run_returns_one_row_per_text_or_input_error(model, inputs):
    try:
        out = model.run(inputs)
    except InputError:
        assert not inputs or not all(isinstance(t, str) for t in inputs)
    else:
        assert all(isinstance(t, str) for t in inputs)
        assert out.shape == (len(inputs), 32) and np.isfinite(out).all()
