"""Prometheus metrics of `pipeline serve` (pipeline.serving.metrics): a live deployment of a tiny chat GPT-2, called
through the `openai` client, scraped from the local Ray node's metrics export port on 127.0.0.1."""

import json
import time
import urllib.request

import pytest

from pipeline.serving import metrics
from tests.serving.test_openai_api import CONVERSATION, chat_decoder

openai = pytest.importorskip("openai", reason="the openai client is in the `dev` extra")
pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")

CHAT = "/v1/chat/completions"
REQUESTS = "ray_pipeline_requests_total"
PROMPT, COMPLETION = "ray_pipeline_prompt_tokens_total", "ray_pipeline_completion_tokens_total"
TTFT, ITL = "ray_pipeline_time_to_first_token_seconds", "ray_pipeline_inter_token_latency_seconds"
WAITING, RUNNING = "ray_pipeline_waiting_requests", "ray_pipeline_running_requests"
MANY = 600  # prompts in one completion: over a replica's 16 batcher slots and the 256 requests its queue holds


def test_route_of_bounds_the_route_tag_to_the_served_routes():
    assert metrics.route_of("/v1/chat/completions/") == CHAT and metrics.route_of("/v1/models") == "/v1/models"
    assert metrics.route_of("/v1/images/generations") == "/v1/other" and metrics.route_of("/v1") == "/v1/other"
    assert metrics.route_of("/") == "/" and metrics.route_of("/anything") == "/"


def test_artifact_tags_name_the_model_version_and_target():
    manifest = {"model_name": "tiny-gpt2", "version": "v3", "target": "cpu-fp32", "model": {}}
    assert metrics.artifact_tags(manifest) == {"model": "tiny-gpt2", "version": "v3", "target": "cpu-fp32"}


@pytest.fixture(scope="module")
def artifact(texts_file, tmp_path_factory):
    return chat_decoder(tmp_path_factory.mktemp("metrics-gpt2"), "gpt2", "smollm2", texts_file)


@pytest.fixture(scope="module")
def served(artifact):
    from pipeline.serving import ray_serve
    from pipeline.serving.triton_server import free_port

    with pytest.MonkeyPatch.context() as env:
        # Ray's processes report metrics every 10 s by default; they inherit this from the instance deploy starts.
        env.setenv("RAY_metrics_report_interval_ms", "500")
        url = ray_serve.deploy(artifact, port=free_port(), max_texts=MANY)
    try:
        yield url, metrics.export_url()
    finally:
        ray_serve.shutdown()


def _scrape(url: str) -> list:
    """Every sample of the Prometheus text at `url`."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=30) as answer:
        text = answer.read().decode()
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _value(samples: list, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0 where there is none)."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


@pytest.mark.slow  # a live Ray Serve deployment
def test_requests_tokens_and_token_latencies_are_exported_labelled_with_the_artifact(served, artifact):
    import ray

    url, scrape = served
    [node] = [n for n in ray.nodes() if n["Alive"]]
    assert scrape == f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"
    manifest = json.loads((artifact / "manifest.json").read_text())
    tags = {"model": manifest["model_name"], "version": manifest["version"], "target": "cpu-fp32"}
    assert tags["model"] == artifact.parent.parent.name and manifest["target"] == "cpu-fp32"
    model_id = f"{tags['model']}/{tags['version']}"
    before = _scrape(scrape)

    client = openai.OpenAI(base_url=url + "v1", api_key="none", max_retries=0, timeout=120)
    whole = client.chat.completions.create(model=model_id, messages=CONVERSATION, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=model_id,
            messages=CONVERSATION,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = chunks[-1].usage
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=model_id, input="a")
    prompt = whole.usage.prompt_tokens + streamed.prompt_tokens
    completion = whole.usage.completion_tokens + streamed.completion_tokens
    expected = {
        (REQUESTS, "200"): 2,
        (PROMPT, None): prompt,
        (COMPLETION, None): completion,
        (TTFT + "_count", None): 2,
        (ITL + "_count", None): completion - 2,  # each token after its prompt's first
        (REQUESTS, "404"): 1,
    }

    def moved(samples) -> dict:
        moves = {}
        for name, status in expected:
            labels = tags | {"route": "/v1/embeddings" if status == "404" else CHAT}
            labels |= {"status": status} if status else {}
            moves[name, status] = _value(samples, name, **labels) - _value(before, name, **labels)
        return moves

    deadline = time.monotonic() + 60  # Ray's processes report every 500 ms here; its agent exports what it has
    while (got := moved(after := _scrape(scrape))) != expected and time.monotonic() < deadline:
        time.sleep(1)
    assert got == expected
    assert whole.usage.completion_tokens >= 2 and streamed.completion_tokens >= 2  # there are token gaps to time
    first_token_s = _value(after, TTFT + "_sum", **tags) - _value(before, TTFT + "_sum", **tags)
    assert 0 < first_token_s < 2 * 60
    # Each sample carries Ray Serve's own tags besides the artifact's.
    [requests] = [s for s in after if s.name == REQUESTS and s.labels.get("status") == "200"]
    assert {"deployment", "replica", "application"} <= set(requests.labels)
    # The replica has a continuous batcher: its queue and slots are sampled, and are empty once the answers are in.
    assert [_value(after, gauge, **tags) for gauge in (WAITING, RUNNING)] == [0, 0]
    assert {s.name for s in after} >= {WAITING, RUNNING}


@pytest.mark.slow  # a live Ray Serve deployment
def test_a_full_batcher_queue_is_a_503_in_openai_shape_and_counted(served, artifact):
    url, scrape = served
    manifest = json.loads((artifact / "manifest.json").read_text())
    tags = {"model": manifest["model_name"], "version": manifest["version"], "target": manifest["target"]}
    labels = tags | {"route": "/v1/completions", "status": "503"}
    before = _value(_scrape(scrape), REQUESTS, **labels)
    client = openai.OpenAI(base_url=url + "v1", api_key="none", max_retries=0, timeout=120)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=openai.omit, prompt=["Once upon a time"] * MANY, max_tokens=50)
    assert err.value.status_code == 503 and err.value.response.headers["Retry-After"] == "1"
    assert err.value.body["type"] == "server_error" and "queue is full" in err.value.body["message"]
    again = client.completions.create(model=openai.omit, prompt="Once upon a time", max_tokens=2)
    assert again.choices[0].finish_reason in ("stop", "length")  # the refused prompts left their slots
    deadline = time.monotonic() + 60
    while _value(_scrape(scrape), REQUESTS, **labels) == before and time.monotonic() < deadline:
        time.sleep(1)
    assert _value(_scrape(scrape), REQUESTS, **labels) == before + 1
