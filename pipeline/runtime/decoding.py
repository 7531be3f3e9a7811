"""Greedy and beam-search decoding over a step function, as transformers' `generate` decodes an encoder-decoder
model with the checkpoint's generation config (transformers 4.57's vectorized beam search, followed step by step).

    step(ids [rows, s], past) -> (logits [rows, s, vocab], grown past)     the decoder graph with its cache
    reorder(past, rows) -> past                                              the cache's rows taken in a new order

The scores of each step are masked as transformers' logits processors mask them: an n-gram already written may
not be written again (`no_repeat_ngram_size`), no end token before `min_length`, only `forced_eos_token_id` at the
length limit, never a suppressed token. Beam search keeps `num_beams` hypotheses a source, scores finished ones by
their summed log-probabilities over (generated length ** `length_penalty`), and stops as `early_stopping` says
(True: once `num_beams` are finished; False: once no running beam can beat the worst finished one at its current
length; "never": at its best possible length).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pipeline.errors import InputError

NEG = np.float32(-1e9)
MAX_BEAMS = 16  # beams a call may ask for: each is a row of the decoder's batch and of its cache


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How to decode: the total decoder length (the prompt's tokens counted), the end tokens and the masks, and the
    beam settings. `prompt_start`: decoder tokens before the first one transformers counts as generated (1, the
    start token, where a forced first token is part of the prompt)."""

    max_length: int
    eos: tuple[int, ...]
    suppress: tuple[int, ...] = ()
    forced_eos: int | None = None
    min_length: int = 0
    no_repeat_ngram_size: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    prompt_start: int = 1
    begin_suppress: tuple[int, ...] = ()  # never the first generated token (Whisper's), at length `begin_index`
    begin_index: int = 0


def check_beams(num_beams) -> int:
    """`num_beams` where it is an int from 1 to MAX_BEAMS, else an InputError."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or not 1 <= num_beams <= MAX_BEAMS:
        raise InputError(f"num_beams={num_beams!r} must be an int from 1 to {MAX_BEAMS}")
    return num_beams


def check_new_tokens(max_new_tokens) -> int:
    """`max_new_tokens` where it is an int >= 1, else an InputError."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
    return max_new_tokens


def mask_scores(scores: np.ndarray, sequences: np.ndarray, settings: Decoding) -> np.ndarray:
    """`scores` [rows, vocab] of the next token after `sequences` [rows, cur_len], masked in place."""
    cur_len, n = sequences.shape[1], settings.no_repeat_ngram_size
    if n and cur_len + 1 >= n:
        for row, tokens in enumerate(sequences.tolist()):
            tail = tuple(tokens[cur_len + 1 - n :])
            banned = [g[-1] for g in zip(*[tokens[i:] for i in range(n)], strict=False) if g[:-1] == tail]
            scores[row, banned] = -np.inf
    eos = list(settings.eos)
    if cur_len < settings.min_length:
        scores[:, eos] = -np.inf
    if settings.forced_eos is not None and cur_len == settings.max_length - 1:
        scores[:] = -np.inf
        scores[:, settings.forced_eos] = 0
    if settings.suppress:
        scores[:, list(settings.suppress)] = -np.inf
    if settings.begin_suppress and cur_len == settings.begin_index:
        scores[:, list(settings.begin_suppress)] = -np.inf
    return scores


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the `k` largest of each row, largest first."""
    return np.argsort(-x, axis=-1, kind="stable")[:, :k]


def _gather(x: np.ndarray, index: np.ndarray) -> np.ndarray:
    return np.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def beam_search(step, reorder, past, prompt: list[int], batch: int, settings: Decoding) -> list[list[int]]:
    """Each source's best hypothesis after the prompt (the end token left out); `past` holds batch x num_beams rows,
    each source's beams together."""
    beams, eos, lp = settings.num_beams, np.array(settings.eos), settings.length_penalty
    keep = max(2, 1 + len(eos)) * beams
    cur_len, start = len(prompt), settings.prompt_start
    running = np.tile(np.array(prompt, dtype=np.int64), (batch, beams, 1))
    running_scores = np.zeros((batch, beams), np.float32)
    running_scores[:, 1:] = NEG
    finished = np.zeros((batch, beams, 0), np.int64)
    finished_scores = np.full((batch, beams), NEG, np.float32)
    done = np.zeros((batch, beams), bool)
    open_ = np.ones((batch, 1), bool)  # transformers' is_early_stop_heuristic_unsatisfied
    ids = running.reshape(batch * beams, -1)
    while True:
        logits, past = step(ids, past)
        flat = running.reshape(batch * beams, cur_len)
        scores = mask_scores(_log_softmax(logits[:, -1].astype(np.float32)), flat, settings)
        vocab = scores.shape[-1]
        scores = (scores.reshape(batch, beams, vocab) + running_scores[:, :, None]).reshape(batch, beams * vocab)
        top = _top(scores, keep)
        top_scores, source_beam, token = _gather(scores, top), top // vocab, top % vocab
        top_seqs = np.concatenate([_gather(running, source_beam), token[:, :, None]], axis=2)
        hits = np.isin(token, eos) | (cur_len + 1 >= settings.max_length)
        alive = top_scores + hits.astype(np.float32) * NEG
        chosen = _top(alive, beams)
        running, running_scores = _gather(top_seqs, chosen), _gather(alive, chosen)
        parents = _gather(source_beam, chosen) + np.arange(batch)[:, None] * beams
        just = hits & (np.arange(keep) < beams)[None, :]
        candidate = top_scores / np.float32((cur_len + 1 - start) ** lp)
        candidate += (done.all(-1, keepdims=True) & (settings.early_stopping is True)) * NEG
        candidate += (~open_) * NEG + (~just) * NEG
        width = cur_len + 1
        finished = np.concatenate([np.pad(finished, ((0, 0), (0, 0), (0, width - finished.shape[2]))), top_seqs], 1)
        merged = np.concatenate([finished_scores, candidate], 1)
        best = _top(merged, beams)
        finished, finished_scores = _gather(finished, best), _gather(merged, best)
        done = _gather(np.concatenate([done, just], 1), best)
        cur_len += 1
        never = settings.early_stopping == "never" and lp > 0
        length = (settings.max_length if never else cur_len) - start
        best_running = running_scores[:, :1] / np.float32(length**lp)
        worst = np.where(done, finished_scores.min(1, keepdims=True), NEG)
        open_ = open_ & (best_running > worst).any(-1, keepdims=True)
        if not open_.any() or (done.all() and settings.early_stopping is True) or hits.all():
            break
        past = reorder(past, parents.reshape(-1))
        ids = running[:, :, -1:].reshape(batch * beams, 1)
    out = []
    for row in finished[:, 0, len(prompt) :].tolist():
        ends = [i for i, t in enumerate(row) if t in settings.eos]
        out.append(row[: ends[0]] if ends else row)
    return out
