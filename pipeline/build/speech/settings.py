"""A Whisper checkpoint's decoding settings, read once at export into the runtime spec: the prompt tokens, the end
token, the tokens never emitted (or not first), and a multilingual model's language and task tokens.

transformers builds the same prompt in `WhisperForConditionalGeneration.generate` for short audio without
timestamps: the start token, then (multilingual models) a language and a task token, then `<|notimestamps|>`.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.build.manifest import Checkpoint
from pipeline.errors import ExportError, InputError
from pipeline.runtime.schema import DECODER_GRAPH
from pipeline.runtime.schema import IMAGE_PROCESSOR as FEATURE_FILE  # a feature extractor's file has the same name

FEATURE_SETTINGS = {"sampling_rate": 16000, "n_fft": 400, "hop_length": 160, "chunk_length": 30}


def read_json(path: Path) -> dict:
    """A small JSON file of the checkpoint as a dict ({} where it is absent)."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _ids(value, what: str, vocab: int) -> list[int]:
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
        raise ExportError(f"generation_config.json: {what} must be token ids below {vocab}, got {str(value)[:80]}")
    return ids


def check_feature_extractor(folder: Path) -> None:
    """A speech checkpoint's preprocessor_config.json must describe the features the runtime computes (Whisper's
    log-mel spectrogram of 30 s windows at 16 kHz); anything else is a one-line InputError."""
    path = Path(folder) / FEATURE_FILE
    if not path.is_file():
        raise InputError(
            f"{folder} is a speech model and needs a feature extractor ({FEATURE_FILE}); save it with the checkpoint "
            "(WhisperProcessor.from_pretrained(...).save_pretrained(folder))"
        )
    config = read_json(path)
    kind = config.get("feature_extractor_type")
    wrong = {k: config.get(k) for k, v in FEATURE_SETTINGS.items() if config.get(k, v) != v}
    if kind != "WhisperFeatureExtractor" or wrong:
        raise InputError(
            f"{path}: the runtime computes WhisperFeatureExtractor features with {FEATURE_SETTINGS}; this file has "
            f"feature_extractor_type={kind!r}{' and ' + str(wrong) if wrong else ''}. Use a Whisper checkpoint's file"
        )


def speech_spec(checkpoint: Checkpoint, config) -> dict:
    """The runtime spec of a speech artifact: its graphs, cache layout, features and decoding settings."""
    generation = read_json(Path(checkpoint.path) / "generation_config.json")
    vocab = int(config.vocab_size)
    start = generation.get("decoder_start_token_id", config.decoder_start_token_id)
    no_timestamps = generation.get("no_timestamps_token_id")
    if start is None or no_timestamps is None:
        raise ExportError(
            f"{checkpoint.path}/generation_config.json names no decoder_start_token_id or no_timestamps_token_id; "
            "save the generation config the official Whisper checkpoints ship"
        )
    languages = generation.get("lang_to_id") or {}
    tasks = generation.get("task_to_id") or {}
    eos = _ids(generation.get("eos_token_id", config.eos_token_id), "eos_token_id", vocab)
    if not eos:
        raise ExportError(f"{checkpoint.path}: generation_config.json and config.json name no eos_token_id")
    multilingual = bool(generation.get("is_multilingual", False)) and bool(languages)
    prompt = (
        [start]
        + ([languages.get("<|en|>", next(iter(languages.values()))), tasks["transcribe"]] if multilingual else [])
        + [no_timestamps]
    )
    return {
        "task": checkpoint.task,
        "modality": "audio",
        "output": "logits",
        "decoder_graph": DECODER_GRAPH,
        "layers": int(config.decoder_layers),
        "heads": int(config.decoder_attention_heads),
        "head_dim": int(config.d_model // config.decoder_attention_heads),
        "n_mels": int(config.num_mel_bins),
        "vocab_size": vocab,
        "max_positions": int(config.max_target_positions),
        "max_length": min(
            int(generation.get("max_length") or config.max_target_positions), int(config.max_target_positions)
        ),
        "start_id": _ids(start, "decoder_start_token_id", vocab)[0],
        "no_timestamps_id": _ids(no_timestamps, "no_timestamps_token_id", vocab)[0],
        "eos_token_ids": eos,
        "pad_id": eos[0],  # what a row that has finished feeds while the others decode
        "suppress_tokens": _ids(generation.get("suppress_tokens"), "suppress_tokens", vocab),
        "begin_suppress_tokens": _ids(generation.get("begin_suppress_tokens"), "begin_suppress_tokens", vocab),
        "multilingual": multilingual,
        "languages": {k: _ids(v, "lang_to_id", vocab)[0] for k, v in languages.items()} if multilingual else {},
        "tasks": {k: _ids(v, "task_to_id", vocab)[0] for k, v in tasks.items()} if multilingual else {},
        "prompt": prompt,
    }
