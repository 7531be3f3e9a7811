"""weight_only: a graph pass that stores MatMul weights in int8 or int4 blocks (ONNX Runtime's MatMulNBits).

    X --MatMul(W fp32)--> Y      becomes      X --MatMulNBits(W_Q<bits>, W_scales[, W_zero_points])--> Y

Symmetric blocks (a scale a block) or zero-point blocks are made by ONNX Runtime's own C++ kernel, into the
initializers and node its MatMulNBitsQuantizer writes; int4 blocks with a float minimum go through
pipeline/build/passes/block_minimum.py. Activations stay float (accuracy_level sets how the kernel multiplies).

The graph is read without its data, and each weight alone from its data file, quantized and dropped before the
next: ONNX Runtime's quantizer holds the whole fp32 graph, several copies at times (6.9 GB for a 1.8 GB
graph), which no 1B-parameter decoder fits on a 24 GB host. docs/targets.md has the measurements.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.build.onnx_files import (
    drop_initializer,
    load_external,
    load_structure,
    read_array,
    save_graph,
    tensor_readers,
    with_opset,
)
from pipeline.build.passes.block_minimum import quantize_with_block_minimum
from pipeline.errors import QuantizationError


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How one MatMul's weight is stored: bits a weight, symmetric or with zero points, the block, the kernel's
    accuracy level."""

    bits: int
    symmetric: bool
    block_size: int
    accuracy_level: int | None


def quantize_weight_only(source: Path, dest: Path, settings, exclude=(), only=None, wide=()) -> None:
    """MatMul weights of `source` in `settings.bits`-bit blocks of `settings.block_size` (MatMulNBits at
    `settings.accuracy_level`; blocks symmetric, with integer zero points, or with float minimums as
    `settings.blocks` says), the LM head (the MatMul making `logits`) and the nodes in `wide` in
    `settings.head_bits`; the nodes in `exclude` (or, given `only`, all others) stay fp32."""
    model = load_structure(source)
    graph = model.graph
    names = {n.name for n in graph.node if n.op_type == "MatMul"}
    fp32 = set(exclude) | (names - set(only) if only is not None else set())
    head = next((n.name for n in graph.node if n.op_type == "MatMul" and "logits" in n.output), None)
    wider = {n for n in (*wide, head) if n is not None and n not in fp32}
    if settings.head_bits == settings.bits:
        wider = set()
    body = Blocks(settings.bits, settings.blocks == "symmetric", settings.block_size, settings.accuracy_level)
    wide_blocks = dataclasses.replace(body, bits=settings.head_bits)
    if settings.blocks != "minimum":
        plan = {n: wide_blocks if n in wider else body for n in names - fp32}
        blocks_from_fp32(model, source, dest, plan)
        return
    del model, graph  # block minimum reads the graph itself
    if not wider:
        quantize_with_block_minimum(source, dest, settings.block_size, settings.accuracy_level, sorted(fp32))
        return
    # Minimum blocks are 4-bit only: the wide nodes get symmetric blocks at the head's bits, in the same pass.
    rewrite = _rewrite_in(dataclasses.replace(wide_blocks, symmetric=True))
    others = dict.fromkeys(wider, rewrite)
    quantize_with_block_minimum(source, dest, settings.block_size, settings.accuracy_level, sorted(fp32), others=others)


def _rewrite_in(blocks: Blocks):
    """`rewrite(node, weight) -> ([MatMulNBits], its new initializers)` of a MatMul and its [K, N] weight in
    `blocks`; MatMuls sharing a weight share its blocks."""
    done: dict[str, list[str]] = {}

    def rewrite(node, weight):
        tensors = [] if node.input[1] in done else _blocks_of(weight, node.input[1], blocks)
        names = done.setdefault(node.input[1], [t.name for t in tensors])
        k, n = weight.shape
        return [_matmul_nbits(node, names, k, n, blocks)], tensors

    return rewrite


def blocks_from_fp32(model, source: Path, dest: Path, plan: dict[str, Blocks]) -> int:
    """Rewrite each MatMul of `model` (the graph file `source`, loaded without its data) that `plan` names and
    whose weight is a constant 2-D fp32 initializer into MatMulNBits with the plan's blocks, as ONNX Runtime's
    MatMulNBitsQuantizer does; write the result to `dest`. Returns the number of MatMuls rewritten.

    Only one fp32 weight is read at a time; an initializer no node reads any more leaves the graph at once."""
    from onnx import TensorProto

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    readers = tensor_readers(graph)
    done: dict[str, tuple[Blocks, list[str], str]] = {}  # weight -> its blocks, initializers and first node
    rewritten = 0
    for index, node in enumerate(graph.node):
        blocks = plan.get(node.name)
        tensor = initializers.get(node.input[1]) if node.op_type == "MatMul" and blocks else None
        if tensor is None or tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != 2:
            continue
        weight = tensor.name
        if weight not in done:
            tensors = _blocks_of(read_array(tensor, source), weight, blocks)
            graph.initializer.extend(tensors)
            done[weight] = (blocks, [t.name for t in tensors], node.name)
        elif done[weight][0] != blocks:
            raise QuantizationError(
                f"MatMuls {done[weight][2]!r} and {node.name!r} share the weight {weight!r} but are planned at "
                f"{done[weight][0].bits} and {blocks.bits} bits, and one weight has one set of blocks; keep one of "
                "them fp32 (exclude) or widen both."
            )
        k, n = tensor.dims
        graph.node[index].CopyFrom(_matmul_nbits(node, done[weight][1], k, n, blocks))
        rewritten += 1
        readers[weight] -= 1
        if readers[weight] == 0:
            drop_initializer(graph, weight)
            del initializers[weight]
    readers = tensor_readers(graph)
    for name in [t.name for t in graph.initializer if not readers[t.name]]:  # as ORT's clean_initializers
        drop_initializer(graph, name)
    with_opset(model, "com.microsoft")
    load_external(model, source)
    save_graph(model, dest, consume=True)
    return rewritten


def _blocks_of(weight, name: str, blocks: Blocks) -> list:
    """Quantize `weight` [K, N] with ONNX Runtime's kernel: its codes, scales and (with zero points) zero points
    as initializers named as ONNX Runtime names them, in MatMulNBits' input order."""
    from onnx import numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import (
        DefaultWeightOnlyQuantConfig,
        DefaultWeightOnlyQuantizer,
    )

    config = DefaultWeightOnlyQuantConfig(
        block_size=blocks.block_size,
        is_symmetric=blocks.symmetric,
        accuracy_level=blocks.accuracy_level,
        bits=blocks.bits,
    )
    packed, scales, zero_points = DefaultWeightOnlyQuantizer(config).qbits_block_quant(weight)
    del weight
    tensors = [(packed, f"{name}_Q{blocks.bits}"), (scales, f"{name}_scales")]
    if not blocks.symmetric:
        tensors.append((zero_points, f"{name}_zero_points"))
    return [numpy_helper.from_array(array, array_name) for array, array_name in tensors]


def _matmul_nbits(node, weights: list[str], k: int, n: int, blocks: Blocks):
    """The MatMulNBits node replacing the MatMul `node`, named and attributed as ONNX Runtime's quantizer does."""
    from onnx import helper

    accuracy = {"accuracy_level": blocks.accuracy_level} if blocks.accuracy_level else {}  # 0 is left out, as ORT
    return helper.make_node(
        "MatMulNBits",
        [node.input[0], *weights],
        [node.output[0]],
        name=f"{node.name}_Q{blocks.bits}" if node.name else "",
        domain="com.microsoft",
        K=k,
        N=n,
        bits=blocks.bits,
        block_size=blocks.block_size,
        **accuracy,
    )
