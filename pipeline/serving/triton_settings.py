"""What Triton's engine backends need in a graph model's config.pbtxt to run it as the loader runs it.

ONNX Runtime (`onnxruntime_backend`): the session's threads and execution mode as parameters, and
`optimization { graph { level } }` (-1 basic, 1 extended, 2 disabled; all by default). It has no parameter for
the session's `allow_spinning`.

OpenVINO (`openvino_backend`): its ParseParameters takes INFERENCE_NUM_THREADS, COMPILATION_NUM_THREADS,
HINT_BF16 (YES only), NUM_STREAMS and PERFORMANCE_HINT, each set on its core before it compiles the IR with no
config. It cannot pin f32 or f16, so those artifacts are refused; the dynamic int8 group travels in the IR's
rt_info (the recipe writes it), which OpenVINO's compile reads where nothing sets the property.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ServingError

# The ONNX Runtime backend's optimization { graph { level } } by the session's level ("all" is its default).
ORT_GRAPH_LEVELS = {"basic": -1, "extended": 1, "disabled": 2}


def backend_settings(artifact: Path, manifest: dict) -> dict:
    """The config.pbtxt fields (`parameters`, `optimization`) for the artifact's engine; {} where none apply."""
    backend, session = manifest["backend"], manifest["session"]
    settings, parameters = {}, {}
    if backend == "openvino":
        parameters = openvino_parameters(artifact, manifest)
    elif backend == "onnxruntime":
        parameters = onnxruntime_parameters(session)
        level = session.get("graph_optimization_level", "all")
        if level != "all":
            settings["optimization"] = {"graph": {"level": ORT_GRAPH_LEVELS[level]}}
    if parameters:
        settings["parameters"] = {key: {"string_value": value} for key, value in parameters.items()}
    return settings


def onnxruntime_parameters(session: dict) -> dict:
    """The ONNX Runtime backend's parameters for the session settings the loader applies (threads, mode)."""
    parameters = {}
    for key, name in (("intra_op_threads", "intra_op_thread_count"), ("inter_op_threads", "inter_op_thread_count")):
        if session.get(key):
            parameters[name] = str(session[key])
    if "execution_mode" in session:
        parameters["execution_mode"] = "1" if session["execution_mode"] == "parallel" else "0"
    return parameters


def pinned_precision(manifest: dict) -> bool:
    """Whether Triton's OpenVINO backend can compile an OpenVINO artifact at the precision it was validated at:
    its parameters pin bf16 (HINT_BF16) and nothing else, so f32 or f16 would run at the serving host's default."""
    return manifest["backend"] != "openvino" or manifest["session"].get("inference_precision") in (None, "bf16")


def openvino_parameters(artifact: Path, manifest: dict) -> dict:
    """The OpenVINO backend's parameters for the loader's compile config (`compile_config`): its precision as
    HINT_BF16, its group left to the IR's rt_info, the rest as they are. Refuses a precision the backend cannot pin
    and an IR that does not name the session's dynamic int8 group."""
    from pipeline.runtime.backends.openvino import compile_config

    config = compile_config(manifest["session"])
    precision = config.pop("INFERENCE_PRECISION_HINT", None)
    if not pinned_precision(manifest):
        raise ServingError(
            f"Triton's OpenVINO backend cannot pin this artifact's inference precision {precision} (its parameters "
            "pin bf16 only), and OpenVINO runs bf16 by default on hosts with AVX512-BF16 or AMX, which the "
            "artifact was not validated at; pass --variant python, which runs it through the loader at its precision"
        )
    group = config.pop("DYNAMIC_QUANTIZATION_GROUP_SIZE", None)
    if group is not None and ir_group(artifact / manifest["graph"]) != int(group):
        raise ServingError(
            f"{artifact} runs dynamic int8 in groups of {group}, and its IR does not name that group for an "
            "OpenVINO compile without our loader (it was built before the IR carried it); rebuild the artifact"
        )
    return {**config, **({"HINT_BF16": "YES"} if precision == "bf16" else {})}


def ir_group(xml: Path) -> int | None:
    """The dynamic int8 group size an OpenVINO IR names in its rt_info, or None."""
    from pipeline.runtime.backends.openvino import GROUP_RT_INFO, openvino_core

    model = openvino_core().read_model(str(xml))
    value = model.get_rt_info(GROUP_RT_INFO).astype(str) if model.has_rt_info(GROUP_RT_INFO) else ""
    return int(value) if value.isdigit() else None
