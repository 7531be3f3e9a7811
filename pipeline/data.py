"""Text data for validation and calibration: one data contract, a list of strings read from a file.

Accepted: a text file (one example a line, blank lines skipped), JSONL (objects with a `text` field, and an
optional `text_pair` for pair classifiers, read as a (text, text_pair) tuple), or a folder of such files.
Errors name the file and line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.errors import InputError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_VALIDATION = DATA_DIR / "validation.txt"
DEFAULT_CALIBRATION = DATA_DIR / "calibration.txt"
MAX_BYTES = 256 * 1024 * 1024


def _read_file(path: Path, purpose: str) -> list[str]:
    if path.stat().st_size > MAX_BYTES:
        raise InputError(f"{purpose} file {path} is over {MAX_BYTES >> 20} MiB; pass a sample of it")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise InputError(
            f"{purpose} file {path}, line {line}: not UTF-8 ({err.reason}); re-encode it as UTF-8"
        ) from None
    texts = []
    jsonl = path.suffix == ".jsonl"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if jsonl:
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise InputError(f"{purpose} file {path}, line {number}: not JSON ({err.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise InputError(f'{purpose} file {path}, line {number}: expected an object with a "text" string')
            pair = row.get("text_pair")
            if pair is not None and not isinstance(pair, str):
                raise InputError(f'{purpose} file {path}, line {number}: "text_pair" must be a string')
            texts.append((row["text"], pair) if pair is not None else row["text"])
        else:
            texts.append(line)
    return texts


def read_texts(path: str | Path, purpose: str) -> list[str]:
    """The examples in a data file or folder; an InputError if there are none or a line is malformed."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".txt", ".jsonl"))
    elif path.is_file():
        files = [path]
    else:
        raise InputError(f"{purpose} data {path} does not exist; pass a .txt or .jsonl file or a folder of them")
    texts = [t for f in files for t in _read_file(f, purpose)]
    if not texts:
        raise InputError(f"{purpose} data {path} holds no examples; it needs at least one non-blank line")
    return texts


def texts_digest(texts: list) -> str:
    """sha256 of the examples themselves, so the same data in another file gives the same cache key."""
    return hashlib.sha256(json.dumps(texts, ensure_ascii=False).encode("utf-8")).hexdigest()
