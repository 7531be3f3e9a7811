"""An artifact as a Ray Serve application (`pipeline serve ARTIFACT [--replicas N] [--address ray://...]`).

Each replica loads the artifact once (verified at load) and batches concurrent requests with @serve.batch; HTTP
is served by Ray's proxy on a loopback port. The request is JSON `{"texts": [...]}`; the answer is
`{"embeddings": ...}` (feature-extraction), `{"logits": ...}` (classifiers) or `{"completions": [...]}` (decoders).
A bad request gets HTTP 400 with a message, and the replica keeps serving.

Cores: each replica's session runs `threads` intra-op threads and reserves as many CPUs from Ray, and
threads = floor(CPUs / replicas) unless given, so replicas x threads never exceeds the CPUs (of this host, or of
the cluster, where Ray places each replica on a node with that many free). More replicas than CPUs is refused.
"""

from __future__ import annotations

import json
import os
import socket
import time
from urllib.parse import urlparse

from pipeline.errors import InputError, ServingError

APP = "pipeline"
ROUTE = "/"
CONNECT_TIMEOUT_S = 5.0


def replica_threads(replicas: int, cpus: int, threads: int | None = None) -> int:
    """Session threads per replica: `threads`, or floor(cpus / replicas); replicas x threads must fit `cpus`."""
    if replicas < 1:
        raise InputError(f"--replicas {replicas}: pass 1 or more")
    threads = threads or cpus // replicas
    if threads < 1 or replicas * threads > cpus:
        raise ServingError(
            f"{replicas} replicas of {max(threads, 1)} thread(s) need {replicas * max(threads, 1)} CPUs, but "
            f"{cpus} are available; pass --replicas {max(cpus, 1)} or fewer (or fewer --threads)"
        )
    return threads


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """A ServingError within `timeout_s` when nothing answers at a Ray address (ray://host:port or host:port):
    ray.init itself waits up to minutes on a dead address."""
    parsed = urlparse(address if "://" in address else f"gcs://{address}")
    host, port = parsed.hostname, parsed.port
    if not host or not port:
        raise InputError(f"--address {address!r} is not host:port or ray://host:port")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise ServingError(
            f"no Ray cluster answers at {address} ({err.strerror or err} within {timeout_s:.0f} s); start one with "
            "`ray start --head` or check the address"
        ) from None


def answer_key(task: str) -> str:
    return {"feature-extraction": "embeddings", "text-generation": "completions"}.get(task, "logits")


def _deployment():
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    class ArtifactReplica:
        """One replica: the artifact loaded once, requests batched across callers."""

        def __init__(self, artifact: str, threads: int, max_batch_size: int, wait_s: float):
            from pipeline.runtime import load

            self.model = load(artifact, intra_op_threads=threads)
            self.key = answer_key(self.model.task)
            self.batched.set_max_batch_size(max_batch_size)
            self.batched.set_batch_wait_timeout_s(wait_s)

        def check_health(self) -> None:
            if self.model is None:
                raise RuntimeError("the artifact is not loaded")

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
        async def batched(self, calls: list[list[str]]) -> list:
            texts = [text for call in calls for text in call]
            if self.key == "completions":
                results = [c.text for c in self.model.generate(texts)]
            else:
                results = self.model.run(texts).tolist()
            answers, start = [], 0
            for call in calls:
                answers.append(results[start : start + len(call)])
                start += len(call)
            return answers

        async def __call__(self, request: Request):
            from pipeline.errors import InputError
            from pipeline.runtime.text import check_texts

            try:
                body = json.loads(await request.body())
                texts = body["texts"] if isinstance(body, dict) and "texts" in body else None
                if texts is None:
                    raise InputError('the request must be JSON {"texts": ["a text", ...]}')
                texts = check_texts(texts, "request")
                empty = [i for i, text in enumerate(texts) if not text.strip()]
                if empty:
                    raise InputError(f"request input {empty[0]} is empty; send text in every entry")
            except (ValueError, InputError) as err:
                return JSONResponse({"error": str(err).splitlines()[0]}, status_code=400)
            return {self.key: await self.batched(list(texts))}

    return ArtifactReplica


def deploy(artifact, replicas: int = 1, address: str | None = None, port: int = 8000, threads: int | None = None,
           max_batch_size: int | None = None, wait_ms: float = 2.0) -> str:  # fmt: skip
    """Deploy `artifact` on a local Ray instance (or the cluster at `address`); returns the HTTP URL once every
    replica runs. Raises ServingError for a port in use, an unreachable address, or replicas that do not fit."""
    from pipeline.runtime import verify_artifact
    from pipeline.serving.triton_server import check_port_free

    manifest = verify_artifact(artifact)
    if address:
        check_reachable(address)
    else:
        check_port_free(port)
        # A local instance stays on loopback and writes no auth token to ~/.ray.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.pop("RAY_ADDRESS", None)
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    threads = replica_threads(replicas, int(ray.available_resources().get("CPU", 0)), threads)
    batch = max_batch_size or int(manifest["model"]["batch_size"])
    options = {"num_replicas": replicas, "ray_actor_options": {"num_cpus": threads},
               "max_ongoing_requests": max(batch, 8), "health_check_period_s": 5}  # fmt: skip
    replica = serve.deployment(_deployment(), name="artifact", **options)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(replica.bind(str(artifact), threads, batch, wait_ms / 1000), name=APP, route_prefix=ROUTE)
    except RuntimeError as err:
        raise ServingError(f"Ray Serve could not deploy {artifact}: {str(err).splitlines()[0]}") from None
    return f"http://127.0.0.1:{port}{ROUTE}"


def status() -> dict:
    """The application's and each deployment's state and replica counts, from serve.status()."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None:
        return {"status": "NOT_DEPLOYED"}
    return {
        "status": getattr(app.status, "value", str(app.status)),
        "deployments": {name: {"status": getattr(d.status, "value", str(d.status)), "replicas": dict(d.replica_states)}
                        for name, d in app.deployments.items()},
    }  # fmt: skip


def shutdown() -> None:
    """Remove the application and stop the Ray instance this process started or joined."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


def serve_forever(artifact, **options) -> None:
    """Deploy, print where, and serve until interrupted (the CLI)."""
    import click

    url = deploy(artifact, **options)
    click.echo(f"serving {artifact} at {url} ({json.dumps(status())}); Ctrl-C stops")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()
