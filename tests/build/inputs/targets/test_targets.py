import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.build.accuracy.metrics import with_headroom
from pipeline.build.inputs.targets import Target, available_targets, load_target, target_from_toml
from pipeline.errors import TargetError
from tests.conftest import write_target


@pytest.mark.parametrize("name", available_targets())
def test_load_target_parses_every_shipped_target(name):
    target = load_target(name)
    assert isinstance(target, Target)
    assert target.name == name
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.name = "other"


def test_load_target_lists_available_when_unknown():
    with pytest.raises(TargetError, match=r"unknown target 'cpu-avx9'.*cpu-avx2.*cpu-avx512"):
        load_target("cpu-avx9")


def test_target_from_toml_names_file_and_key_when_key_unknown(tmp_path):
    path = write_target(tmp_path, "bad", quantize__per_chanel=True)
    with pytest.raises(TargetError, match=r"bad\.toml: unknown key 'quantize\.per_chanel'.*per_channel"):
        target_from_toml(path)


def test_target_from_toml_names_key_when_type_wrong(tmp_path):
    path = write_target(tmp_path, "bad", shapes__batch_size="32")
    with pytest.raises(TargetError, match=r"bad\.toml: key 'shapes\.batch_size': expected an integer, got '32'"):
        target_from_toml(path)


def test_target_from_toml_refuses_bool_where_number_expected(tmp_path):
    path = write_target(tmp_path, "bad", accuracy__cosine_min=True)
    with pytest.raises(TargetError, match="accuracy.cosine_min"):
        target_from_toml(path)


def test_target_from_toml_refuses_value_outside_choices(tmp_path):
    path = write_target(tmp_path, "bad", quantize__mode="dynamc")
    with pytest.raises(TargetError, match=r"'dynamc' is not one of none, dynamic, static"):
        target_from_toml(path)


def test_target_from_toml_refuses_block_minimums_outside_4_bits(tmp_path):
    path = write_target(tmp_path, "bad", quantize__mode="weight_only", quantize__bits=8, quantize__blocks="minimum")
    with pytest.raises(TargetError, match=r"quantize asks for blocks = \"minimum\" with bits = 8.*set bits = 4"):
        target_from_toml(path)


def test_static_targets_keep_asymmetric_activations_by_default():
    # A weight-only setting once shadowed this one and made every static target symmetric.
    assert load_target("cpu-avx2-static").quantize.symmetric is False


def test_target_from_toml_refuses_malformed_toml(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text('name = "broken"\n[quantize\nmode = 1\n')
    with pytest.raises(TargetError, match=r"broken\.toml: not valid TOML"):
        target_from_toml(path)


def test_target_from_toml_refuses_name_not_matching_file(tmp_path):
    path = write_target(tmp_path, "one")
    other = tmp_path / "two.toml"
    other.write_text(path.read_text())
    with pytest.raises(TargetError, match="must match the file name 'two'"):
        target_from_toml(other)


def test_target_from_toml_requires_device(tmp_path):
    path = tmp_path / "small.toml"
    path.write_text('name = "small"\ndescription = "x"\nengine = "onnxruntime"\nprecision = "fp32"\n')
    with pytest.raises(TargetError, match="key 'device' is required"):
        target_from_toml(path)


def test_with_headroom_moves_scores_up_and_differences_down():
    accuracy = load_target("cpu-avx2").accuracy
    strict = with_headroom(accuracy, 0.5)
    assert strict.cosine_min == pytest.approx(1 - (1 - accuracy.cosine_min) / 2)
    assert strict.max_probability_diff == pytest.approx(accuracy.max_probability_diff / 2)
    assert strict.max_abs_diff is None


_scalars = st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=8), st.booleans())


@settings(max_examples=60, deadline=None)
@given(
    key=st.sampled_from(
        ["quantize__mode", "shapes__batch_size", "accuracy__cosine_min", "precision", "tensorrt__workspace_mb"]
    ),
    value=_scalars,
)
def test_target_from_toml_accepts_or_raises_target_error_for_any_value(tmp_path_factory, key, value):
    folder = tmp_path_factory.mktemp("prop")
    path = write_target(folder, "prop", **{key: value})
    try:
        target = target_from_toml(path)
    except TargetError as err:
        assert "prop.toml" in str(err)
    else:
        section, _, field = key.rpartition("__")
        got = getattr(getattr(target, section) if section else target, field)
        assert got == value
        # Accepted values are in range: sizes positive, scores in [-1, 1].
        if field in ("batch_size", "workspace_mb"):
            assert got >= 1
        if field == "cosine_min":
            assert -1 <= got <= 1


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("shapes__batch_size", -5, "'shapes.batch_size': -5 is out of range; it must be from 1 to 4096"),
        ("accuracy__cosine_min", 1.5, "'accuracy.cosine_min': 1.5 is out of range"),
        ("tensorrt__workspace_mb", 0, "'tensorrt.workspace_mb': 0 is out of range; it must be at least 1"),
        ("runtime__candidate_threads", [2, 0], "'runtime.candidate_threads': 0 is out of range"),
        ("optimize__level", 7, "'optimize.level'"),  # ONNX Runtime's optimizer takes 0, 1, 2 or 99 only
    ],
)
def test_target_from_toml_refuses_out_of_range_values_naming_the_key(tmp_path, key, value, message):
    path = write_target(tmp_path, "ranged", **{key: value})
    with pytest.raises(TargetError, match=re.escape(message)):
        target_from_toml(path)


def test_target_candidates_parse_and_refuse_duplicates(tmp_path):
    target = load_target("cpu-avx2")
    assert [(c.engine, c.quantize) for c in target.family_candidates("encoder")] == [
        ("onnxruntime", "none"),
        ("onnxruntime", "dynamic"),
        ("openvino", "none"),
        ("openvino", "dynamic"),
        ("openvino", "nncf"),
    ]
    decoders = target.family_candidates("decoder")
    # A candidate without its own block size has the [quantize] one.
    assert target.quantize.block_size == 32
    assert [(c.quantize, c.bits, c.blocks, c.block_size) for c in decoders] == [
        ("none", 8, "symmetric", 32),
        ("weight_only", 8, "zero_point", 32),
        ("weight_only", 8, "zero_point", 128),
        ("weight_only", 4, "symmetric", 32),
        ("weight_only", 4, "minimum", 32),
    ]
    # A candidate's own thresholds replace the target's once it is chosen; the rest stay the target's.
    int4 = target.with_candidate("ort-int4-weights").accuracy
    assert (int4.perplexity_ratio, int4.greedy_match, int4.cosine_min) == (1.10, 0.0, target.accuracy.cosine_min)
    assert target.with_candidate("ort-fp32-decoder").accuracy.greedy_match == 1.0
    far = [{"name": "a", "engine": "onnxruntime", "precision": "int4", "accuracy": {"perplexity_ratio": -1}}]
    with pytest.raises(TargetError, match="candidates.accuracy.perplexity_ratio'.*out of range"):
        target_from_toml(write_target(tmp_path, "far", candidates=far))
    twice = [{"name": "a", "engine": "openvino", "precision": "fp32"}] * 2
    with pytest.raises(TargetError, match="two \\[\\[candidates\\]\\] share a name"):
        target_from_toml(write_target(tmp_path, "dup", candidates=twice))
    odd = [{"name": "a", "engine": "onnxruntime", "precision": "int8", "quantize": "weight_only", "block_size": 100}]
    with pytest.raises(TargetError, match="candidates.block_size'.*100 is not one of 16, 32, 64, 128, 256"):
        target_from_toml(write_target(tmp_path, "odd", candidates=odd))
    wrong = [{"name": "a", "engine": "tvm", "precision": "fp32"}]
    with pytest.raises(TargetError, match="'tvm' is not one of onnxruntime, openvino"):
        target_from_toml(write_target(tmp_path, "bad", candidates=wrong))
