"""OpenVINO's CPU plugin behind the runtime's session interface. `openvino` is the `openvino` extra
(`pip install pipeline[openvino]`); it is imported only when an OpenVINO artifact is loaded.

The artifact's session settings carry the compile config the build chose: the inference precision (f32, or bf16
on hosts with AVX512-BF16 or AMX) and the thread count.
"""

from __future__ import annotations

import threading
import types
from pathlib import Path

from pipeline.errors import ArtifactError


def openvino_core():
    """An openvino.Core, or an ArtifactError naming the extra to install."""
    try:
        import openvino
    except ImportError:
        raise ArtifactError(
            "this artifact runs on OpenVINO, which is not installed; `pip install pipeline[openvino]` (or "
            "`pip install openvino`)"
        ) from None
    return openvino.Core()


def compile_config(session: dict | None) -> dict:
    """OpenVINO CPU properties from an artifact's session settings."""
    session = session or {}
    config = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1"}
    precision = session.get("inference_precision")
    if precision:
        config["INFERENCE_PRECISION_HINT"] = precision
    threads = int(session.get("intra_op_threads", 0) or 0)
    if threads > 0:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    return config


class OpenVINOSession:
    """A compiled OpenVINO model with onnxruntime.InferenceSession's `get_inputs`, `get_outputs` and `run`.

    One infer request, calls serialized: the CPU plugin already spreads one request over the session's threads."""

    def __init__(self, graph_path: Path, session: dict | None = None):
        core = openvino_core()
        self.config = compile_config(session)
        self.compiled = core.compile_model(core.read_model(str(graph_path)), "CPU", self.config)
        self.request = self.compiled.create_infer_request()
        self._lock = threading.Lock()
        self.precision = str(self.compiled.get_property("INFERENCE_PRECISION_HINT"))

    def get_inputs(self) -> list:
        return [
            types.SimpleNamespace(name=p.get_any_name(), shape=list(p.get_partial_shape()))
            for p in self.compiled.inputs
        ]

    def get_outputs(self) -> list:
        return [types.SimpleNamespace(name=p.get_any_name()) for p in self.compiled.outputs]

    def run(self, output_names, feeds: dict) -> list:
        names = output_names or [o.name for o in self.get_outputs()]
        with self._lock:
            results = self.request.infer(feeds)
            by_name = {port.get_any_name(): value for port, value in results.items()}
            return [by_name[name].copy() for name in names]
