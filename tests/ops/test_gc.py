import dataclasses
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.build.cache import StageSpec, _produce
from pipeline.build.store import cache_entry, gc_lock, model_lock
from pipeline.build.table import build
from pipeline.cli import main
from pipeline.errors import ArtifactError, CacheError, InputError
from pipeline.ops.gc import collect, published_folders
from pipeline.runtime import load
from pipeline.runtime.artifact import manifest_digest
from tests.conftest import write_target

STAGES = ("export", "optimize", "quantize", "validate")
KEYS = [f"{i:064x}" for i in range(8)]

build_strategy = st.tuples(
    st.sampled_from(["model-a", "model-b"]),
    st.sampled_from(["cpu-avx2", "cpu-fp32"]),
    st.fixed_dictionaries({stage: st.sampled_from(KEYS) for stage in STAGES}),
)


@dataclasses.dataclass(frozen=True)
class _Settings:
    """The config of the stand-in stages: gc reads an entry's record, never the config its key was derived from."""


def _entry(cache: Path, stage: str, key: str, content: bytes = b"y", age_s: float = 0.0) -> Path:
    """A cache entry written by the cache's own writer: model.onnx, and a record naming the stage, the key and the
    file's sha256. `age_s`: last used that many seconds ago."""

    def produce(out: Path) -> dict:
        (out / "model.onnx").write_bytes(content)
        return {}

    entry = cache_entry(cache, stage, key)
    _produce(entry, key, StageSpec(stage, 1, _Settings), {}, produce)
    if age_s:
        os.utime(entry, (time.time() - age_s, time.time() - age_s))
    return entry


def _write_manifest(folder: Path, stages) -> None:
    manifest = {"stages": stages}
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _publish(root: Path, builds: list, rollbacks: list[int]) -> None:
    """Lay out published versions as publish does: vN/<target>/manifest.json naming its stage keys, a cache entry
    with a record per key (plus orphans), and latest/<target> links, some rolled back to older versions."""
    numbers: dict = {}
    for model, target, keys in builds:
        number = numbers[(model, target)] = numbers.get((model, target), 0) + 1
        folder = root / "artifacts" / model / f"v{number}" / target
        folder.mkdir(parents=True)
        _write_manifest(folder, {name: {"key": key, "config": {}} for name, key in keys.items()})
        (folder / "model.onnx").write_bytes(b"x" * 100)
        for path in folder.iterdir():
            path.chmod(0o444)
    for index, stage in enumerate(STAGES):
        for key in KEYS:
            _entry(root / "cache", stage, key, b"y" * (index + 1))
    for step, ((model, target), newest) in enumerate(sorted(numbers.items())):
        latest = root / "artifacts" / model / "latest"
        latest.mkdir(exist_ok=True)
        version = max(1, newest - rollbacks[step % len(rollbacks)])
        (latest / target).symlink_to(f"../v{version}/{target}")


def _state(root: Path) -> set[str]:
    # gc takes the publish locks and its own
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.name not in (".lock", ".gc.lock")}


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
        planned = collect(artifacts, cache, keep=keep, min_age_s=0, dry_run=True).removals
        assert _state(root) == before  # a dry run removes nothing
        removed = collect(artifacts, cache, keep=keep, min_age_s=0).removals
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
    (tmp_path / "artifacts").mkdir()  # nothing published yet: only --force removes entries
    entry = _entry(tmp_path / "cache", "export", KEYS[0])
    assert collect(tmp_path / "artifacts", tmp_path / "cache", force=True).removals == []
    old = entry.stat().st_mtime - 7200
    os.utime(entry, (old, old))
    assert [r.path for r in collect(tmp_path / "artifacts", tmp_path / "cache", force=True).removals] == [entry]
    assert not entry.exists()


def test_gc_refuses_keep_zero_and_an_unreadable_manifest(tmp_path):
    with pytest.raises(InputError, match="--keep 0"):
        collect(tmp_path, tmp_path, keep=0)
    folder = tmp_path / "artifacts" / "m" / "v1" / "cpu-avx2"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{not json")
    entry = _entry(tmp_path / "cache", "export", KEYS[1])
    with pytest.raises(ArtifactError, match="nothing was removed"):
        collect(tmp_path / "artifacts", tmp_path / "cache", min_age_s=0)
    assert entry.exists()


@pytest.fixture(scope="module")
def two_versions(tiny_bert, texts_file, calibration_file, tmp_path_factory) -> Path:
    """tiny-bert built twice (v1, then v2 under another gate) into a/ (artifacts) and c/ (stage cache), with its
    target file and stages.json (the stages the build recorded), once per module. `_copy` it before changing it."""
    root = tmp_path_factory.mktemp("gc-built")
    target = str(write_target(root, "gc-target"))
    _build(tiny_bert, target, root, texts_file, calibration_file)
    write_target(root, "gc-target", accuracy__cosine_min=0.985)  # another gate: another version
    newer = _build(tiny_bert, target, root, texts_file, calibration_file)
    assert newer.published.version == "v2"
    (root / "stages.json").write_text(json.dumps([r.name for r in newer.stages]))
    return root


def _build(checkpoint, target, root: Path, texts_file, calibration_file, **options):
    return build(
        checkpoint,
        str(target),
        artifacts_dir=root / "a",
        cache_dir=root / "c",
        validation=texts_file,
        calibration=calibration_file,
        **options,
    )


def _copy(built: Path, tmp_path: Path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(built, root, symlinks=True)
    return root


def _gc(root: Path, *options: str, verbose: bool = False):
    args = ["gc", "--artifacts-dir", str(root / "artifacts"), "--cache-dir", str(root / "cache"), *options]
    return CliRunner().invoke(main, ["-v", *args] if verbose else args)


def test_gc_on_real_builds_removes_the_old_version_and_its_entries_and_latest_still_loads(
    two_versions, tiny_bert, texts_file, calibration_file, tmp_path
):
    root = _copy(two_versions, tmp_path)
    runner = CliRunner()
    args = ["gc", "--artifacts-dir", str(root / "a"), "--cache-dir", str(root / "c"), "--min-age", "0"]
    dry = runner.invoke(main, [*args, "--keep", "1", "--dry-run"])
    assert dry.exit_code == 0 and "would remove" in dry.output and (root / "a" / "tiny-bert" / "v1").exists()
    result = runner.invoke(main, [*args, "--keep", "1"])
    assert result.exit_code == 0, result.output
    assert "an old version beyond --keep" in result.output and "MB freed" in result.output
    assert not (root / "a" / "tiny-bert" / "v1").exists()
    model = load(root / "a" / "tiny-bert" / "latest" / "gc-target")
    assert model.run(["still here"]).shape[0] == 1
    again = _build(tiny_bert, root / "gc-target.toml", root, texts_file, calibration_file)
    assert again.published.reused and all(r.reused for r in again.stages if r.name != "checkpoint")


def test_gc_during_a_build_skips_the_entries_it_holds_and_the_build_publishes(
    two_versions, tiny_bert, texts_file, calibration_file, tmp_path
):
    root = _copy(two_versions, tmp_path)
    shutil.rmtree(root / "a")  # no published version references any entry: only the build's leases keep them
    long_ago = time.time() - 7200
    for entry in (root / "c").glob("*/*"):
        os.utime(entry, (long_ago, long_ago))  # made long ago: past gc's default --min-age
    last = json.loads((root / "stages.json").read_text())[-1]
    during = []

    def gc_before_publishing(record) -> None:
        if record.name == last:  # every entry this build uses has been reused by now
            # Nothing is published yet, hence --force; the default --min-age, as `pipeline gc --force` runs
            during.append(collect(root / "a", root / "c", force=True))
            during.append(collect(root / "a", root / "c", min_age_s=0, force=True))  # as if the build ran for long

    manifest = _build(
        tiny_bert, root / "gc-target.toml", root, texts_file, calibration_file, on_stage=gc_before_publishing
    )
    cached = [r for r in manifest.stages if r.name != "checkpoint"]  # the checkpoint is read, never cached
    used = {root / "c" / r.name / r.key for r in cached}
    assert all(r.reused for r in cached) and len(during) == 2
    assert {n.path for n in during[0].kept if n.reason == "used within --min-age"} == used  # reuse refreshed them
    assert {n.path for n in during[1].skipped if "holds its lease" in n.reason} == used
    assert not used & {r.path for g in during for r in g.removals}
    assert all(entry.is_dir() and entry.stat().st_mtime > long_ago + 3600 for entry in used)  # reuse refreshed
    assert load(manifest.published.path).run(["published"]).shape[0] == 1
    after = collect(root / "a", root / "c", dry_run=True)  # the build is over: its entries are young, not leased
    assert not after.removals and not after.skipped


def test_an_entry_removed_under_a_running_build_is_a_one_line_cache_error(
    two_versions, tiny_bert, texts_file, calibration_file, tmp_path
):
    root = _copy(two_versions, tmp_path)
    for stage_dir in (root / "c").iterdir():
        if stage_dir.name not in ("export", "optimize"):
            shutil.rmtree(stage_dir)  # the stages after optimize run, and read optimize's graph
    removed = []

    def remove_by_hand(record) -> None:
        if record.name == "optimize":
            removed.append(root / "c" / record.name / record.key)
            shutil.rmtree(removed[0])

    with pytest.raises(CacheError) as err:
        _build(tiny_bert, root / "gc-target.toml", root, texts_file, calibration_file, on_stage=remove_by_hand)
    message = str(err.value)
    assert str(removed[0]) in message and "run the build again" in message and "\n" not in message


@pytest.mark.parametrize("stages, redigest", [({}, False), ([], True)])
def test_gc_refuses_a_tampered_manifest_and_removes_nothing(stages, redigest, two_versions, tmp_path):
    root = _copy(two_versions, tmp_path)
    for path in (root / "a").glob("tiny-bert/v*/gc-target/manifest.json"):
        path.chmod(0o644)
        manifest = json.loads(path.read_text())
        manifest["stages"] = stages
        if redigest:  # a tamperer who recomputes the digest still cannot make gc read a malformed table
            manifest["manifest_sha256"] = manifest_digest(manifest)
        path.write_text(json.dumps(manifest))
    before = _state(root)
    result = CliRunner().invoke(
        main,
        ["gc", "--artifacts-dir", str(root / "a"), "--cache-dir", str(root / "c"), "--min-age", "0", "--keep", "1"],
    )
    assert result.exit_code == ArtifactError.exit_code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "nothing was removed" in lines[0] and "manifest.json" in lines[0]
    assert _state(root) == before


def _one_version(root: Path) -> tuple[Path, Path]:
    """artifacts/m/v1/cpu-avx2 referencing KEYS[0] of every stage (latest points to it), and an old unreferenced
    entry cache/export/KEYS[1]; returns (the version's folder, the unreferenced entry)."""
    _publish(root, [("m", "cpu-avx2", {stage: KEYS[0] for stage in STAGES})], [0])
    unreferenced = root / "cache" / "export" / KEYS[1]
    for entry in (root / "cache").glob("*/*"):
        if entry.name != KEYS[0] and entry != unreferenced:
            shutil.rmtree(entry)
    long_ago = time.time() - 7200
    os.utime(unreferenced, (long_ago, long_ago))
    return root / "artifacts" / "m" / "v1" / "cpu-avx2", unreferenced


def _outside(tmp_path: Path) -> Path:
    """A folder outside the artifacts and cache folders, shaped like what a symlink in them would stand for."""
    outside = tmp_path / "outside"
    (outside / KEYS[2]).mkdir(parents=True)
    (outside / KEYS[2] / "record.json").write_text("{}")
    (outside / "cpu-avx2").mkdir()
    (outside / "cpu-avx2" / "manifest.json").write_text(json.dumps({"stages": {}}))
    (outside / "precious.txt").write_text("not gc's")
    return outside


@pytest.mark.parametrize("kind", ["stage folder", "version folder", "cache entry"])
def test_gc_skips_a_symlink_and_its_target_survives(kind, tmp_path):
    root = tmp_path / "tree"
    _one_version(root)
    outside = _outside(tmp_path)
    before = {str(p.relative_to(outside)) for p in outside.rglob("*")}
    link = {
        "stage folder": root / "cache" / "quantize2",
        "version folder": root / "artifacts" / "m" / "v0",
        "cache entry": root / "cache" / "export" / KEYS[3],
    }[kind]
    link.symlink_to(outside / KEYS[2] if kind == "cache entry" else outside, target_is_directory=True)
    result = _gc(root, "--min-age", "0", "--keep", "1")
    assert result.exit_code == 0, result.output
    assert f"skipped {link}: a symlink" in result.output
    assert {str(p.relative_to(outside)) for p in outside.rglob("*")} == before
    assert link.is_symlink() and (root / "artifacts" / "m" / "latest" / "cpu-avx2" / "manifest.json").is_file()


def test_gc_waits_for_a_publish_in_progress_and_keeps_what_it_publishes(tmp_path):
    root = tmp_path / "tree"
    _, unreferenced = _one_version(root)
    results = []
    gc = threading.Thread(target=lambda: results.append(collect(root / "artifacts", root / "cache", min_age_s=0)))
    with model_lock(root / "artifacts" / "m"):  # as publish holds it while it renames a version into place
        gc.start()
        time.sleep(0.5)
        folder = root / "artifacts" / "m" / "v2" / "cpu-avx2"
        folder.mkdir(parents=True)
        _write_manifest(folder, {"export": {"key": KEYS[1], "config": {}}})
        assert unreferenced.exists() and not results  # gc has not decided yet
    gc.join(timeout=30)
    assert results and unreferenced.exists()  # v2 references it now
    assert {r.path for r in results[0].removals} == set()


def test_gc_runs_one_at_a_time_per_cache_folder(tmp_path):
    root = tmp_path / "tree"
    _, unreferenced = _one_version(root)
    results = []
    gc = threading.Thread(target=lambda: results.append(collect(root / "artifacts", root / "cache", min_age_s=0)))
    with gc_lock(root / "cache"):  # another gc at work
        gc.start()
        time.sleep(0.5)
        assert unreferenced.exists() and not results
    gc.join(timeout=30)
    assert [r.path for r in results[0].removals] == [unreferenced] and not unreferenced.exists()


def test_gc_verbose_says_what_it_kept_and_why(tmp_path):
    root = tmp_path / "tree"
    version, unreferenced = _one_version(root)
    young = _entry(root / "cache", "export", KEYS[4])
    quiet = _gc(root, "--dry-run")
    assert quiet.exit_code == 0 and "kept" not in quiet.output
    shown = _gc(root, "--dry-run", verbose=True)
    assert shown.exit_code == 0, shown.output
    assert f"kept {root / 'cache' / 'export' / KEYS[0]}: {version} references it" in shown.stderr
    assert f"kept {young}: used within --min-age" in shown.stderr
    assert f"would remove {unreferenced}" in shown.stdout


def test_gc_removes_the_engine_cache_of_an_old_version_and_keeps_the_kept_ones(tmp_path):
    keys = dict.fromkeys(STAGES, KEYS[0])
    _publish(tmp_path, [("model-a", "a100", keys), ("model-a", "a100", keys)], [0])
    engines = tmp_path / "artifacts" / "model-a" / "engines"
    for version in ("v1", "v2"):
        (engines / f"{version}-a100").mkdir(parents=True)
        (engines / f"{version}-a100" / "sm80-trt10-abc-model.plan").write_bytes(b"plan")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.plan").write_bytes(b"not ours")
    found = collect(tmp_path / "artifacts", tmp_path / "cache", keep=1, min_age_s=0)
    assert engines / "v1-a100" in [r.path for r in found.removals] and not (engines / "v1-a100").exists()
    assert (engines / "v2-a100" / "sm80-trt10-abc-model.plan").is_file()
    # An engine cache that is a symlink is never followed.
    _publish(tmp_path / "again", [("model-a", "a100", keys), ("model-a", "a100", keys)], [0])
    linked = tmp_path / "again" / "artifacts" / "model-a" / "engines"
    linked.mkdir()
    (linked / "v1-a100").symlink_to(outside, target_is_directory=True)
    collect(tmp_path / "again" / "artifacts", tmp_path / "again" / "cache", keep=1, min_age_s=0)
    assert (outside / "keep.plan").is_file()


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("missing", "is not a folder"),
        ("model", "is a model's folder"),
        ("version", "is a version's folder"),
        ("artifact", "is a published artifact's folder"),
    ],
)
def test_gc_refuses_an_artifacts_dir_that_would_make_every_entry_unreferenced(tmp_path, where, says):
    keys = dict.fromkeys(STAGES, KEYS[0])
    _publish(tmp_path, [("model-a", "cpu-avx2", keys)], [0])
    model = tmp_path / "artifacts" / "model-a"
    folder = {
        "missing": tmp_path / "nothing",
        "model": model,
        "version": model / "v1",
        "artifact": model / "v1" / "cpu-avx2",
    }[where]
    before = _state(tmp_path)
    with pytest.raises(InputError, match=says) as err:
        collect(folder, tmp_path / "cache", min_age_s=0)
    assert "\n" not in str(err.value) and _state(tmp_path) == before
    with pytest.raises(InputError, match="not a number of seconds"):
        collect(tmp_path / "artifacts", tmp_path / "cache", min_age_s=float("nan"))


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (lock files included), with each file's bytes."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


def test_gc_refuses_in_one_line_and_removes_nothing_when_the_cache_dir_holds_no_entry(tmp_path):
    root = tmp_path / "tree"
    _one_version(root)  # a published version: only --cache-dir is wrong
    data = tmp_path / "data"  # a user's folder, two levels deep like a cache, with files named record.json
    for folder, name in (("experiments/run-2024-01", "results.csv"), ("photos/2023", "beach.jpg")):
        (data / folder).mkdir(parents=True)
        (data / folder / name).write_bytes(b"the user's")
        (data / folder / "record.json").write_text(json.dumps({"run": folder}))
        os.utime(data / folder, (time.time() - 7200, time.time() - 7200))
    before = _tree(data)
    result = CliRunner().invoke(
        main, ["gc", "--artifacts-dir", str(root / "artifacts"), "--cache-dir", str(data), "--min-age", "0"]
    )
    assert result.exit_code == InputError.exit_code, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"--cache-dir {data} holds experiments, photos but no stage-cache entry" in lines[0]
    assert "default: ./.cache/stages" in lines[0]
    assert _tree(data) == before  # not even a .gc.lock


FAKES = ["unknown stage", "name not a key", "another key's record", "empty record", "edited file", "unlisted file"]


def _fake(cache: Path, kind: str) -> Path:
    """An old folder in a cache that is no entry the cache wrote, though it holds a record.json."""
    stage, key = ("experiments", KEYS[5]) if kind == "unknown stage" else ("export", KEYS[5])
    folder = _entry(cache, stage, "run-2024-01" if kind == "name not a key" else key)
    record = json.loads((folder / "record.json").read_text())
    if kind == "another key's record":
        (folder / "record.json").write_text(json.dumps({**record, "key": KEYS[6]}))
    elif kind == "empty record":
        (folder / "record.json").write_text("{}")
    elif kind == "edited file":
        (folder / "model.onnx").write_bytes(b"edited")
    elif kind == "unlisted file":
        (folder / "beach.jpg").write_bytes(b"the user's")
    os.utime(folder, (time.time() - 7200, time.time() - 7200))
    return folder


@pytest.mark.parametrize("kind", FAKES)
def test_collect_keeps_a_folder_when_it_cannot_prove_it_is_a_cache_entry(kind, tmp_path):
    _, unreferenced = _one_version(tmp_path)
    fake = _fake(tmp_path / "cache", kind)
    before = _tree(fake)
    found = collect(tmp_path / "artifacts", tmp_path / "cache", min_age_s=0)
    assert [r.path for r in found.removals] == [unreferenced]  # the entry the cache wrote goes; the fake stays
    assert _tree(fake) == before
    if kind not in ("unknown stage", "name not a key"):  # looks like an entry: said why it stays
        assert [n.path for n in found.skipped] == [fake]


@pytest.mark.parametrize("state", ["missing", "empty", "emptied by gc"])
def test_collect_removes_nothing_and_succeeds_when_the_cache_dir_holds_nothing(state, tmp_path):
    artifacts, cache = tmp_path / "artifacts", tmp_path / "cache"
    artifacts.mkdir()
    (artifacts / "README.md").write_text("published artifacts land here")
    if state != "missing":
        cache.mkdir()
    if state == "emptied by gc":
        (cache / "export").mkdir()
        (cache / ".gc.lock").touch()
    found = collect(artifacts, cache, min_age_s=0)
    assert not found.removals and not found.skipped


@pytest.mark.parametrize("where", ["empty", "unrelated", "readme only", "parent"])
def test_collect_refuses_and_removes_nothing_when_the_artifacts_dir_holds_no_published_artifact(where, tmp_path):
    _one_version(tmp_path)
    folder = tmp_path if where == "parent" else tmp_path / where
    if where != "parent":
        folder.mkdir()
    if where == "unrelated":
        (folder / "photos" / "2023").mkdir(parents=True)
        (folder / "notes.txt").write_text("not artifacts")
    elif where == "readme only":  # the repository's artifacts/ before any build
        (folder / "README.md").write_text("published artifacts land here")
    before = _state(tmp_path)
    with pytest.raises(InputError) as err:
        collect(folder, tmp_path / "cache", min_age_s=0)
    message = str(err.value)
    assert "\n" not in message and f"--artifacts-dir {folder} holds no published artifact" in message
    if where == "parent":
        assert message.endswith(f"Pass --artifacts-dir {tmp_path / 'artifacts'}")
    else:
        assert "all 5 entries" in message and "--force" in message
    assert _state(tmp_path) == before


def test_gc_removes_the_old_entries_when_forced_with_no_published_artifact(tmp_path):
    (tmp_path / "artifacts").mkdir()
    old = _entry(tmp_path / "cache", "export", KEYS[1], age_s=7200)
    young = _entry(tmp_path / "cache", "optimize", KEYS[2])
    result = _gc(tmp_path, "--force")
    assert result.exit_code == 0, result.output
    assert f"removed {old}" in result.output and not old.exists() and young.is_dir()


@pytest.mark.parametrize("option", ["--artifacts-dir", "--cache-dir", "--artifacts-dir= "])
def test_gc_refuses_an_empty_option_in_one_line(option, tmp_path):
    _one_version(tmp_path)
    given = {"--artifacts-dir": str(tmp_path / "artifacts"), "--cache-dir": str(tmp_path / "cache")}
    name, _, value = option.partition("=")
    given[name] = value
    # --dry-run: where an empty option falls back to its default folder, that folder stays as it was
    result = CliRunner().invoke(main, ["gc", *(part for pair in given.items() for part in pair), "--dry-run"])
    assert result.exit_code == InputError.exit_code, result.output
    assert result.output.strip() == f"error: {name} is empty; pass a value, or leave the option out for its default"
