"""`pipeline bench --profile`: per-op time by class from each engine's own profiler, FLOPs counted from the graph
as it ran, and the host's GEMM limit measured through the same engine."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.bench.gemm_limit import gemm_limit
from pipeline.bench.op_times import onnxruntime_node_times, op_class, openvino_node_times
from pipeline.bench.profile import profile
from pipeline.cli import main

SMALL = {"runs": 6, "warmups": 2, "limit_shapes": ((128, 64, 96),), "limit_runs": 2}


def _one_matmul(batch: int, seq: int, k: int, n: int):
    from onnx import TensorProto, helper, numpy_helper

    weight = numpy_helper.from_array(np.random.default_rng(0).standard_normal((k, n), dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="projection")],
        "one-matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", n])],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_node_flops_of_a_one_matmul_graph_equal_2mnk(engine, tmp_path):
    import onnx

    batch, seq, k, n = 3, 20, 48, 80
    model = _one_matmul(batch, seq, k, n)
    feeds = {"x": np.ones((batch, seq, k), dtype=np.float32)}
    if engine == "onnxruntime":
        import onnxruntime as ort

        times = onnxruntime_node_times(model.SerializeToString(), ort.SessionOptions(), feeds, runs=2, warmups=1)
    else:
        onnx.save(model, tmp_path / "one-matmul.onnx")
        # fp32 asked for: OpenVINO's default on a CPU with BF16 (AVX512-BF16, AMX) is bf16
        config = {"INFERENCE_PRECISION_HINT": "f32"}
        times = openvino_node_times(tmp_path / "one-matmul.onnx", config, feeds, runs=2, warmups=1)
    assert len(times["runs"]) == (2 if engine == "onnxruntime" else 1) and len(times["run_us"]) == 2
    assert all(us > 0 for us in times["run_us"])
    for run in times["runs"]:
        [gemm] = [node for node in run if node["class"] == "gemm"]
        assert gemm["flops"] == 2 * batch * seq * k * n and gemm["precision"] == "fp32" and gemm["us"] >= 0


def test_a_gemm_openvino_runs_in_bf16_is_counted_as_bf16(tmp_path):
    import onnx
    import openvino as ov

    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no BF16 (OpenVINO's OPTIMIZATION_CAPABILITIES): no bf16 GEMM to count")
    onnx.save(_one_matmul(2, 16, 64, 32), tmp_path / "one-matmul.onnx")
    feeds = {"x": np.ones((2, 16, 64), dtype=np.float32)}
    times = openvino_node_times(tmp_path / "one-matmul.onnx", {"INFERENCE_PRECISION_HINT": "bf16"}, feeds, runs=2)
    [gemm] = [node for node in times["runs"][0] if node["class"] == "gemm"]
    assert gemm["precision"] == "bf16" and gemm["flops"] == 2 * 2 * 16 * 64 * 32


@pytest.mark.parametrize(
    ("op", "cls"),
    [
        ("MatMul", "gemm"),
        ("DynamicQuantizeMatMul", "gemm"),
        ("FullyConnectedQuantizedLegacy", "gemm"),
        ("Attention", "attention"),
        ("ScaledDotProductAttention", "attention"),
        ("SkipLayerNormalization", "norm"),
        ("MVN", "norm"),
        ("Reorder", "reorder"),
        ("Transpose", "reorder"),
        ("DynamicQuantizeLinear", "quantize"),
        ("FakeQuantize", "quantize"),
        ("FastGelu", "other"),
    ],
)
def test_op_class_groups_both_engines_op_types(op, cls):
    assert op_class(op) == cls


@pytest.mark.parametrize("engine", ["onnxruntime", "openvino"])
def test_gemm_limit_measures_each_precision_the_host_allows_and_names_what_it_skips(engine):
    result = gemm_limit(engine, ("fp32", "int8", "bf16"), shapes=((128, 64, 96),), runs=2)
    assert {"fp32", "int8"} <= set(result["limits"])
    assert all(row["flops"] == 2 * 128 * 64 * 96 and row["gflops_per_s"] > 0 for row in result["rows"])
    # The int8 graph really runs on int8 kernels, not on an fp32 fallback.
    assert {tuple(row["kernels"]) for row in result["rows"] if row["precision"] == "int8"} == {("int8",)}
    assert set(result["limits"]) | set(result["skipped"]) == {"fp32", "int8", "bf16"}


@pytest.mark.parametrize("which", ["published_fp32", "published_openvino"])
def test_profile_classes_sum_to_the_runs_time_and_gemm_is_counted(which, request, tmp_path):
    artifact = request.getfixturevalue(which)
    results = profile(artifact, tmp_path, **SMALL)
    assert results["engine"] == ("openvino" if which == "published_openvino" else "onnxruntime")
    assert [(s["batch"], s["seq"]) for s in results["shapes"]] == [(1, 128), (32, 128)]
    for shape in results["shapes"]:
        classes = shape["classes"]
        total = sum(c["ms"] for c in classes.values())
        assert total == pytest.approx(shape["op_ms"]) and 0.5 < shape["coverage"] <= 1.2
        if shape["batch"] == 32:  # past the fixed cost of an inference, which no node holds (0.1 ms on OpenVINO)
            assert shape["coverage"] >= 0.8
        assert classes["gemm"]["nodes"] > 0 and classes["gemm"]["ms"] > 0 and classes["gemm"]["flops"] > 0
        gemm = shape["gemm"]
        assert gemm["precisions"] == ["fp32"] and gemm["gflops_per_s"] > 0 and gemm["share_of_limit"] > 0
    written = json.loads((tmp_path / "profile.json").read_text())
    assert written["shapes"] == results["shapes"] and "| b32 x 128 | gemm |" in (tmp_path / "profile.md").read_text()


def test_cli_bench_profile_writes_profile_json_and_prints_the_table(published_fp32, tmp_path):
    result = CliRunner().invoke(main, ["bench", str(published_fp32), "--profile", "--quick", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "| b1 x 128 | gemm |" in result.output and "share of the limit" in result.output
    assert json.loads((tmp_path / "profile.json").read_text())["shapes"][1]["batch"] == 32


def test_cli_bench_profile_refuses_a_decoder_in_one_line(published_gpt2, tmp_path):
    result = CliRunner().invoke(main, ["bench", str(published_gpt2), "--profile", "--out", str(tmp_path)])
    assert result.exit_code != 0 and not (tmp_path / "profile.json").exists()
    [line] = result.output.strip().splitlines()
    assert "is a decoder; --profile profiles encoders" in line
