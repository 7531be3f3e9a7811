import ipaddress
import json
import math
import os
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.errors import InputError, ServingError
from pipeline.runtime import load
from pipeline.runtime.artifact import manifest_digest
from pipeline.serving import ray_local, ray_serve
from pipeline.serving.triton_server import free_port
from tests.conftest import SMALL_TEXTS
from tests.runtime.backtracking import PANICS, add_backtracking_split

pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")

MAX_BODY_BYTES, MAX_TEXTS = 64 * 1024, 16
BODY_TIMEOUT_S, MAX_BODY_READS = 8.0, 32  # a replica reads 32 bodies at once; 2 replicas, 64
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
    """A copy of the fp32 artifact whose manifest refuses overlong input (InputError) rather than truncating, and
    whose tokenizer.json has a Split pattern that backtracks without bound (the tokenizer panics on PANICS)."""
    copy = tmp_path_factory.mktemp("refusing") / "tiny-bert" / published_fp32.parent.name / published_fp32.name
    shutil.copytree(published_fp32, copy)
    path = copy / "manifest.json"
    path.chmod(0o644)
    manifest = json.loads(path.read_text())
    manifest["model"]["overlong"] = "refuse"
    manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    return add_backtracking_split(copy)


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
        body_timeout_s=BODY_TIMEOUT_S,
        max_body_reads=MAX_BODY_READS,
    )
    temp_dir = ray_local._STATE["temp_dir"]
    try:
        yield url
    finally:
        ray_serve.shutdown()
    assert temp_dir and not os.path.exists(temp_dir)  # the session folder went with the instance


@pytest.mark.slow  # a live Ray Serve deployment
def test_the_local_instance_keeps_its_files_private_and_its_token_out_of_the_environment(served):
    import ray

    folder = ray_local._STATE["temp_dir"]
    assert folder and os.stat(folder).st_mode & 0o777 == 0o700 and "RAY_AUTH_TOKEN" not in os.environ
    session = ray._private.worker.global_worker.node.get_session_dir_path()
    assert os.path.realpath(session).startswith(os.path.realpath(folder) + os.sep)
    assert ray_serve.status()["status"] == "RUNNING"  # the driver keeps working without the token in its environment


@pytest.mark.parametrize("mode", ["disabled", "DISABLED", "none"])
def test_deploy_refuses_an_auth_mode_that_turns_ray_token_authentication_off(published_fp32, monkeypatch, mode):
    monkeypatch.setenv("RAY_AUTH_MODE", mode)
    with pytest.raises(ServingError, match=f"RAY_AUTH_MODE={mode} is set in this environment, which turns off"):
        ray_serve.deploy(published_fp32, port=free_port())


@pytest.mark.slow  # a live Ray Serve deployment
def test_two_replicas_answer_32_concurrent_clients_like_load_run(served, refusing_fp32):
    state = ray_serve.status()
    assert state["status"] == "RUNNING"
    assert [d["replicas"] for d in state["deployments"].values()] == [{"RUNNING": 2}]
    model = load(refusing_fp32)
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
@pytest.mark.slow  # a live Ray Serve deployment
def test_bad_requests_get_4xx_with_a_one_line_message_and_the_service_keeps_serving(served, body, code, says):
    status, answer = _post(served, body)
    assert status == code and says in answer["error"] and "\n" not in answer["error"]
    status, answer = _post(served, b'{"texts": ["still serving"]}')
    assert status == 200 and len(answer["embeddings"]) == 1


@pytest.mark.slow  # a live Ray Serve deployment
def test_a_get_gets_405_naming_post(served):
    status, answer = _post(served, None, method="GET")
    assert status == 405 and answer["allow"] == "POST" and "POST" in answer["error"]


@pytest.mark.parametrize(
    "bad, says",
    [(OVERLONG, "tokens, over the model's 128"), (PANICS, "run() input 0: the tokenizer failed on it (")],
)
@pytest.mark.slow  # a live Ray Serve deployment
def test_a_bad_text_gets_400_alone_when_batched_with_six_good_ones(served, bad, says):
    # PANICS makes the tokenizer panic: a BaseException, which Ray's batching answers to no caller.
    bodies = [[bad]] + [[text] for text in SMALL_TEXTS[:6]]
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
    assert answers[0][0] == 400 and says in answers[0][1]["error"] and "\n" not in answers[0][1]["error"]
    assert [status for status, _ in answers[1:]] == [200] * 6
    assert _post(served, b'{"texts": ["still serving"]}')[0] == 200


_HEADERS = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"


def _hold(url: str, count: int) -> list[socket.socket]:
    """`count` connections that each send a POST's headers, announcing a 100-byte body, and no body."""
    port = int(url.rsplit(":", 1)[1].strip("/"))
    held = []
    for _ in range(count):
        held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        held[-1].sendall(_HEADERS)
    return held


def _response(data: bytes, closed: bool) -> tuple[int | None, dict] | None:
    """(status, JSON body) of a whole HTTP response in `data`; (None, {}) for a connection closed without one;
    None while more is to come."""
    head, blank, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().partition(b":")[::2] for line in head.split(b"\r\n")[1:])
    if blank and len(body) >= int(fields.get(b"content-length", b"0")):
        return int(head.split()[1]), json.loads(body or b"{}")
    return (None, {}) if closed else None


def _answers(held: list[socket.socket], timeout_s: float) -> list[tuple[int | None, dict, float]]:
    """(status, JSON body, time.monotonic() when it came) of the answer on each connection; status None where the
    server closed it without one, or nothing came within `timeout_s`."""
    import selectors

    started, found = time.monotonic(), {}
    data = {sock: b"" for sock in held}
    with selectors.DefaultSelector() as selector:
        for sock in held:
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)
        while len(found) < len(held) and time.monotonic() < started + timeout_s:
            for key, _ in selector.select(timeout=0.2):
                chunk = key.fileobj.recv(65536)
                data[key.fileobj] += chunk
                response = _response(data[key.fileobj], closed=not chunk)
                if response is not None:
                    selector.unregister(key.fileobj)
                    found[key.fileobj] = (*response, time.monotonic())
    return [found.get(sock, (None, {}, math.inf)) for sock in held]


@pytest.mark.slow  # a live Ray Serve deployment
def test_clients_that_send_no_body_get_408_after_the_body_timeout_and_others_are_answered_meanwhile(served):
    sent = time.monotonic()
    # More than the 2 x 8 places of the replicas' batches, and no more than one replica reads at once
    # (max_body_reads): the proxy's routing need not split them evenly, and none may be refused with a 503.
    held = _hold(served, MAX_BODY_READS)
    try:
        time.sleep(1)  # the proxy has handed each to a replica, which waits on its body
        started = time.monotonic()
        status, answer = _post(served, b'{"texts": ["a normal request"]}')
        assert status == 200 and len(answer["embeddings"]) == 1
        assert time.monotonic() - started < BODY_TIMEOUT_S / 2, "a normal request waited on the slow clients"
        answers = _answers(held, BODY_TIMEOUT_S + 20)
    finally:
        for sock in held:
            sock.close()
    assert [status for status, _, _ in answers] == [408] * MAX_BODY_READS
    assert min(came for *_, came in answers) - sent > BODY_TIMEOUT_S - 0.5  # the limit, not a refusal at once
    message = answers[0][1]["error"]
    assert f"within the limit of {BODY_TIMEOUT_S:g} s (body_timeout_s, `pipeline serve --body-timeout`)" in message
    assert _post(served, b'{"texts": ["still serving"]}')[0] == 200


@pytest.mark.slow  # a live Ray Serve deployment
def test_a_replica_reading_max_body_reads_bodies_answers_503_at_once(served):
    sent = time.monotonic()
    held = _hold(served, 2 * MAX_BODY_READS + 16)
    try:
        answers = _answers(held, BODY_TIMEOUT_S + 20)
    finally:
        for sock in held:
            sock.close()
    refused = [(body, came - sent) for status, body, came in answers if status == 503]
    assert len(refused) >= 16 and all(seconds < BODY_TIMEOUT_S / 2 for _, seconds in refused)
    assert "max_body_reads" in refused[0][0]["error"]
    assert {status for status, _, _ in answers} == {408, 503}
    assert _post(served, b'{"texts": ["still serving"]}')[0] == 200


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


@pytest.mark.slow  # a live Ray Serve deployment
def test_every_socket_the_serve_process_tree_listens_on_is_loopback(served):
    listeners = _listeners(os.getpid())
    assert any(port == int(served.rsplit(":", 1)[1].strip("/")) for *_, port in listeners)
    exposed = [listener for listener in listeners if not _is_loopback(listener[2])]
    assert not exposed, f"(name, pid, address, port) listening beyond loopback: {exposed}"


@pytest.mark.slow  # a live Ray Serve deployment
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
    from pipeline.cli import main

    result = CliRunner().invoke(main, ["serve", str(tmp_path), option, "0"])
    assert result.exit_code == InputError.exit_code and f"error: {option} 0: pass a positive" in result.output


@pytest.mark.parametrize("slots", [0, 257, True])
def test_deploy_refuses_slots_outside_1_to_256_before_starting_anything(slots, tmp_path):
    with pytest.raises(InputError, match=f"--slots {slots!r}: pass a positive whole number up to 256"):
        ray_serve.deploy(tmp_path, slots=slots)


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_serve_refuses_a_body_timeout_that_is_not_a_positive_number_of_seconds(value, tmp_path):
    from pipeline.cli import main

    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--body-timeout", value])
    assert result.exit_code == InputError.exit_code and "error: --body-timeout" in result.output
    assert "pass a positive number of seconds" in result.output


@pytest.mark.slow  # a live `pipeline serve` process
def test_sigterm_stops_pipeline_serve_and_every_process_it_started(published_fp32):
    import signal
    import subprocess
    import sys

    import psutil

    port = free_port()
    command = [sys.executable, "-m", "pipeline", "serve", str(published_fp32), "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in server.stdout:  # until it serves, or it ends
            if line.startswith("serving "):
                break
        assert server.poll() is None, "pipeline serve ended before it served"
        metrics = re.search(r"; Prometheus metrics at (http://127\.0\.0\.1:\d+/metrics);", line)
        with urllib.request.urlopen(metrics.group(1), timeout=30) as answer:  # Prometheus' text exposition
            assert answer.status == 200 and answer.headers.get_content_type() == "text/plain"
        started = psutil.Process(server.pid).children(recursive=True)
        assert any("raylet" in p.name() for p in started) and _listeners(server.pid)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=120) == 0
        survivors = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not survivors, f"left running after SIGTERM: {[(p.pid, p.name()) for p in survivors]}"
    finally:
        if server.poll() is None:
            server.kill()
