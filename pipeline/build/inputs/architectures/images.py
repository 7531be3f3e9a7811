"""Image encoder families: vision transformers for image embeddings and image classification heads.

They take `pixel_values` [batch, 3, height, width] made by the checkpoint's image processor (preprocessor_config.json,
pipeline/runtime/images.py) rather than tokens, and run through the encoder candidates of the search. ONNX Runtime's
transformer optimizer knows ViT's attention (its "vit" model type); the others get the generic passes.
"""

from __future__ import annotations

from pipeline.build.inputs.architectures import Architecture

ZERO_SHOT = "zero-shot-image-classification"

IMAGE_ENCODERS = (
    Architecture("vit", "encoder", ort_model_type="vit", modality="image", image_embedding="cls"),
    Architecture("deit", "encoder", ort_model_type="vit", modality="image", image_embedding="cls"),
    Architecture("dinov2", "encoder", modality="image"),
    # Two towers (pipeline/build/two_tower.py): the image tower is the searched graph, the text tower rides beside.
    *(
        Architecture(t, "encoder", modality="image", image_embedding="projected", default_task=ZERO_SHOT)
        for t in ("clip", "siglip")
    ),
)
