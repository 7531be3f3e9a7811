"""gc's side of the stage cache: which of its folders are entries gc may remove (proven the cache's own by their
record and files, unreferenced, old enough, leased by no build), and the Collection both sides of gc report into
(pipeline/ops/gc.py has the published side and `collect`)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import time
from pathlib import Path

from pipeline.build.store import (
    LEASE_PREFIX,
    RECORD,
    claim,
    discard,
    lease_path,
    leased_entry,
    remove_dead_scratch,
)
from pipeline.build.table import STAGES
from pipeline.errors import InputError
from pipeline.runtime.artifact import sha256_file

# The stage folders a cache holds are named by the rows of the build's stage table; its keys are sha256 digests.
CACHE_STAGES = tuple(name for name, _ in STAGES)
KEY_SHAPE = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class Removal:
    """One folder gc removed (or, in a dry run, would remove), its size, and why."""

    path: Path
    bytes: int
    reason: str


@dataclasses.dataclass(frozen=True)
class Note:
    """A path gc left in place, and why."""

    path: Path
    reason: str


@dataclasses.dataclass
class Collection:
    """What one gc did: `removals`; `skipped`, what it would not touch (symlinks, leased entries); `kept`, what it
    kept on purpose and why (printed with --verbose)."""

    removals: list[Removal] = dataclasses.field(default_factory=list)
    skipped: list[Note] = dataclasses.field(default_factory=list)
    kept: list[Note] = dataclasses.field(default_factory=list)


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (symlinks neither followed nor counted)."""
    files = (os.path.join(folder, name) for folder, _, names in os.walk(path) for name in names)  # follows none
    return sum(os.lstat(file).st_size for file in files if not os.path.islink(file))


def skipped_symlink(path: Path, found: Collection) -> bool:
    """Whether `path` is a symlink; if so it is reported as skipped."""
    if not path.is_symlink():
        return False
    found.skipped.append(Note(path, f"a symlink (to {os.readlink(path)}); gc never follows one"))
    return True


def subfolders(parent: Path, found: Collection, match=lambda p: True) -> list[Path]:
    """The real folders in `parent` that `match`, sorted; symlinks among them are reported and left alone."""
    children = sorted(p for p in parent.iterdir() if match(p)) if parent.is_dir() else []
    return [p for p in children if not skipped_symlink(p, found) and p.is_dir()]


def _record(entry: Path) -> dict | None:
    """The record of `entry` if it is a cache entry's: its record.json (a file, not a symlink) names the entry's
    stage and key, and lists its files by plain name. Its files are not read: see `_unproven`."""
    path = entry / RECORD
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 1 << 24:
            return None
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (record.get("stage"), record.get("key")) != (entry.parent.name, entry.name):
        return None
    files = record.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(name, str) and isinstance(digest, str) and name not in ("", ".", "..", RECORD) and "/" not in name
        for name, digest in files.items()
    ):
        return None
    return record


def _unproven(entry: Path, record: dict) -> str | None:
    """Why the files of `entry` are not the ones its record lists (None when each hashes as recorded and no other
    file lies beside them; a stage's own work folders may)."""
    listed = record["files"]
    try:
        other = sorted(p.name for p in entry.iterdir() if p.name not in listed and p.name != RECORD and not _folder(p))
        if other:
            return f"it holds {other[0]}, which its record does not list"
        for name, digest in listed.items():
            if (entry / name).is_symlink() or sha256_file(entry / name) != digest:
                return f"its {name} does not hash as its record says"
    except OSError as err:
        return f"its files cannot be read ({err.strerror or err})"
    return None


def _folder(path: Path) -> bool:  # a real folder, not a symlink to one
    return path.is_dir() and not path.is_symlink()


def _keyed(stage_dir: Path, found: Collection) -> list[Path]:
    """The key-named real folders in a stage folder (symlinks among its other children reported as skipped)."""
    children = sorted(p for p in stage_dir.iterdir() if not p.name.startswith("."))
    return [p for p in children if not skipped_symlink(p, found) and p.is_dir() and KEY_SHAPE.fullmatch(p.name)]


def _stage_dirs(cache_dir: Path, found: Collection) -> list[Path]:
    """The real folders of `cache_dir` named by a stage of the build (symlinks among all its children reported)."""
    return [p for p in subfolders(cache_dir, found, lambda p: not p.name.startswith(".")) if p.name in CACHE_STAGES]


def check_cache_dir(cache_dir: Path) -> list[Path]:
    """The entries of `cache_dir` whose record names their stage and key. A folder that holds something else but
    none of them is refused: whatever it is, it is no stage cache, and gc removes nothing there."""
    entries = [e for d in _stage_dirs(cache_dir, Collection()) for e in _keyed(d, Collection()) if _record(e)]
    if entries or not cache_dir.is_dir():  # a missing cache: nothing to do
        return entries
    stray = sorted(
        p.name
        for p in cache_dir.iterdir()
        if not p.name.startswith(".")
        and not (p.name in CACHE_STAGES and _folder(p) and all(c.name.startswith(".") for c in p.iterdir()))
    )
    if stray:
        shown = ", ".join(stray[:3]) + (f" and {len(stray) - 3} more" if len(stray) > 3 else "")
        raise InputError(
            f"--cache-dir {cache_dir} holds {shown} but no stage-cache entry (<stage>/<sha256 key>/{RECORD} naming "
            f"that stage and key, for a stage among {', '.join(CACHE_STAGES)}); nothing was removed. Pass the stage "
            "cache builds write to (default: ./.cache/stages)"
        )
    return entries


def remove_entries(cache_dir: Path, keys: dict, min_age_s: float, dry_run: bool, found: Collection) -> None:
    """Remove (or list) the cache entries not in `keys`, older than `min_age_s`, leased by no build and proven the
    cache's own (their record and files); report the key-named folders with a record.json that proves nothing."""
    now = time.time()
    for stage_dir in _stage_dirs(cache_dir, found):
        for entry in _keyed(stage_dir, found):
            record = _record(entry)
            if (stage_dir.name, entry.name) in keys:
                found.kept.append(Note(entry, f"{keys[(stage_dir.name, entry.name)]} references it"))
            elif record is None:
                if (entry / RECORD).exists() or (entry / RECORD).is_symlink():
                    found.skipped.append(Note(entry, f"its {RECORD} is no record of this stage and key; not gc's"))
            elif now - entry.stat().st_mtime < min_age_s:
                found.kept.append(Note(entry, "used within --min-age"))
            elif why := _unproven(entry, record):
                found.skipped.append(Note(entry, f"{why}; gc removes only entries whose files match their record"))
            else:
                _remove_entry(entry, dry_run, found)
        if not dry_run:
            remove_dead_scratch(stage_dir)
            _remove_orphan_leases(stage_dir)


def _remove_entry(entry: Path, dry_run: bool, found: Collection) -> None:
    try:
        with claim(entry, create=not dry_run) as free:
            if not free:
                found.skipped.append(Note(entry, "a running build holds its lease"))
                return
            found.removals.append(Removal(entry, folder_bytes(entry), "a cache entry no published version references"))
            if not dry_run:
                discard(entry)
                lease_path(entry).unlink(missing_ok=True)  # under the lock: a waiting build takes a fresh one
    except OSError as err:  # a symlink planted as its lease file, or an unwritable stage folder
        found.skipped.append(Note(entry, f"its lease file cannot be taken ({err.strerror or err})"))


def _remove_orphan_leases(stage_dir: Path) -> None:
    for path in stage_dir.glob(f"{LEASE_PREFIX}*"):
        entry = leased_entry(path)
        if path.is_symlink() or entry.exists() or entry.is_symlink():
            continue
        with contextlib.suppress(OSError), claim(entry) as free:
            if free and not entry.exists():
                path.unlink()
