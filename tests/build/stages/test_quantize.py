import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pipeline.build.accuracy.metrics import development_margin
from pipeline.build.inputs.data import read_texts
from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Manifest, candidate_model
from pipeline.build.passes.int8 import quantizable_nodes
from pipeline.build.passes.smoothing import activation_absmax, smooth
from pipeline.build.search import fallback, int8
from pipeline.build.stages import checkpoint, export, optimize, quantize
from pipeline.build.table import build
from pipeline.errors import AccuracyError, TargetError
from tests.conftest import SMALL_TEXTS, write_target
from tests.tiny import make_decoder


@pytest.fixture
def fused(tiny_bert, tmp_path):
    target = load_target("cpu-avx2-dynamic")
    manifest = Manifest("m", str(tiny_bert), str(tmp_path / "cache"), "", "", "")
    for stage in (checkpoint.run, export.run, optimize.run):
        manifest = stage(manifest, target)
    return manifest, target


def test_smooth_keeps_fp32_outputs_and_rescales_every_node(fused, tmp_path):
    manifest, target = fused
    source = manifest.last_model().output("model.onnx")
    model = candidate_model(manifest, target, source)
    nodes = quantizable_nodes(onnx.load(str(source)), target.quantize.op_types)
    ranges = activation_absmax(source, nodes, model, SMALL_TEXTS, 4)
    assert all(r.ndim == 1 and (r > 0).all() for r in ranges.values())
    smoothed = smooth(source, tmp_path / "smoothed.onnx", ranges, target.quantize.op_types, 0.75)
    assert len(smoothed) == len(nodes) == 4 * 2  # per layer: Attention, attention output, FFN in and out
    ops = [n.op_type for n in onnx.load(str(tmp_path / "smoothed.onnx")).graph.node]
    assert ops.count("Mul") >= len(nodes)
    after = candidate_model(manifest, target, tmp_path / "smoothed.onnx").run(SMALL_TEXTS)
    np.testing.assert_allclose(after, model.run(SMALL_TEXTS), atol=1e-4)


def test_quantize_dynamic_writes_integer_matmuls(tiny_bert, texts_file, calibration_file, build_dirs):
    manifest = build(tiny_bert, "cpu-avx2-dynamic", validation=texts_file, calibration=calibration_file, **build_dirs)
    graph = onnx.load(manifest.published.path + "/model.onnx")
    ops = {n.op_type for n in graph.graph.node}
    assert {"MatMulInteger", "DynamicQuantizeLinear"} & ops or "DynamicQuantizeMatMul" in ops
    assert "QAttention" in ops
    metrics = manifest.stage("quantize").metrics
    assert metrics["quantized_nodes"] == 8 and metrics["fp32_nodes"] == [] and metrics["smoothed_nodes"] == 8
    ort.InferenceSession(manifest.published.path + "/model.onnx", providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("ranking", ["measured", "simulated"])
def test_quantize_falls_back_to_mixed_precision_when_int8_misses(
    tiny_bert, texts_file, calibration_file, build_dirs, tmp_path, monkeypatch, ranking
):
    if ranking == "simulated":  # as for a graph too large to quantize once per node
        monkeypatch.setattr(fallback, "MEASURED_SENSITIVITY_BYTES", 0)
    plain = build(tiny_bert, "cpu-avx2-dynamic", validation=texts_file, calibration=calibration_file, **build_dirs)
    plain_diff = plain.stage("quantize").metrics["candidates"][0]["max_abs_diff"]
    # The development gate narrows an extreme by development_margin(n): undo it so that the split must reach 0.7x.
    development = plain.stage("quantize").metrics["development_examples"]
    strict = write_target(
        tmp_path,
        "strict",
        accuracy__max_abs_diff=plain_diff * 0.7 / (1 - development_margin(development)),
        quantize__fallback_headroom=0.0,
        quantize__max_fp32_nodes=6,
    )
    # The stages up to quantize alone: the fallback is judged on the development split (2 of the 8 calibration
    # texts), and a threshold this close to plain int8's may miss on the held-out texts in validation.
    manifest = Manifest(
        "tiny-bert", str(tiny_bert), str(build_dirs["cache_dir"]), "", str(texts_file), str(calibration_file)
    )
    for stage in (checkpoint.run, export.run, optimize.run, quantize.run):
        manifest = stage(manifest, load_target(str(strict)))
    metrics = manifest.stage("quantize").metrics
    tried = metrics["candidates"]
    chosen = next(c for c in tried if c["chosen"])
    assert tried[0]["passed"] is False and chosen["passed"] is True
    assert chosen["fp32_nodes"] == len(metrics["fp32_nodes"]) and 1 <= len(metrics["fp32_nodes"]) <= 6
    assert all(not c["passed"] for c in tried if c["fp32_nodes"] < chosen["fp32_nodes"])  # the fewest that pass
    assert tried[1]["fp32_nodes"] == 6  # the widest first: had it missed, no fewer would be tried
    assert metrics["sensitivity_method"] == ranking
    assert len(metrics["sensitivity"]) == 8
    assert metrics["fp32_nodes"][0] == metrics["sensitivity"][0]["node"]  # the most sensitive goes first
    assert chosen["max_abs_diff"] <= plain_diff * 0.7 < tried[0]["max_abs_diff"]


def test_quantize_keeps_the_smoothing_alpha_nearest_its_gate(
    tiny_bert, texts_file, calibration_file, tmp_path, monkeypatch
):
    target = write_target(tmp_path, "alphas", quantize__smooth_alphas=[0.2, 0.9])
    written = []  # each int8 graph the stage writes (the real pass, counted)
    for name in ("quantize_static", "quantize_dynamic"):
        real = getattr(int8, name)
        monkeypatch.setattr(int8, name, lambda *a, real=real, **k: written.append(a[1]) or real(*a, **k))
    manifest = Manifest(
        "tiny-bert", str(tiny_bert), str(tmp_path / "cache"), "", str(texts_file), str(calibration_file)
    )
    for stage in (checkpoint.run, export.run, optimize.run, quantize.run):
        manifest = stage(manifest, load_target(str(target)))
    metrics = manifest.stage("quantize").metrics
    scan = metrics["smooth_alpha_scan"]
    assert [row["alpha"] for row in scan] == [0.2, 0.9] and scan[0]["cosine_min"] != scan[1]["cosine_min"]
    best = max(scan, key=lambda row: row["closeness"])
    assert [row["chosen"] for row in scan] == [row is best for row in scan]
    assert metrics["smooth_alpha"] == best["alpha"] and metrics["smoothed_nodes"] == 8
    # The graph the stage goes on with (no node in fp32) is the one the scan made and judged for the chosen alpha:
    # one graph an alpha, then one more for each fallback attempt after the first.
    assert metrics["candidates"][0]["fp32_nodes"] == 0
    assert metrics["candidates"][0]["cosine_min"] == best["cosine_min"]
    assert len(written) == len(scan) + len(metrics["candidates"]) - 1


def test_quantize_raises_when_fallback_budget_is_spent(tiny_bert, texts_file, calibration_file, build_dirs, tmp_path):
    strict = write_target(tmp_path, "strict", accuracy__max_abs_diff=1e-9, quantize__max_fp32_nodes=2)
    with pytest.raises(AccuracyError, match="even with 2 of 8 quantizable nodes kept in fp32"):
        build(tiny_bert, str(strict), validation=texts_file, calibration=calibration_file, **build_dirs)
    assert not list(build_dirs["artifacts_dir"].rglob("model.onnx"))


def test_quantize_fallback_keeps_one_node_int8_at_least(tiny_bert, texts_file, calibration_file, build_dirs, tmp_path):
    strict = write_target(tmp_path, "strict", accuracy__max_abs_diff=1e-12, quantize__max_fp32_nodes=64)
    with pytest.raises(AccuracyError, match=r"even with 7 of 8 quantizable nodes kept in fp32.*\(cpu-fp32\)"):
        build(tiny_bert, str(strict), validation=texts_file, calibration=calibration_file, **build_dirs)


def test_quantize_decoder_falls_back_until_its_gate_is_met(texts_file, calibration_file, build_dirs, tmp_path):
    folder = make_decoder(tmp_path / "tiny-llama", "llama")
    # A random tiny LM's logits are nearly flat, so greedy equality depends on near-ties and on the host's int8
    # kernels: the gate is on the next-token logits' max abs difference alone, set below plain int8's so that the
    # fallback must keep nodes in fp32. The stages up to quantize alone, on the development split.
    loose = {"accuracy__greedy_match": 0.0, "accuracy__top1_agreement": 0.0, "accuracy__max_probability_diff": 1.0}

    def quantized(name: str, **overrides) -> dict:
        target = load_target(str(write_target(tmp_path, name, quantize__fallback_headroom=0.0, **loose, **overrides)))
        manifest = Manifest(name, str(folder), str(build_dirs["cache_dir"]), "", str(texts_file), str(calibration_file))
        for stage in (checkpoint.run, export.run, optimize.run, quantize.run):
            manifest = stage(manifest, target)
        return manifest.stage("quantize")

    first = quantized("plain", quantize__max_fp32_nodes=0).metrics
    plain = first["candidates"][0]
    # The development gate narrows an extreme by development_margin(n): undo it so that the split must reach 0.7x.
    # A split this small is filled up from the repository's own text.
    plain_examples = first["development_examples"]
    assert plain_examples == len(read_texts(calibration_file, "calibration")) // 4 + first["development_filled"]
    margin = development_margin(plain_examples)
    record = quantized(
        "wide", quantize__max_fp32_nodes=64, accuracy__max_abs_diff=plain["max_abs_diff"] * 0.7 / (1 - margin)
    )
    metrics = record.metrics
    assert metrics["development_examples"] == plain_examples
    tried = metrics["candidates"]
    chosen = next(c for c in tried if c["chosen"])
    assert len(tried) > 1 and not tried[0]["passed"] and chosen["passed"]  # it fell back, and the gate was met
    assert all(not c["passed"] for c in tried if c["fp32_nodes"] < chosen["fp32_nodes"])  # the fewest that pass
    assert chosen["max_abs_diff"] <= plain["max_abs_diff"] * 0.7 < tried[0]["max_abs_diff"]
    assert metrics["fp32_nodes"] and metrics["quantized_nodes"] >= 1
    errors = [s["error"] for s in metrics["sensitivity"]]
    assert errors == sorted(errors, reverse=True) and metrics["fp32_nodes"][0] == metrics["sensitivity"][0]["node"]
    ops = {n.op_type for n in onnx.load(str(record.output("model.onnx"))).graph.node}
    assert "DynamicQuantizeMatMul" in ops or "MatMulInteger" in ops


def test_quantize_refuses_static_int8_for_decoders(tiny_gpt2, texts_file, calibration_file, build_dirs):
    with pytest.raises(TargetError, match="static int8, which this pipeline does not do for decoders"):
        build(tiny_gpt2, "cpu-avx2-static", validation=texts_file, calibration=calibration_file, **build_dirs)
    assert not list(build_dirs["artifacts_dir"].rglob("model.onnx"))


def test_quantize_honours_excluded_op_types(tiny_bert, texts_file, calibration_file, build_dirs, tmp_path):
    target = write_target(tmp_path, "noattn", quantize__exclude_op_types=["Attention"])
    manifest = build(tiny_bert, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    ops = {n.op_type for n in onnx.load(manifest.published.path + "/model.onnx").graph.node}
    assert "Attention" in ops and "QAttention" not in ops


@pytest.mark.parametrize("method", ["minmax", "entropy", "percentile"])
def test_quantize_static_qoperator_with_each_calibration_method(
    method, tiny_bert, texts_file, calibration_file, build_dirs, tmp_path
):
    target = write_target(tmp_path, f"static-{method}", quantize__mode="static", quantize__calibration_method=method)
    manifest = build(tiny_bert, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    ops = {n.op_type for n in onnx.load(manifest.published.path + "/model.onnx").graph.node}
    assert {"QLinearMatMul", "QAttention"} & ops and "DynamicQuantizeLinear" not in ops
    metrics = manifest.stage("quantize").metrics
    assert metrics["mode"] == "static" and metrics["calibration_method"] == method
    assert manifest.stage("validate").metrics["cosine_min"] >= 0.99
    assert all(c["latency_ms_batch_1"] > 0 for c in metrics["candidates"])


def test_quantize_static_qdq_writes_quantize_dequantize_pairs(
    tiny_bert, texts_file, calibration_file, build_dirs, tmp_path
):
    target = write_target(tmp_path, "static-qdq", quantize__mode="static", quantize__format="qdq")
    manifest = build(tiny_bert, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    ops = [n.op_type for n in onnx.load(manifest.published.path + "/model.onnx").graph.node]
    assert ops.count("QuantizeLinear") > 0 and ops.count("DequantizeLinear") >= ops.count("QuantizeLinear")


def test_quantize_static_same_inputs_give_same_artifact(tiny_bert, texts_file, calibration_file, tmp_path):
    target = write_target(tmp_path, "static", quantize__mode="static")
    files = []
    for run in ("one", "two"):
        manifest = build(
            tiny_bert,
            str(target),
            validation=texts_file,
            calibration=calibration_file,
            artifacts_dir=tmp_path / run / "a",
            cache_dir=tmp_path / run / "c",
        )
        published = json.loads(open(manifest.published.path + "/manifest.json").read())
        files.append({k: v for k, v in published["files"].items() if k != "report.json"})
        assert published["stages"]["quantize"]["config"]["calibration"]
    assert files[0] == files[1]


def test_calibration_reader_streams_fixed_width_batches(fused):
    from pipeline.build.passes.int8 import calibration_reader

    manifest, target = fused
    model = candidate_model(manifest, target)
    reader = calibration_reader(model, SMALL_TEXTS, 5)
    assert len(reader) == 3
    widths = {feeds["input_ids"].shape[1] for feeds in iter(reader.get_next, None)}
    assert len(widths) == 1  # every batch padded to one length
    reader.set_range(1, 2)
    assert reader.get_next()["input_ids"].shape[0] == 5 and reader.get_next() is None


def test_calibration_reader_ignores_the_artifacts_shape_buckets(fused):
    from pipeline.build.passes.int8 import calibration_reader

    manifest, target = fused
    model = candidate_model(manifest, target)
    longest = max(len(e.ids) for e in model.encode(SMALL_TEXTS))
    model.spec["shape_buckets"] = [longest + 7]  # a published spec's plan: a bucket wider than the texts
    reader = calibration_reader(model, SMALL_TEXTS, 5)
    assert {feeds["input_ids"].shape[1] for feeds in iter(reader.get_next, None)} == {longest}


def test_weight_only_int8_puts_every_matmul_weight_in_matmulnbits_and_records_the_decoder_gate(
    texts_file, calibration_file, build_dirs, tmp_path
):
    folder = make_decoder(tmp_path / "tiny-llama", "llama")
    # A random tiny LM's logits are nearly flat: the gate is loose here; SmolLM2 (slow tier) holds the real one.
    target = write_target(
        tmp_path,
        "woq",
        base="cpu-int8-weights",
        accuracy__teacher_top1_agreement=0.0,
        accuracy__perplexity_ratio=10.0,
        accuracy__greedy_prefix_agreement=0.0,
    )
    manifest = build(folder, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    graph = onnx.load(manifest.published.path + "/model.onnx")
    weights = {i.name for i in graph.graph.initializer}
    assert [n.op_type for n in graph.graph.node].count("MatMulNBits") >= 1
    assert not [n.name for n in graph.graph.node if n.op_type == "MatMul" and n.input[1] in weights]  # none in fp32
    bits = {a.i for n in graph.graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "bits"}
    assert bits == {8}
    # The target asks for zero-point blocks: every MatMulNBits has its zero points.
    assert all(len(n.input) > 3 and n.input[3] for n in graph.graph.node if n.op_type == "MatMulNBits")
    validation = json.loads((Path(manifest.published.path) / "manifest.json").read_text())["validation"]
    assert {"teacher_top1_agreement", "perplexity_ratio", "greedy_prefix_agreement"} <= set(validation)
    assert [r["metric"] for r in validation["verdict"]] == [
        "greedy_prefix_agreement",
        "teacher_top1_agreement",
        "perplexity_ratio",
    ]


@pytest.mark.parametrize("blocks", ["symmetric", "minimum"])
def test_weight_only_int4_keeps_the_lm_head_at_8_bits(blocks, texts_file, calibration_file, build_dirs, tmp_path):
    folder = make_decoder(tmp_path / "tiny-llama", "llama")
    target = write_target(
        tmp_path,
        "woq4",
        base="cpu-int8-weights",
        quantize__bits=4,
        quantize__blocks=blocks,
        accuracy__teacher_top1_agreement=0.0,
        accuracy__perplexity_ratio=10.0,
        accuracy__greedy_prefix_agreement=0.0,
    )
    manifest = build(folder, str(target), validation=texts_file, calibration=calibration_file, **build_dirs)
    nodes = onnx.load(manifest.published.path + "/model.onnx").graph.node
    bits = {n.name: next(a.i for a in n.attribute if a.name == "bits") for n in nodes if n.op_type == "MatMulNBits"}
    [head] = [n.name for n in nodes if "logits" in n.output]
    assert bits.pop(head) == 8 and set(bits.values()) == {4} and len(bits) == 2 * 4  # qkv, o, up+gate, down
    assert sum(n.op_type == "Add" and n.name.endswith("/Add") for n in nodes) == (8 if blocks == "minimum" else 0)


def test_build_says_in_one_line_what_a_small_calibration_file_risks(tiny_bert, texts_file, build_dirs, tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    small = tmp_path / "small.txt"
    small.write_text("\n".join(f"calibration sentence {i} about the weather." for i in range(40)) + "\n")
    args = ["build", "--model", str(tiny_bert), "--target", "cpu-avx2-static", "--validation", str(texts_file)]
    args += ["--calibration", str(small), "--artifacts-dir", str(build_dirs["artifacts_dir"])]
    out = CliRunner().invoke(main, [*args, "--cache-dir", str(build_dirs["cache_dir"])])
    assert out.exit_code == 0, out.output
    [line] = [line for line in out.output.splitlines() if line.startswith("note: the calibration file")]
    assert "54 of the repository's own texts judged the candidates" in line and "give 256 or more" in line
