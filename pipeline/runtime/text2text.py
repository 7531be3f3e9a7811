"""A loaded text-to-text artifact (T5, BART, mBART, Marian, M2M100/NLLB): texts in, texts out, without torch.

    texts --tokenizer--> source ids --encoder.onnx--> cross-attention keys and values, once a batch
        --decoder.onnx, one token a step with its self-attention cache--> tokens --tokenizer--> texts

Decoding follows transformers' `generate` with the checkpoint's generation config (pipeline/runtime/decoding.py):
the decoder starts at `decoder_start_token_id` (then the forced first token, mBART's and NLLB's target language),
never emits the suppressed tokens (single-token `bad_words_ids`) or a repeated n-gram (`no_repeat_ngram_size`), no
end token before `min_length`, `forced_eos_token_id` at the length limit; greedy, or beam search with `num_beams`,
`length_penalty` and `early_stopping`. The spec's `not_followed` lists the config's settings it does not follow.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.runtime.decoding import Decoding, check_beams, check_new_tokens, mask_scores
from pipeline.runtime.seq2seq import EncoderDecoder
from pipeline.runtime.text import check_batch_size, check_lengths, check_texts, encode_batch, padded_rows


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
        check_lengths(rows, int(self.spec["max_source_length"]), call)
        ids, mask = padded_rows(rows, int(self.spec["source_pad_id"]))
        cross = self.encoder.run(self.cross_names, {"input_ids": ids, "attention_mask": mask})
        return {"encoder_attention_mask": mask, **dict(zip(self.cross_names, cross, strict=True))}

    def decoding(self, max_new_tokens, num_beams) -> Decoding:
        """The decoding settings of a call: the checkpoint's, the length capped at `max_new_tokens` after the prompt
        and the beam count replaced by `num_beams` where given."""
        spec, length = self.spec, self.max_length
        if max_new_tokens is not None:
            length = min(length, len(self.prompt) + check_new_tokens(max_new_tokens))
        beams = int(spec.get("num_beams", 1)) if num_beams is None else check_beams(num_beams)
        return Decoding(
            max_length=max(length, len(self.prompt) + 1),
            eos=tuple(int(i) for i in spec["eos_token_ids"]),
            suppress=tuple(int(i) for i in spec["suppress_tokens"]),
            forced_eos=spec.get("forced_eos_token_id"),
            min_length=int(spec.get("min_length", 0)),
            no_repeat_ngram_size=int(spec.get("no_repeat_ngram_size", 0)),
            num_beams=beams,
            length_penalty=float(spec.get("length_penalty", 1.0)),
            early_stopping=spec.get("early_stopping", False),
        )

    def greedy(self, source: dict, settings: Decoding) -> list[list[int]]:
        """Greedy new tokens of each source (without the end token)."""
        batch = len(source["encoder_attention_mask"])
        sequences = np.tile(np.array(self.prompt, dtype=np.int64), (batch, 1))
        ids, past, done = sequences, self.empty_cache(batch), np.zeros(batch, bool)
        while sequences.shape[1] < settings.max_length and not done.all():
            logits, past = self.step(ids, past, source)
            chosen = mask_scores(logits[:, -1].copy(), sequences, settings).argmax(-1)
            chosen[done] = int(self.spec["pad_id"])
            done |= np.isin(chosen, settings.eos)
            ids = chosen[:, None].astype(np.int64)
            sequences = np.concatenate([sequences, ids], axis=1)
        tokens = []
        for row in sequences[:, len(self.prompt) :].tolist():
            ends = [i for i, t in enumerate(row) if t in settings.eos]
            tokens.append(row[: ends[0]] if ends else row)
        return tokens

    def beams(self, source: dict, settings: Decoding) -> list[list[int]]:
        """Each source's best beam-search hypothesis (without the end token)."""
        return self.beam_tokens(source, len(source["encoder_attention_mask"]), self.prompt, settings)

    def generate_ids(
        self, texts, max_new_tokens: int | None = None, batch_size: int | None = None, num_beams: int | None = None
    ) -> list[list[int]]:
        """The new token ids of each text (the end token left out)."""
        texts = check_texts(texts, "generate()")
        settings = self.decoding(max_new_tokens, num_beams)
        size = check_batch_size(batch_size, "generate()") or self.batch_size
        decode = self.greedy if settings.num_beams == 1 else self.beams
        tokens: list[list[int]] = []
        for start in range(0, len(texts), size):
            tokens += decode(self.encode(texts[start : start + size]), settings)
        return tokens

    def generate(
        self, texts, max_new_tokens: int | None = None, batch_size: int | None = None, num_beams: int | None = None
    ):
        """The output text of each input text (a list for a list, a str for a str), decoded as transformers'
        `generate` decodes with the checkpoint's generation config: greedy, or beam search where the config (or
        `num_beams`) asks for beams; `max_new_tokens` caps each output (the config's max_length where left out)."""
        single = isinstance(texts, str)
        ids = self.generate_ids([texts] if single else texts, max_new_tokens, batch_size, num_beams)
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
