"""The host's measured GEMM limit: achieved GFLOP/s of large MatMuls per precision, through the engines themselves.

Each shape (M, K, N) is one graph, activations [M, K] times constant weights [K, N], timed by the engine's own
profiler as the artifact's profile is: only the GEMM-class nodes' time counts, so the quantization of activations
that int8 needs is not in it. The best shape of a precision is the host's limit for it.

    fp32: ONNX Runtime MatMul, or OpenVINO MatMul (its FullyConnected)
    int8: ONNX Runtime MatMulInteger (uint8 x int8), or OpenVINO MatMul between FakeQuantize inputs (NNCF's scheme)
    bf16: OpenVINO MatMul with INFERENCE_PRECISION_HINT bf16, where the CPU has AVX512-BF16 or AMX-BF16
"""

from __future__ import annotations

import numpy as np

from pipeline.bench.op_times import onnxruntime_node_times, openvino_node_times

# A batch of 32 rows of 128 tokens through MiniLM's projections (384 -> 1536 -> 384), and a large square GEMM.
SHAPES = ((4096, 384, 1536), (4096, 1536, 384), (2048, 2048, 2048))
BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def _ort_graph(m: int, k: int, n: int, precision: str) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    if precision == "int8":
        weight = numpy_helper.from_array(rng.integers(-127, 128, (k, n), dtype=np.int8), "w")
        node = helper.make_node("MatMulInteger", ["x", "w"], ["y"], name="gemm")
        types = (TensorProto.UINT8, TensorProto.INT32)
    else:
        weight = numpy_helper.from_array(rng.standard_normal((k, n), dtype=np.float32), "w")
        node = helper.make_node("MatMul", ["x", "w"], ["y"], name="gemm")
        types = (TensorProto.FLOAT, TensorProto.FLOAT)
    graph = helper.make_graph(
        [node],
        "gemm",
        [helper.make_tensor_value_info("x", types[0], [m, k])],
        [helper.make_tensor_value_info("y", types[1], [m, n])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _openvino_graph(m: int, k: int, n: int, precision: str):
    import openvino as ov
    from openvino import opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([m, k], ov.Type.f32, name="x")
    w = ops.constant(rng.standard_normal((k, n), dtype=np.float32))
    a, b = x, w
    if precision == "int8":
        # NNCF's symmetric scheme: activations in 256 levels, weights in 255; the CPU plugin then runs the MatMul
        # on int8 kernels (FullyConnectedQuantized), where a 256-level weight would keep it in fp32.
        def fake_quantize(node, low, high, levels):
            low, high = ops.constant(np.float32(low)), ops.constant(np.float32(high))
            return ops.fake_quantize(node, low, high, low, high, levels)

        a, b = fake_quantize(x, -4.0 * 128 / 127, 4.0, 256), fake_quantize(w, -4.0, 4.0, 255)
    y = ops.matmul(a, b, False, False)
    return ov.Model([y], [x], "gemm")


def _measure(engine: str, shape: tuple, precision: str, threads: int, runs: int) -> dict:
    m, k, n = shape
    if engine == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        dtype = np.uint8 if precision == "int8" else np.float32
        feeds = {"x": np.random.default_rng(1).integers(0, 255, (m, k)).astype(dtype)}
        profile = onnxruntime_node_times(_ort_graph(m, k, n, precision), options, feeds, runs, warmups=1)
    else:
        config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": str(threads)}
        config["INFERENCE_PRECISION_HINT"] = "bf16" if precision == "bf16" else "f32"
        feeds = {"x": np.random.default_rng(1).standard_normal((m, k), dtype=np.float32)}
        profile = openvino_node_times(_openvino_graph(m, k, n, precision), config, feeds, runs, warmups=1)
    per_run = [[r for r in run if r["class"] == "gemm"] for run in profile["runs"]]
    times = sorted(sum(r["us"] for r in run) for run in per_run)
    flops = sum(r["flops"] or 0 for r in per_run[0])
    median_us = float(np.median(times))
    return {
        "engine": engine,
        "precision": precision,
        "m": m,
        "k": k,
        "n": n,
        "flops": flops,
        "median_ms": median_us / 1000,
        "gflops_per_s": flops / median_us / 1000 if median_us > 0 else 0.0,
        "kernels": sorted({r["precision"] or "?" for r in per_run[0]}),
    }


def skipped_precisions(engine: str, flags: frozenset[str] | None, openvino: bool) -> dict[str, str]:
    """{precision: why it is not measured} for this engine and host."""
    skipped = {}
    if not openvino:
        skipped["bf16"] = "OpenVINO is not installed (onnxruntime's CPU provider has no bf16 GEMM)"
    elif flags is not None and not set(BF16_FLAGS) & flags:
        skipped["bf16"] = f"the CPU has neither {' nor '.join(BF16_FLAGS)}"
    elif flags is None:
        skipped["bf16"] = "the CPU's flags cannot be read"
    if engine == "openvino" and not openvino:
        skipped["fp32"] = skipped["int8"] = "OpenVINO is not installed"
    return skipped


def gemm_limit(
    engine: str,
    precisions=("fp32", "int8", "bf16"),
    shapes=SHAPES,
    threads: int = 0,
    runs: int = 3,
) -> dict:
    """The host's GEMM limit through `engine` ("onnxruntime" or "openvino"; bf16 always through OpenVINO): every
    (shape, precision) measured, the best GFLOP/s per precision as `limits`, and `skipped` {precision: why}."""
    from pipeline.runtime.host import cpu_flags, kernel_class, usable_cores

    threads = threads or usable_cores()
    try:
        import openvino  # noqa: F401

        has_openvino = True
    except ImportError:
        has_openvino = False
    flags = cpu_flags()
    skipped = {p: why for p, why in skipped_precisions(engine, flags, has_openvino).items() if p in precisions}
    rows = []
    for precision in precisions:
        if precision in skipped:
            continue
        through = "openvino" if precision == "bf16" else engine
        rows += [_measure(through, tuple(shape), precision, threads, runs) for shape in shapes]
    limits = {}
    for row in rows:
        best = limits.get(row["precision"])
        if best is None or row["gflops_per_s"] > best["gflops_per_s"]:
            limits[row["precision"]] = {k: row[k] for k in ("engine", "m", "k", "n", "gflops_per_s")}
    return {"kernel_class": kernel_class(flags), "threads": threads, "rows": rows, "limits": limits, "skipped": skipped}
