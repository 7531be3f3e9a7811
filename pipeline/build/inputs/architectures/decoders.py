"""Decoder families: causal LMs exported with a KV cache, and how their attention becomes GroupQueryAttention.

A record's `attention` names its layer layout in pipeline/build/passes/attention.py; its hooks say when a checkpoint
of the
family cannot be rewritten, and which GroupQueryAttention attributes a layer needs. What the op does not hold
stays in the graph as exported: Gemma's scaled embeddings and (1 + w) norms, Granite's embedding, residual and
logit multipliers, Gemma 2's final logit softcapping, Qwen3/Gemma 3/OLMo2's q/k norms (fed to the op after them).

Sliding windows: transformers lets a query at position p attend to keys p - sliding_window < k <= p
(`sliding_window` keys, itself included). ONNX Runtime 1.32's CPU kernel, measured on a 40-token prompt with a
window of 8 (tests/build/passes/test_attention.py), matches that with local_window_size = sliding_window, and differs by
about 0.1 in the logits with sliding_window - 1 or + 1 (older kernels' source reads as `local_window_size` + 1
keys: the test pins the behaviour of the installed one).
"""

from __future__ import annotations

from pipeline.build.inputs.architectures import Architecture
from pipeline.build.passes.attention import gpt2_problem, rotary_problem


def _window(size) -> dict:
    return {"local_window_size": int(size)} if size else {}


def _sliding_layer(config, layer: int) -> bool:
    """Whether `layer` is a sliding-window layer by the config's layer_types (Qwen2/3, Gemma 2/3, SmolLM3)."""
    types = getattr(config, "layer_types", None)
    return bool(types) and types[layer] == "sliding_attention" and bool(getattr(config, "sliding_window", None))


def every_layer_windowed(config, layer: int) -> dict:
    """Mistral and Phi-3: `sliding_window`, when set, applies to every layer."""
    return _window(getattr(config, "sliding_window", None))


def windowed_by_layer_types(config, layer: int) -> dict:
    """Qwen2 and Qwen3: a window on the layers layer_types marks sliding (use_sliding_window)."""
    return _window(config.sliding_window) if _sliding_layer(config, layer) else {}


def gemma2_options(config, layer: int) -> dict:
    """Gemma 2: scores scaled by query_pre_attn_scalar^-0.5 and softcapped; sliding windows by layer_types."""
    options = {"scale": float(config.query_pre_attn_scalar) ** -0.5} | windowed_by_layer_types(config, layer)
    if config.attn_logit_softcapping:
        options["softcap"] = float(config.attn_logit_softcapping)
    return options


def gemma3_options(config, layer: int) -> dict:
    """Gemma 3: as Gemma 2, and its sliding layers read the local rotary (rope_local_base_freq)."""
    local = {"rotary": "rotary_emb_local"} if config.layer_types[layer] == "sliding_attention" else {}
    return gemma2_options(config, layer) | local


def granite_options(config, layer: int) -> dict:
    """Granite: scores scaled by attention_multiplier instead of 1/sqrt(head size)."""
    return {"scale": float(config.attention_multiplier)}


def smollm3_options(config, layer: int) -> dict:
    """SmolLM3: no rotary on the layers no_rope_layers marks 0; windows by layer_types."""
    no_rope = {} if config.no_rope_layers[layer] else {"rotary": None}
    return no_rope | windowed_by_layer_types(config, layer)


def _llama_like(model_type: str, options=None) -> Architecture:
    return Architecture(
        model_type,
        "decoder",
        ort_model_type="gpt2",
        attention="llama",
        fusion_problem=rotary_problem,
        attention_options=options,
    )


# ORT's GPT-2 optimizer fuses their norms (LayerNorm, RMSNorm as SimplifiedLayerNormalization, with the residual
# Add as Skip*) and Gelu; it finds no attention with a KV cache in these graphs.
DECODERS = (
    Architecture("gpt2", "decoder", ort_model_type="gpt2", attention="gpt2", fusion_problem=gpt2_problem),
    _llama_like("llama"),
    _llama_like("mistral", every_layer_windowed),
    _llama_like("qwen2", windowed_by_layer_types),
    _llama_like("qwen3", windowed_by_layer_types),
    _llama_like("phi3", every_layer_windowed),
    _llama_like("gemma"),
    _llama_like("gemma2", gemma2_options),
    _llama_like("gemma3_text", gemma3_options),
    _llama_like("granite", granite_options),
    _llama_like("olmo2"),
    _llama_like("smollm3", smollm3_options),
    Architecture("gpt_neox", "decoder", ort_model_type="gpt2", attention="neox", fusion_problem=rotary_problem),
)
