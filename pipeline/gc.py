"""Artifact hygiene: remove stage-cache entries no published version references, and old versions.

What is kept, always:
- every version a `latest` link points to;
- the newest `keep` versions of each model and target (all of them when `keep` is None);
- every stage-cache entry that a kept version's manifest names (its `stages` keys);
- every cache entry or scratch folder younger than `min_age_s`: a build running now may still read it before it
  publishes, and a running build's scratch folder is locked besides.

Everything else under the artifacts and cache folders that this module recognises (vN/<target> folders, cache
entries named by their key, dead .tmp- scratch folders) is removed. Nothing else is touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from pipeline.cache import RECORD, remove_dead_scratch
from pipeline.errors import InputError
from pipeline.runtime.artifact import MANIFEST_NAME
from pipeline.stages.publish import model_lock, published_versions

DEFAULT_MIN_AGE_S = 3600.0


@dataclasses.dataclass(frozen=True)
class Removal:
    """One folder gc removed (or, in a dry run, would remove), its size, and why."""

    path: Path
    bytes: int
    reason: str


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (symlinks not followed)."""
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def _latest_targets(model_root: Path) -> set[Path]:
    """The version folders `latest/<target>` links resolve to."""
    latest = model_root / "latest"
    pointed = set()
    for link in latest.iterdir() if latest.is_dir() else ():
        if link.is_symlink():
            with contextlib.suppress(OSError):
                pointed.add(link.resolve(strict=True))
    return pointed


def _model_roots(artifacts_dir: Path) -> list[Path]:
    return (
        sorted(p for p in artifacts_dir.iterdir() if p.is_dir() and published_versions(p))
        if artifacts_dir.is_dir()
        else []
    )


def published_folders(artifacts_dir: Path) -> list[Path]:
    """Every published vN/<target> folder under `artifacts_dir`."""
    return [
        folder
        for root in _model_roots(artifacts_dir)
        for _, version in published_versions(root)
        for folder in sorted(version.iterdir())
        if folder.is_dir() and (folder / MANIFEST_NAME).is_file()
    ]


def stale_versions(artifacts_dir: Path, keep: int | None) -> list[Path]:
    """The vN/<target> folders beyond the newest `keep` of their model and target that no `latest` link names."""
    if keep is None:
        return []
    stale = []
    for root in _model_roots(artifacts_dir):
        pointed = _latest_targets(root)
        by_target: dict[str, list[Path]] = {}
        for _, version in sorted(published_versions(root), reverse=True):  # newest first
            for folder in sorted(version.iterdir()):
                if folder.is_dir():
                    by_target.setdefault(folder.name, []).append(folder)
        for folders in by_target.values():
            stale += [f for f in folders[keep:] if f.resolve() not in pointed]
    return stale


def referenced_keys(folders: list[Path]) -> set[tuple[str, str]]:
    """The (stage, key) cache entries the manifests in `folders` name. A manifest that cannot be read is an error: gc
    cannot know what it references, so it removes nothing."""
    keys = set()
    for folder in folders:
        try:
            stages = json.loads((folder / MANIFEST_NAME).read_text())["stages"]
            keys |= {(name, stage["key"]) for name, stage in stages.items()}
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InputError(
                f"gc cannot read the stages of {folder / MANIFEST_NAME} ({err}); nothing was removed. Repair or "
                "remove that version by hand, then run gc again"
            ) from None
    return keys


def _young(path: Path, min_age_s: float, now: float) -> bool:
    return now - path.stat().st_mtime < min_age_s


def unreferenced_entries(cache_dir: Path, keys: set[tuple[str, str]], min_age_s: float) -> list[Path]:
    """Cache entries (folders named by a key, with a record) whose key is not in `keys`, older than `min_age_s`."""
    now = time.time()
    found = []
    for stage_dir in sorted(p for p in cache_dir.iterdir() if p.is_dir()) if cache_dir.is_dir() else ():
        for entry in sorted(stage_dir.iterdir()):
            if entry.name.startswith(".") or not entry.is_dir() or (stage_dir.name, entry.name) in keys:
                continue
            if (entry / RECORD).exists() and not _young(entry, min_age_s, now):
                found.append(entry)
    return found


def _remove(path: Path) -> None:
    # Published files are read-only; their folder is not, so removal needs no chmod.
    shutil.rmtree(path)
    parent = path.parent
    with contextlib.suppress(OSError):
        if parent.name.startswith("v") and not any(parent.iterdir()):
            parent.rmdir()


def collect(artifacts_dir, cache_dir, keep: int | None = None, min_age_s: float = DEFAULT_MIN_AGE_S,
            dry_run: bool = False) -> list[Removal]:  # fmt: skip
    """Remove (or, with `dry_run`, list) old versions beyond `keep` and the stage-cache entries no remaining
    version references; returns what was removed, with sizes."""
    artifacts_dir, cache_dir = Path(artifacts_dir), Path(cache_dir)
    if keep is not None and keep < 1:
        raise InputError(f"--keep {keep} would remove every version; pass --keep 1 or more, or leave it out")
    if min_age_s < 0:
        raise InputError(f"--min-age {min_age_s} is negative; pass 0 or more seconds")
    locks = [model_lock(root) for root in _model_roots(artifacts_dir)]
    with contextlib.ExitStack() as stack:
        for lock in locks:  # no build publishes (or points latest) while gc decides
            stack.enter_context(lock)
        stale = stale_versions(artifacts_dir, keep)
        kept = [f for f in published_folders(artifacts_dir) if f not in stale]
        entries = unreferenced_entries(cache_dir, referenced_keys(kept), min_age_s)
        removals = [Removal(f, folder_bytes(f), "an old version beyond --keep") for f in stale]
        removals += [Removal(e, folder_bytes(e), "a cache entry no published version references") for e in entries]
        if not dry_run:
            for removal in removals:
                _remove(removal.path)
            for stage_dir in (p for p in cache_dir.iterdir() if p.is_dir()) if cache_dir.is_dir() else ():
                remove_dead_scratch(stage_dir)
    return removals


def describe(removals: list[Removal], dry_run: bool) -> str:
    """One line per removal and a total, for the CLI."""
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {r.path} ({r.bytes / 1e6:.1f} MB): {r.reason}" for r in removals]
    total = sum(r.bytes for r in removals) / 1e6
    lines.append(f"{verb} {len(removals)} folder(s), {total:.1f} MB {'to free' if dry_run else 'freed'}")
    return os.linesep.join(lines)
