"""Encoder families: bidirectional models for embeddings and classification heads.

What the graph takes (token_type_ids or not) is read from the tokenizer and the model, not from this table; a
record says only which of ONNX Runtime's optimizers knows the family and where its positions start.
"""

from __future__ import annotations

from pipeline.build.inputs.architectures import Architecture

# ORT's BERT optimizer fuses attention, SkipLayerNormalization, Gelu and the embedding of these families' exports.
ENCODERS = (
    Architecture("bert", "encoder", ort_model_type="bert"),
    Architecture("roberta", "encoder", ort_model_type="bert", position_offset=2),
    Architecture("xlm-roberta", "encoder", ort_model_type="bert", position_offset=2),
    Architecture("camembert", "encoder", ort_model_type="bert", position_offset=2),
    # ORT's FusionAttention matches DistilBERT's layer, then reads the mask value from the wrong node and gives up.
    Architecture("distilbert", "encoder", ort_model_type="bert", attention_fusion="where-mask"),
    Architecture("electra", "encoder", ort_model_type="bert"),
    # ORT's FusionAttention misses ALBERT's first layer, whose residual (the embedding projection) is the first input.
    Architecture("albert", "encoder", ort_model_type="bert", attention_fusion="residual-first"),
    # Relative-position (MPNet), disentangled (DeBERTa-v2) and rotary local/global (ModernBERT) attention have no
    # fused kernel in ONNX Runtime's optimizer: they get the generic passes.
    Architecture("mpnet", "encoder", position_offset=2),
    Architecture("deberta-v2", "encoder"),
    Architecture("modernbert", "encoder"),
)


def encoder_inputs(tokenizer, model) -> list[str]:
    """The inputs an encoder's forward takes: the tokenizer's, where the model's forward accepts them.

    Segment ids are left out where the model has fewer than two segment types (RoBERTa-style and DeBERTa-v2
    models): there they are all zero, and a tokenizer borrowed from BERT would feed ones for a pair. What the
    exported graph finally takes is read back from it (`graph_inputs`): tracing drops inputs the graph never reads.
    """
    import inspect

    accepted = set(inspect.signature(model.forward).parameters)
    if getattr(model.config, "type_vocab_size", 2) < 2:
        accepted.discard("token_type_ids")
    names = ["input_ids", "attention_mask"] + [
        n for n in tokenizer.model_input_names if n not in ("input_ids", "attention_mask")
    ]
    return [n for n in names if n in accepted]


def graph_inputs(session, offered: list[str]) -> list[str]:
    """The inputs an exported graph takes, in the order it declares them; an input it takes that the tokenizer
    does not make is an error (the runtime could not feed it)."""
    names = [i.name for i in session.get_inputs()]
    unknown = [n for n in names if n not in offered]
    if unknown:
        raise ValueError(f"the exported graph takes {unknown}, which the tokenizer does not make ({offered})")
    return names
