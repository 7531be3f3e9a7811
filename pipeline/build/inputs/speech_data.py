"""The default held-out and calibration speech of a speech model: sentences of the repository's validation and
calibration text, spoken by espeak-ng (pipeline.build.inputs.speech) into 16 kHz WAV files.

A build of a speech model given no --validation or --calibration data uses these, as a text model uses
data/validation.txt and data/calibration.txt. Held out stays held out: the spoken sentences come from the two text
files, which share no line. The gate compares the artifact's transcripts with transformers' transcripts of the same
audio, so synthetic speech serves; what it does not show is accuracy on real voices and noise (pass folders of
real recordings for that).

The files are written once into `<cache>/.speech/<digest>/{validation,calibration}/` (written beside, then
renamed into place), where the digest covers the sentences, the voice and espeak-ng's library and data.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline.build.inputs.data import DEFAULT_CALIBRATION, DEFAULT_VALIDATION, read_texts, written_once
from pipeline.errors import InputError

VERSION = 1
VOICE = "en-us"
MAX_WORDS = 45  # about 17 s at espeak-ng's 160 words a minute: one 30 s window
COUNTS = {"validation": 12, "calibration": 32}  # calibration: every fourth clip is the development split


def _sentences(path: Path, count: int) -> list[str]:
    texts = [t for t in read_texts(path, "speech") if isinstance(t, str) and 3 <= len(t.split()) <= MAX_WORDS]
    return texts[:count]


def _espeak_digest() -> str:
    try:
        import espeakng_loader
    except ImportError:
        raise InputError(
            "a speech model's default validation and calibration audio is synthesized by espeak-ng; install it "
            "(pip install espeakng-loader) or pass --validation and --calibration folders of WAV files"
        ) from None
    digest = hashlib.sha256(Path(espeakng_loader.get_library_path()).read_bytes())
    return digest.hexdigest()


def default_speech_data(cache_dir) -> tuple[Path, Path]:
    """(validation folder, calibration folder) of the default speech, synthesized under `cache_dir` on first use."""
    from pipeline.build.inputs.speech import synthesize, write_wav

    sets = {
        "validation": _sentences(DEFAULT_VALIDATION, COUNTS["validation"]),
        "calibration": _sentences(DEFAULT_CALIBRATION, COUNTS["calibration"]),
    }
    digest = hashlib.sha256(f"{VERSION} {VOICE} {_espeak_digest()}".encode())
    for name, texts in sets.items():
        digest.update((name + "\0" + "\n".join(texts)).encode())

    def write(staging: Path) -> None:
        for name, texts in sets.items():
            (staging / name).mkdir()
            for number, text in enumerate(texts):
                write_wav(staging / name / f"{number:03d}.wav", synthesize(text, VOICE))

    final = written_once(Path(cache_dir) / ".speech" / digest.hexdigest()[:16], write)
    return final / "validation", final / "calibration"
