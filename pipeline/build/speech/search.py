"""The engine search over a speech model's candidates (pipeline/build/search/encoder_decoder.py): judged by the
speech gate on the development split of the calibration audio, timed transcribing it."""

from __future__ import annotations

from pathlib import Path

from pipeline.build.inputs.targets import Target
from pipeline.build.manifest import Manifest, runtime_spec
from pipeline.build.search.candidates import time_shapes
from pipeline.build.search.encoder_decoder import Family, search_encoder_decoder

METRIC = "transcription"


def speech_model(manifest: Manifest, target: Target, graph: Path, session: dict):
    """A runtime SpeechModel over the encoder graph `graph` (its decoder beside it) and the exported tokenizer."""
    from pipeline.runtime.speech import open_speech_model

    return open_speech_model(graph, manifest.preprocessor()[1], runtime_spec(manifest, target), None, session)


def _time(models: dict, paths: list, batch: int) -> tuple[dict, dict]:
    """Each model's ms transcribing the development clips one at a time and as one batch, alternating."""
    from pipeline.runtime.audio import read_wav

    clips = [read_wav(p) for p in paths]
    shapes = {"clip_1": (clips[:1], 1), f"clips_{len(clips)}": (clips, batch)}
    calls = {
        shape: {name: (lambda m=m, w=work, n=size: m.transcribe(w, batch_size=n)) for name, m in models.items()}
        for shape, (work, size) in shapes.items()
    }
    return time_shapes(calls.items(), len(calls), max_rounds=5, budget_s=30.0)


SPEECH = Family("speech", METRIC, speech_model, _time)


def search_speech(manifest: Manifest, target: Target, texts: dict, flags, out: Path):
    """Build, judge and time every speech candidate (see search_encoder_decoder)."""
    return search_encoder_decoder(manifest, target, texts, flags, out, SPEECH)
