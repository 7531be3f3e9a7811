"""The explicit table of the tasks the pipeline builds. Model families are records in
pipeline/build/inputs/architectures/."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Task:
    """A task: which transformers head to load, the graph output the runtime returns, how it is validated.

    `per_token`: the output has a row per token ([batch, sequence, ...]) rather than per text. `labelled`: the
    head's classes are the config's id2label.
    """

    name: str
    auto_class: str
    output: str
    metric: str  # "embedding" | "classification" | "token-classification" | "fill-mask" | "span" | "generation"
    family: str  # the architecture family that can serve it: "encoder" | "decoder" | "speech" | "text2text"
    per_token: bool = False
    labelled: bool = False
    modality: str = "text"  # what the model takes: "text" (a tokenizer), "image" or "audio" (a processor's settings)


TASKS = {
    t.name: t
    for t in (
        Task("feature-extraction", "AutoModel", "sentence_embedding", "embedding", "encoder"),
        Task(
            "sequence-classification",
            "AutoModelForSequenceClassification",
            "logits",
            "classification",
            "encoder",
            labelled=True,
        ),
        Task(
            "token-classification",
            "AutoModelForTokenClassification",
            "logits",
            "token-classification",
            "encoder",
            per_token=True,
            labelled=True,
        ),
        # Vocabulary logits at every position: fill-mask reads the masked ones, sparse retrievers (SPLADE) pool all.
        Task("fill-mask", "AutoModelForMaskedLM", "logits", "fill-mask", "encoder", per_token=True),
        # Extractive QA: start and end logits stacked as [batch, sequence, 2].
        Task("question-answering", "AutoModelForQuestionAnswering", "span_logits", "span", "encoder", per_token=True),
        Task("text-generation", "AutoModelForCausalLM", "logits", "generation", "decoder"),
        # Image encoders: the embedding is the first token's final hidden state (ViT's and DINOv2's CLS token).
        Task("image-feature-extraction", "AutoModel", "image_embedding", "embedding", "encoder", modality="image"),
        Task(
            "image-classification",
            "AutoModelForImageClassification",
            "logits",
            "classification",
            "encoder",
            labelled=True,
            modality="image",
        ),
        # Two towers (CLIP, SigLIP): the image tower's projected embedding is the searched graph's output; the text
        # tower (text.onnx) embeds the labels that pictures are scored against.
        Task(
            "zero-shot-image-classification",
            "AutoModel",
            "image_embedding",
            "embedding",
            "encoder",
            modality="image",
        ),
        # Speech recognition: an audio encoder and a text decoder (Whisper), judged on the words it writes.
        Task(
            "automatic-speech-recognition",
            "AutoModelForSpeechSeq2Seq",
            "logits",
            "transcription",
            "speech",
            modality="audio",
        ),
        # Translation and summarization: a text encoder and a text decoder (T5, BART, Marian, M2M100), judged on
        # the tokens it writes.
        Task("text2text-generation", "AutoModelForSeq2SeqLM", "logits", "text2text", "text2text"),
    )
}

# config.json `architectures` suffixes that imply a task when the user names none. A masked-LM head is an
# embedding model where a sentence-transformers modules.json says so (all-mpnet-base-v2 names MPNetForMaskedLM).
TASK_FROM_HEAD = {
    "ForImageClassification": "image-classification",
    "ForSequenceClassification": "sequence-classification",
    "ForTokenClassification": "token-classification",
    "ForMaskedLM": "fill-mask",
    "ForQuestionAnswering": "question-answering",
    "ForCausalLM": "text-generation",
    "LMHeadModel": "text-generation",
}

# The task of a checkpoint that names no head: what its family is built for.
DEFAULT_TASK = {
    "encoder": "feature-extraction",
    "decoder": "text-generation",
    "image": "image-feature-extraction",
    "speech": "automatic-speech-recognition",
    "text2text": "text2text-generation",
}
