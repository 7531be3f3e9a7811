"""The engine search over a text-to-text model's candidates (pipeline/build/search/encoder_decoder.py): judged by
the text-to-text gate on the development split of the calibration text, timed generating from it."""

from __future__ import annotations

from pathlib import Path

from pipeline.build.inputs.targets import Target
from pipeline.build.manifest import Manifest, runtime_spec
from pipeline.build.search.candidates import time_shapes
from pipeline.build.search.encoder_decoder import Family, search_encoder_decoder
from pipeline.build.text2text.gate import gate_tokens

METRIC = "text2text"


def text2text_model(manifest: Manifest, target: Target, graph: Path, session: dict):
    """A runtime Text2TextModel over the encoder graph `graph` (its decoder beside it) and the exported tokenizer."""
    from pipeline.runtime.text2text import open_text2text_model

    return open_text2text_model(graph, manifest.preprocessor()[1], runtime_spec(manifest, target), None, session)


def _time(models: dict, texts: list, batch: int) -> tuple[dict, dict]:
    """Each model's ms generating from the development texts one at a time and as one batch, alternating."""
    new = gate_tokens(next(iter(models.values())).spec)
    shapes = {"text_1": (texts[:1], 1), f"texts_{len(texts)}": (texts, batch)}
    calls = {
        shape: {
            name: (lambda m=m, w=work, n=size: m.generate_ids(w, max_new_tokens=new, batch_size=n, num_beams=1))
            for name, m in models.items()
        }
        for shape, (work, size) in shapes.items()
    }
    return time_shapes(calls.items(), len(calls), max_rounds=5, budget_s=30.0)


TEXT2TEXT = Family("text2text", METRIC, text2text_model, _time)


def search_text2text(manifest: Manifest, target: Target, texts: dict, flags, out: Path):
    """Build, judge and time every text-to-text candidate (see search_encoder_decoder)."""
    return search_encoder_decoder(manifest, target, texts, flags, out, TEXT2TEXT)
