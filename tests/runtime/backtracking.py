"""An artifact whose tokenizer.json carries a pre-tokenizer `Split` pattern that backtracks without bound, as a
crafted checkpoint can: the tokenizers library builds and saves it, and panics (pyo3's PanicException, a
BaseException) when it meets PANICS."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import edit_manifest

PATTERN = "(a+)+b"
PANICS = "a" * 30  # Oniguruma's retry limit ends the match and the Rust side panics on it


def backtracking_tokenizer(path: Path):
    """The tokenizer in `path` with Split(PATTERN) after its pre-tokenizer."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    tokenizer = Tokenizer.from_file(str(path))
    steps = [tokenizer.pre_tokenizer] if tokenizer.pre_tokenizer is not None else []
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([*steps, pre_tokenizers.Split(Regex(PATTERN), "isolated")])
    return tokenizer


def add_backtracking_split(folder: Path) -> Path:
    """Give the artifact in `folder` (a writable copy) the backtracking Split, and list the new tokenizer.json's
    sha256 in its resealed manifest, as a build of such a checkpoint would publish it."""
    from pipeline.runtime.artifact import sha256_file

    path = folder / "tokenizer.json"
    tokenizer = backtracking_tokenizer(path)
    for file in (path, folder / "manifest.json"):
        file.chmod(0o644)
    tokenizer.save(str(path))
    edit_manifest(folder, lambda manifest: manifest["files"].update({"tokenizer.json": sha256_file(path)}))
    return folder
