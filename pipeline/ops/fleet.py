"""Fleet builds: many models for many targets, each target's host-dependent stages on a node of its class.

    models x targets --> per build: prepare (checkpoint, export, optimize: any node)
                                     --> finish (search, validate, tune, engine, publish: a node of the class)

Nodes advertise their class as a Ray custom resource (`kernel_class:avx2`, `kernel_class:amx`, `gpu:sm80`;
`pipeline host --ray-resources` prints this host's). Every node reads the checkpoints, the stage cache and the
artifacts folder at the same paths (shared storage), so a stage one node cached is reused by the others and each
shared stage runs once. Publishing holds an exclusive flock on the artifact's folder, which needs a file system
whose locks hold across nodes (NFSv4 with locking, CephFS, Lustre; not NFSv3 without lockd, nor most FUSE mounts).

A task whose node dies is retried by Ray on another node of the same class; a build is atomic (stage outputs and
artifacts are renamed into place), so a retry neither publishes half an artifact nor loses finished cache entries.
Without a cluster the fleet runs here, one build at a time.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

from pipeline.errors import InputError, PipelineError, TargetError

PREPARE_UNTIL = "optimize"  # the last stage whose output is the same on any host
RETRIES = 3
# How long a build may wait with no live node of its class (a node that died may come back) before it is a row.
NODE_GRACE_S = 120.0
POLL_S = 5.0
PATH_OPTIONS = ("artifacts_dir", "cache_dir", "validation", "calibration")


def host_resources() -> dict[str, float]:
    """This host's classes as Ray custom resources: its CPU kernel class, and its GPU's compute capability."""
    from pipeline.runtime.host import gpu_host, kernel_class

    resources = {f"kernel_class:{kernel_class()}": 1.0}
    gpu, _ = gpu_host()
    if gpu is not None:
        resources[f"gpu:sm{gpu['compute_capability'].replace('.', '')}"] = 1.0
    return resources


AUTH_NOTE = (
    "# first set RAY_AUTH_TOKEN to one secret (e.g. `openssl rand -hex 32`) on every node and on the driver: "
    "a cluster without it runs code for anyone who reaches its ports"
)


def ray_start_line(head: str | None = None) -> str:
    """The `ray start` command that joins this host to a fleet cluster with its classes advertised, with Ray's token
    authentication on (Ray 2.60 turns it on only where asked or where a token already exists)."""
    if head is not None and not re.fullmatch(r"[A-Za-z0-9.-]+:\d{1,5}", head):
        raise InputError(f"--head {head!r} is not host:port (e.g. 10.0.0.1:6379); pass the head node's address")
    resources = json.dumps(host_resources(), separators=(",", ":"))
    where = f"--address={head}" if head else "--head --port=6379"
    return f"RAY_AUTH_MODE=token ray start {where} --resources='{resources}'"


def target_resource(spec) -> str | None:
    """The Ray resource a node needs to run `spec`'s host-dependent stages, or None where any node will do."""
    if spec.device == "gpu":
        return (
            f"gpu:sm{spec.tensorrt.compute_capability.replace('.', '')}" if spec.tensorrt.compute_capability else None
        )
    return None if spec.kernel_class == "any" else f"kernel_class:{spec.kernel_class}"


def read_models(path: str | Path) -> list[str]:
    """The checkpoint folders listed in a models file, one a line ('#' starts a comment); each must be a folder."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise InputError(f"cannot read the models file {file} ({err}); pass a text file, one folder a line") from None
    models = [line.split("#", 1)[0].strip() for line in lines]
    models = [m for m in models if m]
    if not models:
        raise InputError(f"{file} lists no checkpoint folders; write one folder a line")
    missing = [m for m in models if not Path(m).is_dir()]
    if missing:
        raise InputError(f"{file} lists {', '.join(missing[:3])}, which are not folders; fix the paths")
    return models


def _where() -> dict:
    """The node a task ran on."""
    try:
        import ray

        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        node = None
    return {"node_id": node, "host": socket.gethostname()}


def _failed(err: Exception) -> dict:
    return {"status": "failed", "error": (str(err).splitlines() or [type(err).__name__])[0], **_where()}


def _prepare(model: str, target: str, options: dict) -> dict:
    from pipeline.build.table import build

    try:
        build(model, target, until=PREPARE_UNTIL, **options)
    except PipelineError as err:  # the build's own one line, for `_finish` to hand on as the row
        return _failed(err)
    return _where()


def _finish(model: str, target: str, options: dict, prepared: dict | None = None) -> dict:
    """One build to the end (the stages `_prepare` cached are reused); its row of the fleet table. `prepared` is
    `_prepare`'s result, passed so that Ray runs this task after it (a failed one is the row)."""
    from pipeline.build.table import build

    if prepared and prepared.get("status") == "failed":
        return prepared
    try:
        manifest = build(model, target, **options)
    except PipelineError as err:
        return _failed(err)
    chosen = manifest.ran("search")
    verdict = manifest.stage("validate").metrics.get("verdict", [])
    return {
        "status": "published" if not manifest.published.reused else "unchanged",
        "path": manifest.published.path,
        "chosen": chosen.metrics.get("chosen") if chosen else f"{manifest.chosen().backend} (no search)",
        "accuracy": {r["metric"]: r["value"] for r in verdict if not isinstance(r["value"], bool)},
        "seconds": manifest.published.seconds,
        **_where(),
    }


def _connect(cluster: str, resources: set[str]) -> None:
    """Join the cluster, failing within seconds where nothing answers, and refuse before any work when a class
    the targets need has no node."""
    import ray

    from pipeline.serving.ray_local import check_reachable

    check_reachable(cluster)
    if not ray.is_initialized():
        ray.init(address=cluster, log_to_driver=False)
    available = set(ray.cluster_resources())
    missing = sorted(r for r in resources if r not in available)
    if missing:
        raise TargetError(
            f"the cluster at {cluster} has no node with {', '.join(missing)}; on a host of that class run the line "
            "`pipeline host --ray-resources` prints, or drop those targets"
        )


def fleet(
    models: list[str], targets: list[str], cluster: str | None = None, node_grace_s: float = NODE_GRACE_S, **options
) -> list[dict]:
    """Build every model for every target; one row per build (model, target, status, chosen, accuracy, node).
    With `cluster` (ray://host:port or host:port) each build runs as Ray tasks; without, here, in turn. A build
    whose class has had no live node for `node_grace_s` seconds is a failed row."""
    from pipeline.build.inputs.targets import load_target

    # Paths as this driver sees them: a task on another node runs in another working directory.
    models = [str(Path(m).resolve()) for m in models]
    targets = [str(Path(t).resolve()) if t.endswith(".toml") else t for t in targets]
    options = {k: str(Path(v).resolve()) if k in PATH_OPTIONS and v is not None else v for k, v in options.items()}
    specs = {t: load_target(t) for t in targets}  # a bad target is refused before any work
    jobs = [(m, t) for m in models for t in targets]
    if cluster is None:
        rows = []
        for model, target in jobs:
            rows.append({"model": model, "target": target, **_finish(model, target, options)})
        return rows
    import ray

    needed = {t: target_resource(spec) for t, spec in specs.items()}
    _connect(cluster, {r for r in needed.values() if r})
    prepare = ray.remote(num_cpus=1, max_retries=RETRIES)(_prepare)
    finish = ray.remote(num_cpus=1, max_retries=RETRIES)(_finish)
    pending = []
    for model, target in jobs:
        prepared = prepare.remote(model, target, options)
        resource = needed[target]
        # A finish takes every CPU of its node: the search and tune time candidates on all cores, so no other task
        # of the fleet may share them.
        settings = {"resources": {resource: 0.001}, "num_cpus": _node_cpus(ray, resource)} if resource else {}
        finished = finish.options(**settings).remote(model, target, options, prepared)
        pending.append(((model, target), resource, prepared, finished))
    return [
        {"model": model, "target": target, **_result(ray, finished, prepared, resource, node_grace_s)}
        for (model, target), resource, prepared, finished in pending
    ]


def _live_nodes(ray, resource: str) -> list[dict]:
    """The live nodes of the cluster that advertise `resource`."""
    return [n for n in ray.nodes() if n["Alive"] and resource in n["Resources"]]


def _node_cpus(ray, resource: str) -> float:
    """The CPUs of the smallest live node advertising `resource`."""
    return min((n["Resources"].get("CPU", 1.0) for n in _live_nodes(ray, resource)), default=1.0)


def _result(ray, ref, prepared, resource: str | None, grace_s: float) -> dict:
    """A build's row: the task's result, or a failed row with its error's first line. A build whose host-independent
    part failed is that failure's row, with no need of a node of its class; one whose class has had no live node
    for `grace_s` seconds is cancelled and named as such, never waited for forever."""
    lost = 0.0
    while not ray.wait([ref], timeout=POLL_S)[0]:
        if ray.wait([prepared], timeout=0)[0]:
            early = _outcome(ray, prepared)
            if early.get("status") == "failed":
                ray.cancel(ref, force=True)
                return early
        alive = bool(_live_nodes(ray, resource)) if resource else True
        lost = 0.0 if alive else lost + POLL_S
        if lost >= grace_s:
            ray.cancel(ref, force=True)
            return {
                "status": "failed",
                "error": f"no live node advertises {resource} (for {grace_s:.0f} s); start one with the line "
                "`pipeline host --ray-resources` prints, then build again",
            }
    return _outcome(ray, ref)


def _outcome(ray, ref) -> dict:
    """A finished task's result, or a failed row with its error's first line."""
    try:
        return ray.get(ref)
    except Exception as err:  # a task Ray gave up on after its retries: a row, not the end of the fleet
        cause = getattr(err, "cause", None) or err  # a RayTaskError's own first line names the task, not the error
        return {"status": "failed", "error": _plain((str(cause).splitlines() or [type(cause).__name__])[0])}


def _plain(text: str) -> str:
    """`text` without terminal colour codes (Ray's task errors carry them)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def fleet_table(rows: list[dict]) -> str:
    """The fleet's result, one line a build: model, target, status, chosen candidate, the gate's first figures,
    seconds, and the node it finished on."""
    head = f"  {'model':<22} {'target':<18} {'status':<10} {'chosen':<24} {'accuracy':<38} {'s':>6}  where"
    lines = [head]
    for row in rows:
        accuracy = ", ".join(f"{k} {v:.4f}" for k, v in list((row.get("accuracy") or {}).items())[:2])
        where = row.get("host", "-") + (f" ({row['node_id'][:8]})" if row.get("node_id") else "")
        seconds = f"{row['seconds']:.0f}" if row.get("seconds") is not None else "-"
        lines.append(
            f"  {Path(row['model']).name:<22} {Path(row['target']).stem:<18} {row['status']:<10} "
            f"{str(row.get('chosen')):<24} {accuracy or row.get('error', '-'):<38} {seconds:>6}  {where}"
        )
    return "\n".join(lines)
