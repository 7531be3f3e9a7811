"""Stage: engine_from_onnx, for TensorRT targets.

Where TensorRT and a GPU of the target's compute capability are present, the engine is built with the target's
optimization profiles and recorded; elsewhere (CI, CPU hosts) the stage records the engine as pending, with the
reason, and every other stage's output is still published. Engines are to be cached by
(compute capability, TensorRT version, profile hash): see `runtime.engine_cache_key`.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import time

from pipeline.errors import TargetError
from pipeline.manifest import Manifest, StageRecord
from pipeline.runtime import canonical_json
from pipeline.targets import Target


def profiles(target: Target, spec: dict) -> dict:
    """Optimization profile per input: {"min": [batch, seq], "opt": [...], "max": [...]}, capped at the model's
    maximum length; a profile out of order is a TargetError."""
    trt = target.tensorrt
    limit = int(spec["max_length"])
    max_seq = min(trt.max_sequence or limit, limit)
    opt_seq = min(trt.opt_sequence, max_seq)
    batches, seqs = (trt.min_batch, trt.opt_batch, trt.max_batch), (trt.min_sequence, opt_seq, max_seq)
    for name, (low, mid, high) in (("batch", batches), ("sequence", seqs)):
        if not 1 <= low <= mid <= high:
            raise TargetError(
                f"target {target.name}: [tensorrt] {name} profile min {low} <= opt {mid} <= max {high} does not hold"
            )
    shape = {k: [b, s] for k, b, s in zip(("min", "opt", "max"), batches, seqs, strict=True)}
    return {name: shape for name in spec["inputs"]}


def profile_hash(profile: dict) -> str:
    """A short digest of the profiles, part of the engine cache key."""
    return hashlib.sha256(canonical_json(profile)).hexdigest()[:16]


def gpu_host() -> tuple[dict | None, str]:
    """(the GPU and TensorRT of this host, "") or (None, why there is none)."""
    try:
        import tensorrt
    except ImportError:
        return None, "TensorRT is not installed on this host"
    if shutil.which("nvidia-smi") is None:
        return None, "no NVIDIA driver (nvidia-smi) on this host"
    query = ["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"]
    result = subprocess.run(query, capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        return None, "nvidia-smi found no GPU"
    name, capability, driver = (part.strip() for part in result.stdout.splitlines()[0].split(","))
    return {"gpu": name, "compute_capability": capability, "driver": driver, "tensorrt": tensorrt.__version__}, ""


def run(manifest: Manifest, target: Target) -> Manifest:
    """Record the engine's profiles and cache key; build it only where a matching GPU and TensorRT are present."""
    if target.engine != "tensorrt":
        return manifest
    started = time.perf_counter()
    spec = manifest.stage("export").metrics["spec"]
    profile = profiles(target, spec)
    host, reason = gpu_host()
    if host and host["compute_capability"] != target.tensorrt.compute_capability:
        reason = (
            f"this host's GPU ({host['gpu']}, compute capability {host['compute_capability']}) is not the "
            f"target's ({target.tensorrt.compute_capability})"
        )
    metrics = {
        "status": "pending",
        "reason": reason,
        "profiles": profile,
        "profile_hash": profile_hash(profile),
        "compute_capability": target.tensorrt.compute_capability,
        "tensorrt": host["tensorrt"] if host else None,
    }
    if not reason:
        # Building needs a GPU and has not run on one yet; until it has, the engine stays pending, saying why.
        metrics["reason"] = "building the engine on a GPU host is not implemented yet"
    record = StageRecord(
        name="engine", key=metrics["profile_hash"], config={"tensorrt": target.to_dict()["tensorrt"]},
        outputs={}, metrics=metrics, seconds=round(time.perf_counter() - started, 3), reused=False,
    )  # fmt: skip
    return manifest.with_stage(record)
