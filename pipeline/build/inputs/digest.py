"""A checkpoint folder's digest: what a build records of its source, and what validating a published artifact
again checks its source against."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline.runtime.artifact import sha256_file

# Files that describe the model; docs and VCS files do not change what is built.
IGNORED = {"README.md", ".gitattributes", "data_config.json"}


def checkpoint_digest(folder: Path) -> str:
    """sha256 over the relative path and sha256 of every file that defines the model."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = file.relative_to(folder).as_posix()
        if rel in IGNORED or rel.startswith(".") or "/." in rel:
            continue
        digest.update(f"{rel}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()
