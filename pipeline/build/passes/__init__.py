"""Graph rewrites: each pass is a function from one ONNX graph to another plus a small report of what it did.
Stages are cached callers of passes and never rewrite graphs themselves.

    attention.py      gqa_from_decomposed: a decoder's attention into GroupQueryAttention
    lm_head.py        last_token_logits: a causal LM's head on the last position only
    fusions.py        fused_from_onnx: ONNX Runtime's transformer fusions, or the generic passes
    fp16.py           fp16_from_fp32: fp16 weights and ops, the sensitive ones kept fp32
    smoothing.py      smooth: SmoothQuant's per-channel move of activation outliers into the weights
    int8.py           quantize_dynamic, quantize_static: ONNX Runtime's int8 quantizer
    weight_only.py    quantize_weight_only: MatMulNBits int8/int4 blocks
    block_minimum.py  quantize_with_block_minimum: int4 blocks with a float minimum (GGUF Q4_1's scheme)
"""
