"""An artifact as a Ray Serve application (`pipeline serve ARTIFACT [--replicas N] [--address ray://...]`).

Each replica loads the artifact once (verified at load) and batches concurrent requests with @serve.batch; HTTP
is served by Ray's proxy on a loopback port. The request is a POST of JSON `{"texts": [...]}`; the answer is
`{"embeddings": ...}` (feature-extraction), `{"logits": ...}` (classifiers), `{"completions": [...]}` (decoders) or
`{"outputs": [...]}` (text-to-text).
A bad request gets a one-line `{"error": ...}`: 400 for bad JSON or texts, 413 for a body over `max_body_bytes`,
408 for one not in within `body_timeout_s`, 405 for any method but POST, 503 while a replica already reads
`max_body_reads` bodies or its continuous batcher's queue is full, 500 for a model failure. A batch that fails, on
whatever it raises (a tokenizer's Rust panic is no Exception), is retried request by request: only the request at
fault gets its error.

Paths under /v1/ are OpenAI's API (models, chat and text completions, embeddings): pipeline.serving.openai_api
checks them and builds the answers, pipeline.serving.openai_routes runs them; refusals there take OpenAI's shape.
Each replica records Prometheus metrics of what it answers (pipeline.serving.metrics).

Ray's proxy hands a request to a replica once its headers are in; the replica pulls the body from the proxy as
it comes, holding one of its `max_ongoing_requests`. So reads are bounded in time (`body_timeout_s`) and number
(`max_body_reads` a replica, beyond a batch's places): clients slow to send a body cannot stall the others.

Exposure: a local instance runs every Ray process on 127.0.0.1 with Ray's token authentication on (a token made
for the instance, kept in its environment); docs/serving.md lists what listens where.

Cores: each replica's session runs `threads` intra-op threads and reserves as many CPUs from Ray, and
threads = floor(CPUs / replicas) unless given, so replicas x threads never exceeds the CPUs (of this host, or of
the cluster, where Ray places each replica on a node with that many free). More replicas than CPUs is refused.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.errors import InputError, OverloadedError, ServingError
from pipeline.serving import openai_routes
from pipeline.serving.metrics import Metrics, artifact_tags, export_url
from pipeline.serving.openai_api import (
    EMBEDDINGS,
    MODELS,
    APIError,
    Served,
    check_route,
    models_answer,
    parse_embeddings,
    parse_generation,
)
from pipeline.serving.ray_local import (
    bind_replica_grpc_to_node_ip,
    check_reachable,
    local_ray_environment,
    ray_init,
    remove_private_temp_dir,
    replica_threads,
)
from pipeline.serving.requests import (
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_BODY_READS,
    MAX_TEXTS,
    USAGE,
    answer_key,
    check_limit,
    check_seconds,
    read_audio,
    read_body,
    read_image,
    read_texts,
    run_model,
)

APP = "pipeline"
ROUTE = "/"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0]


def _deployment():
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse

    from pipeline.runtime.text import FATAL

    # Never answered as one request's failure: they stop the process, or cancel the task on purpose.
    fatal = (*FATAL, asyncio.CancelledError)

    def error(status: int, err: BaseException, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": _first_line(err)}, status_code=status, headers=headers)

    def api_error(status: int, err: BaseException, headers: dict | None = None) -> JSONResponse:
        """A refusal in OpenAI's shape, for the /v1 routes."""
        refusal = err if isinstance(err, APIError) else APIError(_first_line(err), status=status)
        return JSONResponse(refusal.body(), status_code=refusal.status, headers=headers)

    class ArtifactReplica:
        """One replica: the artifact loaded once, requests batched across callers."""

        def __init__(
            self, artifact: str, served: Served, threads: int, max_batch_size: int, wait_s: float, limits: dict, tags
        ):  # limits: the body limits, and the decoder's slots
            from pipeline.runtime import load

            bind_replica_grpc_to_node_ip()
            self.model = load(artifact, intra_op_threads=threads)
            self.served = served
            self.key = answer_key(self.model.task)
            self.image = getattr(self.model, "modality", "text") == "image"
            self.limits = limits
            self.reading = 0  # bodies being read; only the replica's event loop changes it
            # Chat and completions of a decoder whose cache allows it share one continuously batched engine; a
            # request that is not streamed waits for its answer in a thread of its own, so that the default
            # executor's few threads (CPUs + 4) do not cap how many requests decode together.
            completions = self.key == "completions"
            self.batcher = openai_routes.continuous_batcher(self.model, limits["slots"]) if completions else None
            self.waiting = (
                ThreadPoolExecutor(max_workers=64, thread_name_prefix="openai-wait") if self.batcher else None
            )
            self.metrics = Metrics(tags, self.batcher)
            self.batched.set_max_batch_size(max_batch_size)
            self.batched.set_batch_wait_timeout_s(wait_s)

        def check_health(self) -> None:
            if self.model is None:
                raise RuntimeError("the artifact is not loaded")

        def run(self, texts: list) -> list:
            results = run_model(self.model, texts)  # a speech artifact's texts are each a clip's samples
            return results if isinstance(results, list) else results.tolist()

        def run_alone(self, texts: list[str]):
            """One request's results, or what its run raised (its InputError, or any other failure)."""
            try:
                return self.run(texts)
            except fatal:
                raise
            except BaseException as err:  # a Rust panic is no Exception
                return err

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.002)
        async def batched(self, calls: list[list[str]]) -> list:
            # One request's bad input (an overlong text) fails the whole batch: each is then run alone, so that
            # only the request at fault gets its error, as pipeline.runtime.batcher does. Whatever the batch
            # raised: Ray's batching answers an Exception to every caller but leaves them all unanswered on
            # another BaseException (a tokenizer's Rust panic).
            try:
                results = self.run([text for call in calls for text in call])
            except fatal:
                raise
            except BaseException as err:
                return [err] if len(calls) == 1 else [self.run_alone(call) for call in calls]
            answers, start = [], 0
            for call in calls:
                answers.append(results[start : start + len(call)])
                start += len(call)
            return answers

        async def read(self, request: Request) -> bytes | tuple[int, InputError, dict | None]:
            """The request's body, or the refusal to answer (status, error, headers): 503 while max_body_reads
            bodies are being read, 408 past body_timeout_s, 413 over max_body_bytes."""
            if self.reading >= self.limits["max_body_reads"]:
                busy = ServingError(
                    f"this replica is reading {self.limits['max_body_reads']} request bodies already (max_body_reads:"
                    " clients slow to send them); retry in a second"
                )
                return 503, busy, {"Retry-After": "1"}
            self.reading += 1
            try:
                async with asyncio.timeout(self.limits["body_timeout_s"]):
                    return await read_body(request, self.limits["max_body_bytes"])
            except TimeoutError:
                late = InputError(
                    f"the request body did not arrive within the limit of {self.limits['body_timeout_s']:g} s "
                    "(body_timeout_s, `pipeline serve --body-timeout`); send the whole body with the headers"
                )
                return 408, late, {"Connection": "close"}
            except InputError as err:
                return 413, err, None
            finally:
                self.reading -= 1

        def failed(self, err: BaseException, respond=error) -> JSONResponse:
            """The answer to a request the model failed on: 400 for its input, 503 while the continuous batcher's
            queue is full, else 500 (logged)."""
            if isinstance(err, InputError):
                return respond(400, err)
            if isinstance(err, OverloadedError):
                return respond(503, err, {"Retry-After": "1"})
            why = f"{type(err).__name__}: {_first_line(err)}"
            logging.getLogger("ray.serve").error("a request failed (%s)", why, exc_info=err)
            return respond(500, ServingError(f"the model failed on this request ({why}); the replica keeps serving"))

        async def openai(self, request: Request):
            """The OpenAI-compatible routes (pipeline.serving.openai_api); a chat or completion joins the replica's
            continuous batch where there is one, else runs alone."""
            try:
                route = check_route(self.served, request.method, request.url.path)
                if route == MODELS:
                    return models_answer(self.served)
                body = await self.read(request)
                if not isinstance(body, bytes):
                    return api_error(*body)
                if route == EMBEDDINGS:
                    parsed = parse_embeddings(body, self.served, self.limits["max_texts"])
                    vectors = await self.batched(list(parsed.texts))
                    if isinstance(vectors, BaseException):
                        return self.failed(vectors, api_error)
                    return openai_routes.embeddings(self.model, self.served, parsed, vectors)
                parsed = parse_generation(route, body, self.served, self.limits["max_texts"])
                timing = self.metrics.timing(route)
                if parsed.stream:
                    chunks = await asyncio.to_thread(
                        openai_routes.start_stream, self.model, self.served, parsed, self.batcher, timing
                    )
                    return StreamingResponse(chunks, media_type="text/event-stream")
                run = functools.partial(openai_routes.generate, self.model, self.served, parsed, self.batcher, timing)
                return await asyncio.get_running_loop().run_in_executor(self.waiting, run)
            except fatal:
                raise
            except APIError as err:
                return api_error(err.status, err)
            except BaseException as err:  # the runtime's InputError, or a failure of the model
                return self.failed(err, api_error)

        async def __call__(self, request: Request):
            answer = await self.answer(request)
            self.metrics.answered(request.url.path, answer)
            return answer

        async def answer(self, request: Request):
            if request.url.path == "/v1" or request.url.path.startswith("/v1/"):
                return await self.openai(request)
            if request.method != "POST":
                return error(405, InputError(f"{request.method} is not served here; {USAGE}"), {"Allow": "POST"})
            body = await self.read(request)
            if not isinstance(body, bytes):
                return error(*body)
            try:
                if self.image:
                    texts = read_image(body)
                else:
                    texts = read_audio(body) if self.key == "texts" else read_texts(body, self.limits["max_texts"])
            except InputError as err:
                return error(400, err)
            answer = await self.batched(texts)
            if isinstance(answer, BaseException):
                return self.failed(answer)
            return {self.key: answer}

    return ArtifactReplica


def deploy(
    artifact,
    replicas: int = 1,
    address: str | None = None,
    port: int = 8000,
    threads: int | None = None,
    max_batch_size: int | None = None,
    wait_ms: float = 2.0,
    max_body_bytes: int | None = None,
    max_texts: int | None = None,
    body_timeout_s: float | None = None,
    max_body_reads: int | None = None,
    slots: int | None = None,
) -> str:
    """Deploy `artifact` on a local Ray instance (or the cluster at `address`); returns the HTTP URL once every
    replica runs. Limits: a body over `max_body_bytes` (1 MiB) or slower than `body_timeout_s` (10 s), texts over
    `max_texts` (256), bodies read at once over `max_body_reads` (128); a decoder replica decodes up to `slots`
    requests together (16, at most the artifact's batch size; each slot holds a cache of max_length tokens).
    Raises ServingError for a port in use, an unreachable address, or replicas that do not fit."""
    from pipeline.runtime import verify_artifact
    from pipeline.runtime.continuous import MAX_SLOTS
    from pipeline.serving.triton_server import check_port_free

    limits = {
        "max_body_bytes": check_limit(MAX_BODY_BYTES if max_body_bytes is None else max_body_bytes, "--max-body-bytes"),
        "max_texts": check_limit(MAX_TEXTS if max_texts is None else max_texts, "--max-texts"),
        "body_timeout_s": check_seconds(BODY_TIMEOUT_S if body_timeout_s is None else body_timeout_s, "--body-timeout"),
        "max_body_reads": check_limit(MAX_BODY_READS if max_body_reads is None else max_body_reads, "max_body_reads"),
        "slots": None if slots is None else check_limit(slots, "--slots", MAX_SLOTS),
    }
    manifest = verify_artifact(artifact)
    served = Served.from_manifest(manifest)
    if address:
        check_reachable(address)
    else:
        check_port_free(port)
        local_ray_environment()
    import ray
    from ray import serve

    if not ray.is_initialized():
        ray_init(address)
    threads = replica_threads(replicas, int(ray.available_resources().get("CPU", 0)), threads)
    batch = max_batch_size or int(manifest["model"]["batch_size"])
    options = {
        "num_replicas": replicas,
        "ray_actor_options": {"num_cpus": threads},
        # A batch's places, and as many more as bodies a replica reads at once.
        "max_ongoing_requests": max(batch, 8, limits["slots"] or 0) + limits["max_body_reads"],
        "health_check_period_s": 5,
    }
    replica = serve.deployment(_deployment(), name="artifact", **options)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(
            replica.bind(str(artifact), served, threads, batch, wait_ms / 1000, limits, artifact_tags(manifest)),
            name=APP,
            route_prefix=ROUTE,
        )
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
        "deployments": {
            name: {"status": getattr(d.status, "value", str(d.status)), "replicas": dict(d.replica_states)}
            for name, d in app.deployments.items()
        },
    }


def shutdown() -> None:
    """Remove the application and stop the Ray instance this process started or joined."""
    import ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()
    remove_private_temp_dir()


def serve_forever(artifact, **options) -> None:
    """Deploy, print where, and serve until interrupted (the CLI)."""
    import click

    try:
        url = deploy(artifact, **options)
        # SIGTERM (how systemd, Docker and Kubernetes stop a process) and SIGHUP stop it as Ctrl-C does: Ray's own
        # handler, which ray.init installs, aborts this process alone and leaves the Ray processes it started
        # running, listening and orphaned.
        for stop in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(stop, _interrupt)
        where = f" on each node of the cluster at {options['address']}" if options.get("address") else ""
        metrics = f"; Prometheus metrics at {export_url()}" if not options.get("address") else ""
        click.echo(f"serving {artifact} at {url}{where} ({json.dumps(status())}){metrics}; Ctrl-C stops")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
