"""Weight-only int4 blocks that keep a float minimum each (the scheme of GGUF's Q4_1): w = scale * q + minimum,
q in 0..15, scale and minimum from the block's range.

ONNX Runtime's MatMulNBits runs fast only with integer zero points (float ones fall back to a much slower kernel),
and rounding a block's minimum to a whole step moves the whole block by up to half a step (docs/targets.md has
what that cost SmolLM2). So the kernel gets the codes with its default zero point (8), and the rest of each
block's offset is added beside it, exactly:

    x @ W = MatMulNBits(x; q, scale) + (x @ S) @ M

S (K x K/block, ones down each block) sums x over each block, once for every MatMul that reads x; M (K/block x N)
holds each block's minimum plus 8 scales. Both are small fp32 MatMuls (1/32 of the weight's multiply-adds).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.build.onnx_files import load_external, load_structure, read_array, save_graph, with_opset

LEVELS = 15  # 4-bit codes 0..15
DEFAULT_ZERO_POINT = 8  # MatMulNBits' zero point for 4-bit blocks when none is given


def blocks_with_minimum(weight: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes packed for MatMulNBits [N, K/block, block/2] uint8, scales [N, K/block], offsets [K/block, N]) of a
    [K, N] weight; a last partial block is padded with its own last row (which leaves its range unchanged)."""
    k, n = weight.shape
    blocks = -(-k // block)
    padded = np.pad(weight.astype(np.float32), ((0, blocks * block - k), (0, 0)), mode="edge")
    grouped = padded.T.reshape(n, blocks, block)  # [N, blocks, block]: MatMulNBits' layout, blocks along K
    low, high = grouped.min(axis=2), grouped.max(axis=2)
    scale = (high - low) / LEVELS
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)  # a constant block: any scale, all codes 0
    codes = np.clip(np.rint((grouped - low[..., None]) / scale[..., None]), 0, LEVELS).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # two codes a byte, the first in the low nibble
    offsets = (low + DEFAULT_ZERO_POINT * scale).T.astype(np.float32)
    return packed, scale, np.ascontiguousarray(offsets)


def block_sums(k: int, block: int) -> np.ndarray:
    """S: [K, K/block] with ones where row k is in block j, so that x @ S is x summed over each block."""
    blocks = -(-k // block)
    sums = np.zeros((k, blocks), np.float32)
    sums[np.arange(k), np.arange(k) // block] = 1.0
    return sums


def _weight(node, initializers: dict, excluded: set, source: Path):
    """The node's constant 2-D fp32 weight (read alone from the graph file `source`), where it is a MatMul this
    scheme replaces; else None."""
    from onnx import TensorProto

    if node.op_type != "MatMul" or node.name in excluded or node.input[1] not in initializers:
        return None
    tensor = initializers[node.input[1]]
    if tensor.data_type != TensorProto.FLOAT or len(tensor.dims) != 2:
        return None
    return read_array(tensor, source)


def quantize_with_block_minimum(
    source: Path, dest: Path, block: int, accuracy_level: int, exclude=(), only=None, others=None
) -> int:
    """Rewrite every constant-weight MatMul of `source` (bar those in `exclude`, or, given `only`, all others) into
    4-bit blocks with a float minimum, written to `dest`. `others` maps node names to a rewrite of their own,
    `rewrite(node, weight) -> (nodes, initializers)`, done in the same pass (a wider head's symmetric blocks).
    Returns the number of MatMuls rewritten."""
    from onnx import helper, numpy_helper

    model = load_structure(source)  # each weight is read alone, then only the kept ones
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    names = {n.name for n in graph.node if n.op_type == "MatMul"}
    others = others or {}
    excluded = (set(exclude) | (names - set(only) if only is not None else set())) - set(others)
    nodes, added, sums_of, replaced, shared = [], [], {}, set(), set()
    for node in graph.node:
        weight = _weight(node, initializers, excluded, source)
        if weight is None:
            nodes.append(node)
            continue
        if node.name in others:
            rewritten, tensors = others[node.name](node, weight)
            nodes += rewritten
            added += tensors
            replaced.add(node.input[1])
            continue
        (k, n), x, name = weight.shape, node.input[0], node.name or node.output[0]
        packed, scale, offsets = blocks_with_minimum(weight, block)
        ones = f"block_sums/S{k}"
        if k not in shared:  # S depends on K alone: one initializer for every input of that width
            shared.add(k)
            added.append(numpy_helper.from_array(block_sums(k, block), ones))
        if (x, k) not in sums_of:
            sums_of[(x, k)] = f"{name}/block_sums"
            nodes.append(helper.make_node("MatMul", [x, ones], [sums_of[(x, k)]], name=f"{name}/BlockSums"))
        added += [
            numpy_helper.from_array(packed, f"{name}/codes"),
            numpy_helper.from_array(scale, f"{name}/scales"),
            numpy_helper.from_array(offsets, f"{name}/offsets"),
        ]
        nodes += [
            helper.make_node(
                "MatMulNBits",
                [x, f"{name}/codes", f"{name}/scales"],
                [f"{name}/scaled"],
                name=f"{name}/Q4",
                domain="com.microsoft",
                K=k,
                N=n,
                bits=4,
                block_size=block,
                accuracy_level=accuracy_level,
            ),
            helper.make_node("MatMul", [sums_of[(x, k)], f"{name}/offsets"], [f"{name}/offset"], name=f"{name}/Min"),
            helper.make_node("Add", [f"{name}/scaled", f"{name}/offset"], [node.output[0]], name=f"{name}/Add"),
        ]
        replaced.add(node.input[1])
    used = {i for n in nodes for i in n.input}  # a weight another node shares (a tied embedding) stays
    for index in reversed(range(len(graph.initializer))):  # deleted in place: a rebuilt list would copy the rest
        if graph.initializer[index].name in replaced - used:
            del graph.initializer[index]
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.extend(added)
    del added
    with_opset(model, "com.microsoft")
    load_external(model, source)
    save_graph(model, dest, consume=True)
    return len(replaced)
