"""A TensorRT engine behind the runtime's session interface (`get_inputs`, `get_outputs`, `run`).

tensorrt and cuda-python (for device memory) are imported only when an engine is run: they are the `tensorrt`
extra, and exist only on NVIDIA GPU hosts.
"""

from __future__ import annotations

import threading
import types
from pathlib import Path

from pipeline.errors import ArtifactError


def cuda_version() -> str | None:
    """The CUDA runtime's version, as cuda-python reports it (1000 * major + 10 * minor)."""
    try:
        cudart = _cudart()
        err, version = cudart.cudaRuntimeGetVersion()
    except (ImportError, RuntimeError):
        return None
    return f"{version // 1000}.{(version % 1000) // 10}" if not int(err) else None


def _cudart():
    """cuda-python's runtime module (its location moved in cuda-python 12.6)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        from cuda import cudart
    return cudart


def _call(cudart, result):
    """cuda-python returns (error, *values): raise on an error, else return the value(s)."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise ArtifactError(f"CUDA call failed: {cudart.cudaGetErrorName(err)[1]}")
    return values[0] if len(values) == 1 else values


class TensorRTSession:
    """Runs a serialized TensorRT engine through the part of onnxruntime.InferenceSession's interface that
    runtime.Model uses: get_inputs(), get_outputs() and run(output_names, feeds) on numpy arrays.

    Device buffers are allocated once, for the engine's largest profile shapes; a call copies the inputs in,
    runs on its own CUDA stream, and copies the outputs out. Calls are serialized: one execution context.
    """

    def __init__(self, plan_path: Path):
        import numpy as np
        import tensorrt as trt

        self._np = np
        self._cudart = cudart = _cudart()
        self._lock = threading.Lock()
        self._buffers: dict[str, tuple[int, int]] = {}
        logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(logger).deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise ArtifactError(
                f"TensorRT {trt.__version__} could not deserialize {plan_path}: built by another TensorRT version "
                "or for another GPU. Delete it and run `pipeline engine ARTIFACT` here"
            )
        self.context = self.engine.create_execution_context()
        self.stream = _call(cudart, cudart.cudaStreamCreate())
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if n not in self.input_names]
        self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in names}
        self.limits = {n: tuple(self.engine.get_tensor_profile_shape(n, 0)) for n in self.input_names}
        self.max_batch = min(int(self.limits[n][2][0]) for n in self.input_names)  # the encoder splits to fit
        for name in self.input_names:
            self.context.set_input_shape(name, self.limits[name][2])
        for name in names:
            shape = tuple(self.context.get_tensor_shape(name))
            nbytes = int(np.prod(shape)) * self.dtypes[name].itemsize
            pointer = _call(cudart, cudart.cudaMalloc(max(nbytes, 1)))
            self._buffers[name] = (pointer, nbytes)
            self.context.set_tensor_address(name, pointer)

    def get_inputs(self) -> list:
        return [types.SimpleNamespace(name=n, shape=list(self.limits[n][2])) for n in self.input_names]

    def get_outputs(self) -> list:
        return [types.SimpleNamespace(name=n) for n in self.output_names]

    def run(self, output_names, feeds: dict) -> list:
        np, cudart = self._np, self._cudart
        to_device = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        to_host = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        with self._lock:
            hold = []  # host arrays must outlive their asynchronous copies
            for name in self.input_names:
                array = np.ascontiguousarray(feeds[name], dtype=self.dtypes[name])
                low, _, high = self.limits[name]
                if len(array.shape) != len(high) or any(
                    not lo <= n <= hi for n, lo, hi in zip(array.shape, low, high, strict=True)
                ):
                    raise ArtifactError(
                        f"input {name} of shape {array.shape} is outside the engine's profile {low}..{high}; "
                        "pass smaller batches, or build the target with larger [tensorrt] profiles"
                    )
                self.context.set_input_shape(name, array.shape)
                hold.append(array)
                _call(
                    cudart,
                    cudart.cudaMemcpyAsync(
                        self._buffers[name][0], array.ctypes.data, array.nbytes, to_device, self.stream
                    ),
                )
            if not self.context.execute_async_v3(self.stream):
                raise ArtifactError("TensorRT failed to run the engine; see the TensorRT log above")
            results = []
            for name in output_names or self.output_names:
                out = np.empty(tuple(self.context.get_tensor_shape(name)), dtype=self.dtypes[name])
                _call(
                    cudart,
                    cudart.cudaMemcpyAsync(out.ctypes.data, self._buffers[name][0], out.nbytes, to_host, self.stream),
                )
                results.append(out)
            _call(cudart, cudart.cudaStreamSynchronize(self.stream))
        return results

    def __del__(self):
        cudart = getattr(self, "_cudart", None)
        for pointer, _ in getattr(self, "_buffers", {}).values():
            cudart.cudaFree(pointer)
        if getattr(self, "stream", None) is not None:
            cudart.cudaStreamDestroy(self.stream)
