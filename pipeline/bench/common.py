"""What every benchmark shares: where results go, and what identifies a run (timing is pipeline/timing.py)."""

from __future__ import annotations

import json
from pathlib import Path


def host_summary(threads: int) -> dict:
    """The host a benchmark ran on: CPU model, kernel class, the flags that pick kernels, threads, versions."""
    from importlib import metadata

    from pipeline.runtime.host import INT8_KERNEL_FLAGS, cpu_flags, cpu_model, kernel_class

    flags = cpu_flags() or frozenset()
    versions = {}
    for name in ("onnxruntime", "openvino", "torch", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    kernel_flags = [f for f in ("avx2", "fma", "avx512f", *INT8_KERNEL_FLAGS, "avx512_bf16", "amx_bf16") if f in flags]
    return {
        "cpu": cpu_model(),
        "kernel_class": kernel_class(flags),
        "flags": kernel_flags,
        "threads": threads,
        "versions": versions,
    }


def identity(manifest: dict, real: Path, threads: int) -> dict:
    """What a benchmark measured: the artifact, the host and the thread count."""
    keys = ("model_name", "version", "target")
    return {"artifact": str(real), **{k: manifest[k] for k in keys}, "threads": threads, "host": host_summary(threads)}


def bench_folder(real: Path, manifest: dict) -> Path:
    """Where an artifact's benchmark results go: beside it, since a published artifact is immutable."""
    return real.parent.parent / "bench" / f"{manifest['version']}-{manifest['target']}"


def write_results(results: dict, text: str, out: str | Path) -> Path:
    """Write the results (bench.json) and their Markdown `text` (bench.md) into `out`; returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(text)
    return out


def host_line(results: dict) -> str:
    """The Markdown line naming the host a benchmark ran on: CPU, kernel class, flags, threads and versions."""
    host = results["host"]
    versions = ", ".join(f"{k} {v}" for k, v in host["versions"].items())
    return (
        f"Host: {host['cpu']} ({host['kernel_class']}; {' '.join(host['flags'])}), {results['threads']} threads; "
        f"{versions}."
    )
