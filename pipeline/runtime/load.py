"""The production loader: verify a published artifact, pick its backend, and open the runtime object for it.

from pipeline.runtime.schema import INT8_GRAPH
from pipeline.runtime import load
model = load("artifacts/all-minilm-l6-v2/latest/cpu-avx2")
vectors = model.run(["a sentence", "another"])
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import ArtifactError, InputError
from pipeline.runtime.artifact import TOKENIZER_NAME, artifact_graphs, verify_artifact
from pipeline.runtime.host import check_host, usable_cores

BACKENDS = ("auto", "onnxruntime", "openvino", "tensorrt")


class EngineFallbackWarning(UserWarning):
    """A TensorRT target's artifact runs on ONNX Runtime: no engine could be used on this host."""


def open_model(
    graph_path: Path,
    tokenizer_path: Path,
    spec: dict,
    providers=None,
    session=None,
    engine=None,
    backend: str = "onnxruntime",
):
    """The runtime object for a graph: a Generator for text generation, else a Model over the backend's session
    (`engine`, a TensorRT plan of that graph, runs on TensorRT) and, where the session settings ask for streams,
    the sessions a split batch runs on (pipeline.runtime.streams)."""
    from pipeline.runtime.encoder import Model

    if spec["task"] == "text-generation":
        from pipeline.runtime.generation import Generator

        return Generator(graph_path, tokenizer_path, spec, providers, session)
    if spec["task"] == "automatic-speech-recognition":
        from pipeline.runtime.speech import open_speech_model

        return open_speech_model(graph_path, tokenizer_path, spec, providers, session, backend)
    if spec["task"] == "text2text-generation":
        from pipeline.runtime.text2text import open_text2text_model

        return open_text2text_model(graph_path, tokenizer_path, spec, providers, session, backend)
    if engine is not None:
        from pipeline.runtime.backends.tensorrt import TensorRTSession

        return Model(TensorRTSession(engine), tokenizer_path, spec, "tensorrt")
    from pipeline.runtime.streams import stream_pool

    if backend == "openvino":
        from pipeline.runtime.backends.openvino import OpenVINOSession

        ov_session = OpenVINOSession(graph_path, session)
        return Model(ov_session, tokenizer_path, spec, "openvino", stream_pool(session, ov_session.stream_sessions))
    from pipeline.runtime.backends.onnxruntime import open_session, open_stream_sessions

    full = open_session(graph_path, session, providers)
    streams = stream_pool(session, lambda: open_stream_sessions(graph_path, session, providers, full))
    return Model(full, tokenizer_path, spec, "onnxruntime", streams)


def _check_arguments(path, strict, intra_op_threads, backend, graph) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise InputError(f"load(path={path!r}): path must be a str or a pathlib.Path of an artifact folder")
    if not isinstance(strict, bool):
        raise InputError(f"load(strict={strict!r}): strict must be True or False")
    if intra_op_threads is not None and (
        isinstance(intra_op_threads, bool) or not isinstance(intra_op_threads, int) or intra_op_threads < 0
    ):
        raise InputError(f"load(intra_op_threads={intra_op_threads!r}) must be an int >= 0 (0: every core) or None")
    if backend not in BACKENDS:
        raise InputError(f"load(backend={backend!r}) must be one of {', '.join(BACKENDS)}")
    if graph is not None and not isinstance(graph, str):
        raise InputError(f"load(graph={graph!r}) must be a graph file name of the artifact, such as 'model.onnx'")
    root = Path(path)
    if not root.exists():
        raise ArtifactError(f"no artifact at {root}; build one with `make build` or check the path")
    return root


def session_settings(manifest: dict, intra_op_threads: int | None) -> dict:
    """The artifact's session settings for this host: a caller's thread count wins; a tuned thread or stream count
    is capped at this host's cores (the build host may have had more)."""
    session = dict(manifest["session"])
    if intra_op_threads is not None:
        session["intra_op_threads"] = intra_op_threads
    elif int(session.get("intra_op_threads", 0)) > usable_cores():
        session["intra_op_threads"] = usable_cores()
    # Each inter-op thread is a thread the session starts at creation: an edited count would start a million.
    if int(session.get("inter_op_threads", 0)) > usable_cores():
        session["inter_op_threads"] = usable_cores()
    if int(session.get("streams", 1)) > usable_cores():
        session["streams"] = usable_cores()
    return session


def load(
    path,
    strict: bool = False,
    providers=None,
    intra_op_threads: int | None = None,
    backend: str = "auto",
    build_engine: Callable | bool = False,
    graph: str | None = None,
):
    """Verify and load a published artifact (a `.../<version>/<target>` folder, or the `latest` link to one):
    a Model (`run`) for encoder tasks, a Generator (`generate`, `stream`, `run`) for text generation.

    Every file's sha256 is checked against the manifest first. A host without the target's CPU flags gives a
    HostMismatchWarning, or an ArtifactError with `strict=True`. The backend is the one the build chose
    (`manifest.json` "backend"): ONNX Runtime or OpenVINO on CPUs, TensorRT on GPUs.

    TensorRT targets: `backend="tensorrt"` runs the graph's engine from the artifact's engine cache, for this
    host's GPU architecture and TensorRT version; a missing one is built here first by `build_engine(artifact, graph)`
    where given (`pipeline.build.stages.engine.build_artifact_engine`, which returns the engine's path; the runtime
    imports nothing of the build), else it is an ArtifactError naming what was found.
    `"auto"` (the default) does the same but falls back, with an EngineFallbackWarning, to ONNX Runtime (its
    TensorRT and CUDA providers where onnxruntime-gpu is installed, else the CPU). `graph=INT8_GRAPH` picks
    the int8 Q/DQ graph of a target that made one.
    """
    root = _check_arguments(path, strict, intra_op_threads, backend, graph)
    real = root.resolve()  # once: a publisher may move `latest` while the files are hashed
    manifest = verify_artifact(real)
    graph = graph or manifest["graph"]
    if graph not in artifact_graphs(manifest):
        raise InputError(f"{root} has no graph {graph!r}; its graphs: {', '.join(artifact_graphs(manifest))}")
    built_for = manifest["backend"]
    if backend == "tensorrt" and built_for != "tensorrt":
        raise ArtifactError(f"{root} is built for {manifest['target']} ({built_for}); it has no TensorRT engine")
    if backend not in ("auto", built_for) and not (built_for == "tensorrt" and backend == "onnxruntime"):
        raise InputError(f"load(backend={backend!r}): {root} is built for {built_for}; pass backend='auto'")
    session = session_settings(manifest, intra_op_threads)
    check_host(manifest, strict)
    engine = None
    if built_for == "tensorrt" and backend != "onnxruntime" and providers is None:
        engine, providers = _gpu_backend(real, manifest, graph, backend, build_engine)
    runs_on = "openvino" if built_for == "openvino" else "onnxruntime"
    preprocessor = real / manifest["model"].get("preprocessor", TOKENIZER_NAME)
    model = open_model(real / graph, preprocessor, manifest["model"], providers, session, engine, runs_on)
    if manifest["model"]["task"] == "zero-shot-image-classification":
        from pipeline.runtime.zero_shot import open_zero_shot_model

        return open_zero_shot_model(model, real, manifest["model"], session, providers)
    return model


def _gpu_backend(root: Path, manifest: dict, graph: str, backend: str, build_engine):
    """(engine plan, None) where an engine can run here, else (None, ONNX Runtime providers) with a warning; with
    backend="tensorrt" an ArtifactError instead of the fallback."""
    from pipeline.runtime.backends.onnxruntime import ort_gpu_providers
    from pipeline.runtime.engine_cache import engine_cache_dir, engine_for_host
    from pipeline.runtime.host import gpu_host

    cache_dir = engine_cache_dir(root, manifest)
    if manifest["model"]["task"] == "text-generation":
        reason = "TensorRT engines are not built for KV-cache decoders"
    else:
        host, reason = gpu_host()
        if host is not None:
            plan, reason = engine_for_host(cache_dir, manifest, graph, host)
            if plan is None and build_engine:
                if not callable(build_engine):
                    raise ArtifactError(
                        f"load(build_engine={build_engine!r}) needs the engine builder itself: install the build "
                        "extra and pass build_engine=pipeline.build.stages.engine.build_artifact_engine"
                    )
                plan = build_engine(root, graph)
            if plan is not None:
                return plan, None
    if backend == "tensorrt":
        raise ArtifactError(f"cannot run {root} on TensorRT: {reason}")
    import onnxruntime

    providers = ort_gpu_providers(manifest, cache_dir, onnxruntime.get_available_providers())
    names = ", ".join(p if isinstance(p, str) else p[0] for p in providers)
    warnings.warn(f"{reason}; running {graph} on ONNX Runtime ({names})", EngineFallbackWarning, stacklevel=3)
    return None, providers
