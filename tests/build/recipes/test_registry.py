"""The recipe table: every kind a shipped target uses has a recipe that builds its family and precision, one
recipe a kind, each with a frozen config of its own fields only, and a target asking for a kind no recipe builds
refused when parsed."""

import dataclasses

import pytest

from pipeline.build.inputs.targets import Candidate, available_targets, load_target
from pipeline.build.recipes import RECIPES, ROW_COLUMNS, check_candidates, checked_target, recipe_for, registry
from pipeline.build.recipes.ort_fp32 import OrtFp32
from pipeline.build.recipes.ort_int8 import OrtInt8
from pipeline.build.search.candidates import candidate_row
from pipeline.build.table import build
from pipeline.errors import TargetError
from tests.conftest import write_target

# Written out rather than read from the recipes under test.
CONFIG_FIELDS = {
    "ort-fp32": set(),
    "ort-int8-dynamic": {"settings"},
    "ort-int8-static": {"settings"},
    "openvino": {"inference_precision"},
    "openvino-int8": {"inference_precision"},
    "openvino-int8-dynamic": {"inference_precision", "group_sizes"},
    "weight-only": {"bits", "blocks", "block_size", "accuracy_level", "head_bits", "bisect_layers"},
}


def shipped_candidates():
    return [(name, c) for name in available_targets() for c in load_target(name).candidates]


def test_every_kind_a_shipped_target_uses_has_a_recipe_for_its_family_and_precision():
    used = shipped_candidates()
    assert used
    for name, candidate in used:
        recipe = recipe_for(candidate)
        assert (recipe.engine, recipe.quantize) == (candidate.engine, candidate.quantize), (name, candidate.name)
        assert candidate.family in recipe.families and candidate.precision in recipe.precisions, (name, candidate)
    assert {recipe_for(c).name for _, c in used} >= {
        "ort-fp32",
        "ort-int8-dynamic",
        "openvino",
        "openvino-int8",
        "openvino-int8-dynamic",
        "weight-only",
    }


def test_registry_refuses_a_kind_or_a_name_registered_twice():
    assert set(registry(OrtFp32(), OrtInt8("dynamic"))) == {("onnxruntime", "none"), ("onnxruntime", "dynamic")}
    with pytest.raises(ValueError, match="ort-fp32 .* registered twice"):
        registry(OrtFp32(), OrtInt8("static"), OrtFp32())
    renamed = OrtInt8("static")
    renamed.name = "ort-int8-dynamic"
    with pytest.raises(ValueError, match="ort-int8-dynamic .* registered twice"):
        registry(OrtInt8("dynamic"), renamed)


def test_each_recipes_config_is_frozen_and_holds_only_its_own_fields():
    assert {r.name for r in RECIPES.values()} == set(CONFIG_FIELDS)
    for recipe in RECIPES.values():
        assert {f.name for f in dataclasses.fields(recipe.Config)} == CONFIG_FIELDS[recipe.name], recipe.name
    for name, candidate in shipped_candidates():
        recipe = recipe_for(candidate)
        config = recipe.config(candidate, load_target(name))
        assert type(config) is recipe.Config
        for field in dataclasses.fields(config):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(config, field.name, None)


def test_configs_are_derived_from_the_candidate_and_its_target():
    target = load_target("cpu-avx2")
    configs = {c.name: recipe_for(c).config(c, target) for c in target.candidates}
    assert configs["ort-int8-dynamic"].settings == dataclasses.replace(target.quantize, mode="dynamic")
    assert configs["openvino-fp32"].inference_precision == "f32"
    # int8's float remainder: pinned to f32 where that is this host's default, else left to OpenVINO (bf16 natively)
    default = pytest.importorskip("openvino").Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    assert configs["openvino-int8"].inference_precision == ("f32" if default == "f32" else None)
    assert configs["openvino-int8-dynamic"].inference_precision == configs["openvino-int8"].inference_precision
    blocks = configs["ort-int8-blocks128"]
    assert (blocks.bits, blocks.blocks, blocks.block_size) == (8, "zero_point", 128)
    assert (blocks.accuracy_level, blocks.head_bits) == (target.quantize.accuracy_level, target.quantize.head_bits)
    assert recipe_for(target.candidates[0]).bisection(configs["ort-fp32"]) == "none"


def test_a_rows_block_columns_are_filled_only_by_recipes_that_have_them():
    fp32 = Candidate("fp32", "onnxruntime", "fp32", bits=4, blocks="minimum", block_size=64)
    weights = Candidate(
        "w", "onnxruntime", "int4", "weight_only", family="decoder", bits=4, blocks="minimum", block_size=64
    )
    assert {k: candidate_row(fp32, "passed")[k] for k in ROW_COLUMNS} == dict.fromkeys(ROW_COLUMNS)
    assert {k: candidate_row(weights, "passed")[k] for k in ROW_COLUMNS} == {
        "bits": 4,
        "blocks": "minimum",
        "block_size": 64,
    }
    for recipe in RECIPES.values():
        assert set(recipe.row(weights)) <= set(ROW_COLUMNS), recipe.name


@pytest.mark.parametrize(
    ("candidate", "message"),
    [
        (
            {"engine": "openvino", "precision": "int8", "quantize": "static"},
            r"no recipe builds engine = 'openvino' with quantize = 'static'; available: ort-fp32 .*openvino-int8",
        ),
        (
            {"engine": "onnxruntime", "precision": "int8", "quantize": "weight_only"},
            r"recipe weight-only builds family decoder, speech, text2text, not 'encoder'; set family",
        ),
        ({"engine": "openvino", "precision": "int4"}, r"recipe openvino builds precision fp32, bf16, not 'int4'"),
    ],
)
def test_a_candidate_no_recipe_builds_is_refused_before_any_stage(tmp_path, candidate, message):
    path = write_target(tmp_path, "odd", base="cpu-avx2", candidates=[{"name": "a", **candidate}])
    with pytest.raises(TargetError, match=f"odd.toml: candidate 'a': {message}"):
        checked_target(str(path))
    with pytest.raises(TargetError, match=f"candidate 'a': {message}"):
        build(tmp_path / "no-model-needed", str(path), artifacts_dir=tmp_path / "a", cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()
    with pytest.raises(TargetError, match="^where: "):
        check_candidates("where", [Candidate("a", **candidate)])
