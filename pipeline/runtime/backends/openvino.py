"""OpenVINO's CPU plugin behind the runtime's session interface. `openvino` is the `openvino` extra
(`pip install pipeline[openvino]`); it is imported only when an OpenVINO artifact is loaded.

The artifact's session settings carry the compile config the build chose: the inference precision (f32, or bf16
on hosts with AVX512-BF16 or AMX), the group size of the dynamic int8 activations of an int8-weight model, the
thread count and the streams (pipeline.runtime.streams).

With streams S > 1 the model is compiled twice: once as a single stream with every thread (a chunk that is not
split runs on it), and once with NUM_STREAMS = S sharing those threads, for the halves of a split batch. One
request on a multi-stream compile gets only its stream's threads (measured on 2 cores: batch 1 twice as slow),
and the CPU plugin shares repacked weights only between the streams of one compiled model, not between compiled
models: streams cost a second copy of the weights, as ONNX Runtime's do.
"""

from __future__ import annotations

import threading
import types
from pathlib import Path

from pipeline.errors import ArtifactError

# Where an IR names the group of its dynamic int8 activations: OpenVINO's compile reads these runtime options of the
# model's rt_info where no config sets the property (the loader's config sets it all the same).
GROUP_RT_INFO = ["runtime_options", "DYNAMIC_QUANTIZATION_GROUP_SIZE"]


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
    group = session.get("dynamic_quantization_group_size")
    if group is not None:  # int8 activations quantized as they run (int8-compressed weights); 0 turns it off
        config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(group)
    threads = int(session.get("intra_op_threads", 0) or 0)
    if threads > 0:
        config["INFERENCE_NUM_THREADS"] = str(threads)
    return config


def stream_config(session: dict | None) -> dict:
    """OpenVINO CPU properties of the multi-stream compile: NUM_STREAMS streams sharing the session's threads."""
    from pipeline.runtime.streams import stream_settings

    streams, per_stream, _ = stream_settings(session)
    config = {**compile_config(session), "PERFORMANCE_HINT": "THROUGHPUT", "NUM_STREAMS": str(streams)}
    config["INFERENCE_NUM_THREADS"] = str(streams * per_stream)
    return config


class _Request:
    """One infer request of a compiled model behind the session interface's `run`; one caller at a time."""

    def __init__(self, request):
        self.request = request

    def run(self, output_names, feeds: dict) -> list:
        results = self.request.infer(feeds)
        by_name = {name: value for port, value in results.items() for name in port.get_names()}
        return [by_name[name].copy() for name in output_names]


def _graph_name(names, fallback: str) -> str:
    """The name a graph's input was given by its exporter, rather than an inner tensor's (`/model/.../Cast`)."""
    return next((n for n in sorted(names) if not n.startswith("/")), fallback)


class OpenVINOSession:
    """A compiled OpenVINO model with onnxruntime.InferenceSession's `get_inputs`, `get_outputs` and `run`.

    One infer request, calls serialized: the CPU plugin already spreads one request over the session's threads.
    `stream_sessions()` gives the requests a split batch runs on, where the session settings ask for streams."""

    def __init__(self, graph_path: Path, session: dict | None = None):
        core = openvino_core()
        self.config = compile_config(session)
        model = core.read_model(str(graph_path))
        self.compiled = core.compile_model(model, "CPU", self.config)
        self.request = _Request(self.compiled.create_infer_request())
        self._lock = threading.Lock()
        self.precision = str(self.compiled.get_property("INFERENCE_PRECISION_HINT"))
        self.streamed = None
        streams = int((session or {}).get("streams", 1))
        if streams > 1:
            self.streamed = core.compile_model(model, "CPU", stream_config(session))

    def stream_sessions(self) -> list:
        """One infer request per stream of the multi-stream compile (empty without one)."""
        if self.streamed is None:
            return []
        count = int(self.streamed.get_property("NUM_STREAMS"))
        return [_Request(self.streamed.create_infer_request()) for _ in range(count)]

    def get_inputs(self) -> list:
        """Each input under its graph input's name: a fused Cast can give it its consumer's name too (an image
        model's pixel_values), and `get_any_name` may return that one."""
        return [
            types.SimpleNamespace(name=_graph_name(p.get_names(), p.get_any_name()), shape=list(p.get_partial_shape()))
            for p in self.compiled.inputs
        ]

    def get_outputs(self) -> list:
        """Each output under each of its tensor names: the CPU plugin's fusions can give an ONNX graph's output
        a second name (its producer's), and either may be the one `get_any_name` returns."""
        return [types.SimpleNamespace(name=n) for p in self.compiled.outputs for n in sorted(p.get_names())]

    def run(self, output_names, feeds: dict) -> list:
        names = output_names or [p.get_any_name() for p in self.compiled.outputs]
        with self._lock:
            return self.request.run(names, feeds)
