"""A loaded speech-to-text artifact (Whisper): audio in, text out, without torch.

    audio (16 kHz floats or a WAV file) --30 s windows--> log-mel features (pipeline.runtime.audio)
        --encoder.onnx--> cross-attention keys and values, once a window
        --decoder.onnx, one token a step with its self-attention cache--> greedy tokens --tokenizer--> text

Decoding follows transformers' `WhisperForConditionalGeneration.generate` for audio without timestamps: the prompt
is the start token, a multilingual model's language and task tokens, and `<|notimestamps|>`; the checkpoint's
suppressed tokens are never emitted, and its begin-suppressed ones never first. Audio longer than 30 s is cut into
consecutive 30 s windows whose texts are joined (transformers' long-form decoding instead moves its window by
the last timestamp; on a window boundary the two can differ by a word).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pipeline.errors import InputError
from pipeline.runtime.audio import MAX_SECONDS, SAMPLE_RATE, log_mel_features, read_wav, windows
from pipeline.runtime.decoding import Decoding, check_beams, check_new_tokens
from pipeline.runtime.seq2seq import EncoderDecoder

TASKS = ("transcribe", "translate")


def check_audio(audio, call: str = "transcribe()") -> np.ndarray:
    """One input as 16 kHz mono float32 samples: a WAV file's path, or a 1-D float array of finite samples."""
    if isinstance(audio, str | os.PathLike):
        return read_wav(audio)
    samples = np.asarray(audio) if isinstance(audio, np.ndarray | list | tuple) else None
    if samples is None or samples.ndim != 1 or not np.issubdtype(samples.dtype, np.floating):
        kind = f"a {samples.ndim}-D {samples.dtype} array" if samples is not None else type(audio).__name__
        raise InputError(
            f"{call} takes 16 kHz mono float samples (a 1-D float array) or a WAV file's path, got {kind}; read "
            "other files with pipeline.runtime.audio.read_wav"
        )
    if not np.isfinite(samples).all():
        raise InputError(f"{call}: the audio holds NaN or inf samples; pass finite samples in [-1, 1]")
    if len(samples) > MAX_SECONDS * SAMPLE_RATE:
        raise InputError(f"{call}: {len(samples) / SAMPLE_RATE:.0f} s of audio is over {MAX_SECONDS:.0f} s; cut it")
    return samples.astype(np.float32, copy=False)


class SpeechModel(EncoderDecoder):
    """A loaded speech artifact: `transcribe(audio)`, and the teacher-forced `logits` its gate reads.

    `encoder` and `decoder` are sessions with ONNX Runtime's `run(names, feeds)`."""

    task = "automatic-speech-recognition"
    modality = "audio"

    def __init__(self, encoder, decoder, tokenizer_path: Path, spec: dict, backend: str = "onnxruntime"):
        super().__init__(encoder, decoder, tokenizer_path, spec, backend)
        self.n_mels = int(spec["n_mels"])
        self.begin_suppress = np.array(spec["begin_suppress_tokens"], dtype=np.int64)

    def prompt(self, language: str | None = None, task: str = "transcribe") -> list[int]:
        """The decoder's first tokens; a multilingual model's language token where `language` names one."""
        spec = self.spec
        if task not in TASKS:
            raise InputError(f"task {task!r} is not one of {', '.join(TASKS)}")
        if not spec["multilingual"]:
            if language not in (None, "en", "english", "<|en|>") or task != "transcribe":
                raise InputError(
                    f"this is an English-only model: it transcribes English; leave out language={language!r} and task"
                )
            return list(spec["prompt"])
        token = language if language is None or language.startswith("<|") else f"<|{language}|>"
        if token is not None and token not in spec["languages"]:
            raise InputError(
                f"language {language!r} is not one of the model's ({', '.join(sorted(spec['languages']))[:300]})"
            )
        return [
            spec["start_id"],
            spec["languages"][token] if token else -1,
            spec["tasks"][task],
            spec["no_timestamps_id"],
        ]

    def features(self, samples: list[np.ndarray]) -> np.ndarray:
        """Log-mel features [windows, mels, 3000] of 30 s windows of audio."""
        return (
            np.stack([log_mel_features(w, self.n_mels) for w in samples])
            if samples
            else np.zeros((0, self.n_mels, 3000), np.float32)
        )

    def encode(self, features: np.ndarray) -> dict:
        """The cross-attention cache of each window."""
        return dict(
            zip(self.cross_names, self.encoder.run(self.cross_names, {"input_features": features}), strict=True)
        )

    def _languages(self, cross: dict) -> np.ndarray:
        """Each window's most likely language token (multilingual models), from one step on the start token."""
        ids = np.full((len(cross[self.cross_names[0]]), 1), self.spec["start_id"], dtype=np.int64)
        logits = self.step(ids, self.empty_cache(len(ids)), cross)[0][:, -1]
        candidates = np.array(sorted(self.spec["languages"].values()), dtype=np.int64)
        return candidates[logits[:, candidates].argmax(-1)]

    def greedy(self, cross: dict, prompt: list[int], max_new_tokens: int) -> list[list[int]]:
        """Greedy tokens of each window (without the prompt and the end token)."""
        batch = len(cross[self.cross_names[0]])
        ids = np.tile(np.array(prompt, dtype=np.int64), (batch, 1))
        if prompt[1] == -1:  # a multilingual model told no language: each window's own
            ids[:, 1] = self._languages(cross)
        past, done, tokens = self.empty_cache(batch), np.zeros(batch, bool), [[] for _ in range(batch)]
        for step in range(max_new_tokens):
            logits, past = self.step(ids, past, cross)
            logits = logits[:, -1].copy()
            logits[:, self.suppress] = -np.inf
            if step == 0:
                logits[:, self.begin_suppress] = -np.inf
            chosen = logits.argmax(-1)
            chosen[done] = self.eos[0]
            for row in np.flatnonzero(~done):
                if chosen[row] in self.eos:
                    done[row] = True
                else:
                    tokens[row].append(int(chosen[row]))
            if done.all():
                break
            ids = chosen[:, None].astype(np.int64)
        return tokens

    def beams(self, cross: dict, prompt: list[int], limit: int, num_beams: int) -> list[list[int]]:
        """Beam-search tokens of each window (without the prompt and the end token), as transformers' generate with
        `num_beams` and no timestamps; a multilingual model told no language searches each window with its own."""
        batch = len(cross[self.cross_names[0]])
        if prompt[1] == -1:
            found = self._languages(cross)
            return [
                self.beams(
                    {k: v[i : i + 1] for k, v in cross.items()},
                    [prompt[0], int(found[i]), *prompt[2:]],
                    limit,
                    num_beams,
                )[0]
                for i in range(batch)
            ]
        settings = Decoding(
            max_length=len(prompt) + limit,
            eos=tuple(int(i) for i in self.eos),
            suppress=tuple(int(i) for i in self.suppress),
            begin_suppress=tuple(int(i) for i in self.begin_suppress),
            begin_index=len(prompt),
            num_beams=num_beams,
            prompt_start=len(prompt),
        )
        return self.beam_tokens(cross, batch, prompt, settings)

    def transcribe(
        self,
        audio,
        language: str | None = None,
        task: str = "transcribe",
        max_new_tokens: int | None = None,
        batch_size: int | None = None,
        num_beams: int = 1,
    ):
        """The text spoken in `audio` (a WAV path or 16 kHz float samples), or a list of texts for a list of them.

        Greedy decoding, or beam search with `num_beams`, as transformers' generate without timestamps;
        `max_new_tokens` caps each 30 s window's tokens (the model's own limit where left out)."""
        check_beams(num_beams)
        single = not isinstance(audio, list)
        inputs = [check_audio(a) for a in ([audio] if single else audio)]
        prompt = self.prompt(language, task)
        limit = int(self.spec["max_length"]) - len(prompt)
        if max_new_tokens is not None:
            limit = min(limit, check_new_tokens(max_new_tokens))
        cuts = [windows(samples) for samples in inputs]
        flat = [w for cut in cuts for w in cut]
        size = int(batch_size or self.batch_size)
        tokens: list[list[int]] = []
        for start in range(0, len(flat), size):
            cross = self.encode(self.features(flat[start : start + size]))
            tokens += (
                self.greedy(cross, prompt, limit) if num_beams == 1 else self.beams(cross, prompt, limit, num_beams)
            )
        texts, at = [], 0
        for cut in cuts:
            parts = [self.tokenizer.decode(t, skip_special_tokens=True).strip() for t in tokens[at : at + len(cut)]]
            texts.append(" ".join(p for p in parts if p))
            at += len(cut)
        return texts[0] if single else texts

    def logits(self, samples: np.ndarray, tokens: list[int], language: str | None = None) -> np.ndarray:
        """Teacher-forced next-token logits [len(tokens), vocab] of one window's transcript `tokens` after the
        prompt: the gate's view of the decoder."""
        cross = self.encode(self.features([check_audio(samples)]))
        prompt = self.prompt(language)
        if prompt[1] == -1:
            prompt[1] = int(self._languages(cross)[0])
        ids = np.array([prompt + list(tokens)], dtype=np.int64)
        out, _ = self.step(ids, self.empty_cache(1), cross)
        return out[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


def open_speech_model(
    encoder_path: Path, tokenizer_path: Path, spec: dict, providers=None, session=None, backend="onnxruntime"
):
    """A SpeechModel over an artifact's encoder graph and the decoder graph beside it, on ONNX Runtime."""
    from pipeline.runtime.backends.onnxruntime import open_encoder_decoder

    encoder, decoder = open_encoder_decoder(encoder_path, spec, session, providers, backend, "speech")
    return SpeechModel(encoder, decoder, tokenizer_path, spec, backend)
