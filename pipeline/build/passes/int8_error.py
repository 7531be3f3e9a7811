"""The error dynamic int8 adds at each quantizable node, simulated from one fp32 pass.

The quantize fallback keeps the nodes whose int8 error is largest in fp32. Quantizing the graph once per node
and running the development split each time ranks them by their effect on the output, but costs a quantization
of the whole model per node: minutes for a 100M-parameter encoder. This ranks them instead by the relative error
each node's output takes when its input and weight are rounded as ONNX Runtime's dynamic int8 rounds them
(activations per tensor, uint8 with a zero point; weights int8, symmetric, per output column where per_channel),
from the fp32 activations one pass over a few examples gives. The figure is local: what earlier nodes' rounding
does is not counted again downstream.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

# A graph serialized in memory must stay under protobuf's 2 GB.
_IN_MEMORY_LIMIT = 1_900_000_000


# Rows of each example's activation that the error is taken over (evenly spaced): enough to rank, and they keep
# the saturating product's pairwise array small.
ROWS = 32
# CPU flags with which int8 products sum in 32 bits (VNNI, AMX); without them, u8 x s8 pairs sum in 16 bits first.
WIDE_SUM_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def _activation(x: np.ndarray) -> tuple[np.ndarray, float, float]:
    """`x` as DynamicQuantizeLinear makes it: uint8 codes over [min(x, 0), max(x, 0)], its scale and zero point."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (high - low) / 255 or 1.0
    zero = float(np.clip(np.round(-low / scale), 0, 255))
    return np.clip(np.round(x / scale) + zero, 0, 255), scale, zero


def _weight(w: np.ndarray, per_channel: bool, reduce_range: bool, signed: bool) -> tuple:
    """`w` ([in, out]) as integer codes: int8 (symmetric) or uint8 (with a zero point), per output column or per
    tensor; (codes, scale, zero point)."""
    axis = 0 if per_channel else None
    if signed:
        levels = 63 if reduce_range else 127
        scale = np.abs(w).max(axis=axis, keepdims=True) / levels
        scale = np.where(scale > 0, scale, 1.0)
        return np.clip(np.round(w / scale), -levels, levels), scale, 0.0
    levels = 127 if reduce_range else 255
    low = np.minimum(w.min(axis=axis, keepdims=True), 0)
    scale = (np.maximum(w.max(axis=axis, keepdims=True), 0) - low) / levels
    scale = np.where(scale > 0, scale, 1.0)
    zero = np.round(-low / scale)
    return np.clip(np.round(w / scale) + zero, 0, levels), scale, zero


def _integer_product(a: np.ndarray, b: np.ndarray, saturate: bool) -> np.ndarray:
    """a @ b of integer codes, in float64 and exact; with `saturate`, as AVX2's u8 x s8 kernel sums: adjacent
    pairs of products in 16 bits, saturating, then in 32 bits."""
    if not saturate:
        # Through BLAS: every partial sum of 8-bit codes is an integer far below 2**53. numpy's integer matmul
        # has no BLAS: it took 46 s of all-mpnet-base-v2's 95 s int8 fallback.
        return a.astype(np.float64) @ b.astype(np.float64)
    if a.shape[1] % 2:
        a, b = np.pad(a, ((0, 0), (0, 1))), np.pad(b, ((0, 1), (0, 0)))
    # A row at a time, in float32 (a pair's sum is below 2**17, exact) and in place: 3 to 12 times faster than
    # the whole (rows, pairs, columns) array at once.
    a, b = a.astype(np.float32), b.astype(np.float32)
    even, odd = np.ascontiguousarray(b[0::2]), np.ascontiguousarray(b[1::2])
    pairs, other = np.empty_like(even), np.empty_like(even)
    out = np.empty((a.shape[0], b.shape[1]))
    for index, row in enumerate(a):
        np.multiply(row[0::2, None], even, out=pairs)
        np.multiply(row[1::2, None], odd, out=other)
        pairs += other
        np.clip(pairs, -32768, 32767, out=pairs)
        out[index] = pairs.sum(axis=0, dtype=np.float64)
    return out


def _rounded_product(x: np.ndarray, rows: np.ndarray, weight: tuple, saturate: bool) -> np.ndarray:
    """x[rows] @ w as dynamic int8 computes it (the activation's scale taken over all of `x`), back in float;
    `weight` is w as `_weight` rounds it."""
    xq, x_scale, x_zero = _activation(x)
    xq = xq[rows]
    wq, w_scale, w_zero = weight
    raw = _integer_product(xq, wq, saturate)
    # (xq - xz)(wq - wz) = xq wq - xz colsum(wq) - wz rowsum(xq) + K xz wz
    k = wq.shape[0]
    # The sums in float64: in float32, x_zero * colsum(wq) passes 2**24 and rounds.
    exact = raw - x_zero * wq.sum(0, dtype=np.float64) - w_zero * xq.sum(1, keepdims=True, dtype=np.float64)
    exact += k * x_zero * w_zero
    return exact * x_scale * w_scale


def _activations(source: Path, names: list[str], feeds: list[dict]) -> list[dict] | None:
    """The fp32 values of the tensors `names` on each of `feeds`, or None where the graph is too large to open in
    memory with them exposed."""
    import onnx
    import onnxruntime as ort

    model = onnx.load(str(source))
    if model.ByteSize() > _IN_MEMORY_LIMIT:
        return None
    outputs = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names if name not in outputs)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every exposed tensor
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    del model
    inputs = {i.name for i in session.get_inputs()}
    runs = (session.run(names, {k: v for k, v in feed.items() if k in inputs}) for feed in feeds)
    return [dict(zip(names, values, strict=True)) for values in runs]


def dynamic_int8_errors(source: Path, nodes: list, feeds: list[dict], settings, flags=frozenset()) -> list | None:
    """[{"node", "op_type", "error"}] for each of `nodes` (each with a constant weight as input 1), most sensitive
    first: the relative error of its product when its input and weight are rounded as dynamic int8 with
    `settings` (per_channel, reduce_range, weight_type) and multiplied as a host with CPU `flags` multiplies them
    (saturating 16-bit pair sums without VNNI), averaged over `feeds`. None where the graph is too large to
    simulate in memory (the caller measures another way)."""
    import onnx
    from onnx import numpy_helper

    values = _activations(source, sorted({n.input[0] for n in nodes}), feeds)
    if values is None:
        return None
    graph = onnx.load(str(source)).graph
    weights = {i.name: i for i in graph.initializer if i.name in {n.input[1] for n in nodes}}
    signed = settings.weight_type == "int8"
    saturate = signed and not set(WIDE_SUM_FLAGS) & set(flags)
    ranked = []
    for node in nodes:
        w = numpy_helper.to_array(weights[node.input[1]]).astype(np.float32)
        w = w.reshape(w.shape[0], -1)
        rounded_w = _weight(w, settings.per_channel, settings.reduce_range, signed)
        errors = []
        for example in values:
            x = example[node.input[0]].reshape(-1, w.shape[0]).astype(np.float32)
            rows = np.linspace(0, len(x) - 1, min(ROWS, len(x))).astype(int)
            exact = x[rows] @ w
            rounded = _rounded_product(x, rows, rounded_w, saturate)
            errors.append(float(np.linalg.norm(rounded - exact) / max(np.linalg.norm(exact), 1e-12)))
        ranked.append({"node": node.name, "op_type": node.op_type, "error": float(np.mean(errors))})
    return sorted(ranked, key=lambda s: -s["error"])
