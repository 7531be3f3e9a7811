import ipaddress
import json
import os
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from pipeline.errors import InputError, ServingError
from pipeline.runtime import load
from pipeline.runtime.artifact import manifest_digest
from pipeline.serving import ray_serve
from pipeline.serving.triton_server import free_port

from ..conftest import SMALL_TEXTS

pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")

MAX_BODY_BYTES, MAX_TEXTS = 64 * 1024, 16
OVERLONG = "word " * 500  # 500 tokens, over the tiny model's 128


def _post(url: str, body: bytes, method: str = "POST") -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.load(answer)
    except urllib.error.HTTPError as err:
        body = err.read()
        try:
            answer = json.loads(body or b"{}")
        except ValueError:
            answer = {"error": body.decode(errors="replace")}
        return err.code, answer | {"allow": err.headers.get("Allow")}


@pytest.fixture(scope="module")
def refusing_fp32(published_fp32, tmp_path_factory):
    """A copy of the fp32 artifact whose manifest refuses overlong input (InputError) rather than truncating."""
    copy = tmp_path_factory.mktemp("refusing") / "tiny-bert" / published_fp32.parent.name / published_fp32.name
    shutil.copytree(published_fp32, copy)
    path = copy / "manifest.json"
    path.chmod(0o644)
    manifest = json.loads(path.read_text())
    manifest["model"]["overlong"] = "refuse"
    manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    return copy


@pytest.fixture(scope="module")
def served(refusing_fp32):
    # A batch waits up to 200 ms so that requests sent together share one.
    url = ray_serve.deploy(
        refusing_fp32,
        replicas=2,
        port=free_port(),
        max_batch_size=8,
        wait_ms=200,
        max_body_bytes=MAX_BODY_BYTES,
        max_texts=MAX_TEXTS,
    )
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
    "body, code, says",
    [
        (b'{"texts": []}', 400, "empty list"),
        (b'{"texts": [3]}', 400, "not str"),
        (b'{"texts": [""]}', 400, "is empty"),
        (b'{"text": "a"}', 400, '"texts"'),
        (b"not json", 400, "Expecting value"),
        (b'{"texts": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", 400, "nests too deeply"),
        (b'{"texts": {"a": 1}}', 400, '"texts" is a JSON object'),
        (b'{"texts": "hello"}', 400, '"texts" is a single string; send a list of strings'),
        (json.dumps({"texts": ["a"] * (MAX_TEXTS + 1)}).encode(), 400, f"over the limit of {MAX_TEXTS} a request"),
        (json.dumps({"texts": ["a" * MAX_BODY_BYTES]}).encode(), 413, f"limit of {MAX_BODY_BYTES} bytes"),
        (json.dumps({"texts": [OVERLONG]}).encode(), 400, "tokens, over the model's 128"),
    ],
)
def test_bad_requests_get_4xx_with_a_one_line_message_and_the_service_keeps_serving(served, body, code, says):
    status, answer = _post(served, body)
    assert status == code and says in answer["error"] and "\n" not in answer["error"]
    status, answer = _post(served, b'{"texts": ["still serving"]}')
    assert status == 200 and len(answer["embeddings"]) == 1


def test_a_get_gets_405_naming_post(served):
    status, answer = _post(served, None, method="GET")
    assert status == 405 and answer["allow"] == "POST" and "POST" in answer["error"]


def test_an_overlong_text_gets_400_alone_when_batched_with_six_good_ones(served):
    bodies = [[OVERLONG]] + [[text] for text in SMALL_TEXTS[:6]]
    answers = [None] * len(bodies)
    start = threading.Barrier(len(bodies))

    def client(i: int) -> None:
        start.wait()
        answers[i] = _post(served, json.dumps({"texts": bodies[i]}).encode())

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert answers[0][0] == 400 and "over the model's 128" in answers[0][1]["error"]
    assert [status for status, _ in answers[1:]] == [200] * 6


def _listeners(pid: int) -> list[tuple[str, int, str, int]]:
    """(process name, pid, address, port) of every TCP socket listening, or UDP socket bound, in a process tree."""
    import psutil

    root = psutil.Process(pid)
    found = []
    for proc in [root, *root.children(recursive=True)]:
        try:
            name, sockets = proc.name(), proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        for conn in sockets:
            if conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM and not conn.raddr):
                found.append((name, proc.pid, conn.laddr.ip, conn.laddr.port))
    return found


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_every_socket_the_serve_process_tree_listens_on_is_loopback(served):
    listeners = _listeners(os.getpid())
    assert any(port == int(served.rsplit(":", 1)[1].strip("/")) for *_, port in listeners)
    exposed = [listener for listener in listeners if not _is_loopback(listener[2])]
    assert not exposed, f"(name, pid, address, port) listening beyond loopback: {exposed}"


def test_the_replicas_grpc_server_refuses_a_call_without_the_ray_token(served):
    import grpc
    import psutil

    replicas = {p.pid for p in psutil.Process().children(recursive=True) if "ServeReplica" in p.name()}
    codes = []
    for _, pid, ip, port in _listeners(os.getpid()):
        if pid in replicas:
            host = f"[{ip}]" if ":" in ip else ip
            with grpc.insecure_channel(f"{host}:{port}") as channel:
                call = channel.unary_unary("/ray.serve.ASGIService/HandleRequest")
                try:
                    call(b"", timeout=20)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
    assert grpc.StatusCode.UNAUTHENTICATED in codes
    assert set(codes) <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED}


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


@pytest.mark.parametrize(
    "body, says",
    [
        (b"[" * 100_000, "nests too deeply"),
        (b'{"texts": {"a": 1}}', '"texts" is a JSON object'),
        (b'{"texts": "hello"}', '"texts" is a single string; send a list of strings: {"texts": ["a text"]}'),
        (b'{"texts": ["a", "b", "c"]}', '"texts" holds 3 texts, over the limit of 2 a request (max_texts'),
        (b'{"texts": ["a", null]}', '"texts" entry 1 is null, not str'),
        (b'{"texts": ["\\ud800"]}', "lone surrogate"),
        (b"\xff", "not JSON"),
    ],
)
def test_read_texts_refuses_bad_bodies_in_one_line(body, says):
    with pytest.raises(InputError) as err:
        ray_serve.read_texts(body, max_texts=2)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_read_texts_returns_the_texts():
    assert ray_serve.read_texts(b'{"texts": ["a", "b"]}', max_texts=2) == ["a", "b"]


@pytest.mark.parametrize("option", ["--max-texts", "--max-body-bytes"])
def test_serve_refuses_a_limit_below_one_naming_the_option(option, tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import main

    result = CliRunner().invoke(main, ["serve", str(tmp_path), option, "0"])
    assert result.exit_code == InputError.exit_code and f"error: {option} 0: pass a positive" in result.output
