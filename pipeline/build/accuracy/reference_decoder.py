"""A decoder's PyTorch references: transformers' greedy continuations of held-out prompts (equal to one prompt at a
time, computed in batches) and its teacher-forced next-token scores, what validation and the search gate against.

Build-side only: imports torch and transformers, lazily.
"""

from __future__ import annotations

import inspect

import numpy as np

from pipeline.build.accuracy.metrics import split_at_middle, teacher_scores
from pipeline.build.console import progress
from pipeline.runtime.kv_cache import padded

# A batched (left-padded) greedy row is taken as the one-prompt-at-a-time row only where padding cannot have changed
# a choice: its first-step logits stay within NOISE of the unpadded forward pass's, and every chosen token led the
# runner-up by TIE, more than twice NOISE (both relative to the largest logit, at least 1). Gemma 3 270M in fp32
# drifts by 4.5e-4 at most over 8 prompts x 32 tokens with logits near 25: 2e-5 relative. Any other row is
# generated again alone (so is every row where a generation_config processor, a repetition penalty, changes the
# first step's scores).
NOISE = 1e-4
TIE = 5e-4
# Prompts a batch: the 32 held-out prompts at once took Gemma 3 270M 34 s against 51 s in batches of 8 (its
# 262k-token head costs about as much for 32 rows as for 8), with the same continuations.
REFERENCE_BATCH = 32


def generation_outputs(model, tokenizer, texts: list[str], new_tokens: int, max_length: int):
    """transformers' next-token logits and `generate(do_sample=False)` continuations, with the checkpoint's
    generation_config.json as it stands; prompts are cut from the left to leave room for the new tokens, as the
    runtime cuts them. The continuations equal one-prompt-at-a-time (unpadded) greedy decoding, what an exact
    greedy gate compares against: they are generated left-padded, REFERENCE_BATCH prompts at a time (several
    times faster), and a row padding could have changed (NOISE, TIE) is generated again alone.
    """
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = [tokenizer(text)["input_ids"][-(max_length - new_tokens) :] for text in texts]
    with torch.inference_mode():
        logits = [_forward(model, [row], 1)[0, -1].float().numpy() for row in rows]
        tokens = []
        for start in progress(range(0, len(rows), REFERENCE_BATCH), "PyTorch: generating reference continuations"):
            chunk = slice(start, start + REFERENCE_BATCH)
            tokens += _greedy(model, rows[chunk], new_tokens, pad, logits[chunk])
    return {
        "logits": np.stack(logits),
        "tokens": tokens,
        "teacher": teacher_forced(model, tokenizer, texts, max_length),
    }


def _greedy(model, rows: list[list[int]], new_tokens: int, pad: int, first: list) -> list[tuple[int, ...]]:
    """Greedy continuations of `rows` in one left-padded batch, each equal to the row's own unpadded greedy
    continuation (`first`: each row's unpadded next-token logits); see NOISE and TIE."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Margins(LogitsProcessor):
        """Last in the processor list: each step's lead of the chosen token over the runner-up, relative to it, and
        the first step's scores (kept here rather than by generate's output_logits, which holds every step's
        [batch, vocabulary] logits: 268 MB for 8 rows x 32 steps of Gemma 3's 262k tokens)."""

        def __init__(self):
            self.steps, self.first = [], None

        def __call__(self, input_ids, scores):
            if self.first is None:
                self.first = scores.float().numpy().copy()
            top = torch.topk(scores.float(), 2, dim=-1).values
            self.steps.append(((top[:, 0] - top[:, 1]) / top[:, 0].abs().clamp(min=1.0)).tolist())
            return scores

    margins = Margins()
    ids, mask = (torch.from_numpy(a) for a in padded(rows, pad))
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=new_tokens,
        pad_token_id=pad,
        logits_processor=LogitsProcessorList([margins]),
        return_dict_in_generate=True,
    )
    eos = model.generation_config.eos_token_id
    continuations = []
    for i, row in enumerate(out.sequences[:, ids.shape[1] :].tolist()):
        row = _until_eos(row, eos)
        if len(rows) > 1:
            drift = np.abs(margins.first[i] - first[i]).max() / max(1.0, np.abs(first[i]).max())
            if drift > NOISE or min(step[i] for step in margins.steps[: len(row)]) < TIE:
                row = _greedy(model, [rows[i]], new_tokens, pad, [first[i]])[0]
        continuations.append(row)
    return continuations


def _until_eos(row: list[int], eos) -> tuple[int, ...]:
    """A generated row up to its first end-of-sequence token, kept (a batch pads rows that ended early)."""
    ends = {eos} if isinstance(eos, int) else set(eos or ())
    cut = next((i + 1 for i, token in enumerate(row) if token in ends), len(row))
    return tuple(row[:cut])


def _forward(model, rows: list[list[int]], keep: int):
    """The logits of the last `keep` positions of `rows` (one forward pass): the head over only those positions
    where the model's forward takes `logits_to_keep` (transformers' CausalLMs do; Gemma 3's 262k-token head over
    every position of a prompt was 10 s of its build's reference), else sliced from all of them."""
    import torch

    ids = torch.tensor(rows)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(input_ids=ids, logits_to_keep=keep).logits
    return model(input_ids=ids).logits[:, -keep:]


def teacher_forced(model, tokenizer, texts: list[str], max_length: int) -> dict:
    """Each held-out text split in two at its middle token: the first half as a prompt, the second as the
    continuation, with transformers' next-token logits at every continuation position (one forward pass each).
    What a decoder's perplexity and teacher-forced agreement are measured against."""
    import torch

    pairs = split_at_middle([tokenizer(text)["input_ids"] for text in texts], max_length)
    scores = []
    with torch.inference_mode():
        for prompt, continuation in pairs:
            out = _forward(model, [prompt + continuation], len(continuation) + 1)[0].float().numpy()
            scores.append(teacher_scores(out[-len(continuation) - 1 : -1], continuation))
    return {"prompts": [p for p, _ in pairs], "continuations": [c for _, c in pairs], "scores": scores}
