"""The text tower of a two-tower image-text model (CLIP, SigLIP), exported beside its image tower.

    text.onnx  input_ids [b, s] (CLIP: and attention_mask [b, s]) -> text_embedding [b, dim]   (get_text_features)

The image tower is the artifact's searched graph (model.onnx: pixel_values -> get_image_features); the text tower
embeds the labels that pictures are scored against and stays fp32 (a label set is embedded once, so its speed
hardly counts). CLIP pads a batch to its longest text and masks the padding; SigLIP was trained on texts padded to
its full length without a mask, and its text graph takes input_ids alone (`text_padding` says which). The scores
are transformers' own: softmax over labels of exp(logit_scale) x cosine (CLIP), or sigmoid of exp(logit_scale) x
cosine + logit_bias (SigLIP), each picture scored against each label.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.build.accuracy.models import load_hf_tokenizer
from pipeline.build.inputs.architectures import architecture_of
from pipeline.build.inputs.tokenizer_patterns import check_tokenizer_patterns
from pipeline.build.manifest import Checkpoint
from pipeline.build.onnx_files import traced_to_onnx
from pipeline.runtime.schema import TEXT_GRAPH, TOKENIZER
from pipeline.runtime.text import padded_rows

PROBE_TEXTS = ("a photo of a cat", "a blurry photo of two dogs playing in the snow")


def _text_settings(model, tokenizer) -> dict:
    siglip = model.config.model_type == "siglip"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {
        "text_graph": TEXT_GRAPH,
        "text_inputs": ["input_ids"] if siglip else ["input_ids", "attention_mask"],
        "text_padding": "max_length" if siglip else "longest",
        "text_max_length": int(model.config.text_config.max_position_embeddings),
        "text_pad_id": int(pad if pad is not None else 0),
        "score": "sigmoid" if siglip else "softmax",
        "logit_scale": float(model.logit_scale.exp().item()),
        "logit_bias": float(model.logit_bias.item()) if siglip else 0.0,
    }


def _probe_batch(tokenizer, settings: dict):
    width = settings["text_max_length"] if settings["text_padding"] == "max_length" else None
    rows = [tokenizer(t)["input_ids"] for t in PROBE_TEXTS]
    ids, mask = padded_rows(rows, settings["text_pad_id"], width)
    return {"input_ids": ids, "attention_mask": mask}


def text_tower_to_onnx(checkpoint: Checkpoint, model, out: Path, opset: int) -> dict:
    """Export the text tower of `model` to `out`/text.onnx and its tokenizer to `out`/tokenizer.json, checked
    against PyTorch on two probe texts; returns the runtime spec's text and scoring settings."""
    import numpy as np
    import onnxruntime as ort
    import torch

    tokenizer = load_hf_tokenizer(checkpoint)
    settings = _text_settings(model, tokenizer)
    names = settings["text_inputs"]

    class Text(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *inputs):
            return self.model.get_text_features(**dict(zip(names, inputs, strict=True)))

    feeds = {k: v for k, v in _probe_batch(tokenizer, settings).items() if k in names}
    tower = Text().eval()
    args = tuple(torch.from_numpy(feeds[n]) for n in names)
    with torch.inference_mode():
        expected = tower(*args).numpy()
    axes = {**{n: {0: "batch", 1: "sequence"} for n in names}, "text_embedding": {0: "batch"}}
    traced_to_onnx(tower, args, out / TEXT_GRAPH, (names, ["text_embedding"]), axes, opset)
    model.eval()  # the exporter puts the wrapper back in its mode, which reaches the model
    session = ort.InferenceSession(str(out / TEXT_GRAPH), providers=["CPUExecutionProvider"])
    got = session.run(None, feeds)[0]
    diff = float(np.abs(got - expected).max()) if np.isfinite(got).all() else float("inf")
    architecture_of(checkpoint).check_probe(diff, "the exported text tower", "a probe text")
    check_tokenizer_patterns(tokenizer.backend_tokenizer.to_str(), checkpoint.path)
    tokenizer.backend_tokenizer.save(str(out / TOKENIZER))
    return {**settings, "companions": [TEXT_GRAPH, TOKENIZER], "text_probe_max_abs_diff": diff}
