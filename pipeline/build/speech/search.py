"""The engine search over a speech model's candidates (pipeline/build/search/encoder_decoder.py): judged by the
speech gate on the development split of the calibration audio, timed transcribing it."""

from __future__ import annotations

from pathlib import Path

from pipeline.build.inputs.targets import Target
from pipeline.build.manifest import Manifest
from pipeline.build.search.encoder_decoder import Family, search_encoder_decoder
from pipeline.runtime.audio import read_wav
from pipeline.runtime.speech import open_speech_model

METRIC = "transcription"


def _transcribe(model, clips: list, batch_size: int):
    return model.transcribe(clips, batch_size=batch_size)


def _clips(paths: list) -> list:
    return [read_wav(p) for p in paths]


SPEECH = Family("speech", METRIC, open_speech_model, "clip", _transcribe, _clips)


def search_speech(manifest: Manifest, target: Target, texts: dict, flags, out: Path):
    """Build, judge and time every speech candidate (see search_encoder_decoder)."""
    return search_encoder_decoder(manifest, target, texts, flags, out, SPEECH)
