"""Shared fixtures: tiny random checkpoints (made by tests/tiny.py), their published artifacts, tiny targets."""

from __future__ import annotations

import contextlib
import json
import shutil
import tomllib
from pathlib import Path

import numpy as np
import pytest

from tests.tiny import make_checkpoint, make_decoder

REPO = Path(__file__).resolve().parent.parent
SMALL_TEXTS = [
    "The cat sat on the mat.",
    "A cat was sitting on the mat.",
    "Stock markets fell sharply on Tuesday.",
    "How do I reset my password?",
    "Preheat the oven to 180 degrees.",
    "The committee postponed its decision until next spring, citing the need for more public consultation.",
    "ok",
    "Zürich is expensive, but the café was lovely.",
    "Photosynthesis turns light into chemical energy.",
    "Please close the door when you leave the room.",
    "The train to Berlin was delayed by forty minutes because of a signal failure near the border.",
    "I disagree.",
]


@contextlib.contextmanager
def scratch(tmp_path_factory, name: str):
    """A folder for a module's real-model builds, removed when the module is done: each holds gigabytes of stage
    cache, and a whole run's would fill a shared disk (tmp_path_retention_policy covers function-scoped folders)."""
    root = tmp_path_factory.mktemp(name)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A tiny random GPT-2 with its own BPE tokenizer."""
    return make_decoder(tmp_path_factory.mktemp("ckpt") / "tiny-gpt2", "gpt2")


def _publish(
    checkpoint: Path, texts_file: Path, calibration: Path, root: Path, target: str = "cpu-avx2-dynamic"
) -> Path:
    """Build `checkpoint` for `target` into `root`/artifacts (stage cache in `root`/cache), calibrated on
    other text than it is validated on; the artifact's path."""
    from pipeline.build.table import build

    manifest = build(
        checkpoint,
        target,
        artifacts_dir=root / "artifacts",
        cache_dir=root / "cache",
        validation=texts_file,
        calibration=calibration,
    )
    return Path(manifest.published.path)


@pytest.fixture(scope="session")
def published_gpt2(tiny_gpt2, texts_file, calibration_file, tmp_path_factory) -> Path:
    """The tiny GPT-2 built for cpu-avx2-dynamic (dynamic int8), once per session. Copy it before changing it."""
    return _publish(tiny_gpt2, texts_file, calibration_file, tmp_path_factory.mktemp("published-gpt2"))


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory) -> Path:
    """A tiny random BERT for feature extraction (mean pooling, no sentence-transformers config)."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-bert")


CALIBRATION_TEXTS = [
    "Rain is expected across the north by the weekend.",
    "She parked the bicycle beside the library.",
    "Reset the router and wait two minutes.",
    "The recipe needs three eggs and a cup of flour.",
    "Our flight was cancelled, so we took the night train.",
    "yes",
    "Mathematics rewards patience more than speed.",
    "The museum opens at nine on weekdays and ten on Sundays.",
]


@pytest.fixture(scope="session")
def calibration_file(tmp_path_factory) -> Path:
    """Calibration text that shares no line with `texts_file`, the held-out text."""
    path = tmp_path_factory.mktemp("data") / "calibration.txt"
    path.write_text("\n".join(CALIBRATION_TEXTS) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def texts_file(tmp_path_factory) -> Path:
    """A small held-out text file for fast builds."""
    path = tmp_path_factory.mktemp("data") / "texts.txt"
    path.write_text("\n".join(SMALL_TEXTS) + "\n", encoding="utf-8")
    return path


def _toml_value(value) -> str:
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value) if not isinstance(value, bool) else str(value).lower()


def write_target(folder: Path, name: str, base: str = "cpu-avx2-dynamic", **overrides) -> Path:
    """A copy of a shipped target under a new name; overrides are `section__key=value` (or `key=value`)."""
    table = tomllib.loads((REPO / "targets" / f"{base}.toml").read_text())
    table["name"] = name
    for dotted, value in overrides.items():
        section, _, key = dotted.rpartition("__")
        (table.setdefault(section, {}) if section else table)[key] = value

    def is_tables(v) -> bool:
        return isinstance(v, list) and bool(v) and all(isinstance(t, dict) for t in v)

    lines = [f"{k} = {_toml_value(v)}" for k, v in table.items() if not isinstance(v, dict) and not is_tables(v)]
    for section, values in table.items():
        if isinstance(values, dict):
            lines += [f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    for section, values in table.items():
        if is_tables(values):
            for item in values:
                lines += [f"[[{section}]]"] + [f"{k} = {_toml_value(v)}" for k, v in item.items()]
    path = folder / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def build_dirs(tmp_path) -> dict:
    """Fresh artifact and cache folders for one test."""
    return {"artifacts_dir": tmp_path / "artifacts", "cache_dir": tmp_path / "cache"}


@pytest.fixture(scope="session")
def published(tiny_bert, texts_file, calibration_file, tmp_path_factory) -> Path:
    """One artifact of the tiny BERT, built once per session. Copy it before changing it."""
    return _publish(tiny_bert, texts_file, calibration_file, tmp_path_factory.mktemp("published"))


@pytest.fixture(scope="session")
def published_fp32(tiny_bert, texts_file, calibration_file, tmp_path_factory) -> Path:
    """The tiny BERT built for cpu-fp32: deterministic per text, whatever shares its batch."""
    return _publish(tiny_bert, texts_file, calibration_file, tmp_path_factory.mktemp("published-fp32"), "cpu-fp32")


@pytest.fixture(scope="session")
def published_openvino(tiny_bert, texts_file, calibration_file, tmp_path_factory) -> Path:
    """The tiny BERT built for a target whose one candidate is OpenVINO fp32."""
    folder = tmp_path_factory.mktemp("published-openvino")
    openvino = [{"name": "openvino-fp32", "engine": "openvino", "precision": "fp32"}]
    return _publish(
        tiny_bert,
        texts_file,
        calibration_file,
        folder,
        str(write_target(folder, "ov", "cpu-avx2", candidates=openvino)),
    )


@pytest.fixture
def artifact_copy(published, tmp_path) -> Path:
    """A writable copy of the session's artifact, laid out as <model>/<version>/<target>."""
    copy = tmp_path / "tiny-bert" / published.parent.name / published.name
    shutil.copytree(published, copy)
    for file in copy.iterdir():
        file.chmod(0o644)
    return copy


def edit_manifest(folder: Path, change, reseal: bool = True) -> None:
    """Apply `change(manifest)` to the manifest.json in `folder`; with `reseal`, its digest is recomputed (the
    digest is no signature: a reader cannot tell the edit)."""
    from pipeline.runtime.artifact import manifest_digest

    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    if reseal:
        manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


def served_answers(artifact, bodies: list[bytes], content_type: str, **options) -> list[tuple[int, dict]]:
    """Deploy `artifact` on Ray Serve (loopback, a free port), POST each of `bodies` as `content_type` in turn, shut
    it down; each answer's (status, JSON body)."""
    import urllib.error
    import urllib.request

    from pipeline.serving import ray_serve
    from pipeline.serving.triton_server import free_port

    url = ray_serve.deploy(artifact, port=free_port(), **options)
    answers = []
    try:
        for body in bodies:
            request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type}, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=120) as answer:
                    answers.append((answer.status, json.load(answer)))
            except urllib.error.HTTPError as err:
                answers.append((err.code, json.loads(err.read())))
    finally:
        ray_serve.shutdown()
    return answers


def tampered_copy(artifact, tmp_path: Path, name: str) -> Path:
    """A copy of the published `artifact` (at its name/version/target, as its manifest says) whose file `name` has
    one byte more than the manifest's hash covers."""
    import shutil

    copy = tmp_path.joinpath(*Path(artifact).parts[-3:])
    shutil.copytree(artifact, copy)
    (copy / name).chmod(0o644)
    with open(copy / name, "ab") as f:
        f.write(b"\0")
    return copy


TRITON_ENV = REPO / ".venv-triton"
needs_triton = pytest.mark.skipif(
    not (TRITON_ENV / ".installed").exists(),
    reason="no .venv-triton with nvidia-pytriton's tritonserver: make triton-env",
)


def triton_answers(artifact, tmp_path: Path, rows: list[bytes]) -> tuple[str, list]:
    """Export `artifact` as Triton's Python variant, serve it on a local tritonserver, send each of `rows` (a text's
    UTF-8, a picture's or a WAV's bytes) as its own request, stop it; the model's input name and each answer: its
    output as an array, or the InferenceServerException it raised."""
    import tritonclient.http as triton_http
    from google.protobuf import text_format
    from tritonclient.utils import InferenceServerException

    from pipeline.serving.triton import model_config_class, repository_from_artifact
    from pipeline.serving.triton_server import LocalTriton

    [config] = repository_from_artifact(artifact, tmp_path / "repo", variants=("python",), python_env=str(TRITON_ENV))
    parsed = text_format.Parse(config.read_text(), model_config_class()())
    kind, output = parsed.input[0].name, parsed.output[0].name
    answers = []
    with LocalTriton(tmp_path / "repo", TRITON_ENV) as server:
        client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))
        for row in rows:
            given = triton_http.InferInput(kind, [1, 1], "BYTES")
            given.set_data_from_numpy(np.array([[row]], dtype=np.object_))
            try:
                answers.append(client.infer(config.parent.name, [given]).as_numpy(output)[0])
            except InferenceServerException as err:
                answers.append(err)
    return kind, answers
