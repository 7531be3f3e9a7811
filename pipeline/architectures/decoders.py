"""Decoder families: causal LMs exported with a KV cache, and how their attention becomes GroupQueryAttention.

A record's `attention` names its layer layout in pipeline/attention.py; its hooks say when a checkpoint of the
family cannot be rewritten, and which GroupQueryAttention attributes a layer needs.
"""

from __future__ import annotations

from pipeline.architectures import Architecture
from pipeline.attention import gpt2_problem, rotary_problem

# ORT's GPT-2 optimizer fuses their norms (LayerNorm, RMSNorm as SimplifiedLayerNormalization, with the residual
# Add as Skip*) and Gelu; it finds no attention with a KV cache in these graphs.
DECODERS = (
    Architecture("gpt2", "decoder", ort_model_type="gpt2", attention="gpt2", fusion_problem=gpt2_problem),
    Architecture("llama", "decoder", ort_model_type="gpt2", attention="llama", fusion_problem=rotary_problem),
    Architecture("qwen2", "decoder", ort_model_type="gpt2", attention="llama", fusion_problem=rotary_problem),
    Architecture("gpt_neox", "decoder", ort_model_type="gpt2", attention="neox", fusion_problem=rotary_problem),
)
