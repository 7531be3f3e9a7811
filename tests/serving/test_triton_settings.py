from pathlib import Path

import pytest

from pipeline.errors import ServingError
from pipeline.runtime import load, verify_artifact
from pipeline.serving.triton import _graph_model, check_config, default_variants, repository_from_artifact
from pipeline.serving.triton_settings import openvino_parameters
from tests.conftest import _publish, write_target

pytest.importorskip("tritonclient.grpc", reason="the Triton schema check needs tritonclient (the dev extra)")


def test_an_onnxruntime_graph_carries_the_session_settings_the_loader_applies(published, tmp_path):
    manifest = verify_artifact(published)
    default = check_config(repository_from_artifact(published, tmp_path / "repo", variants=("graph",))[0])
    assert default.parameters["intra_op_thread_count"].string_value == str(manifest["session"]["intra_op_threads"])
    assert not default.HasField("optimization")  # level "all" is Triton's default
    settings = {"intra_op_threads": 2, "inter_op_threads": 3, "execution_mode": "parallel"}
    session = {**manifest["session"], **settings, "graph_optimization_level": "extended"}
    config = check_config(_graph_model(published, {**manifest, "session": session}, "m", tmp_path / "other", [4]))
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters == {"intra_op_thread_count": "2", "inter_op_thread_count": "3", "execution_mode": "1"}
    assert config.optimization.graph.level == 1  # the backend's basic plus extended


@pytest.fixture(scope="module")
def published_dynamic(tiny_bert, texts_file, calibration_file, tmp_path_factory) -> Path:
    """The tiny BERT built for a target whose one candidate is openvino-int8-dynamic (its float remainder at
    OpenVINO's default precision on this host)."""
    folder = tmp_path_factory.mktemp("published-dynamic")
    dynamic = [{"name": "openvino-int8-dynamic", "engine": "openvino", "precision": "int8", "quantize": "dynamic"}]
    target = write_target(folder, "ov-dynamic", "cpu-avx2", candidates=dynamic)
    return _publish(tiny_bert, texts_file, calibration_file, folder, str(target))


def _threads(count) -> dict:
    return {"INFERENCE_NUM_THREADS": str(count)} if count else {}


def test_an_openvino_graph_compiles_in_triton_as_the_loader_compiles_it(published_dynamic, tmp_path):
    ov = pytest.importorskip("openvino")
    manifest = verify_artifact(published_dynamic)
    threads = manifest["session"].get("intra_op_threads")
    bf16 = {**manifest, "session": {**manifest["session"], "inference_precision": "bf16", "intra_op_threads": 3}}
    expected = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"}
    assert openvino_parameters(published_dynamic, bf16) == {**expected, "HINT_BF16": "YES", **_threads(3)}
    if manifest["session"].get("inference_precision") == "f32":  # built where OpenVINO's default is f32: pinned
        with pytest.raises(ServingError, match="cannot pin this artifact's inference precision f32"):
            repository_from_artifact(published_dynamic, tmp_path / "repo", variants=("graph",))
        pytest.skip("this host's OpenVINO default precision is f32, which the artifact pins and Triton cannot")
    [path] = repository_from_artifact(published_dynamic, tmp_path / "repo", variants=("graph",))
    config = check_config(path)
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert config.backend == "openvino" and config.default_model_filename == "model.xml"
    assert parameters == {**expected, **_threads(threads)}
    # What Triton's OpenVINO backend does: each parameter set on its core, then the copied IR compiled, no config.
    core = ov.Core()
    core.set_property("CPU", parameters)
    compiled = core.compile_model(core.read_model(str(path.parent / "1" / "model.xml")), "CPU")
    group = manifest["session"]["dynamic_quantization_group_size"]
    assert int(compiled.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == group
    loader = load(published_dynamic).session.compiled
    assert compiled.get_property("INFERENCE_PRECISION_HINT") == loader.get_property("INFERENCE_PRECISION_HINT")


def test_an_openvino_graph_at_a_precision_triton_cannot_pin_is_refused(published_openvino, tmp_path):
    manifest = verify_artifact(published_openvino)
    assert manifest["session"]["inference_precision"] == "f32"
    with pytest.raises(ServingError, match="cannot pin this artifact's inference precision f32") as err:
        repository_from_artifact(published_openvino, tmp_path / "graph", variants=("ensemble",))
    assert "\n" not in str(err.value) and "--variant python" in str(err.value)
    assert not (tmp_path / "graph").exists()
    (tmp_path / "empty").mkdir()  # the user's own empty folder: refused before anything is written, and kept
    with pytest.raises(ServingError, match="cannot pin"):
        repository_from_artifact(published_openvino, tmp_path / "empty", variants=("graph",), notify=print)
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())
    notes = []
    written = repository_from_artifact(published_openvino, tmp_path / "default", notify=notes.append)
    assert [p.parent.name for p in written] == ["tiny-bert_python"]  # the default leaves the graph out, and says so
    assert len(notes) == 1 and "cannot pin this artifact's inference precision f32" in notes[0]
    assert "\n" not in notes[0] and notes[0].startswith("the graph and ensemble are left out")
    grouped = {**manifest, "session": {"inference_precision": "bf16", "dynamic_quantization_group_size": 64}}
    with pytest.raises(ServingError, match="its IR does not name that group"):  # built before the IR carried it
        openvino_parameters(published_openvino, grouped)
    assert default_variants(published_openvino, grouped)[0] == ("python",)  # the default export falls back
