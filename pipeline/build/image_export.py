"""onnx_from_checkpoint for image models: `pixel_values` [batch, 3, height, width] in, an embedding or logits out.

    pixel_values --(the checkpoint's model)--> image_embedding [batch, hidden]   (image-feature-extraction)
                                           --> logits [batch, labels]             (image-classification)

The image embedding is the model's pooler output, or the first token's final hidden state where the family's
record says its pooler is no trained part of most checkpoints (ViT's). The TorchScript exporter is used, as for
text encoders, with a dynamic batch axis; the image size is the processor's crop (or resize) size. The graph is
checked against PyTorch on two probe pictures prepared by the runtime's own preprocessing, and the processor's
settings are written as the runtime reads them (preprocessor_config.json in the artifact).
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.build.accuracy.reference import image_head, load_torch_model
from pipeline.build.inputs.architectures import architecture_of
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import Checkpoint
from pipeline.build.onnx_files import traced_to_onnx
from pipeline.errors import ExportError
from pipeline.runtime.artifact import IMAGE_PROCESSOR
from pipeline.runtime.schema import GRAPH

OPSET = 17


def image_spec(checkpoint: Checkpoint):
    """The checkpoint's image processor settings, as the runtime reads them."""
    from pipeline.runtime.images import ImageSpec

    path = Path(checkpoint.path) / IMAGE_PROCESSOR
    return ImageSpec.from_config(json.loads(path.read_text(encoding="utf-8")))


def probe_images():
    """Two pictures of other sizes and shapes than the model's input, made here (gradients and texture)."""
    import numpy as np

    rng = np.random.default_rng(0)
    wide = np.linspace(0, 255, 320 * 240 * 3).reshape(240, 320, 3)
    tall = rng.integers(0, 256, size=(300, 200, 3))
    return [wide.astype(np.uint8), tall.astype(np.uint8)]


def export_image_model(checkpoint: Checkpoint, out: Path) -> dict:
    """Export an image model to `out`/model.onnx and its processor settings to `out`/preprocessor_config.json;
    returns the runtime spec and the probe's difference against PyTorch."""
    import numpy as np
    import onnxruntime as ort
    import torch

    from pipeline.runtime.images import pixel_values

    spec = image_spec(checkpoint)
    task = TASKS[checkpoint.task]
    model = load_torch_model(checkpoint)
    head = image_head(model, checkpoint)
    probe = pixel_values(probe_images(), spec)
    with torch.inference_mode():
        expected = head(torch.from_numpy(probe)).numpy()
    if not np.isfinite(expected).all():
        raise ExportError(f"{checkpoint.path}: the PyTorch model itself outputs NaN or inf; its weights are broken")
    axes = {"pixel_values": {0: "batch"}, task.output: {0: "batch"}}
    traced_to_onnx(head, (torch.from_numpy(probe),), out / GRAPH, (["pixel_values"], [task.output]), axes, OPSET)
    session = ort.InferenceSession(str(out / GRAPH), providers=["CPUExecutionProvider"])
    got = session.run(None, {"pixel_values": probe})[0]
    diff = float(np.abs(got - expected).max()) if np.isfinite(got).all() else float("inf")
    architecture_of(checkpoint).check_probe(diff, "the exported graph", "a probe picture")
    (out / IMAGE_PROCESSOR).write_text(json.dumps(spec.to_json(), indent=1, sort_keys=True))
    labels = checkpoint.config.get("id2label") if task.labelled else None
    runtime = {
        "task": checkpoint.task,
        "modality": "image",
        "preprocessor": IMAGE_PROCESSOR,
        "inputs": ["pixel_values"],
        "output": task.output,
        "max_length": 1,  # one picture a row: no sequence to bound
        "pad_id": 0,
        "labels": {str(k): v for k, v in labels.items()} if labels else None,
    }
    if checkpoint.task == "zero-shot-image-classification":
        from pipeline.build.two_tower import text_tower_to_onnx

        runtime.update(text_tower_to_onnx(checkpoint, model, out, OPSET))
    return {"spec": runtime, "probe_max_abs_diff": diff}
