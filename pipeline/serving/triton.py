"""Triton Inference Server model repositories from published artifacts (`pipeline export triton ARTIFACT OUT`).

    OUT/<name>/            the graph on Triton's own engine: platform onnxruntime_onnx (ONNX Runtime artifacts),
                           tensorrt_plan with one plan per compute capability (cc_model_filenames, from the
                           artifact's engine cache), or backend openvino
    OUT/<name>_tokenizer/  Python backend: TEXT -> the graph's int64 inputs, with the artifact's tokenizer
    OUT/<name>_ensemble/   TEXT in, the graph's output out: tokenizer, then graph; what clients call
    OUT/<name>_python/     Python backend that runs the whole artifact (copied to 1/<model>/<version>/<target>,
                           verified at load) through pipeline.runtime.load

Text encoders (feature-extraction, sequence-classification) get all four; decoders, text-to-text, speech and image
artifacts get the Python-backend model only (a generation loop is not an ensemble; the runtime decodes a request's
WAV or image bytes). Every config.pbtxt is built from a dict checked against Triton's schema
(`tritonclient`'s model_config_pb2, which fails on any unknown field) and parsed back from the written file.
The Python-backend models need `pipeline` (the thin runtime) in the Python environment Triton runs them with:
`--python-env` names one (Triton's EXECUTION_ENV_PATH), else Triton's own.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from pipeline.errors import ArtifactError, InputError, ServingError
from pipeline.runtime.artifact import DATA_SUFFIX, MANIFEST_NAME, artifact_holding, sha256_file, verify_artifact
from pipeline.runtime.engine_cache import cached_engines, engine_cache_dir
from pipeline.runtime.schema import TOKENIZER
from pipeline.serving.triton_settings import backend_settings, graph_refusal

MODELS_DIR = Path(__file__).resolve().parent / "triton_models"
ENCODER_OUTPUTS = {"feature-extraction": "EMBEDDING", "sequence-classification": "LOGITS"}
# Each task's Python-model input and output: texts as UTF-8 strings; a picture or a clip as its file's bytes (a
# WAV for speech), decoded and preprocessed by the runtime. A zero-shot model answers its pictures' embeddings.
TASK_IO = {
    **{task: ("TEXT", output) for task, output in ENCODER_OUTPUTS.items()},
    "text-generation": ("TEXT", "TEXT_OUT"),
    "text2text-generation": ("TEXT", "TEXT_OUT"),
    "automatic-speech-recognition": ("AUDIO", "TEXT_OUT"),
    "image-feature-extraction": ("IMAGE", "EMBEDDING"),
    "image-classification": ("IMAGE", "LOGITS"),
    "zero-shot-image-classification": ("IMAGE", "EMBEDDING"),
}
VARIANTS = ("graph", "ensemble", "python")
GRAPH_PLATFORMS = {
    "onnxruntime": {"platform": "onnxruntime_onnx"},
    "openvino": {"backend": "openvino"},
    "tensorrt": {"platform": "tensorrt_plan"},
}
# A model's name is its folder in the repository and a segment of Triton's URLs (/v2/models/<name>): no separator,
# no dot (so never "." or ".."), nothing a shell or URL must escape.
MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,99}")


def model_config_class():
    """Triton's ModelConfig protobuf class (from tritonclient), or a ServingError saying how to get it."""
    try:
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise ServingError(
            "checking config.pbtxt against Triton's schema needs tritonclient; pip install 'tritonclient[grpc]'"
        ) from None
    return model_config_pb2.ModelConfig


def config_text(config: dict) -> str:
    """A config.pbtxt for `config`, a dict in the protobuf's JSON form; an unknown field or value is an error."""
    from google.protobuf import json_format, text_format

    try:
        message = json_format.ParseDict(config, model_config_class()())
    except json_format.ParseError as err:
        raise ServingError(f"config of {config.get('name')!r} does not fit Triton's schema: {err}") from None
    return text_format.MessageToString(message)


def check_config(path: Path):
    """Parse a written config.pbtxt with Triton's schema; returns the message, or a ServingError naming the field."""
    from google.protobuf import text_format

    try:
        return text_format.Parse(Path(path).read_text(), model_config_class()())
    except text_format.ParseError as err:
        raise ServingError(f"{path} does not fit Triton's model config schema: {err}") from None


def _batching(serving: dict, max_batch: int) -> dict:
    sizes = [s for s in serving["preferred_batch_sizes"] if s <= max_batch] or [max_batch]
    return {"preferred_batch_size": sizes, "max_queue_delay_microseconds": serving["max_queue_delay_us"]}


def _serving(manifest: dict) -> tuple[dict, int]:
    defaults = {"max_batch_size": 0, "preferred_batch_sizes": [8, 32], "max_queue_delay_us": 2000, "instances": 1}
    serving = {**defaults, **manifest["target_spec"].get("serving", {})}
    return serving, int(serving["max_batch_size"] or manifest["model"]["batch_size"])


def _common(name: str, manifest: dict, kind: str) -> dict:
    serving, max_batch = _serving(manifest)
    return {
        "name": name,
        "max_batch_size": max_batch,
        "dynamic_batching": _batching(serving, max_batch),
        "instance_group": [{"kind": kind, "count": serving["instances"]}],
    }


def _write(folder: Path, config: dict) -> Path:
    (folder / "1").mkdir(parents=True, exist_ok=True)
    path = folder / "config.pbtxt"
    path.write_text(config_text(config))
    check_config(path)
    return path


def _output_dims(artifact: Path, task: str) -> list[int]:
    """The per-row shape of the artifact's output, from one probe run through the runtime ([1] for a text)."""
    import warnings

    import numpy as np

    from pipeline.runtime import EngineFallbackWarning, load

    kind, output = TASK_IO[task]
    if output == "TEXT_OUT":
        return [1]
    probe = np.zeros((16, 16, 3), dtype=np.uint8) if kind == "IMAGE" else "probe"
    with warnings.catch_warnings():  # a probe: a TensorRT artifact's shapes are its graph's on the CPU fallback
        warnings.simplefilter("ignore", EngineFallbackWarning)
        return list(load(artifact).run([probe]).shape[1:])


def _graph_files(artifact: Path, manifest: dict, folder: Path) -> dict:
    """Copy the graph (or the cached TensorRT plans) into `folder`/1; returns the config fields naming them."""
    backend = manifest["backend"]
    if backend != "tensorrt":
        graph = manifest["graph"]
        names = [graph] + ([Path(graph).with_suffix(".bin").name] if graph.endswith(".xml") else [])
        names += [graph + DATA_SUFFIX] if graph + DATA_SUFFIX in manifest["files"] else []  # weights kept apart
        for name in names:
            shutil.copyfile(artifact / name, folder / "1" / name)
        return {"default_model_filename": manifest["graph"]}
    plans = {}
    for record, plan in tensorrt_plans(artifact, manifest):
        shutil.copyfile(plan, folder / "1" / plan.name)
        plans[record["compute_capability"]] = plan.name
    return {"cc_model_filenames": plans, "default_model_filename": next(iter(plans.values()))}


def tensorrt_plans(artifact: Path, manifest: dict) -> list[tuple[dict, Path]]:
    """(record, plan) of each engine of a TensorRT artifact's graph in its cache, each plan checked against its
    record's sha256; a ServingError where one does not match or there is none."""
    cache = engine_cache_dir(artifact, manifest)
    plans = cached_engines(cache, manifest, manifest["graph"])
    for record, plan in plans:
        if plan.is_symlink() or not plan.is_file() or sha256_file(plan) != record.get("plan_sha256"):
            raise ServingError(
                f"{plan} is missing, a symlink, or does not match its sha256 in {plan.stem}.json; delete both and "
                "build the engine again with `pipeline engine ARTIFACT`"
            )
    if not plans:
        raise ServingError(
            f"{artifact} is a TensorRT artifact with no engine in its cache {cache}; build one on each GPU kind with "
            "`pipeline engine ARTIFACT`, then export again"
        )
    return plans


def _graph_model(artifact: Path, manifest: dict, name: str, out: Path, dims: list[int]) -> Path:
    folder = out / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    backend = manifest["backend"]
    kind = "KIND_GPU" if backend == "tensorrt" else "KIND_CPU"
    config = {**_common(name, manifest, kind), **GRAPH_PLATFORMS[backend], **_graph_files(artifact, manifest, folder)}
    config["input"] = [{"name": n, "data_type": "TYPE_INT64", "dims": [-1]} for n in manifest["model"]["inputs"]]
    config["output"] = [{"name": manifest["model"]["output"], "data_type": "TYPE_FP32", "dims": dims}]
    return _write(folder, {**config, **backend_settings(artifact, manifest)})


def _python_model(name: str, manifest: dict, out: Path, source: str, python_env: str | None, io: dict) -> Path:
    folder = out / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(MODELS_DIR / source, folder / "1" / "model.py")
    config = {**_common(name, manifest, "KIND_CPU"), "backend": "python", **io}
    if python_env:
        config["parameters"] = {"EXECUTION_ENV_PATH": {"string_value": str(Path(python_env).resolve())}}
    return _write(folder, config)


def _string_input(name: str = "TEXT") -> list[dict]:
    return [{"name": name, "data_type": "TYPE_STRING", "dims": [1]}]


def _tokenizer_model(artifact: Path, manifest: dict, name: str, out: Path, python_env: str | None) -> Path:
    inputs = manifest["model"]["inputs"]
    io = {"input": _string_input(), "output": [{"name": n, "data_type": "TYPE_INT64", "dims": [-1]} for n in inputs]}
    path = _python_model(name, manifest, out, "tokenizer_model.py", python_env, io)
    shutil.copyfile(artifact / TOKENIZER, out / name / "1" / TOKENIZER)
    (out / name / "1" / "spec.json").write_text(json.dumps(manifest["model"], indent=1, sort_keys=True))
    return path


def _ensemble(manifest: dict, name: str, graph: str, tokenizer: str, out: Path, dims: list[int]) -> Path:
    _, max_batch = _serving(manifest)
    inputs, output = manifest["model"]["inputs"], manifest["model"]["output"]
    public = ENCODER_OUTPUTS[manifest["model"]["task"]]
    config = {
        "name": name,
        "platform": "ensemble",
        "max_batch_size": max_batch,
        "input": _string_input(),
        "output": [{"name": public, "data_type": "TYPE_FP32", "dims": dims}],
        "ensemble_scheduling": {
            "step": [
                {
                    "model_name": tokenizer,
                    "model_version": -1,
                    "input_map": {"TEXT": "TEXT"},
                    "output_map": {n: f"_{n}" for n in inputs},
                },
                {
                    "model_name": graph,
                    "model_version": -1,
                    "input_map": {n: f"_{n}" for n in inputs},
                    "output_map": {output: public},
                },
            ]
        },
    }
    return _write(out / name, config)


def _runtime_model(artifact: Path, manifest: dict, name: str, out: Path, python_env: str | None, dims) -> Path:
    kind, public = TASK_IO[manifest["model"]["task"]]
    output = {"name": public, "data_type": "TYPE_STRING" if public == "TEXT_OUT" else "TYPE_FP32", "dims": dims}
    io = {"input": _string_input(kind), "output": [output]}
    path = _python_model(name, manifest, out, "runtime_model.py", python_env, io)
    # The artifact keeps its <model>/<version>/<target> folders: load() checks that its manifest sits in them.
    target = out / name / "1" / manifest["model_name"] / manifest["version"] / manifest["target"]
    target.mkdir(parents=True)
    for file in [MANIFEST_NAME, *manifest["files"]]:
        shutil.copyfile(artifact / file, target / file)
    return path


def _python_only(task: str) -> str:
    if TASK_IO[task][1] == "TEXT_OUT":
        return "its generation loop is not a Triton ensemble"
    return "the runtime decodes and preprocesses each file its request carries"


def check_kind(manifest: dict, variants: tuple[str, ...]) -> None:
    """Refuse, in one line, an artifact kind or variant this export does not take."""
    task = manifest["model"]["task"]
    if task not in TASK_IO:
        raise ServingError(
            f"Triton export takes {', '.join(TASK_IO)} artifacts; this one is {task} (its per-token output is "
            "ragged); serve it with `pipeline serve` instead"
        )
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise InputError(f"unknown Triton variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    if task not in ENCODER_OUTPUTS and set(variants) - {"python"}:
        raise ServingError(
            f"a {task} artifact exports only as the python variant ({_python_only(task)}); pass --variant python"
        )


def check_model_name(name: str) -> None:
    """Refuse, in one line, a model name that is not one folder name of Triton's characters."""
    if not MODEL_NAME.fullmatch(name):
        raise InputError(
            f"Triton model name {name!r} must be 1 to 100 letters, digits, '_' or '-' (not starting with '-'): it "
            "is the model's folder in the repository and its name in Triton's URLs; pass --name like my_model"
        )


def _check_out_dir(out: Path) -> None:
    """Refuse, in one line, an OUT_DIR that is a file, not empty, or inside an immutable artifact."""
    holder = artifact_holding(out)  # its own message: what a Triton repository inside an artifact breaks
    if holder is not None:
        raise InputError(
            f"{out} lies inside the published artifact {holder}, which must not change (a file added to it fails "
            "its verification); pass a folder outside every artifact for the model repository"
        )
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file, not a folder; pass a new or empty folder for the model repository")
    if out.exists() and any(out.iterdir()):
        raise InputError(f"{out} is not empty; pass a new or empty folder for the model repository")


def _remove_written(out: Path, created: bool) -> None:
    """Remove what a failed export wrote: OUT_DIR where this export made it, else the entries it wrote into the
    user's empty folder (itself kept), following no symlink."""
    if created and not out.is_symlink():
        shutil.rmtree(out, ignore_errors=True)
        return
    for entry in out.iterdir() if out.is_dir() else ():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def default_variants(artifact: Path, manifest: dict) -> tuple[tuple[str, ...], str | None]:
    """The variants an export writes when none are asked for, and why it leaves the graph out (None: it does not)."""
    task = manifest["model"]["task"]
    if task in TASK_IO and task not in ENCODER_OUTPUTS:
        return ("python",), f"a {task} artifact exports as its Python model only ({_python_only(task)})"
    why = graph_refusal(artifact, manifest)
    if why:
        return ("python",), f"the graph and ensemble are left out: {why}; the Python model runs it through the loader"
    return VARIANTS, None


def repository_from_artifact(
    artifact,
    out_dir,
    name: str | None = None,
    variants: tuple[str, ...] | None = None,
    python_env: str | None = None,
    notify=None,
) -> list[Path]:
    """Write a Triton model repository for a verified `artifact` into `out_dir` (new or empty, outside every
    artifact); returns the config.pbtxt paths written. `name`: the graph model's name and folder, of Triton's
    characters (default: the artifact's). `variants`: graph, ensemble, python (default: all the artifact takes;
    python alone for a decoder, or for an OpenVINO artifact at a precision Triton's OpenVINO backend cannot pin).
    `notify`, where given, is called with one line saying why the default left the graph out."""
    artifact = Path(artifact).resolve()  # once: the files copied are the files verified
    manifest = verify_artifact(artifact)
    task = manifest["model"]["task"]
    variants, why = (tuple(variants), None) if variants else default_variants(artifact, manifest)
    check_kind(manifest, variants)
    out = Path(out_dir)
    _check_out_dir(out)
    name = name or manifest["model_name"].replace(".", "_")
    check_model_name(name)
    if "graph" in variants or "ensemble" in variants:
        backend_settings(artifact, manifest)  # its refusals, before anything runs or is written
        if manifest["backend"] == "tensorrt":
            tensorrt_plans(artifact, manifest)
    if why and notify:
        notify(why)
    dims = _output_dims(artifact, task)
    created, written = not out.exists(), []
    try:
        if "graph" in variants or "ensemble" in variants:
            written.append(_graph_model(artifact, manifest, name, out, dims))
        if "ensemble" in variants:
            written.append(_tokenizer_model(artifact, manifest, f"{name}_tokenizer", out, python_env))
            written.append(_ensemble(manifest, f"{name}_ensemble", name, f"{name}_tokenizer", out, dims))
        if "python" in variants:
            written.append(_runtime_model(artifact, manifest, f"{name}_python", out, python_env, dims))
    except OSError as err:
        _remove_written(out, created)
        raise ArtifactError(f"writing the Triton repository {out} failed: {err.strerror or err}") from None
    except BaseException:
        _remove_written(out, created)
        raise
    return written
