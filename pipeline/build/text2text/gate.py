"""The text-to-text gate: an artifact's greedy outputs against transformers' greedy outputs of the same held-out
texts, as the decoders' gate judges continuations.

    greedy_prefix_agreement  the mean share of PyTorch's output reproduced before the first differing token
    greedy_match             the share of texts whose output is PyTorch's token for token (reported)
    teacher_top1_agreement   along PyTorch's own output, the share of positions where the artifact's top token is
                             PyTorch's (the decoder judged without its own earlier choices)

Both sides decode greedily (the graphs are judged; beam search is a function of the same scores) for at most
GATE_NEW_TOKENS tokens after the prompt, with the checkpoint's forced, suppressed and repeated-n-gram masks
(pipeline/build/text2text/settings.py).
"""

from __future__ import annotations

from pipeline.build.accuracy.tokens import greedy_stats, top1_along
from pipeline.build.manifest import Checkpoint

GATE_NEW_TOKENS = 32


def gate_tokens(spec: dict) -> int:
    """How many tokens after the prompt the gate decodes."""
    return max(1, min(GATE_NEW_TOKENS, int(spec["max_length"]) - len(spec["prompt"])))


def text2text_reference(checkpoint: Checkpoint, texts: list[str]) -> dict:
    """transformers' greedy output tokens of each text (after the prompt, without the end token) and its
    teacher-forced top-1 tokens along them."""
    import torch

    from pipeline.build.accuracy.models import load_hf_tokenizer, load_torch_model
    from pipeline.build.text2text.export import decoder_layers
    from pipeline.build.text2text.settings import text2text_spec

    model, tokenizer = load_torch_model(checkpoint), load_hf_tokenizer(checkpoint)
    spec = text2text_spec(checkpoint, model.config, tokenizer, decoder_layers(model.config))
    prompt, eos, new = spec["prompt"], set(spec["eos_token_ids"]), gate_tokens(spec)
    tokens, top1 = [], []
    for text in texts:
        source = tokenizer([text], return_tensors="pt", return_token_type_ids=False)
        with torch.inference_mode():
            ids = model.generate(**source, do_sample=False, num_beams=1, max_length=len(prompt) + new)[0].tolist()
        row = ids[len(prompt) :]
        row = row[: next((i for i, t in enumerate(row) if t in eos), len(row))]
        tokens.append(row)
        with torch.inference_mode():
            logits = model(**source, decoder_input_ids=torch.tensor([prompt + row])).logits[0]
        top1.append(logits[len(prompt) - 1 : len(prompt) - 1 + len(row)].argmax(-1).numpy())
    return {"tokens": tokens, "top1": top1}


def text2text_outputs(model, texts: list[str], batch_size: int, reference: dict | None = None) -> dict:
    """A runtime Text2TextModel's greedy output tokens of `texts` (batched by `batch_size`), and its
    teacher-forced top-1 tokens along `reference`'s outputs where given."""
    new = gate_tokens(model.spec)
    result = {"tokens": model.generate_ids(texts, max_new_tokens=new, batch_size=batch_size, num_beams=1)}
    if reference is not None:
        result["top1"] = [model.logits(t, r).argmax(-1) for t, r in zip(texts, reference["tokens"], strict=True)]
    return result


def text2text_stats(reference: dict, candidate: dict) -> dict:
    """The gate's statistics of `candidate` against `reference` (see the module docstring)."""
    stats = greedy_stats(reference["tokens"], candidate["tokens"])
    if "top1" in candidate:
        stats["teacher_top1_agreement"] = top1_along(reference["top1"], candidate["top1"])
    return stats
