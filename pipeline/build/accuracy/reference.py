"""Every PyTorch baseline in one place: the checkpoint's model and tokenizer, its outputs on text (what validation
compares against), and the runners the benchmarks time (encoder forward, transformers' generate).

Build-side only: imports torch and transformers, lazily.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

import numpy as np

from pipeline.build.accuracy.models import load_hf_tokenizer, load_torch_model
from pipeline.build.accuracy.reference_decoder import generation_outputs
from pipeline.build.console import progress
from pipeline.build.inputs.architectures import architecture_of
from pipeline.build.inputs.architectures.encoders import encoder_inputs
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import Checkpoint
from pipeline.errors import InputError
from pipeline.runtime.encoder import masked_row


def checkpoint_from_source(source: dict) -> Checkpoint:
    """The Checkpoint a published manifest's `source` field describes (its config read again where the folder is
    still there)."""
    config_file = Path(source["path"]) / "config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    return Checkpoint(config=config if isinstance(config, dict) else {}, **source)


def _dense_weights(folder: Path) -> dict:
    """A Dense module's tensors: model.safetensors where there is one, else pytorch_model.bin read with
    `weights_only`, which refuses a pickle that would run code."""
    import torch

    safe, pickled = folder / "model.safetensors", folder / "pytorch_model.bin"
    try:
        if safe.is_file():
            from safetensors.torch import load_file

            return load_file(str(safe))
        weights = torch.load(str(pickled), map_location="cpu", weights_only=True)
    except Exception as err:  # safetensors and torch's unpickler each raise their own types for bad files
        first = (str(err).splitlines() or [""])[0]
        raise InputError(
            f"could not load the Dense weights in {folder} ({type(err).__name__}: {first}); they are corrupt or "
            "hold more than tensors: save the model again, as model.safetensors"
        ) from None
    if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise InputError(f"{pickled} holds no plain dict of tensors; save the model again, as model.safetensors")
    return weights


def dense_layers(checkpoint: Checkpoint):
    """The sentence-transformers Dense modules of `checkpoint` (its pooling's `dense` list), each a Linear and its
    activation, in order, as one nn.Sequential (empty where there are none)."""
    import torch

    layers = []
    for dense in (checkpoint.pooling or {}).get("dense", ()):
        folder = Path(checkpoint.path) / dense["path"]
        shapes = {"linear.weight": (dense["out_features"], dense["in_features"])}
        if dense["bias"]:
            shapes["linear.bias"] = (dense["out_features"],)
        weights = _dense_weights(folder)
        got = {k: tuple(v.shape) for k, v in weights.items()}
        if got != shapes:
            raise InputError(
                f"the Dense weights in {folder} are {got}; its config.json needs {shapes}: save the model again"
            )
        linear = torch.nn.Linear(dense["in_features"], dense["out_features"], bias=dense["bias"])
        linear.load_state_dict({k.removeprefix("linear."): v.float() for k, v in weights.items()})
        # DENSE_ACTIVATIONS (the checkpoint stage) admits only torch.nn classes without arguments.
        layers += [linear, getattr(torch.nn, dense["activation"])()]
    return torch.nn.Sequential(*layers).eval()


def pooled_module(model, checkpoint: Checkpoint, input_names: list[str]):
    """An nn.Module whose forward takes the named inputs positionally and returns the task's output: the pooled
    embedding (for sentence-transformers, through its Dense modules and Normalize), the logits, or a
    question-answering head's start and end logits stacked as [batch, sequence, 2]."""
    import torch

    pooling = checkpoint.pooling
    spans = checkpoint.task == "question-answering"
    dense = dense_layers(checkpoint) if pooling else None

    class Pooled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            self.dense = dense

        def forward(self, *inputs):
            kwargs = dict(zip(input_names, inputs, strict=True))
            out = self.model(**kwargs)
            if spans:
                return torch.stack([out.start_logits, out.end_logits], dim=-1)
            if pooling is None:
                return out.logits
            hidden = out.last_hidden_state
            mask = kwargs["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            if pooling["mode"] == "cls":
                pooled = hidden[:, 0]
            elif pooling["mode"] == "max":
                pooled = (hidden + (mask - 1.0) * 1e9).max(dim=1).values
            else:
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = self.dense(pooled)
            if pooling["normalize"]:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return pooled

    return Pooled().eval()


def image_head(model, checkpoint: Checkpoint):
    """The module the graph is traced from: pixel_values -> the task's output."""
    import torch

    embedding = architecture_of(checkpoint).image_embedding
    classify = checkpoint.task == "image-classification"

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, pixel_values):
            if embedding == "projected":
                return self.model.get_image_features(pixel_values=pixel_values)
            out = self.model(pixel_values=pixel_values)
            if classify:
                return out.logits
            pooled = getattr(out, "pooler_output", None)
            if embedding == "cls" or pooled is None:
                return out.last_hidden_state[:, 0]
            return pooled.flatten(1)

    return Head().eval()


def _encoder_outputs(checkpoint: Checkpoint, texts: list) -> list:
    import torch

    tokenizer = load_hf_tokenizer(checkpoint)
    model = load_torch_model(checkpoint)
    inputs = set(encoder_inputs(tokenizer, model))
    outputs = []
    with torch.inference_mode():
        for text in progress(texts, "PyTorch: reference outputs"):
            pair = (text,) if isinstance(text, str) else text
            enc = tokenizer(
                *([p] for p in pair), truncation=True, max_length=checkpoint.max_length, return_tensors="pt"
            )
            feeds = {k: v for k, v in enc.items() if k in inputs}
            positions = None
            if checkpoint.task == "fill-mask":
                ids, positions = masked_row(feeds["input_ids"][0].tolist(), tokenizer.mask_token_id)
                feeds["input_ids"] = torch.tensor([ids])
            out = model(**feeds)
            if checkpoint.task == "feature-extraction":
                hidden = out.last_hidden_state[0]
                mode = checkpoint.pooling["mode"]
                vector = hidden[0] if mode == "cls" else hidden.max(0).values if mode == "max" else hidden.mean(0)
                outputs.append(vector.numpy())
            elif checkpoint.task == "question-answering":
                outputs.append(torch.stack([out.start_logits[0], out.end_logits[0]], dim=-1).numpy())
            else:
                logits = out.logits[0].numpy()
                outputs.append(logits if positions is None else logits[positions])
    return outputs


# The last few baselines computed in this process, by (checkpoint record, text digest, new tokens): the
# search's held-out check and validation ask for the same one.
_BASELINES: dict = {}
_KEPT_BASELINES = 4


def _request(checkpoint: Checkpoint, texts: list, new_tokens: int) -> tuple:
    record = json.dumps(dataclasses.asdict(checkpoint), sort_keys=True, default=str)
    return record, hashlib.sha256(json.dumps(texts).encode()).hexdigest(), new_tokens


def _remembered(key: tuple, compute):
    if key not in _BASELINES:
        while len(_BASELINES) >= _KEPT_BASELINES:
            _BASELINES.pop(next(iter(_BASELINES)))
        _BASELINES[key] = compute()
    return _BASELINES[key]


def pytorch_outputs(checkpoint: Checkpoint, texts: list, new_tokens: int = 0):
    """The PyTorch baseline: SentenceTransformer.encode for sentence-transformers checkpoints with Normalize or Dense
    modules, else the transformers model with the same pooling or head; token classification and question
    answering give one array per text; fill-mask gives the vocabulary logits at the masked positions
    (`masked_row`), all texts' rows in one array; text generation gives next-token logits and greedy
    continuations of `new_tokens` tokens (`generation_reference`). The same request in one process is answered
    once (callers must not modify the result)."""
    if checkpoint.task == "text-generation":
        return generation_reference(checkpoint, texts, new_tokens)
    if checkpoint.task == "automatic-speech-recognition":
        from pipeline.build.speech.gate import speech_reference

        return _remembered(_request(checkpoint, texts, new_tokens), lambda: speech_reference(checkpoint, texts))
    if checkpoint.task == "text2text-generation":
        from pipeline.build.text2text.gate import text2text_reference

        return _remembered(_request(checkpoint, texts, new_tokens), lambda: text2text_reference(checkpoint, texts))
    return _remembered(_request(checkpoint, texts, new_tokens), lambda: _pytorch_outputs(checkpoint, texts))


def generation_reference(checkpoint: Checkpoint, texts: list, new_tokens: int, model=None):
    """`generation_outputs` of the checkpoint's PyTorch model (`model`, where already loaded), answered once per
    process for the same request."""

    def compute():
        torch_model = model if model is not None else load_torch_model(checkpoint)
        tokenizer = load_hf_tokenizer(checkpoint)
        return generation_outputs(torch_model, tokenizer, texts, new_tokens, checkpoint.max_length)

    return _remembered(_request(checkpoint, texts, new_tokens), compute)


def _image_outputs(checkpoint: Checkpoint, images: list):
    """The checkpoint's model on pictures prepared by transformers' own image processor (the slow one, the
    checkpoint's class): [n, dim] embeddings or [n, labels] logits."""
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(checkpoint.path, use_fast=False, local_files_only=True)
    head = image_head(load_torch_model(checkpoint), checkpoint)
    outputs = []
    with torch.inference_mode():
        for start in progress(range(0, len(images), 16), "PyTorch: reference outputs"):
            pictures = []
            for path in images[start : start + 16]:
                with Image.open(path) as picture:
                    pictures.append(picture.convert("RGB"))
            pixels = processor(images=pictures, return_tensors="pt")["pixel_values"]
            outputs.append(head(pixels).numpy())
    return np.concatenate(outputs)


def _pytorch_outputs(checkpoint: Checkpoint, texts: list):
    if TASKS[checkpoint.task].modality == "image":
        return _image_outputs(checkpoint, texts)
    pooling = checkpoint.pooling or {}
    if checkpoint.task == "feature-extraction" and (pooling.get("normalize") or pooling.get("dense")):
        model = sentence_transformer(checkpoint)
        return model.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=pooling["normalize"])
    outputs = _encoder_outputs(checkpoint, texts)
    if checkpoint.task == "fill-mask":
        return np.concatenate(outputs)
    return outputs if TASKS[checkpoint.task].per_token else np.stack(outputs)


def sentence_transformer(checkpoint: Checkpoint, dtype: str = "float32"):
    """SentenceTransformer over the checkpoint, on the CPU, in `dtype` (bfloat16 is the one-argument peer)."""
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(
        checkpoint.path,
        device="cpu",
        model_kwargs={"dtype": getattr(torch, dtype)},
        trust_remote_code=False,
        local_files_only=True,
    )
    model.max_seq_length = checkpoint.max_length
    return model


def encoder_runner(checkpoint: Checkpoint, input_names: list[str], threads: int, dtype: str = "float32"):
    """run(feeds) -> numpy output: the PyTorch model with the export's pooling, on the same token ids an ONNX graph
    gets, at `threads` threads and in `dtype`."""
    import torch

    torch.set_num_threads(threads)
    module = pooled_module(load_torch_model(checkpoint, dtype), checkpoint, input_names)

    def run(feeds: dict):
        with torch.inference_mode():
            return module(*(torch.from_numpy(feeds[n]) for n in input_names)).float().numpy()

    return run


class _FirstToken:
    """A generate() streamer that notes when the first new tokens arrive (its first put() is the prompt)."""

    def __init__(self):
        self.puts, self.first = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def generate_runner(model, tokenizer):
    """run(batch, n) -> the perf_counter time its first tokens were chosen: transformers' greedy generate of exactly
    n tokens per prompt, left-padded."""
    import torch

    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = pad

    def run(batch: list[str], n: int) -> float:
        enc = tokenizer(batch, return_tensors="pt", padding=True)
        streamer = _FirstToken()
        with torch.inference_mode():
            model.generate(
                **enc,
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=pad,
                use_cache=True,
                streamer=streamer,
            )
        return streamer.first

    return run
