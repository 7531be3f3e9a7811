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
    metric: str  # "embedding" | "classification" | "token-classification"


@dataclasses.dataclass(frozen=True)
class Architecture:
    """A model family (config.json's model_type) and what the export and optimizer need to know of it."""

    model_type: str
    family: str  # "encoder"
    ort_model_type: str  # onnxruntime.transformers.optimizer model_type
    token_type_ids: bool


TASKS = {
    t.name: t
    for t in (
        Task("feature-extraction", "AutoModel", "sentence_embedding", "embedding"),
        Task("sequence-classification", "AutoModelForSequenceClassification", "logits", "classification"),
        Task("token-classification", "AutoModelForTokenClassification", "logits", "token-classification"),
    )
}

ARCHITECTURES = {
    a.model_type: a
    for a in (
        Architecture("bert", "encoder", "bert", True),
        Architecture("roberta", "encoder", "bert", False),
        Architecture("distilbert", "encoder", "bert", False),
        Architecture("electra", "encoder", "bert", True),
    )
}

# config.json `architectures` suffixes that imply a task when the user names none.
TASK_FROM_HEAD = {
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
}
