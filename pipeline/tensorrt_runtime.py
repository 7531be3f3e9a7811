"""TensorRT at run time: the host's GPU, the engine cache beside an artifact, and a session that runs an engine.

Engines are tied to the GPU architecture and the TensorRT version, so they never go into the immutable,
hardware-neutral artifact. They live in its engine cache, one pair of files per engine:

    artifacts/<model>/engines/<version>-<target>/<key>-<graph>.plan   the serialized engine
    artifacts/<model>/engines/<version>-<target>/<key>-<graph>.json   what it was built from and for, and how it
                                                                       validated; written last, so it marks a
                                                                       complete entry
    <key> = sm<compute capability>-trt<TensorRT version>-<profile hash>     (runtime.engine_cache_key)

Like the rest of the runtime this imports no torch, transformers or onnx; tensorrt and cuda-python (for device
memory) are imported only when an engine is run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import types
import uuid
from pathlib import Path

from pipeline.errors import ArtifactError
from pipeline.runtime import check_engine, engine_cache_key, runs_on, sha256_file

ENGINES_DIR = "engines"


def gpu_host() -> tuple[dict | None, str]:
    """(this host's GPU, driver, CUDA and TensorRT versions, "") or (None, why TensorRT cannot run here)."""
    try:
        import tensorrt
    except ImportError:
        return None, "TensorRT is not installed on this host"
    if shutil.which("nvidia-smi") is None:
        return None, "no NVIDIA driver (nvidia-smi) on this host"
    query = ["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"]
    result = subprocess.run(query, capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        return None, f"nvidia-smi found no GPU ({(result.stderr or result.stdout).strip()[:200]})"
    name, capability, driver = (part.strip() for part in result.stdout.splitlines()[0].split(","))
    return {
        "gpu": name,
        "compute_capability": capability,
        "driver": driver,
        "cuda": _cuda_version(),
        "tensorrt": tensorrt.__version__,
    }, ""


def _cuda_version() -> str | None:
    """The CUDA runtime's version, as cuda-python reports it (1000 * major + 10 * minor)."""
    try:
        cudart = _cudart()
        err, version = cudart.cudaRuntimeGetVersion()
    except (ImportError, RuntimeError):
        return None
    return f"{version // 1000}.{(version % 1000) // 10}" if not int(err) else None


def engine_cache_dir(artifact: Path, manifest: dict) -> Path:
    """Where the engines of a published artifact are cached: beside its versions, outside the artifact."""
    return Path(artifact).resolve().parent.parent / ENGINES_DIR / f"{manifest['version']}-{manifest['target']}"


def engine_name(compute_capability: str, tensorrt_version: str, profile_hash: str, graph: str) -> str:
    """The file stem of one graph's engine in the cache (model.onnx -> ...-model, model.int8.onnx -> ...-int8)."""
    stem = "model" if graph == "model.onnx" else graph.removeprefix("model.").removesuffix(".onnx")
    return f"{engine_cache_key(compute_capability, tensorrt_version, profile_hash)}-{stem}"


def write_engine(cache_dir: Path, name: str, plan: bytes, record: dict) -> dict:
    """Put one engine into the cache: the plan, then its record (with the plan's sha256), each renamed into place,
    so a reader sees a complete entry or none."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = cache_dir / f".{name}.{uuid.uuid4().hex}"
    scratch.write_bytes(plan)
    os.replace(scratch, cache_dir / f"{name}.plan")
    record = {**record, "name": name, "plan_sha256": sha256_file(cache_dir / f"{name}.plan")}
    scratch.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(scratch, cache_dir / f"{name}.json")
    return record


def find_engine(cache_dir: Path, manifest: dict, graph: str, host: dict) -> tuple[Path | None, list[dict]]:
    """The cached engine of `graph` for this host's GPU architecture and TensorRT version, checked against the
    artifact's graph and its own hash; else (None, the records of the engines cached for other hosts)."""
    profile_hash = manifest["engine"]["profile_hash"]
    name = engine_name(host["compute_capability"], host["tensorrt"], profile_hash, graph)
    record_path = cache_dir / f"{name}.json"
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
        except (OSError, ValueError) as err:
            raise ArtifactError(f"{record_path} is damaged ({err}); delete it and build the engine again") from None
        if record.get("graph_sha256") != manifest["files"].get(graph):
            raise ArtifactError(
                f"{record_path} was built from another {graph} than this artifact's; delete it and run "
                "`pipeline engine ARTIFACT`"
            )
        plan = cache_dir / f"{name}.plan"
        if not plan.is_file() or sha256_file(plan) != record.get("plan_sha256"):
            raise ArtifactError(f"{plan} is missing or does not match its sha256 in {record_path.name}; rebuild it")
        check_engine(record, host["compute_capability"], host["tensorrt"])
        return plan, []
    others = []
    for path in sorted(cache_dir.glob("*.json")) if cache_dir.is_dir() else ():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("graph") == graph and record.get("profile_hash") == profile_hash:
            others.append(record)
    # A hardware-compatible engine built on another Ampere-or-later GPU serves this one too.
    for record in others:
        if runs_on(record, host["compute_capability"]) and record.get("tensorrt") == host["tensorrt"]:
            return find_engine(cache_dir, manifest, graph, {**host, "compute_capability": record["compute_capability"]})
    return None, others


def engine_for_host(cache_dir: Path, manifest: dict, graph: str, host: dict) -> tuple[Path | None, str]:
    """(the engine of `graph` for this host, "") or (None, why there is none: an engine built for another GPU
    architecture or TensorRT version, naming both, or none at all)."""
    plan, others = find_engine(cache_dir, manifest, graph, host)
    if plan is not None:
        return plan, ""
    for record in others:
        try:
            check_engine(record, host["compute_capability"], host["tensorrt"])
        except ArtifactError as err:
            return None, str(err)
    return None, (
        f"no engine of {graph} for this host (compute capability {host['compute_capability']}, TensorRT "
        f"{host['tensorrt']}) in {cache_dir}; build it with `pipeline engine ARTIFACT` or load(..., build_engine=True)"
    )


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
                _call(cudart, cudart.cudaMemcpyAsync(
                    self._buffers[name][0], array.ctypes.data, array.nbytes, to_device, self.stream
                ))  # fmt: skip
            if not self.context.execute_async_v3(self.stream):
                raise ArtifactError("TensorRT failed to run the engine; see the TensorRT log above")
            results = []
            for name in output_names or self.output_names:
                out = np.empty(tuple(self.context.get_tensor_shape(name)), dtype=self.dtypes[name])
                _call(cudart, cudart.cudaMemcpyAsync(
                    out.ctypes.data, self._buffers[name][0], out.nbytes, to_host, self.stream
                ))  # fmt: skip
                results.append(out)
            _call(cudart, cudart.cudaStreamSynchronize(self.stream))
        return results

    def __del__(self):
        cudart = getattr(self, "_cudart", None)
        for pointer, _ in getattr(self, "_buffers", {}).values():
            cudart.cudaFree(pointer)
        if getattr(self, "stream", None) is not None:
            cudart.cudaStreamDestroy(self.stream)
