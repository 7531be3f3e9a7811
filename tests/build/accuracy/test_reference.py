"""The PyTorch baselines, checked against direct transformers calls on tiny checkpoints."""

import json

import numpy as np
import pytest

from pipeline.build.accuracy.metrics import teacher_scores
from pipeline.build.accuracy.reference import checkpoint_from_source, dense_layers, pooled_module, pytorch_outputs
from pipeline.build.accuracy.reference_decoder import _until_eos
from pipeline.build.manifest import Checkpoint
from pipeline.errors import InputError
from tests.conftest import SMALL_TEXTS
from tests.tiny import make_checkpoint

TEXTS = ["The museum opens at nine.", "Reset the router and wait two minutes before trying again."]


def _checkpoint(folder, task="feature-extraction", pooling=None, max_length=64) -> Checkpoint:
    config = json.loads((folder / "config.json").read_text())
    return Checkpoint(str(folder), "", config["model_type"], task, config, pooling, max_length)


def _direct(folder, auto: str, texts):
    """transformers' own outputs, one text at a time, with the model's default attention."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = getattr(transformers, auto).from_pretrained(folder).eval()
    with torch.inference_mode():
        return [model(**tokenizer(text, return_tensors="pt")) for text in texts]


@pytest.mark.parametrize(
    ("mode", "pool"),
    [("mean", lambda h: h.mean(0)), ("cls", lambda h: h[0]), ("max", lambda h: h.max(0).values)],
)
def test_pytorch_outputs_pool_an_encoder_as_transformers_hidden_states_say(mode, pool, tiny_bert):
    got = pytorch_outputs(_checkpoint(tiny_bert, pooling={"mode": mode, "normalize": False}), TEXTS)
    expected = np.stack([pool(out.last_hidden_state[0]).numpy() for out in _direct(tiny_bert, "AutoModel", TEXTS)])
    assert got.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_pytorch_outputs_of_a_normalizing_checkpoint_are_unit_mean_pooled_vectors(tiny_bert):
    got = pytorch_outputs(_checkpoint(tiny_bert, pooling={"mode": "mean", "normalize": True}), TEXTS)
    means = np.stack([out.last_hidden_state[0].mean(0).numpy() for out in _direct(tiny_bert, "AutoModel", TEXTS)])
    np.testing.assert_allclose(got, means / np.linalg.norm(means, axis=1, keepdims=True), atol=1e-5)


def test_pytorch_outputs_of_a_classifier_are_its_logits(tmp_path):
    folder = make_checkpoint(tmp_path / "classifier", "bert", "sequence-classification")
    got = pytorch_outputs(_checkpoint(folder, "sequence-classification"), TEXTS)
    expected = np.stack([out.logits[0].numpy() for out in _direct(folder, "AutoModelForSequenceClassification", TEXTS)])
    assert got.shape == expected.shape and got.shape[0] == len(TEXTS)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_pytorch_outputs_of_a_decoder_are_next_token_logits_and_greedy_continuations(tiny_gpt2):
    import torch
    import transformers

    got = pytorch_outputs(_checkpoint(tiny_gpt2, "text-generation"), SMALL_TEXTS[:2], new_tokens=4)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_gpt2)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    for i, text in enumerate(SMALL_TEXTS[:2]):
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        with torch.inference_mode():
            logits = model(input_ids=ids).logits[0, -1].numpy()
            new = model.generate(input_ids=ids, do_sample=False, max_new_tokens=4, pad_token_id=0)[0, ids.shape[1] :]
        np.testing.assert_allclose(got["logits"][i], logits, atol=1e-4)
        assert got["tokens"][i] == _until_eos(new.tolist(), model.generation_config.eos_token_id)
    teacher = got["teacher"]
    assert len(teacher["prompts"]) == len(teacher["continuations"]) == len(teacher["scores"]) == 2
    for score, prompt, continuation in zip(
        teacher["scores"], teacher["prompts"], teacher["continuations"], strict=True
    ):
        assert score["top1"].shape == score["nll"].shape == (len(continuation),) and (score["nll"] > 0).all()
        with torch.inference_mode():  # every position's logits, the continuation's taken from them
            full = model(input_ids=torch.tensor([prompt + continuation])).logits[0].numpy()
        want = teacher_scores(full[len(prompt) - 1 : -1], continuation)
        np.testing.assert_array_equal(score["top1"], want["top1"])
        np.testing.assert_allclose(score["nll"], want["nll"], rtol=1e-5, atol=1e-6)


def test_pooled_module_ignores_padding_in_a_batch(tiny_bert):
    import torch
    import transformers

    checkpoint = _checkpoint(tiny_bert, pooling={"mode": "mean", "normalize": False})
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_bert)
    model = transformers.AutoModel.from_pretrained(tiny_bert, attn_implementation="eager").eval()
    names = ["input_ids", "attention_mask", "token_type_ids"]
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    assert not batch["attention_mask"].all()  # the short text is padded
    with torch.inference_mode():
        pooled = pooled_module(model, checkpoint, names)(*(batch[n] for n in names)).numpy()
    np.testing.assert_allclose(pooled, pytorch_outputs(checkpoint, TEXTS), atol=1e-5)


def test_checkpoint_from_source_reads_the_config_again_or_none_where_gone(tiny_bert, tmp_path):
    source = {
        "path": str(tiny_bert),
        "digest": "d",
        "model_type": "bert",
        "task": "feature-extraction",
        "pooling": None,
        "max_length": 64,
    }
    assert checkpoint_from_source(source).config == json.loads((tiny_bert / "config.json").read_text())
    assert checkpoint_from_source({**source, "path": str(tmp_path / "gone")}).config == {}
    (tmp_path / "config.json").write_text("[1, 2]")  # JSON, but not a config
    restored = checkpoint_from_source({**source, "path": str(tmp_path)})
    assert restored.config == {} and restored.max_length == 64 and restored.task == "feature-extraction"


def test_pytorch_outputs_answer_the_same_request_once_in_a_process(tiny_bert):
    checkpoint = _checkpoint(tiny_bert, pooling={"mode": "mean", "normalize": False})
    first = pytorch_outputs(checkpoint, TEXTS[:1])
    assert pytorch_outputs(checkpoint, TEXTS[:1]) is first
    assert pytorch_outputs(checkpoint, TEXTS[1:]) is not first  # other texts: another baseline
    other = pytorch_outputs(_checkpoint(tiny_bert, pooling={"mode": "cls", "normalize": False}), TEXTS[:1])
    assert not np.allclose(other, first)


def test_a_large_vocabulary_tokenizer_loads_without_the_mistral_regex_warning(tmp_path, capfd):
    # transformers 4.57 looks for Mistral's regex in every tokenizer of over 100,000 tokens saved by 4.57.3 or later
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pipeline.build.accuracy.reference import load_hf_tokenizer

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100_001)} | {"<unk>": 100_001}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "transformers_version": "4.57.6"}))
    assert load_hf_tokenizer(_checkpoint(tmp_path, "text-generation"))("w7 w100000")["input_ids"] == [7, 100_000]
    assert "incorrect regex pattern" not in capfd.readouterr().err


def _dense_folder(folder, out_features=8, bias=True, shape=None):
    import torch
    from safetensors.torch import save_file

    weights = {"linear.weight": torch.randn(shape or (out_features, 32))}
    if bias:
        weights["linear.bias"] = torch.randn(out_features)
    (folder / "2_Dense").mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "bert"}')
    save_file(weights, str(folder / "2_Dense" / "model.safetensors"))
    dense = {"path": "2_Dense", "in_features": 32, "out_features": out_features, "bias": bias, "activation": "Tanh"}
    return _checkpoint(folder, pooling={"mode": "mean", "normalize": False, "dense": [dense]}), weights


def test_dense_layers_apply_the_saved_linear_and_its_activation(tmp_path):
    import torch

    checkpoint, weights = _dense_folder(tmp_path / "ckpt")
    x = torch.randn(3, 32)
    with torch.inference_mode():
        got = dense_layers(checkpoint)(x)
    expected = torch.tanh(x @ weights["linear.weight"].T + weights["linear.bias"])
    torch.testing.assert_close(got, expected)
    assert len(dense_layers(_checkpoint(tmp_path / "ckpt", pooling={"mode": "mean", "normalize": False}))) == 0


def test_dense_layers_refuse_weights_of_another_shape_naming_both(tmp_path):
    checkpoint, _ = _dense_folder(tmp_path / "ckpt", shape=(8, 16))
    with pytest.raises(
        InputError,
        match=r"2_Dense are \{.*'linear.weight': \(8, 16\)\}; its config.json needs \{'linear.weight': \(8, 32\)",
    ):
        dense_layers(checkpoint)
