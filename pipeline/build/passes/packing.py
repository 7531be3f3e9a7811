"""matmuls_packed: a graph pass that packs the MatMuls reading one input with constant weights into one MatMul.

    x --MatMul(W_q)--> q            x --MatMul([W_q | W_k | W_v])--> Split(last axis) --> q, k, v
    x --MatMul(W_k)--> k    ->
    x --MatMul(W_v)--> v

A decoder step at batch 1 multiplies one row by each weight: a kernel call, and a fork and join of the thread pool,
per weight. Packed, the projections that read the same normalized hidden state (Q/K/V where q/k norms keep them
apart in the attention rewrite, and the MLP's gate and up) take one call. Packing is along the output columns, so
weight-only blocks (along the input dimension, per column) hold the same values as they would unpacked.
"""

from __future__ import annotations

import os
from collections import defaultdict

import numpy as np

from pipeline.build.onnx_files import drop_initializer, tensor_readers

FLOAT = 1  # onnx.TensorProto.FLOAT


def _groups(graph) -> list[list]:
    """MatMul nodes whose weight is a 2-D fp32 initializer that no other node reads, by their (first) input: two or
    more a group, all of one input width. (A weight read elsewhere, a tied one, is left where it is.)"""
    initializers = {i.name: i for i in graph.initializer}
    readers = tensor_readers(graph)
    by_input = defaultdict(list)
    for node in graph.node:
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" else None
        if weight is not None and len(weight.dims) == 2 and weight.data_type == FLOAT and readers[weight.name] == 1:
            by_input[node.input[0]].append(node)
    return [
        nodes
        for nodes in by_input.values()
        if len(nodes) > 1 and len({initializers[n.input[1]].dims[0] for n in nodes}) == 1
    ]


def _packed_name(nodes: list, index: int) -> str:
    """The packed node's name from its members': `/model/layers.0/mlp/gate_proj+up_proj/MatMul` from
    `/model/layers.0/mlp/gate_proj/MatMul` and `/model/layers.0/mlp/up_proj/MatMul`, so layer-wise choices by name
    still find it."""
    names = [n.name for n in nodes]
    head = os.path.commonprefix(names)
    head = head[: head.rfind("/") + 1]
    tail = os.path.commonprefix([n[::-1] for n in names])[::-1]
    tail = tail[tail.find("/") :] if "/" in tail else ""
    parts = [n[len(head) : len(n) - len(tail)] for n in names]
    if not all(names) or not all(parts):
        return f"packed_matmul_{index}/MatMul"
    return f"{head}{'+'.join(parts)}{tail}"


def _pack(graph, nodes: list, name: str, read) -> None:
    """Replace `nodes` in `graph` by one MatMul `name` and a Split, dropping their weights (read by no other node)
    as soon as they are packed: a graph holds each weight about once."""
    from onnx import helper, numpy_helper

    sole = {n.input[1] for n in nodes}
    weights = {i.name: i for i in graph.initializer if i.name in sole}
    arrays = [read(weights[n.input[1]]) for n in nodes]
    sizes = np.array([a.shape[1] for a in arrays], np.int64)
    packed = numpy_helper.from_array(np.concatenate(arrays, axis=1), f"{name}.weight")
    del arrays, weights
    for weight in sole:
        drop_initializer(graph, weight)
    graph.initializer.extend([packed, numpy_helper.from_array(sizes, f"{name}.split")])
    at = list(graph.node).index(nodes[0])  # the group's input is made before its first reader
    for node in nodes:
        graph.node.remove(node)
    made = [
        helper.make_node("MatMul", [nodes[0].input[0], f"{name}.weight"], [f"{name}_output"], name=name),
        helper.make_node(
            "Split", [f"{name}_output", f"{name}.split"], [n.output[0] for n in nodes], name=f"{name}/Split", axis=-1
        ),
    ]
    for offset, node in enumerate(made):
        graph.node.insert(at + offset, node)


def _packable_groups(model) -> list[list]:
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    return _groups(model.graph) if opset >= 13 else []  # Split takes its sizes as an input from opset 13


def packable(model) -> int:
    """How many MatMuls `matmuls_packed` would pack away; `model` may be a structure without weight data
    (pipeline.build.onnx_files.load_structure), so a graph with nothing to pack is never loaded whole."""
    return sum(len(nodes) - 1 for nodes in _packable_groups(model))


def matmuls_packed(model, read=None) -> int:
    """Pack, in `model` (ModelProto) in place, each group of MatMuls that read one input with their own constant
    fp32 weights into one MatMul and a Split whose outputs keep the old names. Returns the number of MatMuls packed
    away. `read(tensor)` gives a weight's array (default: from the loaded tensor; for a structure whose weights are
    in a data file, `pipeline.build.onnx_files.read_array`); the packed weights are held in `model`."""
    from onnx import numpy_helper

    groups = _packable_groups(model)
    for index, nodes in enumerate(groups):
        _pack(model.graph, nodes, _packed_name(nodes, index), read or numpy_helper.to_array)
    return sum(len(nodes) - 1 for nodes in groups)
