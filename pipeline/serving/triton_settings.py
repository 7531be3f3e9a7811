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


def graph_refusal(artifact: Path, manifest: dict) -> str | None:
    """Why Triton's engine backend cannot run this artifact's graph as it was validated, or None where it can: an
    OpenVINO precision other than bf16 (the backend's parameters pin bf16 only, and OpenVINO runs bf16 by default on
    AVX512-BF16 and AMX hosts), or a dynamic int8 group its IR does not name (built before the IR carried it)."""
    if manifest["backend"] != "openvino":
        return None
    session = manifest["session"]
    precision = session.get("inference_precision")
    if precision not in (None, "bf16"):
        return (
            f"Triton's OpenVINO backend cannot pin this artifact's inference precision {precision} (its parameters "
            "pin bf16 only), and OpenVINO runs bf16 by default on hosts with AVX512-BF16 or AMX, which the artifact "
            "was not validated at"
        )
    group = session.get("dynamic_quantization_group_size")
    if group is not None and ir_group(artifact / manifest["graph"]) != group:
        return (
            f"the artifact runs dynamic int8 in groups of {group}, and its IR does not name that group for an "
            "OpenVINO compile without our loader (it was built before the IR carried it)"
        )
    return None


def openvino_parameters(artifact: Path, manifest: dict) -> dict:
    """The OpenVINO backend's parameters for the loader's compile config (`compile_config`): its precision as
    HINT_BF16, its group left to the IR's rt_info, the rest as they are. Refuses what `graph_refusal` names."""
    from pipeline.runtime.backends.openvino import compile_config

    why = graph_refusal(artifact, manifest)
    if why:
        raise ServingError(f"{why}; pass --variant python, which runs it through the loader, or rebuild the artifact")
    config = compile_config(manifest["session"])
    precision = config.pop("INFERENCE_PRECISION_HINT", None)
    config.pop("DYNAMIC_QUANTIZATION_GROUP_SIZE", None)  # the IR names it
    return {**config, **({"HINT_BF16": "YES"} if precision == "bf16" else {})}


def ir_group(xml: Path) -> int | None:
    """The dynamic int8 group size an OpenVINO IR names in its rt_info, or None."""
    from pipeline.runtime.backends.openvino import GROUP_RT_INFO, openvino_core

    model = openvino_core().read_model(str(xml))
    value = model.get_rt_info(GROUP_RT_INFO).astype(str) if model.has_rt_info(GROUP_RT_INFO) else ""
    return int(value) if value.isdigit() else None
