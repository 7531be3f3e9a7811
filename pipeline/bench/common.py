"""What every benchmark shares: where results go, and what identifies a run (timing is pipeline/build/timing.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path


def host_summary(threads: int) -> dict:
    """The host a benchmark ran on: CPU model, kernel class, the flags that pick kernels, threads, versions."""
    from pipeline.build.cache import package_versions
    from pipeline.runtime.host import describe_host

    host = describe_host()
    versions = package_versions(("onnxruntime", "openvino", "torch", "numpy"))
    return {
        "cpu": host["cpu"],
        "kernel_class": host["kernel_class"],
        "flags": host["kernel_flags"],
        "threads": threads,
        "versions": {k: v for k, v in versions.items() if v != "absent"},
    }


def identity(manifest: dict, real: Path, threads: int) -> dict:
    """What a benchmark measured: the artifact, the host and the thread count."""
    keys = ("model_name", "version", "target")
    return {"artifact": str(real), **{k: manifest[k] for k in keys}, "threads": threads, "host": host_summary(threads)}


def open_decoder(artifact, option: str) -> tuple:
    """A decoder artifact opened for a serving benchmark (`option`: the flag that asked, for the error) with one
    intra-op thread a core: (path, verified manifest, model, threads, the benchmark's texts). An InputError where
    the artifact is not a decoder."""
    from pipeline.build.inputs.data import DEFAULT_VALIDATION, read_texts
    from pipeline.errors import InputError
    from pipeline.runtime import load
    from pipeline.runtime.artifact import verify_artifact

    artifact = Path(artifact)
    manifest = verify_artifact(artifact)
    if manifest["model"]["task"] != "text-generation":
        raise InputError(f"{option} benchmarks decoders; {artifact} is {manifest['model']['task']}")
    threads = os.cpu_count() or 1
    model = load(artifact, intra_op_threads=threads)
    return artifact, manifest, model, threads, read_texts(DEFAULT_VALIDATION, "benchmark")


def bench_folder(real: Path, manifest: dict) -> Path:
    """Where an artifact's benchmark results go: beside it, since a published artifact is immutable."""
    return real.parent.parent / "bench" / f"{manifest['version']}-{manifest['target']}"


def check_out(out: str | Path | None) -> None:
    """Refuse, before anything runs, an --out that lies inside a published artifact or cannot be written."""
    import tempfile

    from pipeline.build.store import check_outside_artifacts
    from pipeline.errors import InputError

    if out is None:
        return
    check_outside_artifacts(Path(out), "--out")
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as err:
        raise InputError(f"--out {out} cannot be written ({err.strerror or err}); pass a writable folder") from None


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


def figure(values: list[float]) -> dict:
    """A figure of several runs: its median and its p10-p90 range."""
    from pipeline.build.timing import median_range

    median, low, high = median_range(values)
    return {"median": median, "range": [low, high]}


def figure_cell(value: dict, scale: float = 1.0, digits: int = 2) -> str:
    """A `figure` as a Markdown cell: median [p10, p90], times `scale`."""
    low, high = (scale * v for v in value["range"])
    return f"{scale * value['median']:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"
