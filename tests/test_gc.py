import json
import os
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.build import build
from pipeline.cli import main
from pipeline.errors import InputError
from pipeline.gc import collect, published_folders
from pipeline.runtime import load

from .conftest import write_target

STAGES = ("export", "optimize", "quantize", "validate")
KEYS = [f"{i:064x}" for i in range(8)]

build_strategy = st.tuples(
    st.sampled_from(["model-a", "model-b"]),
    st.sampled_from(["cpu-avx2", "cpu-fp32"]),
    st.fixed_dictionaries({stage: st.sampled_from(KEYS) for stage in STAGES}),
)


def _publish(root: Path, builds: list, rollbacks: list[int]) -> None:
    """Lay out published versions as publish does: vN/<target>/manifest.json naming its stage keys, a cache entry
    with a record per key (plus orphans), and latest/<target> links, some rolled back to older versions."""
    numbers: dict = {}
    for model, target, keys in builds:
        number = numbers[(model, target)] = numbers.get((model, target), 0) + 1
        folder = root / "artifacts" / model / f"v{number}" / target
        folder.mkdir(parents=True)
        stages = {name: {"key": key, "config": {}} for name, key in keys.items()}
        (folder / "manifest.json").write_text(json.dumps({"stages": stages}))
        (folder / "model.onnx").write_bytes(b"x" * 100)
        for path in folder.iterdir():
            path.chmod(0o444)
    for index, stage in enumerate(STAGES):
        for key in KEYS:
            entry = root / "cache" / stage / key
            entry.mkdir(parents=True)
            (entry / "record.json").write_text("{}")
            (entry / "model.onnx").write_bytes(b"y" * (index + 1))
    for step, ((model, target), newest) in enumerate(sorted(numbers.items())):
        latest = root / "artifacts" / model / "latest"
        latest.mkdir(exist_ok=True)
        version = max(1, newest - rollbacks[step % len(rollbacks)])
        (latest / target).symlink_to(f"../v{version}/{target}")


def _state(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".lock"}  # gc takes the publish lock


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    builds=st.lists(build_strategy, min_size=1, max_size=10),
    rollbacks=st.lists(st.integers(0, 3), min_size=1, max_size=4),
    keep=st.one_of(st.none(), st.integers(1, 3)),
)
def test_gc_never_removes_a_referenced_version_or_cache_entry(builds, rollbacks, keep):
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        _publish(root, builds, rollbacks)
        artifacts, cache = root / "artifacts", root / "cache"
        before = _state(root)
        planned = collect(artifacts, cache, keep=keep, min_age_s=0, dry_run=True)
        assert _state(root) == before  # a dry run removes nothing
        removed = collect(artifacts, cache, keep=keep, min_age_s=0)
        assert [r.path for r in removed] == [r.path for r in planned]
        assert sum(r.bytes for r in removed) == sum(r.bytes for r in planned)
        for link in artifacts.glob("*/latest/*"):
            assert (link / "manifest.json").is_file(), link  # every latest link still resolves
        kept = published_folders(artifacts)
        referenced = {
            (name, stage["key"])
            for folder in kept
            for name, stage in json.loads((folder / "manifest.json").read_text())["stages"].items()
        }
        left = {(entry.parent.name, entry.name) for entry in cache.glob("*/*")}
        assert left == referenced  # every referenced entry survives, and nothing unreferenced does
        if keep is not None:
            for model, target in {(m, t) for m, t, _ in builds}:
                versions = sorted(
                    (int(f.parent.name[1:]), f) for f in kept if (f.parent.parent.name, f.name) == (model, target)
                )[::-1]
                pointed = (artifacts / model / "latest" / target).resolve()
                assert all(f.resolve() == pointed for _, f in versions[keep:])  # beyond keep: only latest's


def test_gc_keeps_young_entries_a_running_build_may_need(tmp_path):
    entry = tmp_path / "cache" / "export" / KEYS[0]
    entry.mkdir(parents=True)
    (entry / "record.json").write_text("{}")
    assert collect(tmp_path / "artifacts", tmp_path / "cache") == []
    old = entry.stat().st_mtime - 7200
    os.utime(entry, (old, old))
    assert [r.path for r in collect(tmp_path / "artifacts", tmp_path / "cache")] == [entry]
    assert not entry.exists()


def test_gc_refuses_keep_zero_and_an_unreadable_manifest(tmp_path):
    with pytest.raises(InputError, match="--keep 0"):
        collect(tmp_path, tmp_path, keep=0)
    folder = tmp_path / "artifacts" / "m" / "v1" / "cpu-avx2"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{not json")
    entry = tmp_path / "cache" / "export" / KEYS[1]
    entry.mkdir(parents=True)
    (entry / "record.json").write_text("{}")
    with pytest.raises(InputError, match="nothing was removed"):
        collect(tmp_path / "artifacts", tmp_path / "cache", min_age_s=0)
    assert entry.exists()


def test_gc_on_real_builds_removes_the_old_version_and_its_entries_and_latest_still_loads(
    tiny_bert, texts_file, calibration_file, tmp_path
):
    dirs = {"artifacts_dir": tmp_path / "a", "cache_dir": tmp_path / "c"}
    target = str(write_target(tmp_path, "gc-target"))
    build(tiny_bert, target, validation=texts_file, calibration=calibration_file, **dirs)
    write_target(tmp_path, "gc-target", accuracy__cosine_min=0.985)  # another gate: another version
    newer = build(tiny_bert, target, validation=texts_file, calibration=calibration_file, **dirs)
    assert newer.published["version"] == "v2"
    runner = CliRunner()
    args = ["gc", "--artifacts-dir", str(tmp_path / "a"), "--cache-dir", str(tmp_path / "c"), "--min-age", "0"]
    dry = runner.invoke(main, [*args, "--keep", "1", "--dry-run"])
    assert dry.exit_code == 0 and "would remove" in dry.output and (tmp_path / "a" / "tiny-bert" / "v1").exists()
    result = runner.invoke(main, [*args, "--keep", "1"])
    assert result.exit_code == 0, result.output
    assert "an old version beyond --keep" in result.output and "MB freed" in result.output
    assert not (tmp_path / "a" / "tiny-bert" / "v1").exists()
    model = load(tmp_path / "a" / "tiny-bert" / "latest" / "gc-target")
    assert model.run(["still here"]).shape[0] == 1
    again = build(tiny_bert, target, validation=texts_file, calibration=calibration_file, **dirs)
    assert again.published["reused"] and all(r.reused for r in again.stages if r.name != "checkpoint")
