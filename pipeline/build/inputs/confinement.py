"""A checkpoint folder stays a closed world: nothing in it may lead the build to a file outside it.

Two ways out are refused before anything reads the checkpoint:
- a file or folder in it that is a symlink resolving outside the folder (its target would be hashed, read by the
  exporter and, for a chat template, copied into the published manifest);
- a JSON value under a path-like key (`vocab_file`, `tokenizer_file`, `path`, ...) that is absolute, holds a `..`
  part, or resolves outside the folder: transformers lets tokenizer_config.json's values override the files it
  finds in the folder, so `"vocab_file": "/etc/..."` would be read and published as the tokenizer.

One layout is let through: a Hugging Face hub cache snapshot (`<repo>/snapshots/<rev>/`), whose files are
symlinks into the same repository's `blobs/` folder. Those blobs are the snapshot's own files.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from pipeline.errors import InputError

# Keys whose string values name files or folders. Older checkpoints record where they came from in the first two
# and the absolute path of the file saved beside them in the third; transformers opens none of them when loading
# from a folder (it finds the special tokens map in the folder itself).
PATH_KEY = re.compile(r"(^|_)(file|files|path|paths|dir|directory|filename|folder)$", re.IGNORECASE)
NOT_OPENED = {"_name_or_path", "name_or_path", "special_tokens_map_file"}
MAX_JSON_BYTES = 1 << 30  # a tokenizer.json of a large vocabulary is tens of MB
MAX_ENTRIES = 100_000  # files and folders in one checkpoint


def _allowed_roots(folder: Path) -> list[Path]:
    """Where the checkpoint's files may live: the folder, and for a hub cache snapshot its repository's blobs."""
    roots = [folder]
    if folder.parent.name == "snapshots":
        roots.append(folder.parent.parent / "blobs")
    return roots


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def _links_out(folder: Path, roots: list[Path]) -> None:
    """Refuse a symlink in the folder (at any depth) that resolves outside the allowed roots, or dangles."""
    seen = 0
    for parent, dirs, files in os.walk(folder):  # follows no symlinked folder
        seen += len(dirs) + len(files)
        if seen > MAX_ENTRIES:
            raise InputError(
                f"{folder} holds over {MAX_ENTRIES} files and folders; a checkpoint folder holds a model's few files: "
                "pass the checkpoint's own folder"
            )
        for name in dirs + files:
            path = Path(parent) / name
            if not path.is_symlink():
                continue
            target = path.resolve()
            if not _inside(target, roots) or not target.exists():
                rel = path.relative_to(folder).as_posix()
                raise InputError(
                    f"{folder}: {rel!r} is a symlink to {os.readlink(path)!r}, outside the checkpoint folder (or "
                    "missing); the build reads only the folder's own files: copy that file into the folder"
                )


def _path_values(value, key: str = ""):
    """(key, string) for each string under a path-like key in a JSON value, at any depth (no recursion)."""
    stack = [(key, value)]
    while stack:
        key, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((key, v) for v in value)
        elif isinstance(value, str) and value and key not in NOT_OPENED and PATH_KEY.search(key):
            yield key, value


def _leads_out(value: str, base: Path, roots: list[Path]) -> bool:
    parts = re.split(r"[\\/]", value)
    if os.path.isabs(value) or value.startswith(("~", "\\")) or re.match(r"^[A-Za-z]:", value) or ".." in parts:
        return True
    return not _inside((base / value).resolve(), roots)


def _json_paths_out(folder: Path, roots: list[Path]) -> None:
    """Refuse a JSON file in the folder with a path-like value that leads out of it."""
    for path in sorted(folder.rglob("*.json")):
        if path.is_symlink() or not path.is_file():
            continue  # symlinks were checked by _links_out
        if path.stat().st_size > MAX_JSON_BYTES:
            raise InputError(f"{path} is over {MAX_JSON_BYTES >> 20} MB; a checkpoint's JSON is smaller: save it again")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError, OSError):
            continue  # the stage that reads the file says what is wrong with it
        for key, value in _path_values(data):
            if _leads_out(value, path.parent, roots):
                raise InputError(
                    f"{path}: {key!r} is {value[:200]!r}, a path outside the checkpoint folder; the build reads only "
                    "the folder's own files: copy that file into the folder and name it relative to it"
                )


def check_confined(folder) -> None:
    """An InputError when anything in the checkpoint `folder` leads to a file outside it (see the module doc)."""
    folder = Path(folder).resolve()
    roots = _allowed_roots(folder)
    _links_out(folder, roots)
    _json_paths_out(folder, roots)
