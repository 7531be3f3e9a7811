"""One record per model family (config.json's `model_type`), with hooks for what differs between families.

Stages never branch on `model_type`: they ask the record. `architecture_for(config)` resolves a checkpoint's
config to its record, or refuses it in one line before any export:

    known family      -> its record (encoders.py, decoders.py): fusions, attention layout, hooks
    unknown family    -> a generic record where the exporter knows the model (decomposed attention, generic
                         graph passes), else an InputError naming what is missing

This is the pattern of optimum's per-architecture export configs and onnxruntime-genai's builder model classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from pipeline.errors import ExportError, InputError


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A model family and what the export, the graph passes and the runtime need to know of it.

    `ort_model_type` names ONNX Runtime's transformer optimizer for the family; None means the optimizer does not
    know it, and only the generic passes (constant folding, dead-node removal) run. `attention` names the
    GroupQueryAttention layout of a decoder's layers (pipeline/build/passes/attention.py); None keeps the decomposed
    graph.
    `fusion_problem`, given the transformers model, says why this checkpoint's attention cannot be rewritten, or
    None. `attention_options`, given the config, returns extra GroupQueryAttention attributes per layer (scale,
    softcap, local_window_size). `position_offset` is the number of positions reserved before the first token
    (RoBERTa's padding index + 1). `attention_fusion` names this project's own encoder attention fusion
    (pipeline/build/passes/encoder_attention.py), run after ONNX Runtime's where its optimizer does not fuse the
    family's
    attention.
    """

    model_type: str
    family: str  # "encoder" | "decoder" | "speech" (an audio encoder, a text decoder) | "text2text" (two text)
    ort_model_type: str | None = None
    attention: str | None = None
    fusion_problem: Callable | None = None
    attention_options: Callable | None = None
    position_offset: int = 0
    generic: bool = False
    attention_fusion: str | None = None
    modality: str = "text"  # "text", "image" or "audio": what the model takes, and so what prepares its input
    # An image embedding: the model's pooler output ("pooler"), the first token's final hidden state ("cls")
    # where the pooler is a freshly initialised dense layer in most checkpoints (ViT's), or a two-tower model's
    # projected image features ("projected": CLIP's and SigLIP's get_image_features).
    image_embedding: str = "pooler"
    default_task: str | None = None  # where it is not the family's (two-tower models: zero-shot classification)
    # The largest absolute difference from PyTorch an exported graph may show on the export's probe input.
    probe_tolerance: float = 1e-3

    def check_probe(self, diff: float, what: str, probe: str = "a probe input") -> None:
        """An ExportError where the exported graph (`what`) differs from PyTorch on `probe` by more than the family
        allows (NaN or inf included)."""
        if not diff <= self.probe_tolerance:
            raise ExportError(
                f"{what} differs from PyTorch by {diff:.2e} on {probe} (allowed {self.probe_tolerance:g}); the "
                "exporter traced this checkpoint wrongly: report it with the checkpoint's config.json"
            )

    def why_not_fused(self, model) -> str | None:
        """Why the model's attention stays decomposed, or None when it becomes GroupQueryAttention."""
        if self.attention is None:
            return f"{self.model_type} attention has no GroupQueryAttention layout"
        return self.fusion_problem(model) if self.fusion_problem else None

    def layer_attention_options(self, config, layer: int) -> dict:
        """Extra GroupQueryAttention attributes of one layer (none for most families)."""
        return self.attention_options(config, layer) if self.attention_options else {}


# Families built as two graphs (encoder.onnx, decoder.onnx) by pipeline/build/search/encoder_decoder.py.
ENCODER_DECODER_FAMILIES = ("speech", "text2text")


def _registry() -> dict[str, Architecture]:
    from pipeline.build.inputs.architectures.decoders import DECODERS
    from pipeline.build.inputs.architectures.encoders import ENCODERS
    from pipeline.build.inputs.architectures.images import IMAGE_ENCODERS
    from pipeline.build.inputs.architectures.speech import SPEECH
    from pipeline.build.inputs.architectures.text2text import TEXT2TEXT

    table: dict[str, Architecture] = {}
    for record in ENCODERS + DECODERS + IMAGE_ENCODERS + SPEECH + TEXT2TEXT:
        if record.model_type in table:
            raise ValueError(f"architecture {record.model_type} is registered twice")
        table[record.model_type] = record
    return table


ARCHITECTURES: dict[str, Architecture] = _registry()

# config.json `architectures` suffixes that make a checkpoint a decoder (causal LM) rather than an encoder.
DECODER_HEADS = ("ForCausalLM", "LMHeadModel")


def remote_code_problem(folder, config: dict) -> str | None:
    """Why the checkpoint in `folder` would need its own Python code, or None. Such code is never run."""
    import json
    from pathlib import Path

    for name in ("config.json", "tokenizer_config.json"):
        path = Path(folder) / name
        data = config if name == "config.json" else None
        if data is None and path.is_file():
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                data = None
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map:
            named = ", ".join(sorted(map(str, auto_map))) if isinstance(auto_map, dict | list) else repr(auto_map)
            return f"{name} has `auto_map` ({named[:200]}), which names custom code"
    return None


def _exporter_supports(model_type: str, task: str) -> bool:
    """Whether optimum-onnx's exporter knows `model_type` for `task` (an optimum task name)."""
    try:
        # Importing the ONNX export configs is what registers them with the TasksManager: without it, a fresh
        # process (the CLI checks the checkpoint before anything else imports optimum) finds no family at all.
        import optimum.exporters.onnx.model_configs  # noqa: F401
        from optimum.exporters.tasks import TasksManager

        supported = TasksManager.get_supported_tasks_for_model_type(model_type, "onnx", library_name="transformers")
    except Exception:  # optimum raises KeyError or ValueError, by version, for an unknown model type
        return False
    return task in supported


def _config_defaults(model_type: str):
    """transformers' default config of `model_type`, or None where transformers does not know the type."""
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[model_type]()
    except KeyError:
        return None


# transformers' task tables that make a family a speech, image or text-to-text model, with what such a model
# needs besides its weights. Checked before the text paths: a Whisper or DINOv2 checkpoint is refused for what it
# is, not for a missing tokenizer.
_MODALITIES = (
    (
        ("SPEECH_SEQ_2_SEQ", "CTC", "AUDIO_CLASSIFICATION"),
        "a speech model: it needs a feature extractor (preprocessor_config.json) and audio input",
    ),
    (
        ("ZERO_SHOT_IMAGE_CLASSIFICATION",),
        "a two-tower image-text model of another family than CLIP and SigLIP (built as zero-shot image classifiers)",
    ),
    (("SEQ_TO_SEQ_CAUSAL_LM",), "an encoder-decoder text-to-text model (translation, summarization)"),
)
# Single-tower image families: built as image encoders where the exporter knows them (generic records).
_IMAGE_TABLES = ("IMAGE", "IMAGE_CLASSIFICATION")


def _in_tables(model_type: str, tables: tuple) -> bool:
    from transformers.models.auto import modeling_auto

    return any(model_type in getattr(modeling_auto, f"MODEL_FOR_{t}_MAPPING_NAMES", {}) for t in tables)


def modality_problem(model_type: str) -> str | None:
    """What kind of model `model_type` is where it is a speech, two-tower or text-to-text model this pipeline
    does not build yet, else None (transformers' own task tables say which)."""
    for tables, what in _MODALITIES:
        if _in_tables(model_type, tables):
            built = "text encoders, decoders, image encoders, Whisper and the text-to-text families named below"
            return f"{what}; this pipeline builds {built}"
    return None


def architecture_for(config: dict, folder="") -> Architecture:
    """The record of a checkpoint's config.json; a generic record for a family the exporter knows but this table
    does not; else a one-line InputError naming what is missing."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise InputError(f"{folder}/config.json has no model_type; save the checkpoint with save_pretrained")
    if model_type in ARCHITECTURES:
        return ARCHITECTURES[model_type]
    heads = config.get("architectures") or []
    decoder = any(str(h).endswith(DECODER_HEADS) for h in heads)
    defaults = _config_defaults(model_type)
    modality = modality_problem(model_type) if defaults is not None else None
    if modality:
        problem = modality
    elif defaults is not None and _in_tables(model_type, _IMAGE_TABLES):
        if _exporter_supports(model_type, "image-feature-extraction") or _exporter_supports(
            model_type, "image-classification"
        ):
            return Architecture(model_type, "encoder", generic=True, modality="image")
        problem = "an image model optimum-onnx's exporter does not know"
    elif defaults is None:
        problem = "transformers has no such model type: a custom architecture, whose code this pipeline never runs"
    elif config.get("is_encoder_decoder", defaults.is_encoder_decoder):
        problem = "encoder-decoder models (translation, summarization) are not built by this pipeline"
    elif decoder and _exporter_supports(model_type, "text-generation-with-past"):
        return Architecture(model_type, "decoder", generic=True)
    elif not decoder and _exporter_supports(model_type, "feature-extraction"):
        return Architecture(model_type, "encoder", generic=True)
    else:
        problem = "optimum-onnx's exporter does not know it"
    known = ", ".join(sorted(ARCHITECTURES))
    raise InputError(
        f"{folder}: architecture {model_type!r} is not supported ({problem}); supported: {known}, and any other "
        "family optimum-onnx exports for feature extraction or text generation"
    )


def architecture_of(checkpoint) -> Architecture:
    """The record of a Checkpoint (its config, or, for one read back from a published manifest, its model type)."""
    return architecture_for(checkpoint.config or {"model_type": checkpoint.model_type}, checkpoint.path)
