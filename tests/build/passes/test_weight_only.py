"""The streaming weight-only pass writes what ONNX Runtime's MatMulNBitsQuantizer writes (same initializers, same
MatMulNBits nodes, same outputs), reads graphs with a data file, and holds one fp32 weight at a time."""

import json
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.build import onnx_files
from pipeline.build.inputs.targets import Quantize, load_target
from pipeline.build.manifest import Manifest
from pipeline.build.onnx_files import graph_files, load_graph, save_graph
from pipeline.build.passes.weight_only import quantize_weight_only
from pipeline.build.stages import checkpoint, export, optimize
from tests.tiny import make_decoder

HEAD = "/lm_head/MatMul"
UP = "/model/layers.0/mlp/up_proj+gate_proj/MatMul"  # packed by the optimize stage
DOWN = "/model/layers.1/mlp/down_proj/MatMul"


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    """A tiny Llama's optimized fp32 graph (fused QKV, GroupQueryAttention, the head on the last token)."""
    root = tmp_path_factory.mktemp("decoder")
    folder = make_decoder(root / "tiny-llama", "llama")
    manifest = Manifest("tiny-llama", str(folder), str(root / "cache"), "", "", "")
    target = load_target("cpu-int8-weights")
    for stage in (checkpoint.run, export.run, optimize.run):
        manifest = stage(manifest, target)
    return manifest.stage("optimize").output("model.onnx")


def _ort_pass(source, dest, bits, blocks, block_size, level, exclude):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=blocks == "symmetric", bits=bits, accuracy_level=level
    )
    quantizer = MatMulNBitsQuantizer(load_graph(source), nodes_to_exclude=list(exclude), algo_config=config)
    quantizer.process()
    quantizer.model.topological_sort()
    save_graph(quantizer.model.model, dest)


def _ort_quantized(source, dest, settings, exclude=(), wide=()):
    """ONNX Runtime's MatMulNBitsQuantizer alone: the body at `bits`, then the head and `wide` at `head_bits`."""
    names = {n.name for n in onnx.load(str(source)).graph.node if n.op_type == "MatMul"}
    wider = set(wide) | {HEAD}
    args = (settings.block_size, settings.accuracy_level)
    if settings.head_bits == settings.bits:
        _ort_pass(source, dest, settings.bits, settings.blocks, *args, exclude)
        return
    body = dest.with_name("ort-body.onnx")
    _ort_pass(source, body, settings.bits, settings.blocks, *args, set(exclude) | wider)
    _ort_pass(body, dest, settings.head_bits, settings.blocks, *args, names - wider)


def _contents(path) -> tuple[dict, list, dict]:
    """(initializers by name as (dtype, shape, bytes), nodes as sorted tuples, opsets) of a graph."""
    model = load_graph(path)
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    initializers = {name: (a.dtype.str, a.shape, a.tobytes()) for name, a in arrays.items()}
    nodes = sorted(
        (n.op_type, n.domain, n.name, tuple(n.input), tuple(n.output), tuple(sorted(map(str, n.attribute))))
        for n in model.graph.node
    )
    return initializers, nodes, {o.domain: o.version for o in model.opset_import}


def _outputs(path) -> list:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, 512, (2, 7))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in session.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros((2, i.shape[1], 0, i.shape[3]), np.float32)
    return session.run(None, feeds)


def _settings(bits, blocks, block_size, head_bits=8):
    return Quantize(
        mode="weight_only", bits=bits, blocks=blocks, block_size=block_size, accuracy_level=4, head_bits=head_bits
    )


def _assert_same(path, reference) -> None:
    got, expected = _contents(path), _contents(reference)
    assert got[0].keys() == expected[0].keys()
    assert [name for name in got[0] if got[0][name] != expected[0][name]] == []
    assert got[1:] == expected[1:]
    for a, b in zip(_outputs(path), _outputs(reference), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "bits, blocks, block_size, exclude, wide",
    [
        (8, "zero_point", 32, (), ()),
        (8, "symmetric", 128, (UP,), ()),
        (4, "zero_point", 32, (UP,), (DOWN,)),
        (4, "symmetric", 128, (), (DOWN,)),
    ],
)
def test_quantize_weight_only_writes_what_onnx_runtimes_quantizer_writes(
    decoder, tmp_path, bits, blocks, block_size, exclude, wide
):
    settings = _settings(bits, blocks, block_size)
    quantize_weight_only(decoder, tmp_path / "q.onnx", settings, exclude=exclude, wide=wide)
    _ort_quantized(decoder, tmp_path / "ort.onnx", settings, exclude, wide)
    _assert_same(tmp_path / "q.onnx", tmp_path / "ort.onnx")
    nodes = {n.name: n for n in onnx.load(str(tmp_path / "q.onnx")).graph.node}
    assert nodes[f"{HEAD}_Q8"].op_type == "MatMulNBits" and all(f"{n}_Q8" in nodes for n in wide)
    assert all(nodes[n].op_type == "MatMul" for n in exclude)
    # 2 layers x (qkv, o, up+gate, down), and the head
    assert sum(n.op_type == "MatMulNBits" for n in nodes.values()) == 9 - len(exclude)


def test_quantize_weight_only_reads_a_graph_whose_weights_are_in_a_data_file(decoder, tmp_path, monkeypatch):
    settings = _settings(4, "zero_point", 32)
    with monkeypatch.context() as patch:
        patch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)
        save_graph(load_graph(decoder), tmp_path / "external.onnx")
    assert len(graph_files(tmp_path / "external.onnx")) == 2
    quantize_weight_only(tmp_path / "external.onnx", tmp_path / "q.onnx", settings, wide=(DOWN,))
    assert graph_files(tmp_path / "q.onnx") == [tmp_path / "q.onnx"]  # it fits in one file once quantized
    quantize_weight_only(decoder, tmp_path / "single.onnx", settings, wide=(DOWN,))
    _assert_same(tmp_path / "q.onnx", tmp_path / "single.onnx")
    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)  # and writes a data file where it must
    quantize_weight_only(tmp_path / "external.onnx", tmp_path / "q2.onnx", settings, wide=(DOWN,))
    assert graph_files(tmp_path / "q2.onnx") == [tmp_path / "q2.onnx", tmp_path / "q2.onnx.data"]
    _assert_same(tmp_path / "q2.onnx", tmp_path / "single.onnx")


def test_quantize_weight_only_keeps_a_weight_another_node_reads(tmp_path):
    # The weight of `first` is also read by a Gather (a tied embedding): it stays, beside its blocks.
    rng = np.random.default_rng(0)
    weights = {f"w{i}": rng.standard_normal((64, 64)).astype(np.float32) for i in (1, 2)}
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="first"),
        helper.make_node("Gather", ["w1", "ids"], ["row"], name="embed"),
        helper.make_node("Add", ["h", "row"], ["s"], name="add"),
        helper.make_node("MatMul", ["s", "w2"], ["logits"], name="head"),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64]),
        helper.make_tensor_value_info("ids", TensorProto.INT64, [1]),
    ]
    output = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 64])
    initializers = [numpy_helper.from_array(w, name) for name, w in weights.items()]
    model = helper.make_model(helper.make_graph(nodes, "tied", inputs, [output], initializers))
    save_graph(model, tmp_path / "tied.onnx")
    settings = _settings(8, "zero_point", 32)
    quantize_weight_only(tmp_path / "tied.onnx", tmp_path / "q.onnx", settings)
    _ort_pass(tmp_path / "tied.onnx", tmp_path / "ort.onnx", 8, "zero_point", 32, 4, ())
    names = {t.name for t in onnx.load(str(tmp_path / "q.onnx")).graph.initializer}
    assert "w1" in names and "w2" not in names
    got, expected = _contents(tmp_path / "q.onnx"), _contents(tmp_path / "ort.onnx")
    assert got == expected


PEAK = """
import json, sys
from pathlib import Path

import onnx, onnxruntime.quantization.matmul_nbits_quantizer
from pipeline.build.passes.weight_only import quantize_weight_only
from pipeline.build.inputs.targets import Quantize

def memory(key):  # bytes; the high-water mark of this process alone (ru_maxrss keeps the forking parent's)
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

base = memory("VmRSS:")
settings = Quantize(mode="weight_only", bits=4, blocks="zero_point", block_size=32, accuracy_level=4, head_bits=8)
quantize_weight_only(Path(sys.argv[1]), Path(sys.argv[2]), settings)
print(json.dumps({"base": base, "peak": memory("VmHWM:")}))
"""


def test_quantize_weight_only_holds_far_less_than_the_fp32_weights(tmp_path, monkeypatch):
    # Eight 16 MiB fp32 weights in a data file, the last (the head) at 8 bits. ONNX Runtime's quantizer, on the
    # whole graph, peaks at about 2.5 times its fp32 bytes; streamed, at one weight and the int4 result (0.4).
    rng = np.random.default_rng(0)
    layers, k, n = 8, 1024, 4096
    nodes, initializers, x = [], [], "x"
    for i in range(layers):
        weight = rng.standard_normal((k, n), dtype=np.float32)
        initializers.append(numpy_helper.from_array(weight.reshape(n, k) if i % 2 else weight, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [x, f"w{i}"], [f"h{i}" if i < layers - 1 else "logits"], name=f"m{i}"))
        x = f"h{i}"
    graph = helper.make_graph(
        nodes,
        "stack",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, k])],
        initializers,
    )
    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)
    save_graph(helper.make_model(graph), tmp_path / "stack.onnx")
    fp32 = sum(f.stat().st_size for f in graph_files(tmp_path / "stack.onnx"))
    done = subprocess.run(
        [sys.executable, "-c", PEAK, str(tmp_path / "stack.onnx"), str(tmp_path / "q.onnx")],
        capture_output=True,
        text=True,
        check=True,
    )
    memory = json.loads(done.stdout.splitlines()[-1])
    assert memory["peak"] - memory["base"] < 0.75 * fp32


def test_quantize_weight_only_refuses_a_shared_weight_planned_at_two_bits(tmp_path):
    from pipeline.errors import QuantizationError

    weight = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="body"),
        helper.make_node("MatMul", ["h", "w"], ["logits"], name="head"),
    ]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "shared",
        [value("x", TensorProto.FLOAT, [1, 64])],
        [value("logits", TensorProto.FLOAT, [1, 64])],
        [weight],
    )
    save_graph(helper.make_model(graph), tmp_path / "shared.onnx")
    with pytest.raises(QuantizationError, match=r"'body' and 'head' share the weight 'w' but are planned at 4 and 8"):
        quantize_weight_only(tmp_path / "shared.onnx", tmp_path / "q.onnx", _settings(4, "symmetric", 32))
    quantize_weight_only(tmp_path / "shared.onnx", tmp_path / "q.onnx", _settings(8, "symmetric", 32))
    nodes = onnx.load(str(tmp_path / "q.onnx")).graph.node
    assert [n.input[1:] for n in nodes] == [["w_Q8", "w_scales"]] * 2  # one set of blocks, read by both


def test_minimum_blocks_and_a_wider_head_are_written_in_one_pass_as_two_passes_wrote_them(decoder, tmp_path):
    from pipeline.build.onnx_files import load_structure
    from pipeline.build.passes.block_minimum import quantize_with_block_minimum
    from pipeline.build.passes.weight_only import Blocks, blocks_from_fp32

    quantize_weight_only(decoder, tmp_path / "q.onnx", _settings(4, "minimum", 32), exclude=(UP,), wide=(DOWN,))
    body = tmp_path / "body.onnx"  # the body in minimum blocks, then the head and DOWN in symmetric 8-bit blocks
    quantize_with_block_minimum(decoder, body, 32, 4, exclude=[UP, HEAD, DOWN])
    blocks_from_fp32(
        load_structure(body), body, tmp_path / "two.onnx", dict.fromkeys([HEAD, DOWN], Blocks(8, True, 32, 4))
    )
    _assert_same(tmp_path / "q.onnx", tmp_path / "two.onnx")
    nodes = {n.name: n for n in onnx.load(str(tmp_path / "q.onnx")).graph.node}
    assert nodes[f"{HEAD}_Q8"].op_type == nodes[f"{DOWN}_Q8"].op_type == "MatMulNBits" and nodes[UP].op_type == "MatMul"
