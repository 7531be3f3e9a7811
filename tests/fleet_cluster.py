"""A real two-node Ray cluster for the fleet tests, run inside a network namespace whose only interface is loopback
(`unshare -n`), so that nothing the cluster opens can be reached from beyond this machine.

    unshare -n python -m tests.fleet_cluster SPEC.json RESULT.json

SPEC names the models, the two targets, each node's class resource, the artifacts and cache folders and whether
to kill the worker mid-build. The head (127.0.0.2) and the worker (127.0.0.3) are started with `ray start`, with
Ray's token authentication on; the fleet runs as this process's driver; RESULT holds its rows, each node's id
and resources, the interfaces of the namespace and every listening socket.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HEAD, WORKER, PORT = "127.0.0.2", "127.0.0.3", 6391


def _ray(*args: str) -> None:
    ray = Path(sys.executable).parent / "ray"
    subprocess.run([str(ray), *args], check=True, capture_output=True, timeout=180)


def _start(resource: str, head: bool) -> None:
    common = ["--num-cpus=2", f"--resources={json.dumps({resource: 1})}", "--disable-usage-stats"]
    if head:
        _ray("start", "--head", f"--node-ip-address={HEAD}", f"--port={PORT}", "--include-dashboard=false", *common)
    else:
        _ray("start", f"--address={HEAD}:{PORT}", f"--node-ip-address={WORKER}", *common)


def _worker_pids() -> list[int]:
    """The worker node's processes: its raylet and everything under it."""
    import psutil

    raylets = [p for p in psutil.process_iter(["cmdline"]) if any(f"={WORKER}" in a for a in p.info["cmdline"] or [])]
    pids = {p.pid for p in raylets}
    for proc in raylets:
        pids |= {c.pid for c in proc.children(recursive=True)}
    return sorted(pids)


def _kill_worker_when_building(cache: Path, resource: str, restarted: dict, for_good: bool = False) -> None:
    """Once a validate stage is being written (a build is past its host-independent stages), kill the worker node
    and (unless `for_good`) start it again."""
    deadline = time.time() + 240
    while time.time() < deadline and not list((cache / "validate").glob(".tmp-*")):
        time.sleep(0.05)
    for pid in _worker_pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    restarted["killed_at"] = time.time()
    if for_good:
        return
    time.sleep(3)
    _start(resource, head=False)
    restarted["back_at"] = time.time()


def _listeners() -> list[str]:
    import psutil

    return sorted({f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.net_connections("inet") if c.status == "LISTEN"})


def main(spec_path: str, result_path: str) -> None:
    """Start the cluster, run the fleet, record what happened, stop the cluster."""
    spec = json.loads(Path(spec_path).read_text())
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    # A multi-node cluster (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 would refuse the worker), token auth on.
    os.environ.update(
        RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1"
    )
    os.environ.pop("RAY_ADDRESS", None)
    # /proc/net/dev lists the interfaces of this process's namespace (sysfs may still show the host's).
    lines = Path("/proc/net/dev").read_text().splitlines()[2:]
    result = {"interfaces": sorted(line.split(":")[0].strip() for line in lines)}
    try:
        _start(spec["head_resource"], head=True)
        _start(spec["worker_resource"], head=False)
        from pipeline.ops.fleet import fleet

        restarted = {}
        if spec.get("kill_worker"):
            killer = threading.Thread(
                target=_kill_worker_when_building,
                args=(Path(spec["cache_dir"]), spec["worker_resource"], restarted, spec["kill_worker"] == "for good"),
                daemon=True,
            )
            killer.start()
        import ray

        options = {k: spec[k] for k in ("artifacts_dir", "cache_dir", "validation", "calibration")}
        if spec.get("missing_target"):
            from pipeline.errors import TargetError

            try:
                fleet(spec["models"], [spec["missing_target"]], f"{HEAD}:{PORT}", **options)
            except TargetError as err:
                result["missing"] = str(err)
        grace = {"node_grace_s": spec["node_grace_s"]} if "node_grace_s" in spec else {}
        started = time.time()
        result["rows"] = fleet(spec["models"], spec["targets"], f"{HEAD}:{PORT}", **grace, **options)
        result["fleet_seconds"] = time.time() - started
        result["restarted"] = restarted
        result["nodes"] = [{"id": n["NodeID"], "resources": n["Resources"], "alive": n["Alive"]} for n in ray.nodes()]
        result["listeners"] = _listeners()
        ray.shutdown()
    finally:
        _ray("stop", "--force")
        Path(result_path).write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:])
