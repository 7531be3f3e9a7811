"""The local Ray instance `pipeline serve` starts when it joins no cluster: every process on 127.0.0.1, Ray's
token authentication on with a token made for the instance, and Ray's session files (sockets, logs, spilled
objects) inside a private folder this process makes (0700) and removes at shutdown, rather than in /tmp/ray, whose
session folders Ray makes world-writable and whose logs world-readable.

The token lives in the process's environment only while ray.init starts the instance, which hands it to each
process it starts; Ray keeps it cached in this process afterwards, so it is taken out of os.environ again and
no later child of the caller inherits it. Each replica keeps its inter-deployment gRPC server on the node's IP
(bind_replica_grpc_to_node_ip). Before joining a cluster, `check_reachable` fails fast on a dead address, and
`replica_threads` splits the CPUs between replicas.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import tempfile
from urllib.parse import urlparse

from pipeline.errors import InputError, ServingError

_STATE: dict = {"temp_dir": None, "token_set": False}


def _check_auth_mode(env) -> None:
    """Refuse a RAY_AUTH_MODE that turns token authentication off: the replicas' gRPC servers unpickle what they
    are sent, so without the token any local process could run code as this one."""
    mode = env.get("RAY_AUTH_MODE", "")
    if mode and mode.lower() != "token":
        raise ServingError(
            f"RAY_AUTH_MODE={mode} is set in this environment, which turns off Ray's token authentication for the "
            "instance pipeline serve starts (any local process could then run code through it); unset RAY_AUTH_MODE "
            "or set it to token"
        )


def local_ray_environment(env=os.environ) -> None:
    """Settings for the Ray instance this process starts, for it and every process it starts: all on 127.0.0.1,
    and a token for Ray's token authentication, made for the instance and never written to ~/.ray. A
    RAY_AUTH_MODE other than token is refused."""
    # On Linux this makes Ray take 127.0.0.1 as the node's IP, which GCS, the raylet and the workers bind.
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    # Ray turns token authentication on for a new local instance unless RAY_AUTH_MODE says otherwise; setting
    # the mode here would leave a process that imported ray earlier on its cached mode.
    _check_auth_mode(env)
    if not env.get("RAY_AUTH_TOKEN") and not env.get("RAY_AUTH_TOKEN_PATH"):
        # One token a process: Ray caches the first it loads, so a second instance started by this process must
        # be given the same one.
        env["RAY_AUTH_TOKEN"] = _STATE.setdefault("token", secrets.token_hex(32))
        _STATE["token_set"] = True
    env.pop("RAY_ADDRESS", None)


def ray_init(address: str | None) -> None:
    """ray.init: joins the cluster at `address`, or starts a local instance whose node IP is 127.0.0.1."""
    import ray
    from ray._private import ray_constants

    # Ray reads RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER once, at import; a process that imported ray before
    # _local_ray_environment ran would take the host's network address as the node IP, which every Ray process
    # then binds. The node IP is fixed once ray.init has made the node.
    cluster = ray_constants.ENABLE_RAY_CLUSTER
    if not address:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        # "local": a new instance even where `ray start` left one running, which address=None would join.
        options = {} if address else {"_temp_dir": _private_temp_dir()}
        ray.init(address=address or "local", include_dashboard=False, log_to_driver=False, **options)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster
        if _STATE["token_set"]:  # the instance has it, and this process's Ray keeps it cached
            os.environ.pop("RAY_AUTH_TOKEN", None)
            _STATE["token_set"] = False


def _private_temp_dir() -> str:
    """A folder for the instance's session files inside a new folder only this user can enter (Ray makes the one
    it is given world-writable; the path stays short, as Ray puts sockets in it)."""
    _STATE["temp_dir"] = tempfile.mkdtemp(prefix="pipeline-ray-")
    return os.path.join(_STATE["temp_dir"], "ray")


def remove_private_temp_dir() -> None:
    """Remove the session folder this process made for its local instance (after the instance stopped)."""
    folder, _STATE["temp_dir"] = _STATE["temp_dir"], None
    if folder and os.path.isdir(folder) and not os.path.islink(folder):
        shutil.rmtree(folder, ignore_errors=True)


def bind_replica_grpc_to_node_ip() -> None:
    """Make this replica's inter-deployment gRPC server listen on the node's IP (127.0.0.1 for a local instance)
    rather than on every interface. Call it in the replica before Ray starts that server.

    Ray 2.60 binds that server to [::]:0, with no setting to change it, and its handler unpickles request
    metadata: reachable from the network, one request runs code on the host. Peers dial it at the node's IP,
    which is the address it keeps here; Ray's TLS (RAY_USE_TLS) still applies, as Ray's own helper binds it."""
    import ray
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None:
        raise ServingError(
            f"Ray {ray.__version__} no longer binds the replica's gRPC server where pipeline keeps it on the "
            "node's IP; install the Ray of the `serve` extra (pip install 'pipeline[serve]')"
        )
    if getattr(bind, "pipeline_node_ip", False):
        return
    host = ray.util.get_node_ip_address()
    host = f"[{host}]" if ":" in host else host

    def on_node_ip(server, address: str):
        if address.startswith(("[::]:", "0.0.0.0:")):
            address = f"{host}:{address.rsplit(':', 1)[1]}"
        return bind(server, address)

    on_node_ip.pipeline_node_ip = True
    replica.add_port_to_grpc_server = on_node_ip


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
    try:
        host, port = parsed.hostname, parsed.port
    except ValueError:  # a port that is not a number from 0 to 65535
        host, port = None, None
    if not host or not port:
        raise InputError(f"--address {address!r} is not host:port or ray://host:port")
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        raise ServingError(
            f"no Ray cluster answers at {address} ({err.strerror or err} within {timeout_s:.0f} s); start one with "
            "`ray start --head` or check the address"
        ) from None
