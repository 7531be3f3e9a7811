"""weight_only: a graph pass that stores MatMul weights in int8 or int4 blocks (ONNX Runtime's MatMulNBits).

    X --MatMul(W fp32)--> Y      becomes      X --MatMulNBits(codes, scales[, zero points])--> Y

Symmetric blocks (a scale a block) or zero-point blocks go through ONNX Runtime's quantizer; int4 blocks with a
float minimum go through pipeline/passes/block_minimum.py. Activations stay float (accuracy_level sets how the
kernel multiplies).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.onnx_files import graph_files, load_graph, save_graph
from pipeline.passes.block_minimum import quantize_with_block_minimum


def quantize_weight_only(source: Path, dest: Path, settings, exclude=(), only=None, wide=()) -> None:
    """MatMul weights of `source` in `settings.bits`-bit blocks of `settings.block_size` (MatMulNBits at
    `settings.accuracy_level`; blocks symmetric, with integer zero points, or with float minimums as
    `settings.blocks` says), the LM head (the MatMul making `logits`) and the nodes in `wide` in
    `settings.head_bits`; the nodes in `exclude` (or, given `only`, all others) stay fp32."""
    import onnx

    graph = onnx.load(str(source), load_external_data=False).graph
    names = {n.name for n in graph.node if n.op_type == "MatMul"}
    fp32 = set(exclude) | (names - set(only) if only is not None else set())
    head = next((n.name for n in graph.node if n.op_type == "MatMul" and "logits" in n.output), None)
    wider = sorted({n for n in (*wide, head) if n is not None and n not in fp32})
    if not wider or settings.head_bits == settings.bits:
        _weight_only(source, dest, settings, sorted(fp32))
        return
    body = dest.with_name(f"{dest.stem}.body.onnx")
    _weight_only(source, body, settings, sorted(fp32 | set(wider)))
    blocks = "symmetric" if settings.blocks == "minimum" else settings.blocks  # minimum is 4-bit: its head is 8
    _weight_only(body, dest, dataclasses.replace(settings, bits=settings.head_bits, blocks=blocks), only=wider)
    for file in graph_files(body):
        file.unlink()


def _weight_only(source: Path, dest: Path, settings, exclude=(), only=None) -> None:
    """quantize_weight_only for every MatMul at `settings.bits`."""
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    if settings.blocks == "minimum":
        quantize_with_block_minimum(source, dest, settings.block_size, settings.accuracy_level, exclude, only)
        return
    model = load_graph(source)  # the quantizer works on this one copy of the weights, replacing them node by node
    names = [n.name for n in model.graph.node if n.op_type == "MatMul"]
    excluded = list(exclude) + ([n for n in names if n not in set(only)] if only is not None else [])
    config = DefaultWeightOnlyQuantConfig(
        block_size=settings.block_size,
        is_symmetric=settings.blocks == "symmetric",
        bits=settings.bits,
        accuracy_level=settings.accuracy_level,
    )
    quantizer = MatMulNBitsQuantizer(model, nodes_to_exclude=excluded, algo_config=config)
    # The quantizer logs every node at INFO, through the root logger it configures on import.
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.WARNING)
    try:
        quantizer.process()
    finally:
        logging.getLogger().setLevel(level)
    quantizer.model.topological_sort()
    save_graph(quantizer.model.model, dest)
