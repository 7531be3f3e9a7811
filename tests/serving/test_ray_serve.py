import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from pipeline.errors import InputError, ServingError
from pipeline.runtime import load
from pipeline.serving import ray_serve
from pipeline.serving.triton_server import free_port

from ..conftest import SMALL_TEXTS

pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


@pytest.fixture(scope="module")
def served(published_fp32):
    url = ray_serve.deploy(published_fp32, replicas=2, port=free_port(), max_batch_size=8)
    try:
        yield url
    finally:
        ray_serve.shutdown()


def test_two_replicas_answer_32_concurrent_clients_like_load_run(served, published_fp32):
    state = ray_serve.status()
    assert state["status"] == "RUNNING"
    assert [d["replicas"] for d in state["deployments"].values()] == [{"RUNNING": 2}]
    model = load(published_fp32)
    texts = [f"{SMALL_TEXTS[i % len(SMALL_TEXTS)]} {i}" for i in range(40)]
    expected = dict(zip(texts, model.run(texts), strict=True))
    wrong, done, deadline = [], [], time.monotonic() + 6

    def client(k: int) -> None:
        i = k
        while time.monotonic() < deadline:
            text = texts[i % len(texts)]
            status, body = _post(served, json.dumps({"texts": [text]}).encode())
            if status != 200 or not np.allclose(body["embeddings"][0], expected[text], atol=1e-5):
                wrong.append((status, body))
            done.append(1)
            i += 32

    threads = [threading.Thread(target=client, args=(k,)) for k in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong and len(done) >= 32


@pytest.mark.parametrize(
    "body, says",
    [
        (b'{"texts": []}', "empty list"),
        (b'{"texts": [3]}', "not str"),
        (b'{"texts": [""]}', "is empty"),
        (b'{"text": "a"}', '"texts"'),
        (b"not json", "Expecting value"),
    ],
)
def test_bad_requests_get_400_with_a_message_and_the_service_keeps_serving(served, body, says):
    status, answer = _post(served, body)
    assert status == 400 and says in answer["error"]
    status, answer = _post(served, b'{"texts": ["still serving"]}')
    assert status == 200 and len(answer["embeddings"]) == 1


def test_replicas_times_threads_fit_the_cpus():
    assert ray_serve.replica_threads(2, 2) == 1 and ray_serve.replica_threads(1, 16) == 16
    assert ray_serve.replica_threads(3, 16) == 5
    with pytest.raises(ServingError, match="3 replicas of 1 thread"):
        ray_serve.replica_threads(3, 2)
    with pytest.raises(ServingError, match="need 4 CPUs, but 2"):
        ray_serve.replica_threads(2, 2, threads=2)
    with pytest.raises(InputError, match="--replicas 0"):
        ray_serve.replica_threads(0, 2)


def test_an_unreachable_address_fails_fast_naming_it():
    started = time.monotonic()
    with pytest.raises(ServingError, match="no Ray cluster answers at ray://127.0.0.1:1 "):
        ray_serve.check_reachable("ray://127.0.0.1:1", timeout_s=2)
    assert time.monotonic() - started < 5
    with pytest.raises(InputError, match="is not host:port"):
        ray_serve.check_reachable("nowhere")


def test_a_port_in_use_is_refused_naming_it(published_fp32):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ServingError, match=f"port {port} on 127.0.0.1 is in use"):
            ray_serve.deploy(published_fp32, port=port)
