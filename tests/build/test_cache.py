"""Cache keys are derived from each stage's declaration: every declared field, the inputs, package versions and,
where the output depends on it, the host. Changing what shapes an output rebuilds it; nothing else does."""

import dataclasses
import json
import shutil
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.build import cache
from pipeline.build import table as build_table
from pipeline.build.cache import StageSpec, runtime_code_digest
from pipeline.build.stages import engine, export, fp16, optimize, validate
from pipeline.build.table import build
from pipeline.errors import CacheError, PipelineError
from pipeline.runtime.host import KERNEL_CLASSES
from tests.conftest import write_target


def _declared_stages() -> list[StageSpec]:
    """Every StageSpec the modules of the build's stage table declare (a module may declare more than one)."""
    specs = {}
    for _, run in build_table.STAGES:
        for value in vars(sys.modules[run.__module__]).values():
            if isinstance(value, StageSpec):
                specs[value.name] = value
    return [specs[name] for name in sorted(specs)]


STAGES = _declared_stages()


def test_the_declared_stages_include_every_cached_stage_of_the_table():
    assert {"export", "optimize", "search", "quantize", "int8_qdq", "fp16", "validate", "tune", "engine"} <= {
        s.name for s in STAGES
    }


def _sample(spec: StageSpec):
    values = {}
    for field in dataclasses.fields(spec.config):
        values[field.name] = {"x": 1} if "dict" in str(field.type) else 3 if "int" in str(field.type) else "a"
        if "tuple" in str(field.type):
            values[field.name] = (1,) if "int" in str(field.type) else ("a",)
    return spec.config(**values)


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(STAGES), data=st.data())
def test_changing_any_declared_field_changes_the_key(spec, data):
    config = _sample(spec)
    field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(spec.config)]))
    new = data.draw(st.text(min_size=1, max_size=5).filter(lambda v: v != getattr(config, field)))
    changed = dataclasses.replace(config, **{field: new})
    assert spec.key(config, {"graph": "k"}) != spec.key(changed, {"graph": "k"})
    assert spec.key(config, {"graph": "k"}) != spec.key(config, {"graph": "other"})


@pytest.mark.parametrize("spec", STAGES, ids=lambda s: s.name)
def test_a_config_missing_a_declared_field_or_of_another_type_is_an_error(spec):
    fields = [f.name for f in dataclasses.fields(spec.config)]
    with pytest.raises(TypeError):
        spec.config(**{name: 1 for name in fields[1:]})
    with pytest.raises(PipelineError, match=f"declares {spec.config.__name__}"):
        spec.key({name: 1 for name in fields}, {})


def test_package_version_and_host_enter_the_key_where_declared(monkeypatch):
    config = _sample(export.STAGE)
    before = export.STAGE.key(config, {})
    monkeypatch.setattr(cache.metadata, "version", lambda name: "9.9.9")
    assert export.STAGE.key(config, {}) != before
    assert {"optimum", "optimum-onnx", "onnx", "tokenizers", "sentence-transformers"} <= set(export.STAGE.packages)
    assert "onnxruntime" in fp16.STAGE.packages
    body = validate.STAGE.key_body(_sample(validate.STAGE), {})
    assert body["host"] == cache.kernel_class() and body["runtime_code"] == runtime_code_digest()
    assert "host" not in export.STAGE.key_body(config, {})
    other_class = next(name for name, _ in KERNEL_CLASSES if name != cache.kernel_class())
    monkeypatch.setattr(cache, "kernel_class", lambda: other_class)
    assert validate.STAGE.key_body(_sample(validate.STAGE), {})["host"] == other_class


def test_engine_key_holds_data_and_thresholds_but_not_the_driver():
    fields = {f.name for f in dataclasses.fields(engine.EngineConfig)}
    assert {"data", "accuracy"} <= fields


def test_runtime_code_digest_follows_the_runtime_source(tmp_path, monkeypatch):
    copy = tmp_path / "runtime"
    shutil.copytree(cache.RUNTIME_DIR, copy)
    monkeypatch.setattr(cache, "RUNTIME_DIR", copy)
    before = runtime_code_digest()
    (copy / "encoder.py").write_text((copy / "encoder.py").read_text() + "\n# changed\n")
    assert runtime_code_digest() != before


def _rebuilt(manifest):
    return [r.name for r in manifest.stages if not r.reused and r.name != "checkpoint"]


def test_runtime_only_settings_do_not_re_export(tiny_bert, texts_file, calibration_file, tmp_path):
    dirs = {"artifacts_dir": tmp_path / "a", "cache_dir": tmp_path / "c"}
    data = {"validation": texts_file, "calibration": calibration_file}
    build(tiny_bert, "cpu-avx2-dynamic", **dirs, **data)
    overlong = write_target(tmp_path, "cpu-avx2-dynamic", shapes__overlong="refuse")
    again = build(tiny_bert, str(overlong), **dirs, **data)
    assert "export" not in _rebuilt(again) and "quantize" not in _rebuilt(again)
    assert "validate" in _rebuilt(again)  # it ran the held-out text under the other policy
    assert (
        json.loads((tmp_path / "a" / "tiny-bert" / "v2" / "cpu-avx2-dynamic" / "manifest.json").read_text())["model"][
            "overlong"
        ]
        == "refuse"
    )
    threads = write_target(tmp_path, "cpu-avx2-dynamic", runtime__intra_op_threads=1)
    third = build(tiny_bert, str(threads), **dirs, **data)
    assert "validate" in _rebuilt(third) and "export" not in _rebuilt(third)
    assert "quantize" in _rebuilt(third)  # its fallback measured through a session of the old settings


def test_another_kernel_class_revalidates_and_a_new_tune_keeps_the_version(
    tiny_bert, texts_file, calibration_file, tmp_path, monkeypatch
):
    dirs = {"artifacts_dir": tmp_path / "a", "cache_dir": tmp_path / "c"}
    data = {"validation": texts_file, "calibration": calibration_file}
    first = build(tiny_bert, "cpu-avx2-dynamic", **dirs, **data)
    monkeypatch.setattr(cache, "usable_cores", lambda: 64)  # another machine: tune again
    retuned = build(tiny_bert, "cpu-avx2-dynamic", **dirs, **data)
    assert _rebuilt(retuned) == ["tune"]
    assert retuned.published.reused and retuned.published.version == first.published.version
    other_class = next(name for name, _ in KERNEL_CLASSES if name != cache.kernel_class())
    monkeypatch.setattr(cache, "kernel_class", lambda: other_class)  # other int8 kernels: measure again
    other = build(tiny_bert, "cpu-avx2-dynamic", **dirs, **data)
    assert {"quantize", "validate"} <= set(_rebuilt(other)) and "export" not in _rebuilt(other)


def test_unwritable_cache_is_one_line_error_naming_the_folder(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder should be")
    spec = optimize.STAGE
    with pytest.raises(CacheError, match=r"the stage cache .*not-a-folder/optimize cannot be written"):
        cache.run_cached(blocker, spec, _sample(spec), {}, lambda out: {})


def test_a_damaged_entry_is_replaced_and_leaves_no_record_less_folder_or_scratch(tmp_path):
    spec = optimize.STAGE
    calls = []

    def produce(out):
        calls.append(out)
        (out / "model.onnx").write_bytes(b"graph")
        return {"n": len(calls)}

    first = cache.run_cached(tmp_path, spec, _sample(spec), {}, produce)
    entry = tmp_path / "optimize" / first.key
    (entry / "model.onnx").write_bytes(b"trunc")  # damaged: no longer its sha256
    again = cache.run_cached(tmp_path, spec, _sample(spec), {}, produce)
    assert (again.key, again.metrics, again.reused) == (first.key, {"n": 2}, False)
    names = sorted(p.name for p in (tmp_path / "optimize").iterdir() if not p.name.startswith(".lease"))
    assert names == [first.key] and (entry / "record.json").is_file()


def test_a_symlink_planted_as_a_lease_file_is_a_one_line_cache_error(tmp_path):
    from pipeline.build.store import cache_entry, lease_path

    spec = optimize.STAGE
    key = spec.key(_sample(spec), {})
    lease = lease_path(cache_entry(tmp_path, spec.name, key))
    lease.parent.mkdir(parents=True)
    lease.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CacheError, match="is a symlink where the cache keeps its own file") as err:
        cache.run_cached(tmp_path, spec, _sample(spec), {}, lambda out: {})
    assert "\n" not in str(err.value) and not (tmp_path / "elsewhere").exists()
