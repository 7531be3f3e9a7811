"""Graph files: one file where the graph fits, else the graph plus `<name>.data`; hostile data locations refused."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pipeline.build import onnx_files
from pipeline.build.onnx_files import copy_graph, graph_files, load_graph, move_graph, save_graph, save_if_small
from pipeline.errors import ExportError

X = np.arange(8, dtype=np.float32).reshape(1, 8)


def _graph():
    """y = x @ W + b: W (8x64 fp32, 2 KiB) goes to a data file when forced, b (4 bytes) stays inline."""
    weight = np.linspace(-1, 1, 8 * 64, dtype=np.float32).reshape(8, 64)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(np.ones(1, np.float32), "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _run(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


@pytest.fixture
def forced(monkeypatch):
    """Every graph over the single-file limit."""
    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)


def test_save_graph_writes_one_file_when_it_fits(tmp_path):
    assert save_graph(_graph(), tmp_path / "m.onnx") == [tmp_path / "m.onnx"]
    assert graph_files(tmp_path / "m.onnx") == [tmp_path / "m.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_save_graph_writes_data_file_beside_when_over_limit(tmp_path, forced):
    expected = _run_single(tmp_path)
    written = save_graph(_graph(), tmp_path / "m.onnx")
    assert written == [tmp_path / "m.onnx", tmp_path / "m.onnx.data"]
    assert graph_files(tmp_path / "m.onnx") == written
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    external = {t.name for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    assert external == {"W"}  # the 4-byte bias stays in the graph
    locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"m.onnx.data"}
    np.testing.assert_array_equal(_run(tmp_path / "m.onnx"), expected)


def _run_single(tmp_path):
    folder = tmp_path / "single"
    folder.mkdir()
    onnx.save(_graph(), str(folder / "m.onnx"))
    return _run(folder / "m.onnx")


def test_save_graph_replaces_a_stale_data_file(tmp_path, forced):
    save_graph(_graph(), tmp_path / "m.onnx")
    size = (tmp_path / "m.onnx.data").stat().st_size
    save_graph(load_graph(tmp_path / "m.onnx"), tmp_path / "m.onnx")
    assert (tmp_path / "m.onnx.data").stat().st_size == size  # not appended to
    np.testing.assert_array_equal(_run(tmp_path / "m.onnx"), _run_single(tmp_path))


@pytest.mark.parametrize("location", ["../w.data", "sub/w.data", "/tmp/w.data", "..\\w.data", ".hidden", ""])
def test_graph_files_refuses_a_location_that_is_not_a_bare_name(tmp_path, location):
    model = _graph()
    weight = model.graph.initializer[0]
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value=location)
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    with pytest.raises(ExportError, match="not a plain file name beside the graph"):
        graph_files(tmp_path / "m.onnx")
    with pytest.raises(ExportError, match="not a plain file name"):
        load_graph(tmp_path / "m.onnx")


@pytest.mark.parametrize("place", [copy_graph, move_graph])
def test_copy_and_move_graph_rename_the_data_file_with_the_graph(tmp_path, forced, place):
    expected = _run_single(tmp_path)
    save_graph(_graph(), tmp_path / "int8-3.onnx")
    (tmp_path / "out").mkdir()
    written = place(tmp_path / "int8-3.onnx", tmp_path / "out" / "model.onnx")
    assert written == [tmp_path / "out" / "model.onnx", tmp_path / "out" / "model.onnx.data"]
    assert graph_files(tmp_path / "out" / "model.onnx") == written
    left = {p.name for p in tmp_path.iterdir()} & {"int8-3.onnx", "int8-3.onnx.data"}
    assert left == (set() if place is move_graph else {"int8-3.onnx", "int8-3.onnx.data"})
    np.testing.assert_array_equal(_run(tmp_path / "out" / "model.onnx"), expected)


def test_save_if_small_rewrites_a_graph_that_fits_as_one_file(tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)
    save_graph(_graph(), tmp_path / "m.onnx")
    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1 << 20)
    assert save_if_small(tmp_path / "m.onnx") == [tmp_path / "m.onnx"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]
    np.testing.assert_array_equal(_run(tmp_path / "m.onnx"), _run_single(tmp_path))


@pytest.mark.parametrize("fusions", [False, True])
def test_optimized_onnx_keeps_the_weights_in_a_data_file(tmp_path, forced, fusions):
    from pipeline.build.passes.fusions import fused_from_onnx
    from pipeline.build.stages.optimize import OptimizeConfig

    save_graph(_graph(), tmp_path / "m.onnx")
    (tmp_path / "out").mkdir()
    config = OptimizeConfig(fusions=fusions, level=1, model_type="gpt2" if fusions else "", packed=True)
    fused_from_onnx(tmp_path / "m.onnx", config, tmp_path / "out")
    graph = tmp_path / "out" / "model.onnx"
    assert graph_files(graph) == [graph, tmp_path / "out" / "model.onnx.data"]
    np.testing.assert_allclose(_run(graph), _run_single(tmp_path), rtol=1e-6)


@pytest.mark.parametrize("target", ["cpu-avx2-dynamic", "cpu-int8-weights"])
def test_quantized_graph_of_a_data_file_graph_is_one_file_where_it_fits(tmp_path, monkeypatch, target):
    from pipeline.build.inputs.targets import load_target
    from pipeline.build.passes.int8 import quantize_dynamic
    from pipeline.build.passes.weight_only import quantize_weight_only

    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)
    save_graph(_graph(), tmp_path / "m.onnx")
    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1 << 20)
    settings = load_target(target).quantize
    quantize = quantize_dynamic if settings.mode == "dynamic" else quantize_weight_only
    quantize(tmp_path / "m.onnx", tmp_path / "q.onnx", settings)
    assert graph_files(tmp_path / "q.onnx") == [tmp_path / "q.onnx"]
    assert not (tmp_path / "q.onnx.data").exists()
    _run_single(tmp_path)  # the same graph in one file, quantized alike: the data file changes nothing
    quantize(tmp_path / "single" / "m.onnx", tmp_path / "single" / "q.onnx", settings)
    np.testing.assert_array_equal(_run(tmp_path / "q.onnx"), _run(tmp_path / "single" / "q.onnx"))


def test_save_graph_consume_writes_the_same_graph_one_initializer_at_a_time(tmp_path):
    model = _graph()
    # A tensor of float_data, not raw bytes, is written whole; a plain one around its raw data.
    model.graph.initializer.append(helper.make_tensor("unused", TensorProto.FLOAT, [2], [1.5, 2.5]))
    save_graph(_graph(), tmp_path / "plain.onnx")
    expected = onnx.load(str(tmp_path / "plain.onnx"))
    assert save_graph(model, tmp_path / "m.onnx", consume=True) == [tmp_path / "m.onnx"]
    assert len(model.graph.initializer) == 0  # given up to the file
    got = onnx.load(str(tmp_path / "m.onnx"))
    assert [t.name for t in got.graph.initializer] == ["W", "b", "unused"]
    for tensor, reference in zip(got.graph.initializer, expected.graph.initializer, strict=False):
        assert tensor == reference
    assert numpy_helper.to_array(got.graph.initializer[2]).tolist() == [1.5, 2.5]
    assert got.graph.node == expected.graph.node and got.opset_import == expected.opset_import
    np.testing.assert_array_equal(_run(tmp_path / "m.onnx"), _run(tmp_path / "plain.onnx"))


def test_save_graph_consume_writes_a_data_file_when_over_limit(tmp_path, forced):
    assert save_graph(_graph(), tmp_path / "m.onnx", consume=True) == [tmp_path / "m.onnx", tmp_path / "m.onnx.data"]
    np.testing.assert_array_equal(_run(tmp_path / "m.onnx"), _run_single(tmp_path))


def test_read_array_reads_one_tensor_and_refuses_bytes_past_its_data_file(tmp_path, forced):
    from pipeline.build.onnx_files import read_array

    save_graph(_graph(), tmp_path / "m.onnx")
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    weight = next(t for t in model.graph.initializer if t.name == "W")
    np.testing.assert_array_equal(
        read_array(weight, tmp_path / "m.onnx"), numpy_helper.to_array(_graph().graph.initializer[0])
    )
    for entry in weight.external_data:
        if entry.key == "offset":
            entry.value = str(int(entry.value) + 8)
    with pytest.raises(ExportError, match=r"tensor 'W' of shape \[8, 64\] claims bytes 8\.\.2056 of m\.onnx\.data"):
        read_array(weight, tmp_path / "m.onnx")


def test_load_structure_points_a_one_file_graphs_weights_at_their_bytes_in_it(tmp_path):
    from pipeline.build.onnx_files import load_external, load_structure, read_array

    save_graph(_graph(), tmp_path / "m.onnx")
    model = load_structure(tmp_path / "m.onnx")
    external = {t.name: {e.key: e.value for e in t.external_data} for t in model.graph.initializer if t.external_data}
    assert list(external) == ["W"] and external["W"]["location"] == "m.onnx"  # the 4-byte bias stays inline
    weight = next(t for t in model.graph.initializer if t.name == "W")
    np.testing.assert_array_equal(
        read_array(weight, tmp_path / "m.onnx"), numpy_helper.to_array(_graph().graph.initializer[0])
    )
    load_external(model, tmp_path / "m.onnx")
    whole = onnx.load(str(tmp_path / "m.onnx"))
    assert model.graph.node == whole.graph.node and model.graph.input == whole.graph.input
    for tensor, reference in zip(model.graph.initializer, whole.graph.initializer, strict=True):
        assert tensor.name == reference.name and not tensor.external_data
        np.testing.assert_array_equal(numpy_helper.to_array(tensor), numpy_helper.to_array(reference))
    (tmp_path / "cut.onnx").write_bytes((tmp_path / "m.onnx").read_bytes()[:-20])
    with pytest.raises(ExportError, match="truncated"):
        load_structure(tmp_path / "cut.onnx")
