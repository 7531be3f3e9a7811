"""The decoding state: a GroupQueryAttention artifact writes its cache in place; greedy output stays transformers'."""

import numpy as np
import pytest
import torch
import transformers

from pipeline.runtime import load
from pipeline.runtime.kv_cache import Decoding
from tests.conftest import SMALL_TEXTS
from tests.tiny import make_decoder


def fp32_decoder(root, model_type: str, texts_file, **config):
    """A tiny random decoder of `model_type` built for cpu-fp32 under `root`: its folder and published artifact."""
    from pipeline.build.table import build

    folder = make_decoder(root / f"tiny-{model_type}", model_type, **config)
    manifest = build(
        folder,
        "cpu-fp32",
        validation=texts_file,
        calibration=texts_file,
        artifacts_dir=root / "a",
        cache_dir=root / "c",
    )
    return folder, manifest.published.path


def _fp32_build(root, model_type: str, texts_file, **config):
    folder, artifact = fp32_decoder(root, model_type, texts_file, **config)
    return folder, load(artifact)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, texts_file):
    return _fp32_build(tmp_path_factory.mktemp("llama-fp32"), "llama", texts_file)


@pytest.fixture(scope="module")
def neox(tmp_path_factory, texts_file):
    """A GPT-NeoX whose 16 rotary dimensions a head the GroupQueryAttention rewrite takes (head size 32)."""
    return _fp32_build(tmp_path_factory.mktemp("neox-fp32"), "gpt_neox", texts_file, hidden_size=128)


def _hf_greedy(folder, prompts: list[str], n: int) -> list[tuple[int, ...]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        out = model.generate(**batch, do_sample=False, max_new_tokens=n, pad_token_id=tokenizer.pad_token_id)
    return [tuple(row) for row in out[:, batch["input_ids"].shape[1] :].tolist()]


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_greedy_equals_transformers_at_batch_1_and_batched_with_padding(family, request):
    folder, model = request.getfixturevalue(family)
    assert model.spec["cache"] == "shared" and model.spec["padding"] == "right"  # the GroupQueryAttention graph
    prompts = SMALL_TEXTS[:6]
    assert len({len(e.ids) for e in model.encode(prompts)}) > 1  # rows of several lengths: padding
    batched = model.generate(prompts, max_new_tokens=24, eos=False, batch_size=len(prompts))
    assert [c.token_ids for c in batched] == _hf_greedy(folder, prompts, 24)
    for prompt, completion in zip(prompts, batched, strict=True):
        [alone] = model.generate([prompt], max_new_tokens=24, eos=False)
        assert alone.token_ids == _hf_greedy(folder, [prompt], 24)[0] == completion.token_ids


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_a_right_padded_row_computes_exactly_as_it_would_alone(family, request):
    _, model = request.getfixturevalue(family)
    short, long = "Hi", SMALL_TEXTS[3] + " " + SMALL_TEXTS[4]
    assert len(model.encode([short])[0].ids) < len(model.encode([long])[0].ids)
    padded = model.run([short, long], batch_size=2, bucketing=False)
    assert np.array_equal(padded[0], model.run([short])[0]) and np.array_equal(padded[1], model.run([long])[0])
    rows = [e.ids for e in model.encode([short, long])]
    together, alone = Decoding(model, rows, len(rows[1]) + 6), Decoding(model, rows[:1], len(rows[0]) + 6)
    both, one = together.step(), alone.step()
    for _ in range(5):  # each row's new token at its own end of the shared cache, the short row's included
        assert np.array_equal(both[0], one[0])
        both, one = together.step(both.argmax(-1)), alone.step(one.argmax(-1))


def _addresses(state: Decoding, steps: int) -> list[list[int]]:
    """The cache buffers each step reads and the present outputs it wrote, step after step."""
    seen, logits = [], state.step()
    for _ in range(steps):
        written = [v.data_ptr() for v in state.binding.get_outputs()[1:]]
        seen.append(state.buffers() + written)
        logits = state.step(logits.argmax(-1))
    return seen


def test_shared_cache_is_written_in_place_without_a_copy_per_step(llama):
    _, model = llama
    rows = [e.ids for e in model.encode(SMALL_TEXTS[:3])]
    width = max(map(len, rows))
    state = Decoding(model, rows, width + 8)
    past = state.buffers()
    assert {v.shape()[2] for v in state.past.values()} == {width + 8}

    def cache() -> list[np.ndarray]:  # what the bound past buffers hold now
        return [np.array(v.numpy(), copy=True) for v in state.past.values()]

    logits = state.step()
    for step in range(6):
        assert [v.data_ptr() for v in state.binding.get_outputs()[1:]] == past  # present written into past
        before = cache()
        logits = state.step(logits.argmax(-1))
        for old, new in zip(before, cache(), strict=True):
            for row, end in enumerate(state.lengths - 1):  # each row's new token goes in at its own length
                assert np.array_equal(new[row, :, :end], old[row, :, :end])  # what it held before stays
                assert new[row, :, end].any() and not np.array_equal(new[row, :, end], old[row, :, end])
            assert not new[:, :, width + step + 1 :].any()  # nothing past the longest row's new token
        assert not np.shares_memory(state.mask, state.masks)  # a batch of several copies its mask (the docstring)


def test_concat_cache_of_an_unfused_graph_gets_new_buffers_each_step(tmp_path, texts_file):
    _, model = _fp32_build(tmp_path, "gpt_neox", texts_file)  # 8 rotary dimensions a head: not rewritten
    assert model.spec["cache"] == "concat"
    state = Decoding(model, [e.ids for e in model.encode(SMALL_TEXTS[:2])], 64)
    seen = _addresses(state, 4)
    assert len({tuple(step) for step in seen}) == len(seen)


def test_a_full_cache_refuses_another_token(llama):
    _, model = llama
    state = Decoding(model, [model.encode(["ok"])[0].ids], len(model.encode(["ok"])[0].ids) + 1)
    logits = state.step()
    logits = state.step(logits.argmax(-1))
    assert np.shares_memory(state.mask, state.masks)  # a batch of one binds a view of its mask, no copy
    with pytest.raises(ValueError, match=r"holds \d+ tokens and is full"):
        state.step(np.array([0]))
