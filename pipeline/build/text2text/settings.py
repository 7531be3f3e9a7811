"""A text-to-text checkpoint's decoding settings, read once at export into the runtime spec.

transformers' `generate` starts the decoder at `decoder_start_token_id`, forces `forced_bos_token_id` (mBART's and
NLLB's target language) as the first new token, never emits a single-token entry of `bad_words_ids` (Marian's
padding), forces `forced_eos_token_id` when the output reaches `max_length`, never repeats an n-gram of
`no_repeat_ngram_size`, writes no end token before `min_length`, stops at `eos_token_id`, and searches `num_beams`
beams with `length_penalty` and `early_stopping`. The runtime does the same (pipeline/runtime/decoding.py); the
settings it does not follow (sampling, repetition penalties, beam groups) are listed in the spec's `not_followed`.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.build.manifest import Checkpoint
from pipeline.build.speech.settings import read_json
from pipeline.errors import ExportError
from pipeline.runtime.schema import DECODER_GRAPH

# generation_config.json settings the runtime's decoding does not follow, with the value that means "off".
NOT_FOLLOWED = {
    "do_sample": False,
    "num_beam_groups": 1,
    "repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0,
    "num_return_sequences": 1,
}
MAX_BEAMS = 16  # the runtime's bound; a config asking for more is decoded with this many
DEFAULT_MAX_LENGTH = 20  # transformers' GenerationConfig default
LONGEST_SOURCE = 4096  # a bound on the source tokens where neither the config nor the tokenizer gives one


def _id(value, what: str, vocab: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab:
        raise ExportError(f"generation_config.json: {what} must be a token id below {vocab}, got {str(value)[:80]}")
    return value


def _eos(value, vocab: int) -> list[int]:
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list):
        raise ExportError(f"generation_config.json: eos_token_id must be ids, got {str(value)[:80]}")
    return [_id(i, "eos_token_id", vocab) for i in ids]


def _max_source(checkpoint: Checkpoint, config, tokenizer) -> int:
    """The longest source the model takes: its position table's size, or (T5's relative positions) the
    tokenizer's model_max_length."""
    bounds = [int(getattr(config, "max_position_embeddings", 0) or 0)]
    limit = getattr(tokenizer, "model_max_length", None)
    bounds.append(int(limit) if isinstance(limit, int) and 0 < limit < 10**6 else 0)
    found = [b for b in bounds if b > 0]
    return min(found) if found else LONGEST_SOURCE


def text2text_spec(checkpoint: Checkpoint, config, tokenizer, layers: int) -> dict:
    """The runtime spec of a text-to-text artifact: its graphs, cache layout and decoding settings."""
    generation = {**config.to_dict(), **read_json(Path(checkpoint.path) / "generation_config.json")}
    vocab = int(config.vocab_size)
    start = _id(generation.get("decoder_start_token_id"), "decoder_start_token_id", vocab)
    eos = _eos(generation.get("eos_token_id"), vocab)
    if start is None or not eos:
        raise ExportError(
            f"{checkpoint.path}: config.json and generation_config.json name no decoder_start_token_id or no "
            "eos_token_id; save the checkpoint's generation config with it"
        )
    forced_bos = _id(generation.get("forced_bos_token_id"), "forced_bos_token_id", vocab)
    bad = generation.get("bad_words_ids") or []
    suppress = sorted({_id(w[0], "bad_words_ids", vocab) for w in bad if isinstance(w, list) and len(w) == 1})
    pad = generation.get("pad_token_id")
    return {
        "task": checkpoint.task,
        "modality": "text",
        "output": "logits",
        "decoder_graph": DECODER_GRAPH,
        "layers": layers,
        "vocab_size": vocab,
        "max_source_length": _max_source(checkpoint, config, tokenizer),
        "max_length": int(generation.get("max_length") or DEFAULT_MAX_LENGTH),
        "prompt": [start] + ([forced_bos] if forced_bos is not None else []),
        "eos_token_ids": eos,
        "forced_eos_token_id": _id(generation.get("forced_eos_token_id"), "forced_eos_token_id", vocab),
        "pad_id": eos[0] if pad is None else _id(pad, "pad_token_id", vocab),
        "source_pad_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0],
        "suppress_tokens": suppress,
        **_search_settings(generation),
        "not_followed": {
            k: generation[k] for k, off in NOT_FOLLOWED.items() if generation.get(k, off) not in (off, None)
        },
    }


def _search_settings(generation: dict) -> dict:
    """The length and beam settings of the generation config, checked."""
    early = generation.get("early_stopping", False)
    if early not in (True, False, "never"):
        raise ExportError(f'generation_config.json: early_stopping must be true, false or "never", got {early!r}')
    settings = {
        "min_length": generation.get("min_length") or 0,
        "no_repeat_ngram_size": generation.get("no_repeat_ngram_size") or 0,
        "num_beams": generation.get("num_beams") or 1,
    }
    for key, value in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ExportError(f"generation_config.json: {key} must be an int >= 0, got {str(value)[:40]}")
    penalty = generation.get("length_penalty", 1.0)
    if isinstance(penalty, bool) or not isinstance(penalty, int | float):
        raise ExportError(f"generation_config.json: length_penalty must be a number, got {str(penalty)[:40]}")
    beams = min(max(settings["num_beams"], 1), MAX_BEAMS)
    return {**settings, "num_beams": beams, "length_penalty": float(penalty), "early_stopping": early}
