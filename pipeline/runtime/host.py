"""What the host offers: CPU feature flags, the class of kernels they select, cores, and the GPU probe.

ONNX Runtime and OpenVINO pick their int8 and bf16 kernels by these flags at run time, so an artifact's accuracy and
speed were measured on one kernel class; the loader compares the host's with the build host's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from pathlib import Path

from pipeline.errors import ArtifactError

# Ordered from the most capable: the first whose flags the host has is its class.
KERNEL_CLASSES = (
    ("amx", ("amx_bf16", "amx_int8", "avx512f", "avx512_vnni")),
    ("avx512-vnni", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")),
    ("avx512", ("avx512f", "avx512bw", "avx512vl")),
    ("avx2", ("avx2", "fma")),
)
# ONNX Runtime picks its int8 kernels by these flags at run time, so int8 results can differ between hosts.
INT8_KERNEL_FLAGS = ("avx512_vnni", "avx_vnni", "avx512bw", "amx_int8")


class HostMismatchWarning(UserWarning):
    """The host lacks CPU features the artifact's target requires, or runs other kernels than the build host."""


def cpu_flags() -> frozenset[str] | None:
    """The host's CPU feature flags from /proc/cpuinfo, or None where they cannot be read (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return None


def kernel_class(flags: frozenset[str] | None = None) -> str:
    """The host's kernel class: "amx", "avx512-vnni", "avx512", "avx2", else "baseline" (or "unknown")."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return "unknown"
    return next((name for name, needed in KERNEL_CLASSES if set(needed) <= flags), "baseline")


def cpu_model() -> str:
    """The CPU's model name, for benchmark and build reports."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


# The flags that pick ONNX Runtime's and OpenVINO's kernels, as benchmark reports list them.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", *INT8_KERNEL_FLAGS, "avx512_bf16", "amx_bf16")


def describe_host() -> dict:
    """This host as manifests and benchmark reports record it: machine, system, CPU model, usable cores, kernel
    class, every CPU flag (None where unreadable) and the flags that pick kernels."""
    import platform

    flags = cpu_flags()
    return {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "kernel_class": kernel_class(flags),
        "cpu_flags": sorted(flags) if flags else None,
        "kernel_flags": [f for f in KERNEL_FLAGS if f in (flags or ())],
    }


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_host(manifest: dict, strict: bool) -> None:
    """Warn (or, with `strict`, refuse) where this host lacks the target's CPU flags, and warn where its int8 or
    bf16 kernels differ from the build host's."""
    required = set(manifest["target_spec"].get("required_cpu_flags", ()))
    flags = cpu_flags()
    built_on = set(manifest["host"].get("cpu_flags") or ())
    precision = manifest.get("precision") or manifest["target_spec"].get("precision")
    if precision in ("int8", "bf16") and flags is not None and built_on:
        differ = sorted(f for f in INT8_KERNEL_FLAGS + ("amx_bf16", "avx512_bf16") if (f in flags) != (f in built_on))
        if differ:
            warnings.warn(
                f"this host and the build host differ in {', '.join(differ)}, so the engine runs other kernels than "
                "the ones validated; re-validate here with `pipeline validate ARTIFACT`",
                HostMismatchWarning,
                stacklevel=4,
            )
    if not required:
        return
    if flags is None:
        message = f"cannot read this host's CPU flags to check {sorted(required)} for target {manifest['target']}"
    else:
        missing = sorted(required - flags)
        if not missing:
            return
        message = (
            f"this host lacks CPU flags {', '.join(missing)} that target {manifest['target']} requires; "
            f"the artifact may run slowly or fail. Load the artifact built for this host's class "
            f"({kernel_class(flags)}) instead"
        )
    if strict:
        raise ArtifactError(message)
    warnings.warn(message, HostMismatchWarning, stacklevel=4)


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
    from pipeline.runtime.backends.tensorrt import cuda_version

    return {
        "gpu": name,
        "compute_capability": capability,
        "driver": driver,
        "cuda": cuda_version(),
        "tensorrt": tensorrt.__version__,
    }, ""
