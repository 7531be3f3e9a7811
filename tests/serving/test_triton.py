import json
import os
import socket
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import InputError, ServingError
from pipeline.runtime import load, verify_artifact
from pipeline.serving.triton import check_config, check_kind, config_text, repository_from_artifact
from pipeline.serving.triton_server import LocalTriton
from tests.conftest import SMALL_TEXTS, TRITON_ENV, needs_triton

pytest.importorskip("tritonclient.grpc", reason="the Triton schema check needs tritonclient (the dev extra)")
import tritonclient.http as triton_http  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

needs_server = needs_triton


def test_export_writes_a_repository_whose_configs_fit_triton_schema(published, tmp_path):
    written = repository_from_artifact(published, tmp_path / "repo", python_env=str(TRITON_ENV))
    configs = {path.parent.name: check_config(path) for path in written}
    assert set(configs) == {"tiny-bert", "tiny-bert_tokenizer", "tiny-bert_ensemble", "tiny-bert_python"}
    manifest = verify_artifact(published)
    graph = configs["tiny-bert"]
    assert graph.platform == "onnxruntime_onnx" and graph.max_batch_size == manifest["model"]["batch_size"]
    assert (tmp_path / "repo" / "tiny-bert" / "1" / "model.onnx").read_bytes() == (
        published / "model.onnx"
    ).read_bytes()
    assert [i.name for i in graph.input] == manifest["model"]["inputs"]
    assert list(graph.output[0].dims) == [load(published).run(["x"]).shape[1]]
    assert (
        list(graph.dynamic_batching.preferred_batch_size) == [8, 32]
        and graph.instance_group[0].kind == graph.instance_group[0].KIND_CPU
    )
    steps = configs["tiny-bert_ensemble"].ensemble_scheduling.step
    assert [s.model_name for s in steps] == ["tiny-bert_tokenizer", "tiny-bert"]
    assert dict(steps[0].output_map) == {n: v for n, v in dict(steps[1].input_map).items()}  # wired through
    python = configs["tiny-bert_python"]
    assert python.backend == "python" and python.parameters["EXECUTION_ENV_PATH"].string_value == str(TRITON_ENV)
    copied = tmp_path / "repo" / "tiny-bert_python" / "1" / "tiny-bert" / manifest["version"] / manifest["target"]
    assert np.allclose(load(copied).run(SMALL_TEXTS), load(published).run(SMALL_TEXTS))


def test_schema_check_fails_on_an_unknown_field(tmp_path):
    with pytest.raises(ServingError, match="max_batch_sizes"):
        config_text({"name": "m", "backend": "python", "max_batch_sizes": 4})
    path = tmp_path / "config.pbtxt"
    path.write_text('name: "m"\nbackend: "python"\ninstance_group { kind: KIND_TPU }\n')
    with pytest.raises(ServingError, match="KIND_TPU"):
        check_config(path)


def test_export_refuses_an_unsupported_kind_a_decoder_ensemble_and_a_full_folder(published, published_gpt2, tmp_path):
    manifest = verify_artifact(published)
    tagger = {**manifest, "model": {**manifest["model"], "task": "token-classification"}}
    with pytest.raises(ServingError, match="this one is token-classification") as err:
        check_kind(tagger, ("graph",))
    assert "\n" not in str(err.value)
    with pytest.raises(ServingError, match="pass --variant python"):
        repository_from_artifact(published_gpt2, tmp_path / "gen", variants=("ensemble",))
    assert not (tmp_path / "gen").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="is not empty"):
        repository_from_artifact(published, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("name", ["../../x", "../other", "a/b", "..", ".hidden", "-x", "tiny bert"])
def test_export_refuses_a_name_that_is_not_one_triton_model_folder(name, published, tmp_path):
    shared = tmp_path / "shared"
    (shared / "other").mkdir(parents=True)
    (shared / "other" / "config.pbtxt").write_text("another model's")
    with pytest.raises(InputError, match="letters, digits") as err:
        repository_from_artifact(published, shared / "new", name=name)
    assert "\n" not in str(err.value) and "--name" in str(err.value)
    assert (shared / "other" / "config.pbtxt").read_text() == "another model's"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.pbtxt", "other", "shared"]


@pytest.mark.parametrize("where", ["artifact", "version", "deeper"])
def test_export_refuses_an_out_dir_inside_an_artifact(where, published, artifact_copy):
    out = {
        "artifact": artifact_copy / "repo",
        "version": artifact_copy.parent / "repo",
        "deeper": artifact_copy.parent / "a" / "b",
    }[where]
    with pytest.raises(InputError, match="inside the published artifact") as err:
        repository_from_artifact(published, out)
    assert "\n" not in str(err.value) and "outside every artifact" in str(err.value)
    assert not out.exists()
    verify_artifact(artifact_copy)  # still the published artifact, nothing added


def test_export_refuses_an_out_dir_that_is_a_file(published, tmp_path):
    file = tmp_path / "repo"
    file.write_text("mine")
    with pytest.raises(InputError, match="is a file, not a folder"):
        repository_from_artifact(published, file)
    assert file.read_text() == "mine"


def _infer(url: str, model: str, texts: list[str], output: str) -> np.ndarray:
    client = triton_http.InferenceServerClient(url.removeprefix("http://"))  # one per thread: it is not thread-safe
    text = triton_http.InferInput("TEXT", [len(texts), 1], "BYTES")
    text.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=np.object_))
    return client.infer(model, [text]).as_numpy(output)


@pytest.mark.slow  # a live tritonserver
@needs_server
def test_live_triton_serves_the_python_variant_with_dynamic_batching(published_fp32, tmp_path):
    # fp32: each answer is independent of what Triton batched it with (dynamic int8's is not, by design).
    repository_from_artifact(published_fp32, tmp_path / "repo", variants=("python",), python_env=str(TRITON_ENV))
    texts = [f"{SMALL_TEXTS[i % len(SMALL_TEXTS)]} {i}" for i in range(64)]
    expected = load(published_fp32).run(texts)
    got: dict[int, np.ndarray] = {}

    def client(first: int) -> None:
        for i in range(first, len(texts), 32):
            got[i] = _infer(server.url, "tiny-bert_python", [texts[i]], "EMBEDDING")[0]

    with LocalTriton(tmp_path / "repo", TRITON_ENV) as server:
        threads = [threading.Thread(target=client, args=(k,)) for k in range(32)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        np.testing.assert_allclose(np.stack([got[i] for i in range(len(texts))]), expected, atol=1e-5)
        with pytest.raises(InferenceServerException) as err:
            _infer(server.url, "tiny-bert_python", [""], "EMBEDDING")
        assert err.value.status() == "400" and "non-empty" in err.value.message()
        assert _infer(server.url, "tiny-bert_python", [texts[0]], "EMBEDDING").shape == expected[:1].shape
        with urllib.request.urlopen(f"{server.url}/v2/models/tiny-bert_python/stats") as answer:
            stats = json.load(answer)["model_stats"][0]
        assert max(b["batch_size"] for b in stats["batch_stats"]) > 1  # Triton's dynamic batcher formed batches
        assert stats["execution_count"] < stats["inference_count"]
        pid = server.process.pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped by its pid


@pytest.mark.slow  # a live tritonserver
@needs_server
def test_live_triton_answers_each_request_alone_when_one_fails_the_batch(artifact_copy, tmp_path):
    from tests.conftest import edit_manifest

    edit_manifest(artifact_copy, lambda m: m["model"].update(overlong="refuse"))
    repository_from_artifact(artifact_copy, tmp_path / "repo", variants=("python",), python_env=str(TRITON_ENV))
    long = " ".join(["word"] * 4 * verify_artifact(artifact_copy)["model"]["max_length"])
    texts = [long if i == 7 else f"{SMALL_TEXTS[i % len(SMALL_TEXTS)]} {i}" for i in range(16)]
    answers: dict[int, object] = {}

    def client(i: int) -> None:
        try:
            answers[i] = _infer(server.url, "tiny-bert_python", [texts[i]], "EMBEDDING")
        except InferenceServerException as err:
            answers[i] = err

    with LocalTriton(tmp_path / "repo", TRITON_ENV) as server:
        for _ in range(3):  # rounds of concurrent requests, so that Triton batches the bad one with good ones
            threads = [threading.Thread(target=client, args=(i,)) for i in range(len(texts))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            bad = answers.pop(7)
            assert isinstance(bad, InferenceServerException) and bad.status() == "400" and "token" in bad.message()
            assert all(isinstance(a, np.ndarray) for a in answers.values()), answers
        with urllib.request.urlopen(f"{server.url}/v2/models/tiny-bert_python/stats") as answer:
            stats = json.load(answer)["model_stats"][0]
    assert stats["execution_count"] < stats["inference_count"]  # some requests shared a batch


@pytest.mark.slow  # a live tritonserver
@needs_server
def test_live_triton_serves_an_openvino_artifact(published_openvino, tmp_path):
    # The Python backend runs in .venv-triton, which must hold the artifact's engine (the triton extra's openvino).
    repository_from_artifact(published_openvino, tmp_path / "repo", variants=("python",), python_env=str(TRITON_ENV))
    with LocalTriton(tmp_path / "repo", TRITON_ENV) as server:
        got = _infer(server.url, "tiny-bert_python", [SMALL_TEXTS[0]], "EMBEDDING")
    np.testing.assert_allclose(got, load(published_openvino).run(SMALL_TEXTS[:1]), atol=1e-5)


def test_triton_refuses_a_port_in_use(published, tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ServingError, match=f"port {port} on 127.0.0.1 is in use"):
            LocalTriton(tmp_path, TRITON_ENV, http_port=port)


def test_a_tensorrt_export_copies_only_verified_engines_and_refuses_a_changed_plan(
    tiny_bert, texts_file, build_dirs, tmp_path
):
    import warnings

    from pipeline.build.table import build
    from pipeline.runtime.engine_cache import engine_cache_dir, engine_name, write_engine

    manifest = build(tiny_bert, "a100", validation=texts_file, calibration=texts_file, **build_dirs)
    artifact = Path(manifest.published.path)
    published = verify_artifact(artifact)
    cache, graph = engine_cache_dir(artifact, published), published["graph"]
    record = {"graph": graph, "graph_sha256": published["files"][graph], "tensorrt": "10.3.0"}
    record |= {"profile_hash": published["engine"]["profile_hash"], "compute_capability": "8.0"}
    name = engine_name("8.0", "10.3.0", record["profile_hash"], graph)
    write_engine(cache, name, b"plan bytes", record)
    # A record whose name is a path: copied as it stood, it would read and write outside both folders.
    write_engine(cache, "hostile", b"other plan", {**record, "compute_capability": "9.0"})
    hostile = json.loads((cache / "hostile.json").read_text())
    (cache / "hostile.json").write_text(json.dumps({**hostile, "name": os.path.relpath(tmp_path / "escaped", cache)}))
    before = set(tmp_path.rglob("*"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the probe's fallback to the CPU is expected, and not printed
        [path] = repository_from_artifact(artifact, tmp_path / "repo", variants=("graph",))
    config = check_config(path)
    assert dict(config.cc_model_filenames) == {"8.0": f"{name}.plan"} == {"8.0": config.default_model_filename}
    assert [p.name for p in (path.parent / "1").iterdir()] == [f"{name}.plan"]
    assert {p for p in tmp_path.rglob("*") if p not in before} == set((tmp_path / "repo").rglob("*")) | {
        path.parents[1]
    }
    (cache / f"{name}.plan").write_bytes(b"tampered")
    with pytest.raises(ServingError, match=r"\.plan is missing, a symlink, or does not match its sha256") as err:
        repository_from_artifact(artifact, tmp_path / "again", variants=("graph",))
    assert "\n" not in str(err.value) and not (tmp_path / "again").exists()


def test_export_copies_a_graphs_external_weights_beside_it(artifact_copy, tmp_path):
    import onnx
    import onnxruntime

    from pipeline.runtime.artifact import sha256_file
    from tests.conftest import edit_manifest

    graph = onnx.load(artifact_copy / "model.onnx")
    onnx.save_model(graph, artifact_copy / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    files = {name: sha256_file(artifact_copy / name) for name in ("model.onnx", "model.onnx.data")}
    edit_manifest(artifact_copy, lambda m: m["files"].update(files))
    repository_from_artifact(artifact_copy, tmp_path / "repo", variants=("graph",))
    version = tmp_path / "repo" / "tiny-bert" / "1"
    assert sorted(p.name for p in version.iterdir()) == ["model.onnx", "model.onnx.data"]
    session = onnxruntime.InferenceSession(str(version / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == verify_artifact(artifact_copy)["model"]["inputs"]
