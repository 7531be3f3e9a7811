"""Serving under concurrency: direct calls, the in-process Batcher, Triton (Python backend) and Ray Serve, each at
1, 8 and 32 concurrent callers sending one text per request; requests/s and latency p50/p99.

The servers run on this host beside their clients (which take CPU from them), one variant at a time; Triton
needs .venv-triton (`make triton-env`) and Ray the `serve` extra, and each is a row marked missing otherwise.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from pipeline.build.console import progress
from pipeline.build.timing import percentile
from pipeline.errors import PipelineError

REPO = Path(__file__).resolve().parents[2]
TRITON_ENV = REPO / ".venv-triton"


def drive(make_call, texts: list[str], callers: int, seconds: float) -> dict:
    """Run `callers` threads for `seconds`, each calling its own `make_call()` with one text per request."""
    barrier = threading.Barrier(callers + 1)
    latencies: list[list[float]] = [[] for _ in range(callers)]
    errors = []

    def caller(n: int) -> None:
        call = make_call()
        barrier.wait()
        deadline = time.perf_counter() + seconds
        i = n
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                call(texts[i % len(texts)])
            except Exception as err:  # a failed request is a figure of the variant, not a crash of the bench
                errors.append(repr(err))
            latencies[n].append(time.perf_counter() - started)
            i += callers

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(callers)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    flat = [x for row in latencies for x in row]
    return {
        "callers": callers,
        "requests": len(flat),
        "errors": len(errors),
        "requests_per_s": len(flat) / elapsed,
        "p50_ms": percentile(flat, 50) * 1000,
        "p99_ms": percentile(flat, 99) * 1000,
    }


def _triton(artifact: Path, scratch: Path):
    """A started local Triton serving the artifact's Python-backend model, and a per-thread call factory."""
    import tritonclient.http as triton_http

    from pipeline.serving.triton import repository_from_artifact
    from pipeline.serving.triton_server import LocalTriton

    [config] = repository_from_artifact(artifact, scratch / "repo", variants=("python",), python_env=str(TRITON_ENV))
    model, output = config.parent.name, "EMBEDDING"
    server = LocalTriton(scratch / "repo", TRITON_ENV).__enter__()

    def make_call():
        client = triton_http.InferenceServerClient(server.url.removeprefix("http://"))

        def call(text: str):
            tensor = triton_http.InferInput("TEXT", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
            return client.infer(model, [tensor]).as_numpy(output)

        return call

    return server.stop, make_call


def _ray(artifact: Path):
    from pipeline.serving import ray_serve
    from pipeline.serving.triton_server import free_port

    port = free_port()
    ray_serve.deploy(artifact, replicas=1, port=port)

    def make_call():
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

        def call(text: str):
            connection.request("POST", "/", json.dumps({"texts": [text]}), {"Content-Type": "application/json"})
            answer = connection.getresponse()
            body = answer.read()
            if answer.status != 200:
                raise RuntimeError(f"HTTP {answer.status}: {body[:200]!r}")
            return body

        return call

    return ray_serve.shutdown, make_call


def _servers(artifact: Path, scratch: Path) -> dict:
    """Each server variant's (start, why it is missing)."""
    servers = {}
    if (TRITON_ENV / ".installed").exists():
        servers["triton-python"] = (lambda: _triton(artifact, scratch), None)
    else:
        servers["triton-python"] = (None, "no .venv-triton: make triton-env")
    try:
        import ray.serve  # noqa: F401

        servers["ray-serve"] = (lambda: _ray(artifact), None)
    except ImportError:
        servers["ray-serve"] = (None, "ray[serve] is not installed (the serve extra)")
    return servers


def concurrency(
    model, artifact: Path, texts: list[str], callers=(1, 8, 32), seconds: float = 4.0, servers: bool = True
) -> dict:
    """Requests/s and p50/p99 latency of each way to serve `model` at each number of concurrent callers."""
    from pipeline.runtime.batcher import Batcher

    rows, missing = [], {}
    with Batcher(model, max_batch_size=32, max_wait_ms=2) as batcher:
        local = {"direct": lambda: lambda text: model.run([text]), "batcher": lambda: batcher}
        for name, make_call in local.items():
            for n in progress(callers, f"bench: {name} callers"):
                rows.append({"variant": name, **drive(make_call, texts, n, seconds)})
    with tempfile.TemporaryDirectory() as scratch:
        for name, (start, why) in (_servers(artifact, Path(scratch)) if servers else {}).items():
            if start is None:
                missing[name] = why
                continue
            try:
                stop, make_call = start()
            except PipelineError as err:  # a server that cannot start is a row, not the end of the benchmark
                missing[name] = f"it did not start: {str(err).splitlines()[0][:300]}"
                continue
            try:
                for n in progress(callers, f"bench: {name} callers"):
                    rows.append({"variant": name, **drive(make_call, texts, n, seconds)})
            finally:
                with contextlib.suppress(Exception):
                    stop()
    return {"seconds_per_point": seconds, "rows": rows, "missing": missing}


def markdown(results: dict) -> list[str]:
    """The concurrency table as Markdown lines."""
    lines = [
        f"Serving one text per request, {results['seconds_per_point']:.0f} s per point, servers and clients on this "
        "host:",
        "",
        "| variant | callers | requests/s | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['variant']} | {row['callers']} | {row['requests_per_s']:.0f} | {row['p50_ms']:.1f} | "
            f"{row['p99_ms']:.1f} | {row['errors']} |"
        )
    lines += [f"- {name}: not measured ({why})" for name, why in results["missing"].items()]
    return lines
