"""The explicit table of the tasks the pipeline builds. Model families are records in pipeline/architectures/."""

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


TASKS = {
    t.name: t
    for t in (
        Task("feature-extraction", "AutoModel", "sentence_embedding", "embedding", "encoder"),
        Task("sequence-classification", "AutoModelForSequenceClassification", "logits", "classification", "encoder"),
        Task("token-classification", "AutoModelForTokenClassification", "logits", "token-classification", "encoder"),
        Task("text-generation", "AutoModelForCausalLM", "logits", "generation", "decoder"),
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
