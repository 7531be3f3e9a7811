"""Data for validation and calibration: one data contract, a list of strings read from a file or folder.

Accepted: a text file (one example a line, blank lines skipped), JSONL (objects with a `text` field, and an
optional `text_pair` for pair classifiers, read as a (text, text_pair) tuple), or a folder of such files; for
image models, a folder of image files, each example the file's absolute path (the runtime reads paths).
Errors name the file and line. Held-out text must share no example with the calibration text (`check_held_out`),
and calibration text must leave a development split (`check_calibration`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.errors import InputError

DATA_DIR = Path(__file__).resolve().parents[3] / "data"
DEFAULT_VALIDATION = DATA_DIR / "validation.txt"
DEFAULT_CALIBRATION = DATA_DIR / "calibration.txt"
MAX_BYTES = 256 * 1024 * 1024
# Every fourth calibration example is the development split that judges the fallback and the search: with 8, it
# holds 2, the fewest on which every statistic is measured (an embedding's nearest-neighbour agreement needs two).
MIN_CALIBRATION = 8
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
AUDIO_SUFFIXES = (".wav",)
MAX_IMAGES = 10_000  # a data folder's images; more is a sample's work


def _read_file(path: Path, purpose: str) -> list[str]:
    try:
        if path.stat().st_size > MAX_BYTES:
            raise InputError(f"{purpose} file {path} is over {MAX_BYTES >> 20} MiB; pass a sample of it")
        raw = path.read_bytes()
    except OSError as err:
        raise InputError(f"cannot read {purpose} file {path} ({err.strerror or err}); check its permissions") from None
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
    """The examples in a data file or folder; an InputError if there are none or a line is malformed. A folder's
    image files are examples too, each as its absolute path (the data of image models)."""
    path = Path(path)
    images = []
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".txt", ".jsonl") and p.is_file())
        images = sorted(str(p.resolve()) for p in path.iterdir() if is_media_file(p))[:MAX_IMAGES]
    elif path.is_file():
        files = [path]
    else:
        raise InputError(
            f"{purpose} data {path} does not exist; pass a .txt or .jsonl file, or a folder of them or of images"
        )
    texts = [t for f in files for t in _read_file(f, purpose)] + images
    if not texts:
        raise InputError(f"{purpose} data {path} holds no examples; it needs at least one non-blank line or image")
    return texts


def is_image_file(path, suffixes: tuple = IMAGE_SUFFIXES) -> bool:
    """Whether `path` names an image file an image model's data may hold (a plain file with an image suffix), or
    with `suffixes` given, a file of those (AUDIO_SUFFIXES: a speech model's)."""
    path = Path(path)
    return path.suffix.lower() in suffixes and path.is_file() and not path.is_symlink()


def is_media_file(path) -> bool:
    """Whether `path` names an image or audio file: an example of an image or speech model's data."""
    return is_image_file(path, IMAGE_SUFFIXES + AUDIO_SUFFIXES)


def _content(example):
    """An example as a digest sees it: an image file by its bytes' sha256 (the same picture elsewhere is the same
    example, and a changed one is another), text as it is."""
    if isinstance(example, str) and Path(example).is_absolute() and is_media_file(example):
        return "sha256:" + hashlib.sha256(Path(example).read_bytes()).hexdigest()
    return example


def texts_digest(texts: list) -> str:
    """sha256 of the examples themselves (image files by content), so the same data in another file or folder
    gives the same cache key."""
    content = [_content(t) for t in texts]
    return hashlib.sha256(json.dumps(content, ensure_ascii=False).encode("utf-8")).hexdigest()


def normalized(example) -> str:
    """An example as overlap is judged: a pair's two texts joined, whitespace collapsed, case folded; an image file
    by its content."""
    example = _content(example)
    text = example if isinstance(example, str) else " ".join(example)
    return " ".join(text.split()).casefold()


def check_held_out(validation: list, calibration: list, validation_path, calibration_path) -> None:
    """An InputError if any validation example is also a calibration example (compared `normalized`): text a
    build was calibrated or judged on is not held out."""
    shared = {normalized(t) for t in validation} & {normalized(t) for t in calibration}
    if shared:
        raise InputError(
            f"validation data {validation_path} and calibration data {calibration_path} share {len(shared)} "
            "example(s) (compared with whitespace collapsed and case folded), so validation would not be on "
            "held-out text; remove them from one of the two, or pass other --validation or --calibration data"
        )


def check_calibration(texts: list, path, limit: int) -> None:
    """An InputError if the calibration examples a build uses (the first `limit`) are fewer than MIN_CALIBRATION."""
    usable = min(len(texts), limit)
    if usable < MIN_CALIBRATION:
        capped = f" (quantize.calibration_examples = {limit})" if limit < len(texts) else ""
        raise InputError(
            f"calibration data {path} gives {usable} example(s){capped}; the target needs at least "
            f"{MIN_CALIBRATION}, every fourth held back as the development split that judges its graphs: add "
            "examples, or pass other --calibration data"
        )


def written_once(final: Path, write) -> Path:
    """`final`, a folder of generated data: where missing, `write(staging)` fills a staging folder beside it, which
    is then renamed into place in one step (a build that stops leaves no half-written set; another build that wrote
    the same set first wins)."""
    import contextlib
    import os
    import shutil
    import tempfile

    if not final.is_dir():
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".writing-", dir=final.parent))
        try:
            write(staging)
            with contextlib.suppress(OSError):
                os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final
