"""ONNX Runtime sessions with an artifact's session settings, and its GPU providers for TensorRT targets."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ArtifactError

_GRAPH_LEVELS = {"disabled": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED"}


def open_session(onnx_path: Path, session: dict | None, providers=None):
    """An ONNX Runtime session with the artifact's session settings (threads, graph level, execution mode)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    session = session or {}
    options.intra_op_num_threads = int(session.get("intra_op_threads", 0))
    options.inter_op_num_threads = int(session.get("inter_op_threads", 1))
    level = session.get("graph_optimization_level", "all")
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _GRAPH_LEVELS.get(level, "ORT_ENABLE_ALL"))
    if not session.get("allow_spinning", True):
        # Idle pool threads otherwise spin for a while after each run, taking cores from whatever runs next.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if session.get("execution_mode") == "parallel":
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    try:
        return ort.InferenceSession(str(onnx_path), options, providers=providers or ["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime raises its own Fail/InvalidGraph types
        detail = " ".join(str(err).split()).removeprefix("[ONNXRuntimeError] : 1 : FAIL : ")
        if "external data" not in detail.lower():
            raise
        raise ArtifactError(
            f"{onnx_path} cannot be opened: its weights' data file is missing or unreadable ({detail}); restore the "
            "file or rebuild the artifact"
        ) from None


def open_stream_sessions(onnx_path: Path, session: dict | None, providers=None, full=None) -> list:
    """The sessions the streams of a split batch run on (see pipeline.runtime.streams), one per stream, each with
    its share of the threads. `full`, the session with all the threads, is reused where its share is all of them.

    A one-thread session runs each call on its caller's thread with no pool, so the streams share one such session
    (one copy of the weights beside `full`'s). Concurrent runs of one wider session share its intra-op pool and wait
    on each other's parallel sections (on 2 cores no faster than one request: docs/runtime.md), so wider streams get
    a session each. ONNX Runtime's Python API cannot share pre-packed weights between sessions (no
    PrepackedWeightsContainer; add_initializer shares only the raw initializers), so each session holds its own."""
    from pipeline.runtime.streams import stream_settings

    streams, per_stream, _ = stream_settings(session)
    settings = {**(session or {}), "intra_op_threads": per_stream}
    if per_stream == 1:
        reusable = full is not None and full.get_session_options().intra_op_num_threads == 1
        return [full if reusable else open_session(onnx_path, settings, providers)] * streams
    return [open_session(onnx_path, settings, providers) for _ in range(streams)]


def ort_gpu_providers(manifest: dict, cache_dir: Path, available: list[str]) -> list:
    """ONNX Runtime providers for a TensorRT target's graph, of those `available`: the TensorRT provider (engine
    and timing caches in the artifact's engine cache, the target's profiles and settings), then CUDA, then CPU.
    Decoders skip the TensorRT provider: their KV-cache shapes are outside its profiles."""
    trt = manifest["target_spec"]["tensorrt"]
    profiles = (manifest.get("engine") or {}).get("profiles")
    providers: list = []
    if "TensorrtExecutionProvider" in available and profiles:

        def shapes(kind: str) -> str:
            return ",".join(f"{name}:{'x'.join(map(str, p[kind]))}" for name, p in profiles.items())

        options = {
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(Path(cache_dir) / "onnxruntime"),
            "trt_timing_cache_enable": bool(trt["timing_cache"]),
            "trt_timing_cache_path": str(Path(cache_dir) / "onnxruntime"),
            "trt_max_workspace_size": int(trt["workspace_mb"]) << 20,
            "trt_builder_optimization_level": int(trt["builder_optimization_level"]),
            "trt_engine_hw_compatible": trt["hardware_compatibility"] != "none",
            "trt_profile_min_shapes": shapes("min"),
            "trt_profile_opt_shapes": shapes("opt"),
            "trt_profile_max_shapes": shapes("max"),
        }
        providers.append(("TensorrtExecutionProvider", options))
    if "CUDAExecutionProvider" in available:
        providers.append("CUDAExecutionProvider")
    return providers + ["CPUExecutionProvider"]


def open_encoder_decoder(encoder_path: Path, spec: dict, session, providers, backend: str, kind: str) -> tuple:
    """(encoder, decoder) sessions of a two-graph artifact (`kind`: "speech", "text-to-text"): the encoder graph and
    the decoder graph its spec names beside it, on ONNX Runtime; else an ArtifactError."""
    from pipeline.errors import ArtifactError
    from pipeline.runtime.schema import DECODER_GRAPH

    if spec.get("decoder_graph") != DECODER_GRAPH or backend != "onnxruntime":
        raise ArtifactError(
            f"{encoder_path.parent}: a {kind} artifact runs {DECODER_GRAPH} beside its encoder on ONNX Runtime; this "
            f"one names {spec.get('decoder_graph')!r} on {backend}. Rebuild it"
        )
    encoder = open_session(encoder_path, session, providers)
    return encoder, open_session(encoder_path.parent / DECODER_GRAPH, session, providers)
