"""The engine search over a text-to-text model's candidates (pipeline/build/search/encoder_decoder.py): judged by
the text-to-text gate on the development split of the calibration text, timed generating from it, greedily, as many
tokens as the gate decodes."""

from __future__ import annotations

from pathlib import Path

from pipeline.build.inputs.targets import Target
from pipeline.build.manifest import Manifest
from pipeline.build.search.encoder_decoder import Family, search_encoder_decoder
from pipeline.build.text2text.gate import gate_tokens
from pipeline.runtime.text2text import open_text2text_model

METRIC = "text2text"


def _generate(model, texts: list, batch_size: int):
    return model.generate_ids(texts, max_new_tokens=gate_tokens(model.spec), batch_size=batch_size, num_beams=1)


TEXT2TEXT = Family("text2text", METRIC, open_text2text_model, "text", _generate)


def search_text2text(manifest: Manifest, target: Target, texts: dict, flags, out: Path):
    """Build, judge and time every text-to-text candidate (see search_encoder_decoder)."""
    return search_encoder_decoder(manifest, target, texts, flags, out, TEXT2TEXT)
