"""Prometheus metrics of a `pipeline serve` replica, through Ray Serve's metrics API (ray.serve.metrics). Ray's
metrics agent on each node exports them, prefixed `ray_`, on the node's metrics export port (127.0.0.1 for a local
instance: `export_url`), and adds the deployment, replica and application tags.

    pipeline_requests_total{route, status}           requests answered, by route and HTTP status
    pipeline_prompt_tokens_total{route}              prompt tokens read (/v1 generation and embeddings routes)
    pipeline_completion_tokens_total{route}          tokens generated (/v1 generation routes)
    pipeline_time_to_first_token_seconds{route}      histogram: from the parsed request to its first token
    pipeline_inter_token_latency_seconds{route}      histogram: between a prompt's consecutive tokens
    pipeline_waiting_requests, pipeline_running_requests   the continuous batcher's queue and slots (gauges)

Every metric also carries the artifact's identity from its verified manifest: model, version and target.
"""

from __future__ import annotations

import threading
import time

from pipeline.serving.openai_api import ROUTES

TTFT_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
ITL_BOUNDARIES = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
QUEUE_PERIOD_S = 1.0


def artifact_tags(manifest: dict) -> dict[str, str]:
    """The tags naming an artifact: model, version and target, from its (verified) manifest."""
    return {"model": str(manifest["model_name"]), "version": str(manifest["version"]), "target": manifest["target"]}


def route_of(path: str) -> str:
    """The route tag of a request path: an OpenAI route, "/v1/other" for any other /v1 path, or "/" (POST /
    answers every other path); a bounded set, whatever paths clients send."""
    if path == "/v1" or path.startswith("/v1/"):
        path = path.rstrip("/")
        return path if path in ROUTES else "/v1/other"
    return "/"


class Metrics:
    """One replica's metrics, tagged with the artifact; `batcher` (a ContinuousBatcher, or None) has its queue and
    slots sampled every second into the two gauges. Make it in the replica (Ray Serve tags it there)."""

    def __init__(self, tags: dict[str, str], batcher=None):
        from ray.serve.metrics import Counter, Gauge, Histogram

        keys, routed = tuple(tags), (*tags, "route")
        self.requests = Counter(
            "pipeline_requests", "Requests answered, by route and HTTP status.", (*routed, "status")
        )
        self.prompt_tokens = Counter("pipeline_prompt_tokens", "Prompt tokens the model read.", routed)
        self.completion_tokens = Counter("pipeline_completion_tokens", "Tokens the model generated.", routed)
        self.first_token = Histogram(
            "pipeline_time_to_first_token_seconds",
            "Seconds from a parsed generation request to its first token (streamed: its first content chunk).",
            TTFT_BOUNDARIES,
            routed,
        )
        self.inter_token = Histogram(
            "pipeline_inter_token_latency_seconds",
            "Seconds between consecutive tokens of a prompt, after its first.",
            ITL_BOUNDARIES,
            routed,
        )
        self.waiting = Gauge("pipeline_waiting_requests", "Requests waiting for a continuous batcher slot.", keys)
        self.running = Gauge("pipeline_running_requests", "Requests in a continuous batcher slot.", keys)
        for metric in (self.requests, self.prompt_tokens, self.completion_tokens, self.first_token, self.inter_token):
            metric.set_default_tags(dict(tags))
        self.waiting.set_default_tags(dict(tags))
        self.running.set_default_tags(dict(tags))
        if batcher is not None:
            threading.Thread(target=self._sample, args=(batcher,), name="pipeline-metrics", daemon=True).start()

    def _sample(self, batcher) -> None:
        while True:
            waiting, running = batcher.queue
            self.waiting.set(waiting, {})
            self.running.set(running, {})
            time.sleep(QUEUE_PERIOD_S)

    def answered(self, path: str, answer) -> None:
        """Count a request by route and status; a whole answer's usage (a dict's "usage") counts its tokens."""
        route = route_of(path)
        self.requests.inc(1, {"route": route, "status": str(getattr(answer, "status_code", 200))})
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if usage:
            self.tokens(route, usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))

    def tokens(self, route: str, prompt: int, completion: int) -> None:
        """Count a request's prompt and completion tokens."""
        if prompt:
            self.prompt_tokens.inc(prompt, {"route": route})
        if completion:
            self.completion_tokens.inc(completion, {"route": route})

    def timing(self, route: str) -> Timing:
        """A generation request's clock, started now."""
        return Timing(self, route)


class Timing:
    """One generation request's clock: `timed` observes its tokens' times as its events pass."""

    def __init__(self, metrics: Metrics, route: str):
        self.metrics, self.route, self.started = metrics, route, time.perf_counter()

    def timed(self, events, prompt_tokens: int | None = None):
        """The runtime's token events (each with index, text, finish_reason), passed on as they come. The first
        that makes a chunk (text, or the end) is the time to first token; each prompt's later ones, inter-token
        latencies. Given `prompt_tokens` (a streamed request), the tokens are counted when the events end."""
        tags, last, generated = {"route": self.route}, {}, 0
        try:
            for event in events:
                now = time.perf_counter()
                generated += 1
                if event.index in last:
                    self.metrics.inter_token.observe(now - last[event.index], tags)
                last[event.index] = now
                if self.started is not None and (event.text or event.finish_reason):
                    self.metrics.first_token.observe(now - self.started, tags)
                    self.started = None
                yield event
        finally:
            if prompt_tokens is not None:
                self.metrics.tokens(self.route, prompt_tokens, generated)
            close = getattr(events, "close", None)
            if close is not None:  # a generator's own cleanup (a batcher slot freed) runs now, not at collection
                close()


def export_url() -> str | None:
    """Where this node's Ray metrics agent serves the Prometheus text (http://127.0.0.1:PORT/metrics for a local
    instance); None where Ray runs without its metrics agent. Call it in the process that ran ray.init."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == here and node.get("MetricsExportPort"):
            host = node["NodeManagerAddress"]
            return f"http://{f'[{host}]' if ':' in host else host}:{node['MetricsExportPort']}/metrics"
    return None
