"""The speech gate: an artifact's transcripts against transformers' fp32 transcripts of the same held-out audio.

    word_error_rate          the artifact's words against PyTorch's (pipeline.build.accuracy.words), all clips
    teacher_top1_agreement   along PyTorch's own transcript, the share of positions where the artifact's top
                             token is PyTorch's (the decoder judged without its own earlier choices)
    transcript_match         the share of clips transcribed word for word as PyTorch does (reported)

The reference decodes as transformers' `generate` does for short audio without timestamps (greedy), on the
features of transformers' own WhisperFeatureExtractor. Clips are at most 30 s: one window each.
"""

from __future__ import annotations

import numpy as np

from pipeline.build.accuracy.tokens import top1_along
from pipeline.build.accuracy.words import normalized_words, word_error_rate
from pipeline.build.console import silenced
from pipeline.build.manifest import Checkpoint
from pipeline.errors import InputError
from pipeline.runtime.audio import N_SAMPLES, read_wav


def _clips(paths: list) -> list[np.ndarray]:
    clips = [read_wav(p) for p in paths]
    long = [str(p) for p, c in zip(paths, clips, strict=True) if len(c) > N_SAMPLES]
    if long:
        raise InputError(
            f"held-out and calibration clips of a speech model are at most 30 s each (one window); {long[0]} and "
            f"{len(long) - 1} more are longer: cut them"
        )
    return clips


def speech_reference(checkpoint: Checkpoint, paths: list) -> dict:
    """transformers' greedy transcripts of the clips at `paths`, their tokens after the prompt, and its
    teacher-forced top-1 tokens along them."""
    import torch
    from transformers import WhisperFeatureExtractor, WhisperTokenizerFast

    from pipeline.build.accuracy.models import load_torch_model
    from pipeline.build.speech.settings import speech_spec

    model = load_torch_model(checkpoint)
    extractor = WhisperFeatureExtractor.from_pretrained(checkpoint.path, local_files_only=True)
    tokenizer = WhisperTokenizerFast.from_pretrained(checkpoint.path, local_files_only=True)
    prompt = speech_spec(checkpoint, model.config)["prompt"]
    texts, tokens, top1 = [], [], []
    for clip in _clips(paths):
        with silenced("transformers"):  # its notes on Whisper's deprecated generation settings, once a clip
            features = extractor(clip, sampling_rate=16000, return_tensors="pt").input_features
            with torch.inference_mode():
                ids = model.generate(features, do_sample=False, num_beams=1)[0].tolist()
        if ids[: len(prompt)] == prompt:  # transformers releases differ in whether they return the prompt
            ids = ids[len(prompt) :]
        row = [t for t in ids if t not in _eos(model.generation_config)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True).strip())
        tokens.append(row)
        with torch.inference_mode():
            logits = model(input_features=features, decoder_input_ids=torch.tensor([prompt + row])).logits[0]
        top1.append(logits[len(prompt) - 1 : len(prompt) - 1 + len(row)].argmax(-1).numpy())
    return {"texts": texts, "tokens": tokens, "top1": top1}


def _eos(config) -> set:
    eos = config.eos_token_id
    return {eos} if isinstance(eos, int) else set(eos or ())


def speech_outputs(model, paths: list, batch_size: int, reference: dict | None = None) -> dict:
    """A runtime SpeechModel's transcripts of the clips at `paths` (batched by `batch_size`), and its
    teacher-forced top-1 tokens along `reference`'s transcripts where given."""
    clips = _clips(paths)
    result = {"texts": model.transcribe(clips, batch_size=batch_size)}
    if reference is not None:
        result["top1"] = [model.logits(c, t).argmax(-1) for c, t in zip(clips, reference["tokens"], strict=True)]
    return result


def speech_stats(reference: dict, candidate: dict) -> dict:
    """The gate's statistics of `candidate` against `reference` (see the module docstring)."""
    stats = {
        "word_error_rate": word_error_rate(reference["texts"], candidate["texts"]),
        "transcript_match": float(
            np.mean(
                [
                    normalized_words(r) == normalized_words(c)
                    for r, c in zip(reference["texts"], candidate["texts"], strict=True)
                ]
            )
        ),
    }
    if "top1" in candidate:
        stats["teacher_top1_agreement"] = top1_along(reference["top1"], candidate["top1"])
    return stats
