"""What the two-graph runtimes (speech: pipeline/runtime/speech.py, text-to-text: pipeline/runtime/text2text.py)
share: an encoder session that gives the cross-attention cache, and a decoder session run one step at a time with
its self-attention cache."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.runtime.text import open_tokenizer


def cache_names(layers: int, kind: str) -> list[str]:
    """`kind`.{i}.key and `kind`.{i}.value for each layer, in the graphs' order."""
    return [f"{kind}.{i}.{part}" for i in range(layers) for part in ("key", "value")]


class EncoderDecoder:
    """The sessions, tokenizer and decoding settings of a two-graph artifact. `encoder` and `decoder` are sessions
    with ONNX Runtime's `run(names, feeds)`."""

    def __init__(self, encoder, decoder, tokenizer_path: Path, spec: dict, backend: str = "onnxruntime"):
        self.spec, self.backend = spec, backend
        self.encoder, self.decoder = encoder, decoder
        self.tokenizer = open_tokenizer(tokenizer_path)
        self.layers = int(spec["layers"])
        self.past_names, self.cross_names = cache_names(self.layers, "past"), cache_names(self.layers, "cross")
        self.eos = np.array(spec["eos_token_ids"], dtype=np.int64)
        self.suppress = np.array(spec["suppress_tokens"], dtype=np.int64)
        self.batch_size = int(spec.get("batch_size") or 8)

    def step(self, ids: np.ndarray, past: dict, feeds: dict) -> tuple[np.ndarray, dict]:
        """Logits [b, s, vocab] of new tokens `ids` (the encoder's `feeds` beside them) and the grown cache."""
        outs = self.decoder.run(None, {"input_ids": ids, **past, **feeds})
        return outs[0], dict(zip(self.past_names, outs[1:], strict=True))

    def beam_tokens(self, feeds: dict, batch: int, prompt: list[int], settings) -> list[list[int]]:
        """Each input's best beam-search hypothesis after `prompt` (pipeline.runtime.decoding), the encoder's
        `feeds` of `batch` inputs repeated for each input's beams."""
        from pipeline.runtime.decoding import beam_search

        repeated = {name: np.repeat(value, settings.num_beams, axis=0) for name, value in feeds.items()}

        def step(ids, past):
            return self.step(ids, past, repeated)

        def reorder(past, rows):
            return {name: value[rows] for name, value in past.items()}

        return beam_search(step, reorder, self.empty_cache(batch * settings.num_beams), prompt, batch, settings)

    def empty_cache(self, batch: int) -> dict:
        shape = (batch, int(self.spec["heads"]), 0, int(self.spec["head_dim"]))
        return {name: np.zeros(shape, np.float32) for name in self.past_names}
