"""last_token_logits: a graph pass that makes a causal LM's head run on the last position only."""

from __future__ import annotations

# Ops that act on each position alone, with constants: the head's MatMul may sit behind them.
POSITIONWISE = ("Div", "Mul", "Tanh", "Add", "Sub", "Cast")


def _lm_head(graph, weights: set):
    """The MatMul of a constant weight that `logits` comes from through position-wise ops only, or None."""
    producers = {o: n for n in graph.graph.node for o in n.output}
    constant = weights | {n.output[0] for n in graph.graph.node if n.op_type == "Constant"}
    node = producers.get("logits")
    while node is not None and node.op_type in POSITIONWISE:
        moving = [i for i in node.input if i not in constant]
        node = producers.get(moving[0]) if len(moving) == 1 else None
    if node is None or node.op_type != "MatMul" or node.input[1] not in weights:
        return None
    return node


def last_token_logits(graph) -> bool:
    """Rewrite a causal LM graph in place so that its LM head runs on the last position only.

        hidden [b, s, h] --MatMul(W)--> logits [b, s, V]
    becomes
        hidden [b, s, h] --Slice(axis 1, -1:)--> [b, 1, h] --MatMul(W)--> logits [b, 1, V]

    Generation needs only the next token's logits; on a prompt the head's work and the logits it returns then
    shrink by the prompt's length. Position-wise ops after the head (Granite's logits scaling, Gemma 2's final
    softcapping) are passed through. Returns False, changing nothing, where `logits` is not made by a MatMul
    with a constant weight: an initializer, or the Transpose of one, which optimum's post-processing makes of a
    head tied to the embedding (the runtime reads the last position either way).
    """
    import onnx

    weights = {i.name for i in graph.graph.initializer}
    weights |= {n.output[0] for n in graph.graph.node if n.op_type == "Transpose" and n.input[0] in weights}
    producer = _lm_head(graph, weights)
    if producer is None:
        return False
    constants = {"last_token_starts": -1, "last_token_ends": 2**63 - 1, "last_token_axes": 1}
    for name, value in constants.items():
        graph.graph.initializer.append(onnx.helper.make_tensor(name, onnx.TensorProto.INT64, [1], [value]))
    sliced = producer.input[0] + "_last_token"
    index = list(graph.graph.node).index(producer)
    graph.graph.node.insert(
        index, onnx.helper.make_node("Slice", [producer.input[0], *constants], [sliced], name="last_token_slice")
    )
    producer.input[0] = sliced
    output = next(o for o in graph.graph.output if o.name == "logits")
    output.type.tensor_type.shape.dim[1].Clear()
    output.type.tensor_type.shape.dim[1].dim_value = 1
    return True
