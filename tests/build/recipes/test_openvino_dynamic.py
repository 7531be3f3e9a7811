"""int8 weights with OpenVINO's dynamic int8 activations: the compression, the coarsest group size that passes,
and a built artifact that carries its group size to the CPU plugin, with real NNCF and OpenVINO on the tiny BERT."""

import json

import numpy as np
import pytest

from pipeline.build.recipes.openvino_dynamic import GROUP_SIZES, finest_passing, int8_weights, session_for
from pipeline.errors import ArtifactError
from pipeline.runtime import load
from pipeline.runtime.backends.openvino import GROUP_RT_INFO, compile_config
from tests.build.stages.conftest import build_into
from tests.conftest import SMALL_TEXTS, write_target

ov = pytest.importorskip("openvino")

DYNAMIC = [{"name": "openvino-int8-dynamic", "engine": "openvino", "precision": "int8", "quantize": "dynamic"}]


def _weight_types(model) -> set[str]:
    """The element type of each MatMul's weight as stored: its largest constant behind Convert, Subtract,
    Multiply and Reshape (a compressed weight is int8 codes, a zero point and an fp32 scale a channel)."""
    found = set()
    for op in model.get_ops():
        if op.get_type_name() != "MatMul":
            continue
        stack, constants = [op.input_value(1).get_node()], []
        while stack:
            node = stack.pop()
            if node.get_type_name() == "Constant":
                constants.append(node)
            elif node.get_type_name() in ("Convert", "Subtract", "Multiply", "Reshape", "Transpose"):
                stack += [v.get_node() for v in node.input_values()]
        if constants:  # the attention products multiply two activations
            largest = max(constants, key=lambda c: int(np.prod(c.get_output_shape(0))))
            found.add(largest.get_element_type().get_type_name())
    return found


@pytest.fixture(scope="module")
def dynamic_build(tiny_bert, texts_file, calibration_file, tmp_path_factory):
    """The tiny BERT built for a target whose one candidate is openvino-int8-dynamic."""
    folder = tmp_path_factory.mktemp("dynamic")
    target = write_target(folder, "ov-dynamic", base="cpu-avx2", candidates=DYNAMIC)
    return build_into(tiny_bert, target, texts_file, calibration_file, folder)


def test_int8_weights_compresses_every_matmul_weight_and_leaves_the_model_alone(dynamic_build):
    plain = ov.convert_model(str(dynamic_build.stage("export").output("model.onnx")))
    compressed = int8_weights(plain)
    assert _weight_types(plain) == {"f32"} and _weight_types(compressed) == {"u8"}


def test_the_coarsest_group_that_passes_is_kept_and_the_screen_runs_once_after_the_first_miss():
    sessions = [session_for(size, None) for size in GROUP_SIZES]
    assert GROUP_SIZES == tuple(sorted(GROUP_SIZES, reverse=True)) and len(GROUP_SIZES) > 2
    screened = []
    chosen, tries = finest_passing(
        sessions, lambda s: s["dynamic_quantization_group_size"] <= GROUP_SIZES[1], screened.append
    )
    assert chosen == sessions[1] and screened == [sessions[0]]
    assert tries == [{"group_size": GROUP_SIZES[0], "passed": False}, {"group_size": GROUP_SIZES[1], "passed": True}]
    chosen, tries = finest_passing(sessions, lambda s: True, screened.append)
    assert chosen == sessions[0] and len(tries) == 1 and len(screened) == 1
    chosen, tries = finest_passing(sessions, lambda s: False)
    assert chosen == sessions[-1] and [t["passed"] for t in tries] == [False] * len(GROUP_SIZES)
    assert session_for(32, "bf16") == {"dynamic_quantization_group_size": 32, "inference_precision": "bf16"}


def test_the_session_sets_the_plugins_group_size():
    assert compile_config(session_for(64, None))["DYNAMIC_QUANTIZATION_GROUP_SIZE"] == "64"
    assert "DYNAMIC_QUANTIZATION_GROUP_SIZE" not in compile_config({})


def test_the_artifact_runs_int8_weights_at_its_group_size_and_matches_pytorch(dynamic_build):
    from pipeline.build.accuracy.reference import checkpoint_from_source, pytorch_outputs

    folder = dynamic_build.published.path
    published = json.loads(open(f"{folder}/manifest.json").read())
    group = published["session"]["dynamic_quantization_group_size"]
    [row] = published["candidates"]
    # Where this host's plugin leaves the activations f32 (no VNNI), the artifact pins that: group 0.
    assert group in (GROUP_SIZES if row["fallback"]["int8_activations"] else (0,))
    assert row["fallback"]["group_size"] == group and row["status"] == "passed"
    assert row["fallback"]["tries"][-1] == {"group_size": group, "passed": True}
    model = load(folder)
    assert int(model.session.compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == group
    ir = ov.Core().read_model(f"{folder}/model.xml")
    assert _weight_types(ir) == {"u8"}
    assert ir.get_rt_info(GROUP_RT_INFO).astype(int) == group  # what a compile without our config runs
    assert int(ov.Core().compile_model(ir, "CPU").get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == group
    expected = pytorch_outputs(checkpoint_from_source(published["source"]), SMALL_TEXTS)
    got = model.run(SMALL_TEXTS)
    cosine = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() > 0.99


def test_a_group_size_that_is_not_a_count_is_refused_at_load(dynamic_build, tmp_path):
    import shutil

    from pipeline.runtime.artifact import manifest_digest

    folder = tmp_path / "copy"
    shutil.copytree(dynamic_build.published.path, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["session"]["dynamic_quantization_group_size"] = -32
    manifest["manifest_sha256"] = manifest_digest(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="dynamic_quantization_group_size"):
        load(folder)
