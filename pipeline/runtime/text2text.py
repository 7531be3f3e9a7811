"""A loaded text-to-text artifact (T5, BART, mBART, Marian, M2M100/NLLB): texts in, texts out, without torch.

    texts --tokenizer--> source ids --encoder.onnx--> cross-attention keys and values, once a batch
        --decoder.onnx, one token a step with its self-attention cache--> greedy tokens --tokenizer--> texts

Decoding follows transformers' greedy `generate` with the checkpoint's generation config: the decoder starts at
`decoder_start_token_id` (then the forced first token, mBART's and NLLB's target language), never emits the
suppressed tokens (single-token `bad_words_ids`), writes `forced_eos_token_id` at the length limit, and stops at an
end token. Beam search is not implemented (the spec's `not_followed` lists the settings that ask for it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.errors import InputError
from pipeline.runtime.seq2seq import EncoderDecoder
from pipeline.runtime.text import check_batch_size, check_texts, encode_batch


class Text2TextModel(EncoderDecoder):
    """A loaded text-to-text artifact: `generate(texts)`, and the teacher-forced `logits` its gate reads.

    `encoder` and `decoder` are sessions with ONNX Runtime's `run(names, feeds)`."""

    task = "text2text-generation"
    modality = "text"

    def __init__(self, encoder, decoder, tokenizer_path: Path, spec: dict, backend: str = "onnxruntime"):
        super().__init__(encoder, decoder, tokenizer_path, spec, backend)
        self.prompt = [int(i) for i in spec["prompt"]]
        self.max_length = int(spec["max_length"])

    def encode(self, texts: list[str], call: str = "generate()") -> dict:
        """The source batch (ids and mask, padded) and the cross-attention cache of each text."""
        rows = [e.ids for e in encode_batch(self.tokenizer, texts, call)]
        limit = int(self.spec["max_source_length"])
        for i, row in enumerate(rows):
            if len(row) > limit:
                raise InputError(
                    f"{call} input {i} is {len(row)} tokens, over the model's {limit}; shorten or split it"
                )
        width = max(len(r) for r in rows)
        pad = int(self.spec["source_pad_id"])
        ids = np.array([r + [pad] * (width - len(r)) for r in rows], dtype=np.int64)
        mask = np.array([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=np.int64)
        cross = self.encoder.run(self.cross_names, {"input_ids": ids, "attention_mask": mask})
        return {"encoder_attention_mask": mask, **dict(zip(self.cross_names, cross, strict=True))}

    def greedy(self, source: dict, limit: int) -> list[list[int]]:
        """Greedy new tokens of each source (without the end token), at most `limit` each."""
        batch = len(source["encoder_attention_mask"])
        ids = np.tile(np.array(self.prompt, dtype=np.int64), (batch, 1))
        past, done, tokens = self.empty_cache(batch), np.zeros(batch, bool), [[] for _ in range(batch)]
        forced_eos = self.spec.get("forced_eos_token_id")
        for step in range(limit):
            logits, past = self.step(ids, past, source)
            logits = logits[:, -1].copy()
            logits[:, self.suppress] = -np.inf
            chosen = logits.argmax(-1)
            if forced_eos is not None and step == limit - 1:  # transformers forces it at its max_length
                chosen[:] = forced_eos
            chosen[done] = int(self.spec["pad_id"])
            for row in np.flatnonzero(~done):
                if chosen[row] in self.eos:
                    done[row] = True
                else:
                    tokens[row].append(int(chosen[row]))
            if done.all():
                break
            ids = chosen[:, None].astype(np.int64)
        return tokens

    def _limit(self, max_new_tokens) -> int:
        limit = self.max_length - len(self.prompt)
        if max_new_tokens is not None:
            if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
                raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
            limit = min(limit, max_new_tokens)
        return max(limit, 1)

    def generate_ids(self, texts, max_new_tokens: int | None = None, batch_size: int | None = None) -> list[list[int]]:
        """The greedy new token ids of each text (the end token left out)."""
        texts = check_texts(texts, "generate()")
        limit, size = self._limit(max_new_tokens), check_batch_size(batch_size, "generate()") or self.batch_size
        tokens: list[list[int]] = []
        for start in range(0, len(texts), size):
            tokens += self.greedy(self.encode(texts[start : start + size]), limit)
        return tokens

    def generate(self, texts, max_new_tokens: int | None = None, batch_size: int | None = None):
        """The output text of each input text (a list for a list, a str for a str): greedy decoding as
        transformers' `generate` with the checkpoint's generation config; `max_new_tokens` caps each output
        (the config's max_length where left out)."""
        single = isinstance(texts, str)
        ids = self.generate_ids([texts] if single else texts, max_new_tokens, batch_size)
        out = [self.tokenizer.decode(t, skip_special_tokens=True).strip() for t in ids]
        return out[0] if single else out

    def logits(self, text: str, tokens: list[int]) -> np.ndarray:
        """Teacher-forced next-token logits [len(tokens), vocab] of `tokens` after the prompt, for source `text`:
        the gate's view of the decoder."""
        source = self.encode(check_texts([text], "logits()"), "logits()")
        ids = np.array([self.prompt + list(tokens)], dtype=np.int64)
        out, _ = self.step(ids, self.empty_cache(1), source)
        return out[0, len(self.prompt) - 1 : len(self.prompt) - 1 + len(tokens)]


def open_text2text_model(
    encoder_path: Path, tokenizer_path: Path, spec: dict, providers=None, session=None, backend="onnxruntime"
):
    """A Text2TextModel over an artifact's encoder graph and the decoder graph beside it, on ONNX Runtime."""
    from pipeline.runtime.backends.onnxruntime import open_encoder_decoder

    encoder, decoder = open_encoder_decoder(encoder_path, spec, session, providers, backend, "text-to-text")
    return Text2TextModel(encoder, decoder, tokenizer_path, spec, backend)
