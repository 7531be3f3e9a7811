"""The candidate table both searches share: one row per candidate, whatever happens to it."""

import time
import weakref

import pytest

from pipeline.build.inputs.targets import Accuracy, Candidate
from pipeline.build.search.candidates import CannotWin, Screen, attach_timings, candidate_row, judge_candidates
from pipeline.errors import QuantizationError

GATE = Accuracy(cosine_min=0.99, max_abs_diff=0.1)


def _judge(candidates, make, flags=frozenset()):
    return judge_candidates(candidates, flags, "test", make)


def test_a_candidate_needing_flags_the_host_lacks_is_a_skipped_row_never_built():
    asked = []

    def make(candidate):
        asked.append(candidate.name)
        return "built", "model", {"cosine_min": 1.0, "max_abs_diff": 0.0}, GATE, {}

    needs = Candidate("bf16", "openvino", "bf16", required_cpu_flags=("avx512_bf16", "amx_bf16", "avx2"))
    rows, built = _judge([needs, Candidate("fp32", "onnxruntime", "fp32")], make, flags=frozenset({"avx2"}))
    assert asked == ["fp32"] and list(built) == ["fp32"]
    assert rows[0]["status"] == "skipped" and rows[0]["reason"] == "this host lacks amx_bf16, avx512_bf16"
    assert rows[0]["name"] == "bf16" and rows[0]["engine"] == "openvino" and "closeness" not in rows[0]


def test_a_candidate_that_onnx_runtime_refuses_or_that_cannot_open_a_file_is_a_failed_row(tmp_path):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    node = helper.make_node("NoSuchOperator", ["x"], ["y"], domain="no.such.domain")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("no.such.domain", 1)]
    )
    onnx.save(model, str(tmp_path / "refused.onnx"))

    def make(candidate):
        if candidate.name == "refused":
            ort.InferenceSession(str(tmp_path / "refused.onnx"), providers=["CPUExecutionProvider"])
        if candidate.name == "unreadable":
            (tmp_path / "missing" / "model.onnx").read_bytes()
        return "built", "model", {"cosine_min": 1.0}, Accuracy(cosine_min=0.99), {}

    rows, built = _judge([Candidate(name, "onnxruntime", "fp32") for name in ("refused", "unreadable", "fine")], make)
    assert [r["status"] for r in rows] == ["failed", "failed", "passed"] and list(built) == ["fine"]
    refused, unreadable = rows[0]["reason"], rows[1]["reason"]
    assert refused.startswith(("Fail: ", "InvalidGraph: ", "NotImplemented: ")) and "NoSuchOperator" in refused
    assert unreadable.startswith("FileNotFoundError: [Errno 2]") and "\n" not in refused + unreadable


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ValueError("bad shape\nTraceback detail"), "ValueError: bad shape"),
        (RuntimeError(), "RuntimeError"),
        (QuantizationError("int8 calibration diverged\nmore"), "int8 calibration diverged"),
        (KeyError("x" * 400), "KeyError: '" + "x" * 289),
    ],
)
def test_a_failed_row_carries_the_errors_first_line_named_by_type_unless_it_is_the_pipelines(error, reason):
    def make(candidate):
        raise error

    rows, built = _judge([Candidate("int8", "onnxruntime", "int8", quantize="dynamic")], make)
    assert rows[0]["status"] == "failed" and rows[0]["reason"] == reason and not built
    assert len(rows[0]["reason"]) <= 300


def test_a_candidate_that_misses_its_gate_is_a_missed_row_with_its_closeness_and_stats():
    stats = {"cosine_min": 0.95, "max_abs_diff": 0.05}

    def make(candidate):
        return "built", "model", stats, GATE, {"size_mb": 1.5}

    rows, built = _judge([Candidate("int8", "onnxruntime", "int8", quantize="dynamic")], make)
    [row] = rows
    assert row["status"] == "missed" and row["missed"] == ["cosine_min = 0.95, needs >= 0.99"]
    assert row["closeness"] == pytest.approx(0.95 - 0.99)  # the worst margin: cosine's
    assert row["cosine_min"] == 0.95 and row["size_mb"] == 1.5 and row["build_seconds"] >= 0
    assert built == {"int8": ("built", None)}  # only passed candidates are timed and held out


def test_a_missed_candidates_model_is_let_go_at_once_and_a_passed_ones_kept():
    class Model:  # stands for a runtime model holding an ONNX Runtime session
        pass

    made = {}

    def make(candidate):
        made[candidate.name] = Model()
        cosine = 0.999 if candidate.name == "fp32" else 0.9
        return "built", made[candidate.name], {"cosine_min": cosine, "max_abs_diff": 0.02}, GATE, {}

    candidates = [
        Candidate("int8", "onnxruntime", "int8", quantize="dynamic"),
        Candidate("fp32", "onnxruntime", "fp32"),
    ]
    refs = {}

    def tracking(candidate):
        result = make(candidate)
        refs[candidate.name] = weakref.ref(made.pop(candidate.name))
        return result

    _, built = _judge(candidates, tracking)
    assert refs["int8"]() is None and built["int8"] == ("built", None)
    assert refs["fp32"]() is built["fp32"][1]


def test_a_candidate_that_passes_has_no_missed_lines_and_a_positive_closeness():
    def make(candidate):
        return "built", "model", {"cosine_min": 0.999, "max_abs_diff": 0.02}, GATE, {}

    [row], _ = _judge([Candidate("fp32", "onnxruntime", "fp32")], make)
    assert row["status"] == "passed" and row["missed"] == []
    assert row["closeness"] == pytest.approx(min(0.999 - 0.99, 0.1 - 0.02))


def test_candidate_row_shows_the_candidate_its_status_and_values():
    row = candidate_row(Candidate("int8", "onnxruntime", "int8", quantize="static"), "skipped", reason="why")
    assert row["name"] == "int8" and row["engine"] == "onnxruntime" and row["precision"] == "int8"
    assert row["quantize"] == "static" and row["status"] == "skipped" and row["reason"] == "why"


def test_attach_timings_splits_median_and_range_and_leaves_untimed_rows_none():
    rows = [{"name": "fp32"}, {"name": "int8"}]
    attach_timings(rows, {"fp32": {"batch_1": (2.0, 1.5, 3.0), "batch_32": (20.0, 18.0, 25.0)}})
    assert rows[0]["latency_ms"] == {"batch_1": 2.0, "batch_32": 20.0}
    assert rows[0]["latency_range_ms"] == {"batch_1": (1.5, 3.0), "batch_32": (18.0, 25.0)}
    assert rows[1]["latency_ms"] is None and rows[1]["latency_range_ms"] is None


def _sleeping_screen(passed: dict) -> Screen:
    """A screen over "models" that are seconds to sleep at each of two shapes: {shape: seconds}."""
    screen = Screen(lambda _: {shape: (lambda m, s=shape: lambda: time.sleep(m[s])) for shape in ("b1", "b8")})
    screen.passed.update(passed)
    return screen


def test_screen_drops_a_candidate_slower_at_every_shape_and_keeps_one_faster_at_any():
    screen = _sleeping_screen({"fast": {"b1": 0.002, "b8": 0.004}})
    with pytest.raises(CannotWin, match="slower than fast, which passed, at b1, b8") as raised:
        screen.could_win({"b1": 0.02, "b8": 0.04})
    assert all(ratio > 3 for ratio in raised.value.ratios.values())
    screen.could_win({"b1": 0.02, "b8": 0.0005})  # faster at one shape: it could still win on the score
    Screen(lambda _: {}).could_win({"b1": 1.0})  # nothing passed yet: anything could win


def test_candidates_with_a_fallback_are_built_last_and_a_dropped_one_is_a_row_in_target_order():
    order = []
    gate = Accuracy(cosine_min=0.99)
    screen = _sleeping_screen({})

    def make(candidate):
        order.append(candidate.name)
        if candidate.quantize == "dynamic":
            screen.could_win({"b1": 0.02, "b8": 0.04})
        return "built", {"b1": 0.002, "b8": 0.004}, {"cosine_min": 1.0}, gate, {}

    candidates = [
        Candidate("int8", "onnxruntime", "int8", quantize="dynamic"),
        Candidate("fp32", "onnxruntime", "fp32"),
    ]
    rows, built = judge_candidates(candidates, frozenset(), "test", make, screen)
    assert order == ["fp32", "int8"] and [r["name"] for r in rows] == ["int8", "fp32"]
    assert rows[0]["status"] == "dropped" and "slower than fp32" in rows[0]["reason"] and list(built) == ["fp32"]
    assert rows[0]["screen_ratios"]["b1"] > 3 and rows[0]["build_seconds"] > 0 and list(screen.passed) == ["fp32"]
