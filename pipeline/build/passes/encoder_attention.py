"""Encoder attention that ONNX Runtime's optimizer finds but does not fuse, fused into its Attention contrib op:

- attention_from_where_mask: self-attention masked with Where (DistilBERT: ONNX Runtime's FusionAttention matches
  the layer, then reads the mask's fill value from the wrong node and gives up), fused here;
- attention_from_residual_first: a layer whose residual comes first in its sum (ALBERT's first layer), put in the
  order ONNX Runtime's fusion follows, which then fuses it.

attention_from_where_mask: per layer, the export computes

    x -> MatMul(Wq) + bq -> Reshape(B, S, N, D) -> Transpose(0,2,1,3) -> Div(sqrt(D)) --+
    x -> MatMul(Wk) + bk -> Reshape(B, S, N, D) -> Transpose(0,2,3,1) -------------------+-> MatMul -> scores
    Where(Expand(Reshape(Equal(attention_mask, 0), (B, 1, 1, S))), fill, scores) -> Softmax(-1) --+
    x -> MatMul(Wv) + bv -> Reshape(B, S, N, D) -> Transpose(0,2,1,3) ---------------------------+-> MatMul
      -> Transpose(0,2,1,3) -> Reshape(B, S, N*D)

which becomes

    Attention(x, [Wq Wk Wv], [bq bk bv], int32(attention_mask); num_heads=N, scale, mask_filter_value=fill)

A layer that differs anywhere (another mask, a bias missing, weights not constant) is left as it is.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

# The projection path of query, key and value, from the attention product back to the MatMul that reads x.
_PROJECTION = ["Transpose", "Reshape", "Add", "MatMul"]
_HEADS_FIRST = [0, 2, 1, 3]  # (B, S, N, D) -> (B, N, S, D)
_KEYS_TRANSPOSED = [0, 2, 3, 1]  # (B, S, N, D) -> (B, N, D, S)


def _scalar(model, name: str) -> float | None:
    value = model.get_constant_value(name)
    return float(np.asarray(value).reshape(-1)[0]) if value is not None and np.asarray(value).size == 1 else None


def _dims(model, name: str, output_name_to_node) -> list[int | None]:
    """The target shape a Reshape reads: from a constant, or from a Concat of parts (None where a part is not)."""
    value = model.get_constant_value(name)
    if value is not None:
        return [int(v) for v in np.asarray(value).reshape(-1)]
    concat = output_name_to_node.get(name)
    if concat is None or concat.op_type != "Concat":
        return []
    return [None if (v := _scalar(model, part)) is None else int(v) for part in concat.input]


def _projection(model, node, index, perm, output_name_to_node):
    """(nodes, weight, bias, heads, head_size) of the projection feeding input `index` of `node`, or None."""
    nodes = model.match_parent_path(node, _PROJECTION, [index, 0, None, None], output_name_to_node)
    if nodes is None or model.get_node_attribute(nodes[0], "perm") != perm:
        return None
    _, reshape, add, matmul = nodes
    weight = model.get_initializer(matmul.input[1])
    bias_name = next((i for i in add.input if i != matmul.output[0]), "")
    bias = model.get_initializer(bias_name)
    if weight is None or bias is None or len(weight.dims) != 2 or list(bias.dims) != [weight.dims[1]]:
        return None
    dims = _dims(model, reshape.input[1], output_name_to_node)
    if len(dims) != 4 or dims[2] is None or dims[3] is None or dims[2] * dims[3] != weight.dims[1]:
        return None
    return nodes, numpy_helper.to_array(weight), numpy_helper.to_array(bias), dims[2], dims[3]


def _mask(model, where, output_name_to_node):
    """(mask nodes, the graph input the mask reads) where `where`'s condition is `attention_mask == 0` laid out as
    (B, 1, 1, S), else None."""
    nodes = model.match_parent_path(where, ["Expand", "Reshape", "Equal"], [0, 0, 0], output_name_to_node)
    if nodes is None:
        return None
    _, reshape, equal = nodes
    if _dims(model, reshape.input[1], output_name_to_node)[1:3] != [1, 1]:
        return None
    values = [_scalar(model, name) for name in equal.input]
    if values.count(0.0) != 1:
        return None
    source = equal.input[1 - values.index(0.0)]
    if model.find_graph_input(source) is None:
        return None
    return nodes, source


def _layer(model, softmax, input_name_to_nodes, output_name_to_node) -> dict | None:
    """What one layer's fusion needs, or None where the layer is not the pattern of the module docstring."""
    axis = model.get_node_attribute(softmax, "axis")
    if axis is None:  # Softmax before opset 13 defaults to axis 1, over the flattened trailing dimensions
        axis = -1 if model.get_opset_version() >= 13 else 1
    where = model.match_parent_path(softmax, ["Where", "MatMul"], [0, 2], output_name_to_node)
    consumers = input_name_to_nodes.get(softmax.output[0], [])
    if axis not in (-1, 3) or where is None or len(consumers) != 1 or consumers[0].op_type != "MatMul":
        return None
    (where, scores), context = where, consumers[0]
    fill, mask = _scalar(model, where.input[1]), _mask(model, where, output_name_to_node)
    scaled = model.match_parent_path(scores, ["Div"], [0], output_name_to_node)
    divisor = _scalar(model, scaled[0].input[1]) if scaled else None
    tail = [n for n in input_name_to_nodes.get(context.output[0], []) if n.op_type == "Transpose"]
    if fill is None or fill >= 0 or mask is None or not divisor or context.input[0] != softmax.output[0] or not tail:
        return None
    reshape = input_name_to_nodes.get(tail[0].output[0], [])
    if (
        model.get_node_attribute(tail[0], "perm") != _HEADS_FIRST
        or len(reshape) != 1
        or reshape[0].op_type != "Reshape"
    ):
        return None
    q = _projection(model, scaled[0], 0, _HEADS_FIRST, output_name_to_node)
    k = _projection(model, scores, 1, _KEYS_TRANSPOSED, output_name_to_node)
    v = _projection(model, context, 1, _HEADS_FIRST, output_name_to_node)
    if q is None or k is None or v is None or len({p[0][-1].input[0] for p in (q, k, v)}) != 1:
        return None
    if len({(p[3], p[4]) for p in (q, k, v)}) != 1 or len({p[1].shape for p in (q, k, v)}) != 1:
        return None
    merged = _dims(model, reshape[0].input[1], output_name_to_node)
    if len(merged) != 3 or merged[2] != q[3] * q[4]:  # (B, S, N*D)
        return None
    nodes = [*q[0], *k[0], *v[0], *mask[0][:2], scaled[0], scores, where, softmax, context, tail[0], reshape[0]]
    return {
        "nodes": nodes + _served_shapes(nodes, input_name_to_nodes),
        "x": q[0][-1].input[0],
        "weight": np.concatenate([q[1], k[1], v[1]], axis=1),
        "bias": np.concatenate([q[2], k[2], v[2]]),
        "heads": q[3],
        "scale": 1.0 / divisor,
        "head_size": q[4],
        "fill": fill,
        "mask": mask[1],
        "output": reshape[0].output[0],
    }


def _served_shapes(nodes: list, input_name_to_nodes) -> list:
    """The Shape nodes reading what `nodes` compute that only `nodes` read (the scores' Shape, which only the
    mask's Expand reads): they go with the layer."""
    inside = {id(n) for n in nodes}
    return [
        shape
        for node in nodes
        for name in node.output
        for shape in input_name_to_nodes.get(name, [])
        if shape.op_type == "Shape" and all(id(c) in inside for c in input_name_to_nodes.get(shape.output[0], []))
    ]


def _private(layer: dict, input_name_to_nodes, graph_outputs: set[str]) -> bool:
    """Whether nothing outside the layer's nodes reads what they compute (but for the layer's output), and none of
    it is a graph output."""
    inside = {id(n) for n in layer["nodes"]}
    for node in layer["nodes"]:
        for name in node.output:
            if name == layer["output"]:
                continue
            if name in graph_outputs or any(id(c) not in inside for c in input_name_to_nodes.get(name, [])):
                return False
    return True


def _mask_int32(model, source: str) -> str:
    """The name of `source` cast to int32, the mask type of the Attention op (one Cast for every layer)."""
    for node in model.nodes():
        if (
            node.op_type == "Cast"
            and list(node.input) == [source]
            and model.get_node_attribute(node, "to") == TensorProto.INT32
        ):
            return node.output[0]
    taken = {name for n in model.nodes() for name in n.output} | {i.name for i in model.model.graph.input}
    name, index = f"{source}_int32", 0
    while name in taken:
        index += 1
        name = f"{source}_int32_{index}"
    model.add_node(
        helper.make_node("Cast", [source], [name], name=model.create_node_name("Cast"), to=TensorProto.INT32)
    )
    return name


def attention_from_where_mask(model) -> int:
    """Fuse each layer of `model` (an ONNX Runtime OnnxModel, weights loaded) whose attention is the pattern of the
    module docstring into one Attention node; returns the number of layers fused."""
    fused = 0
    for softmax in [n for n in model.nodes() if n.op_type == "Softmax"]:
        input_name_to_nodes, output_name_to_node = model.input_name_to_nodes(), model.output_name_to_node()
        layer = _layer(model, softmax, input_name_to_nodes, output_name_to_node)
        if layer is None or not _private(layer, input_name_to_nodes, {o.name for o in model.model.graph.output}):
            continue
        name = model.create_node_name("Attention")
        model.add_initializer(numpy_helper.from_array(layer["weight"].astype(np.float32), f"{name}_qkv_weight"))
        model.add_initializer(numpy_helper.from_array(layer["bias"].astype(np.float32), f"{name}_qkv_bias"))
        attributes = {"num_heads": layer["heads"], "mask_filter_value": layer["fill"]}
        if not np.isclose(layer["scale"], layer["head_size"] ** -0.5, rtol=1e-6):
            attributes["scale"] = layer["scale"]
        inputs = [layer["x"], f"{name}_qkv_weight", f"{name}_qkv_bias", _mask_int32(model, layer["mask"])]
        model.remove_nodes(layer["nodes"])
        model.add_node(
            helper.make_node("Attention", inputs, [layer["output"]], name=name, domain="com.microsoft", **attributes)
        )
        fused += 1
    if fused:
        if not any(o.domain == "com.microsoft" for o in model.model.opset_import):
            model.model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
        model.prune_graph(allow_remove_graph_inputs=False)
        model.topological_sort()
    return fused


# ONNX Runtime's attention fusion walks up from a SkipLayerNormalization through this path, taking at each step the
# first input of the op type it wants: the attention output projection's bias Add, its MatMul, the head merge.
_ATTENTION_OUTPUT = (["MatMul", "Reshape", "Transpose", "MatMul"], [None, 0, 0, 0])


def attention_from_residual_first(model) -> int:
    """Attention of a layer whose residual is a projection's output, fused by ONNX Runtime's own fusion (`model`
    is the BertOnnxModel its optimizer returned); returns the Attention nodes added.

    ALBERT's first layer adds its attention output to the embedding projection (a MatMul and a bias Add) with the
    residual as the first input. ONNX Runtime's fusion follows the first Add parent of the SkipLayerNormalization,
    the residual's, and gives up; the later layers' residual is a SkipLayerNormalization, so they fuse. Where a
    SkipLayerNormalization's second input is the attention output's Add and its first is another Add, the two are
    swapped (the op adds them: the same sum, both of the hidden states' shape) and the fusion runs again."""
    before = len(model.get_nodes_by_op_type("Attention"))
    producers = model.output_name_to_node()
    swapped = 0
    for node in model.get_nodes_by_op_type("SkipLayerNormalization"):
        first, second = (producers.get(name) for name in node.input[:2])
        if first is None or second is None or first.op_type != "Add" or second.op_type != "Add":
            continue
        if model.match_parent_path(second, *_ATTENTION_OUTPUT, producers) is None:
            continue
        if model.match_parent_path(first, *_ATTENTION_OUTPUT, producers) is not None:
            continue
        node.input[0], node.input[1] = node.input[1], node.input[0]
        swapped += 1
    if not swapped:
        return 0
    # A fresh fusion of the optimizer's own class: the one it ran still holds the nodes it added and removed.
    fusion = type(model.attention_fusion)(model, model.hidden_size, model.num_heads, model.attention_mask)
    fusion.apply()
    model.fuse_add_bias_skip_layer_norm()
    model.prune_graph(allow_remove_graph_inputs=False)
    model.topological_sort()
    return len(model.get_nodes_by_op_type("Attention")) - before


# The layouts an architecture record's `attention_fusion` names.
FUSIONS = {"where-mask": attention_from_where_mask, "residual-first": attention_from_residual_first}
