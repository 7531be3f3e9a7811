"""A decoder's PyTorch references: batched greedy continuations equal to one prompt at a time, cut at the end token."""

import pytest

from pipeline.build.accuracy.reference import generation_reference, pytorch_outputs
from pipeline.build.accuracy.reference_decoder import _until_eos
from tests.build.accuracy.test_reference import TEXTS, _checkpoint


@pytest.mark.parametrize(
    ("row", "eos", "kept"),
    [
        ([5, 6, 2, 0, 0], 2, (5, 6, 2)),
        ([5, 6, 7], 2, (5, 6, 7)),
        ([5, 9, 6, 2], [2, 9], (5, 9)),
        ([5, 6], None, (5, 6)),
    ],
)
def test_until_eos_keeps_a_row_up_to_its_first_end_token(row, eos, kept):
    assert _until_eos(row, eos) == kept


def test_generation_reference_is_answered_once_and_equals_one_prompt_at_a_time_greedy(tiny_gpt2, monkeypatch):
    import torch
    import transformers

    from pipeline.build.accuracy import reference_decoder

    checkpoint = _checkpoint(tiny_gpt2, "text-generation")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_gpt2)
    texts = [*TEXTS, "x", "a longer prompt than the others, padded least of all in its batch"]
    with torch.inference_mode():
        alone = [
            model.generate(torch.tensor([tokenizer(t)["input_ids"]]), do_sample=False, max_new_tokens=6)[0].tolist()
            for t in texts
        ]
    alone = [tuple(row[len(tokenizer(t)["input_ids"]) :]) for row, t in zip(alone, texts, strict=True)]
    batches = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda **kw: batches.append(len(kw["input_ids"])) or generate(**kw))
    found = generation_reference(checkpoint, texts, 6, model)
    assert generation_reference(checkpoint, texts, 6) is found and pytorch_outputs(checkpoint, texts, 6) is found
    assert [tuple(t) for t in found["tokens"]] == alone
    assert batches[0] == len(texts) and len(batches) < len(texts)  # one padded batch, few rows again alone

    batches.clear()
    monkeypatch.setattr(reference_decoder, "TIE", 10.0)  # no lead is large enough: every row is generated again alone
    doubted = reference_decoder.generation_outputs(model, tokenizer, texts, 6, checkpoint.max_length)
    assert batches == [len(texts)] + [1] * len(texts) and [tuple(t) for t in doubted["tokens"]] == alone
