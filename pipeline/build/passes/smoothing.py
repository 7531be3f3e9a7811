"""Smoothing (SmoothQuant): a graph pass that moves activation outliers into the weights before int8.

Transformer activations have a few channels far larger than the rest, and a per-tensor activation scale spends all
of int8 on them. For each quantized node Y = X @ W, a per-input-channel factor s moves that range into the
weights, which are quantized per channel:

    X --MatMul(W)--> Y      becomes      X --Mul(1/s)--> X' --MatMul(diag(s) W)--> Y

s_j = max|X_j|^alpha / max|W_j|^(1-alpha), from activation ranges on the calibration text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.build.console import progress
from pipeline.build.onnx_files import load_graph, save_graph
from pipeline.build.passes.int8 import quantizable_nodes


def activation_absmax(source: Path, nodes: list, model, texts: list[str], batch_size: int) -> dict[str, np.ndarray]:
    """Per-channel max |x| of each node's input 0 over the calibration text (padding excluded)."""
    import onnx
    import onnxruntime as ort

    graph = load_graph(source, load_data=False)
    names = sorted({n.input[0] for n in nodes})
    known = {o.name for o in graph.graph.output}
    for name in names:
        if name not in known:
            graph.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    options = ort.SessionOptions()
    # The graph is handed over from memory; weights in a data file are read from beside `source`.
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(source.parent))
    session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
    encodings = model.encode(texts)
    ranges: dict[str, np.ndarray] = {}
    for start in progress(range(0, len(encodings), batch_size), "calibration: activation ranges"):
        feeds = model.feeds(encodings[start : start + batch_size])
        mask = feeds["attention_mask"].astype(bool) if "attention_mask" in feeds else None  # pictures: no padding
        for name, value in zip(names, session.run(names, feeds), strict=True):
            # Padding is left out where the activation has the mask's [batch, sequence] shape (a decoder's LM head
            # sees the last position only).
            value = np.abs(value[mask] if mask is not None and value.shape[:2] == mask.shape else value)
            peak = value.reshape(-1, value.shape[-1]).max(0)
            ranges[name] = np.maximum(ranges.get(name, 0.0), peak)
    return ranges


def smooth(source: Path, out: Path, ranges: dict[str, np.ndarray], op_types, alpha: float) -> list[str]:
    """Write a smoothed copy of `source` to `out`; returns the names of the nodes smoothed."""
    import onnx
    from onnx import numpy_helper

    graph = load_graph(source)
    initializers = {i.name: i for i in graph.graph.initializer}
    targets = {n.name for n in quantizable_nodes(graph, op_types)}
    nodes, smoothed, users = [], [], {}
    for node in graph.graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    for node in graph.graph.node:
        weight_name = node.input[1] if len(node.input) > 1 else None
        # A weight shared by two nodes cannot be rescaled for one of them alone.
        if node.name in targets and users.get(weight_name) == 1 and node.input[0] in ranges:
            weight = numpy_helper.to_array(initializers[weight_name])
            act = ranges[node.input[0]]
            if weight.ndim == 2 and act.shape[0] == weight.shape[0]:
                w_max = np.abs(weight).max(1)
                scale = (np.maximum(act, 1e-5) ** alpha / np.maximum(w_max, 1e-5) ** (1 - alpha)).astype(np.float32)
                initializers[weight_name].CopyFrom(numpy_helper.from_array(weight * scale[:, None], weight_name))
                scale_name = f"{node.name}_smooth_inv_scale"
                graph.graph.initializer.append(numpy_helper.from_array((1.0 / scale).astype(np.float32), scale_name))
                scaled = f"{node.input[0]}_smoothed_for_{node.name}"
                nodes.append(
                    onnx.helper.make_node("Mul", [node.input[0], scale_name], [scaled], name=f"{node.name}_smooth")
                )
                node.input[0] = scaled
                smoothed.append(node.name)
        nodes.append(node)
    del graph.graph.node[:]
    graph.graph.node.extend(nodes)
    save_graph(graph, out)
    return smoothed
