"""The explicit tables of what the pipeline supports: tasks, and model architectures.

Per-model variation lives in these rows, not in subclasses. Adding an architecture is one row here plus a
test in tests/test_tasks.py (a test fails if a row has none).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: which transformers head to load, the graph output the runtime returns, how it is validated."""

    name: str
    auto_class: str
    output: str
    metric: str  # "embedding" | "classification" | "token-classification" | "generation"
    family: str  # the architecture family that can serve it: "encoder" | "decoder"


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A model family (config.json's model_type) and what the export and optimizer need to know of it."""

    model_type: str
    family: str  # "encoder" | "decoder" (causal LM, exported with a KV cache)
    ort_model_type: str  # onnxruntime.transformers.optimizer model_type
    token_type_ids: bool


TASKS = {
    t.name: t
    for t in (
        Task("feature-extraction", "AutoModel", "sentence_embedding", "embedding", "encoder"),
        Task("sequence-classification", "AutoModelForSequenceClassification", "logits", "classification", "encoder"),
        Task("token-classification", "AutoModelForTokenClassification", "logits", "token-classification", "encoder"),
        Task("text-generation", "AutoModelForCausalLM", "logits", "generation", "decoder"),
    )
}

ARCHITECTURES = {
    a.model_type: a
    for a in (
        Architecture("bert", "encoder", "bert", True),
        Architecture("roberta", "encoder", "bert", False),
        Architecture("distilbert", "encoder", "bert", False),
        Architecture("electra", "encoder", "bert", True),
        # Decoders: ORT's GPT-2 optimizer fuses their norms (LayerNorm, RMSNorm as SimplifiedLayerNormalization,
        # with the residual Add as Skip*) and Gelu; it finds no attention with a KV cache in these graphs.
        Architecture("gpt2", "decoder", "gpt2", False),
        Architecture("llama", "decoder", "gpt2", False),
        Architecture("qwen2", "decoder", "gpt2", False),
        Architecture("gpt_neox", "decoder", "gpt2", False),
    )
}

# config.json `architectures` suffixes that imply a task when the user names none.
TASK_FROM_HEAD = {
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
    "ForCausalLM": "text-generation",
    "LMHeadModel": "text-generation",
}

# The task of a checkpoint that names no head: what its family is built for.
DEFAULT_TASK = {"encoder": "feature-extraction", "decoder": "text-generation"}
