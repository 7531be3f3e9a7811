"""Artifact hygiene: remove stage-cache entries no published version references, and old versions.

What is kept, always:
- every version a `latest` link points to;
- the newest `keep` versions of each model and target (all of them when `keep` is None);
- every stage-cache entry that a kept version's manifest names (its `stages` keys), once that manifest's digest
  is verified: gc reads no manifest it cannot trust, and then removes nothing;
- every cache entry a running build holds (its lease, see pipeline.build.store), and every cache entry or scratch folder
  younger than `min_age_s` (an entry's age counts from its last use).

Everything else that gc recognises (vN/<target> folders, dead .tmp- scratch folders, and cache entries it proves
are the cache's, in pipeline/ops/gc_cache.py: `<stage>/<sha256 key>/` for a stage of the build's table, whose
record.json names that stage and key and whose files hash as it records, beside no file it does not list) is
removed. Nothing else is touched, and no symlink is followed: each is reported as skipped. One gc runs at a time per
cache folder, and none while a build of a model publishes. Refused: a cache folder that holds things but no entry,
and (unless `force`) an artifacts folder that holds no published artifact while the cache holds entries (each
would be unreferenced).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from pipeline.build.store import gc_lock, latest_targets, model_lock, version_number
from pipeline.errors import ArtifactError, InputError
from pipeline.ops.gc_cache import Collection, Note, Removal, check_cache_dir, folder_bytes, remove_entries, subfolders
from pipeline.runtime.artifact import MANIFEST_NAME, manifest_digest
from pipeline.runtime.engine_cache import ENGINES_DIR

DEFAULT_MIN_AGE_S = 3600.0


def _versions(model_root: Path, found: Collection) -> list[tuple[int, Path]]:
    """The vN folders of a model, oldest first (symlinked ones reported, not listed)."""
    folders = subfolders(model_root, found, lambda p: version_number(p.name) is not None)
    return sorted((version_number(p.name), p) for p in folders)


def _published(artifacts_dir: Path, found: Collection) -> dict[Path, list[tuple[int, Path]]]:
    """Each model folder with published versions, and its vN/<target> folders that hold a manifest."""
    models = {}
    for root in subfolders(artifacts_dir, found, lambda p: not p.name.startswith(".")):
        folders = [
            (number, folder)
            for number, version in _versions(root, found)
            for folder in subfolders(version, found)
            if (folder / MANIFEST_NAME).exists() or (folder / MANIFEST_NAME).is_symlink()
        ]
        if folders:
            models[root] = folders
    return models


def published_folders(artifacts_dir) -> list[Path]:
    """Every published vN/<target> folder under `artifacts_dir` (symlinks not followed)."""
    return [folder for folders in _published(Path(artifacts_dir), Collection()).values() for _, folder in folders]


def _stale(models: dict[Path, list[tuple[int, Path]]], keep: int | None, found: Collection) -> list[Path]:
    """The vN/<target> folders beyond the newest `keep` of their model and target that no `latest` link names."""
    if keep is None:
        return []
    stale = []
    for root, folders in models.items():
        pointed = latest_targets(root)
        by_target: dict[str, list[Path]] = {}
        for _, folder in sorted(folders, reverse=True):  # newest first
            by_target.setdefault(folder.name, []).append(folder)
        for newest in by_target.values():
            for folder in newest[keep:]:
                if folder.resolve() in pointed:
                    found.kept.append(Note(folder, "a latest link points to it"))
                else:
                    stale.append(folder)
    return stale


def verified_stages(folder: Path) -> dict:
    """The `stages` of the manifest in `folder`, once its digest proves it is the published one. Anything else is
    an ArtifactError: gc cannot know what that version references, so it removes nothing."""
    path = folder / MANIFEST_NAME
    fix = "nothing was removed. Rebuild that version, or remove it by hand, then run gc again"
    try:
        if path.is_symlink():
            raise ValueError("it is a symlink")
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(manifest, dict) or manifest.get("manifest_sha256") != manifest_digest(manifest):
            raise ValueError("its digest does not match: it was edited after publishing")
        stages = manifest.get("stages")
        if not isinstance(stages, dict) or not all(
            isinstance(s, dict) and isinstance(s.get("key"), str) for s in stages.values()
        ):
            raise ValueError("its stages are not a table of {key: ...} records")
    except (OSError, ValueError) as err:
        raise ArtifactError(f"gc cannot trust {path} ({err}); {fix}") from None
    return stages


def referenced_keys(folders: list[Path]) -> dict[tuple[str, str], Path]:
    """The (stage, key) cache entries the verified manifests in `folders` name, each with a folder naming it."""
    return {(name, stage["key"]): folder for folder in folders for name, stage in verified_stages(folder).items()}


def _remove(path: Path) -> None:
    # Published files are read-only; their folder is not, so removal needs no chmod. rmtree follows no symlink.
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(path)
    parent = path.parent
    with contextlib.suppress(OSError):
        if version_number(parent.name) is not None and not any(parent.iterdir()):
            parent.rmdir()


def _engine_caches(stale: list[Path]) -> list[Path]:
    """The TensorRT engine caches of old versions (`<model>/engines/<version>-<target>`, beside the versions), as
    plain folders: a symlinked one, or one under a symlinked engines folder, is left alone."""
    caches = []
    for folder in stale:
        engines = folder.parent.parent / ENGINES_DIR
        cache = engines / f"{folder.parent.name}-{folder.name}"
        if not engines.is_symlink() and cache.is_dir() and not cache.is_symlink():
            caches.append(cache)
    return caches


def _check_artifacts_dir(artifacts_dir: Path) -> None:
    """Refuse an artifacts folder gc would read as holding no published version, which would make every cache entry
    unreferenced: a missing path, a file, or a model's, version's or artifact's own folder."""
    if not artifacts_dir.is_dir():
        raise InputError(
            f"--artifacts-dir {artifacts_dir} is not a folder; gc would find no published version and remove every "
            "cache entry. Pass the artifacts folder builds publish to (default: ./artifacts)"
        )
    inner, children = None, list(artifacts_dir.iterdir())
    if (artifacts_dir / MANIFEST_NAME).exists():
        inner = "a published artifact's folder"
    elif (artifacts_dir / "latest").is_dir() or any(version_number(p.name) is not None for p in children):
        inner = "a model's folder"
    elif any((p / MANIFEST_NAME).exists() for p in children if p.is_dir() and not p.is_symlink()):
        inner = "a version's folder"
    if inner:
        raise InputError(
            f"--artifacts-dir {artifacts_dir} is {inner}, not the artifacts folder that holds <model>/vN/<target>; "
            "pass that folder (default: ./artifacts), or gc would count what lies beside it as unreferenced"
        )


def _check_published(artifacts_dir: Path, models: dict, cache_dir: Path, entries: list[Path]) -> None:
    """Refuse an artifacts folder that holds no published artifact while the cache holds entries: gc would take
    each for unreferenced. A folder with the artifacts one level down (their parent) is named."""
    if models or not entries:
        return
    deeper = [p for p in subfolders(artifacts_dir, Collection()) if _published(p, Collection())]
    if deeper:
        raise InputError(
            f"--artifacts-dir {artifacts_dir} holds no published artifact, but {deeper[0]} does (<model>/vN/<target> "
            f"one level down); nothing was removed. Pass --artifacts-dir {deeper[0]}"
        )
    raise InputError(
        f"--artifacts-dir {artifacts_dir} holds no published artifact (<model>/vN/<target>/{MANIFEST_NAME}), so gc "
        f"would take all {len(entries)} entries of {cache_dir} for unreferenced; nothing was removed. Pass the "
        "artifacts folder builds publish to (default: ./artifacts), or --force to remove the entries anyway"
    )


def collect(
    artifacts_dir,
    cache_dir,
    keep: int | None = None,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    dry_run: bool = False,
    force: bool = False,
) -> Collection:
    """Remove (or, with `dry_run`, list) old versions beyond `keep` and the stage-cache entries no remaining
    version references; returns what was removed (with sizes), skipped and kept. `force`: go on where the artifacts
    folder holds no published artifact, removing every entry older than `min_age_s`."""
    artifacts_dir, cache_dir = Path(artifacts_dir), Path(cache_dir)
    if keep is not None and keep < 1:
        raise InputError(f"--keep {keep} would remove every version; pass --keep 1 or more, or leave it out")
    if not min_age_s >= 0 or min_age_s == float("inf"):  # NaN compares false
        raise InputError(f"--min-age {min_age_s} is not a number of seconds >= 0; pass 0 or more seconds")
    _check_artifacts_dir(artifacts_dir)
    entries = check_cache_dir(cache_dir)  # before the lock: a folder that is no cache gets no .gc.lock either
    found = Collection()
    models = _published(artifacts_dir, Collection())
    with gc_lock(cache_dir), contextlib.ExitStack() as stack:
        for root in models:  # no build publishes (or points latest) while gc decides
            stack.enter_context(model_lock(root))
        models = _published(artifacts_dir, found)  # again, under the locks
        if not force:
            _check_published(artifacts_dir, models, cache_dir, entries)
        stale = _stale(models, keep, found)
        kept = [folder for folders in models.values() for _, folder in folders if folder not in stale]
        keys = referenced_keys(kept)
        found.removals += [Removal(f, folder_bytes(f), "an old version beyond --keep") for f in stale]
        engines = _engine_caches(stale)
        found.removals += [Removal(f, folder_bytes(f), "the TensorRT engines of an old version") for f in engines]
        if not dry_run:
            for folder in stale:
                _remove(folder)
            for folder in engines:
                shutil.rmtree(folder, ignore_errors=True)
        remove_entries(cache_dir, keys, min_age_s, dry_run, found)
    return found


def describe(found: Collection, dry_run: bool) -> str:
    """One line per removal and per skipped path, and a total, for the CLI."""
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {r.path} ({r.bytes / 1e6:.1f} MB): {r.reason}" for r in found.removals]
    lines += [f"skipped {s.path}: {s.reason}" for s in found.skipped]
    total = sum(r.bytes for r in found.removals) / 1e6
    lines.append(f"{verb} {len(found.removals)} folder(s), {total:.1f} MB {'to free' if dry_run else 'freed'}")
    return os.linesep.join(lines)
