"""Stage 2: onnx_from_checkpoint. A PyTorch checkpoint becomes one ONNX graph plus a Rust tokenizer file.

The graph has dynamic batch and sequence axes. For feature extraction the pooling (and the normalization of
sentence-transformers checkpoints) is part of the graph, so its `sentence_embedding` output equals
`SentenceTransformer.encode`. The TorchScript exporter is used because ONNX Runtime's transformer fusions
recognise its attention pattern; they find none in the dynamo exporter's graph.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from pipeline.cache import run_cached
from pipeline.errors import ExportError, InputError
from pipeline.manifest import Checkpoint, Manifest
from pipeline.targets import Target
from pipeline.tasks import ARCHITECTURES, TASKS

OPSET = 17
PROBE_TEXTS = ("A short probe.", "A somewhat longer probe sentence, so that the batch needs padding to line up.")


def load_torch_model(checkpoint: Checkpoint):
    """The checkpoint's PyTorch model for its task, in eval mode, with eager attention."""
    import transformers

    auto = getattr(transformers, TASKS[checkpoint.task].auto_class)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = auto.from_pretrained(checkpoint.path, attn_implementation="eager", dtype="float32")
    except Exception as err:  # safetensors, torch and transformers each raise their own types for bad files
        first = (str(err).splitlines() or [""])[0]
        raise InputError(
            f"could not load the weights in {checkpoint.path} ({type(err).__name__}: {first}); "
            "the weight files are missing or corrupt: save the checkpoint again"
        ) from None
    return model.eval()


def load_hf_tokenizer(checkpoint: Checkpoint):
    """The checkpoint's fast tokenizer (the Rust one the runtime uses, through transformers)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(checkpoint.path, use_fast=True)
    except (OSError, ValueError) as err:
        raise InputError(f"could not load the tokenizer in {checkpoint.path}: {str(err).splitlines()[0]}") from None
    if not tokenizer.is_fast:
        raise InputError(f"{checkpoint.path} has no fast (Rust) tokenizer; the runtime needs tokenizer.json")
    return tokenizer


def _wrapper(model, checkpoint: Checkpoint, input_names: list[str]):
    """An nn.Module whose forward takes the named inputs positionally and returns the task's output."""
    import torch

    pooling = checkpoint.pooling

    class Exported(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            kwargs = dict(zip(input_names, inputs, strict=True))
            out = self.model(**kwargs)
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
            if pooling["normalize"]:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
            return pooled

    return Exported().eval()


def runtime_spec(checkpoint: Checkpoint, tokenizer, input_names: list[str], target: Target) -> dict:
    """What the runtime loader needs to feed the graph and read its output."""
    config = checkpoint.config
    labels = config.get("id2label") if checkpoint.task != "feature-extraction" else None
    return {
        "task": checkpoint.task,
        "inputs": input_names,
        "output": TASKS[checkpoint.task].output,
        "max_length": checkpoint.max_length,
        "pad_id": int(tokenizer.pad_token_id or 0),
        "batch_size": target.shapes.batch_size,
        "overlong": target.shapes.overlong,
        "labels": {str(k): v for k, v in labels.items()} if labels else None,
    }


def _export(checkpoint: Checkpoint, target: Target, out: Path) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch

    arch = ARCHITECTURES[checkpoint.model_type]
    tokenizer = load_hf_tokenizer(checkpoint)
    model = load_torch_model(checkpoint)
    input_names = ["input_ids", "attention_mask"] + (["token_type_ids"] if arch.token_type_ids else [])
    probe = tokenizer(list(PROBE_TEXTS), padding=True, return_tensors="pt")
    args = tuple(probe[name] for name in input_names)
    wrapper = _wrapper(model, checkpoint, input_names)
    output = TASKS[checkpoint.task].output
    axes = {name: {0: "batch", 1: "sequence"} for name in input_names}
    axes[output] = {0: "batch", 1: "sequence"} if checkpoint.task == "token-classification" else {0: "batch"}
    with torch.inference_mode():
        expected = wrapper(*args).numpy()
    if not np.isfinite(expected).all():
        raise ExportError(f"{checkpoint.path}: the PyTorch model itself outputs NaN or inf; its weights are broken")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper, args, str(out / "model.onnx"), dynamo=False, opset_version=OPSET,
            input_names=input_names, output_names=[output], dynamic_axes=axes, do_constant_folding=True,
        )  # fmt: skip
    session = ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {name: probe[name].numpy() for name in input_names})[0]
    if not np.isfinite(got).all():
        raise ExportError(f"the exported graph of {checkpoint.path} outputs NaN or inf on a probe input")
    diff = float(np.abs(got - expected).max())
    if diff > 1e-3:
        raise ExportError(f"the exported graph differs from PyTorch by {diff:.2e} on a probe input (allowed 1e-3)")
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    spec = runtime_spec(checkpoint, tokenizer, input_names, target)
    return {"spec": spec, "probe_max_abs_diff": diff}


def run(manifest: Manifest, target: Target) -> Manifest:
    """Export the checkpoint to ONNX (cached by checkpoint digest and export settings)."""
    import torch
    import transformers

    checkpoint = manifest.checkpoint
    config = {
        "opset": OPSET,
        "task": checkpoint.task,
        "pooling": checkpoint.pooling,
        "max_length": checkpoint.max_length,
        "batch_size": target.shapes.batch_size,
        "overlong": target.shapes.overlong,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    record = run_cached(
        manifest.cache_dir, "export", config, checkpoint.digest, None, lambda out: _export(checkpoint, target, out)
    )
    return manifest.with_stage(record)
