"""A loaded two-tower image-text artifact (CLIP, SigLIP): pictures and label texts embedded in one space, and
pictures scored against labels, without torch.

    pictures --preprocessor_config.json--> pixel_values --model.onnx--> image embeddings (the searched graph)
    labels   --tokenizer.json--> input_ids --text.onnx--> text embeddings (fp32)

`classify_images(images, labels)` scores each picture against each label as transformers does: the cosine of the
two embeddings times exp(logit_scale), then a softmax over the labels (CLIP), or plus logit_bias and a sigmoid per
label (SigLIP, whose scores need not sum to one). Embeddings are returned as the models give them (unnormalized,
as `get_image_features` and `get_text_features`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.errors import InputError
from pipeline.runtime.text import check_lengths, check_texts, encode_batch, open_tokenizer, padded_rows


class ZeroShotImageModel:
    """An image tower (a runtime Model over model.onnx) and the text tower beside it (`text_session`)."""

    task = "zero-shot-image-classification"
    modality = "image"

    def __init__(self, image_model, text_session, tokenizer_path: Path, spec: dict):
        self.image_model, self.text_session, self.spec = image_model, text_session, spec
        self.backend = image_model.backend
        self.tokenizer = open_tokenizer(tokenizer_path)

    def run(self, images, batch_size: int | None = None):
        """The image embeddings [n, dim] of a list of pictures (paths, file bytes, uint8 arrays or Pillow images)."""
        return self.image_model.run(images, batch_size)

    embed_images = run

    def embed_texts(self, texts) -> np.ndarray:
        """The text embeddings [n, dim] of a list of texts (labels, prompts such as "a photo of a cat")."""
        texts = check_texts(texts, "embed_texts()")
        rows = [e.ids for e in encode_batch(self.tokenizer, texts, "embed_texts()")]
        limit = int(self.spec["text_max_length"])
        check_lengths(rows, limit, "embed_texts()")
        width = limit if self.spec["text_padding"] == "max_length" else None
        ids, mask = padded_rows(rows, int(self.spec["text_pad_id"]), width)
        feeds = {"input_ids": ids, "attention_mask": mask}
        return self.text_session.run(None, {name: feeds[name] for name in self.spec["text_inputs"]})[0]

    def scores(self, images, labels, batch_size: int | None = None) -> np.ndarray:
        """Each picture's score [n, labels] for each label: probabilities over the labels (CLIP) or each label's own
        probability (SigLIP)."""
        labels = check_texts(labels, "classify_images(labels=...)")
        image = _normalized(self.run(images, batch_size))
        text = _normalized(self.embed_texts(labels))
        logits = float(self.spec["logit_scale"]) * image @ text.T + float(self.spec["logit_bias"])
        if self.spec["score"] == "sigmoid":
            return 1.0 / (1.0 + np.exp(-logits))
        shifted = np.exp(logits - logits.max(-1, keepdims=True))
        return shifted / shifted.sum(-1, keepdims=True)

    def classify_images(self, images, labels, top_k: int = 5, batch_size: int | None = None) -> list:
        """The `top_k` best-scored of `labels` for each picture, as Prediction(label, score) lists, best first."""
        from pipeline.runtime.images import Prediction

        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise InputError(f"classify_images(top_k={top_k!r}): top_k must be an int >= 1")
        scores = self.scores(images, labels, batch_size)
        labels = list(labels)
        order = np.argsort(-scores, axis=-1, kind="stable")[:, :top_k]
        return [[Prediction(labels[j], float(row[j])) for j in best] for row, best in zip(scores, order, strict=True)]


def _normalized(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def open_zero_shot_model(image_model, root: Path, spec: dict, session, providers=None) -> ZeroShotImageModel:
    """A ZeroShotImageModel over an opened image tower and the artifact's text tower and tokenizer in `root`."""
    from pipeline.runtime.backends.onnxruntime import open_session
    from pipeline.runtime.schema import TEXT_GRAPH, TOKENIZER

    text = open_session(root / TEXT_GRAPH, session, providers)
    return ZeroShotImageModel(image_model, text, root / TOKENIZER, spec)
