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
import socket
from pathlib import Path

from pipeline.errors import InputError, PipelineError, TargetError

PREPARE_UNTIL = "optimize"  # the last stage whose output is the same on any host
RETRIES = 3


def host_resources() -> dict[str, float]:
    """This host's classes as Ray custom resources: its CPU kernel class, and its GPU's compute capability."""
    from pipeline.runtime.host import gpu_host, kernel_class

    resources = {f"kernel_class:{kernel_class()}": 1.0}
    gpu, _ = gpu_host()
    if gpu is not None:
        resources[f"gpu:sm{gpu['compute_capability'].replace('.', '')}"] = 1.0
    return resources


def ray_start_line(head: str | None = None) -> str:
    """The `ray start` command that joins this host to a fleet cluster with its classes advertised."""
    resources = json.dumps(host_resources(), separators=(",", ":"))
    where = f"--address={head}" if head else "--head --port=6379"
    return f"ray start {where} --resources='{resources}'"


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


def _prepare(model: str, target: str, options: dict) -> dict:
    from pipeline.build import build

    build(model, target, until=PREPARE_UNTIL, **options)
    return _where()


def _finish(model: str, target: str, options: dict, prepared: dict | None = None) -> dict:
    """One build to the end (the stages `_prepare` cached are reused); its row of the fleet table. `prepared` is
    `_prepare`'s result, passed so that Ray runs this task after it."""
    from pipeline.build import build

    try:
        manifest = build(model, target, **options)
    except PipelineError as err:
        return {"status": "failed", "error": str(err).splitlines()[0], **_where()}
    chosen = next((r for r in manifest.stages if r.name == "search"), None)
    verdict = manifest.stage("validate").metrics.get("verdict", [])
    return {
        "status": "published" if not manifest.published.get("reused") else "unchanged",
        "path": manifest.published["path"],
        "chosen": chosen.metrics.get("chosen") if chosen else f"{manifest.chosen()['backend']} (no search)",
        "accuracy": {r["metric"]: r["value"] for r in verdict if not isinstance(r["value"], bool)},
        "seconds": manifest.published.get("seconds"),
        **_where(),
    }


def _connect(cluster: str, resources: set[str]) -> None:
    """Join the cluster, failing within seconds where nothing answers, and refuse before any work when a class
    the targets need has no node."""
    import ray

    from pipeline.serving.ray_serve import check_reachable

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


def fleet(models: list[str], targets: list[str], cluster: str | None = None, **options) -> list[dict]:
    """Build every model for every target; one row per build (model, target, status, chosen, accuracy, node).
    With `cluster` (ray://host:port or host:port) each build runs as Ray tasks; without, here, in turn."""
    from pipeline.targets import load_target

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
        resources = {needed[target]: 0.001} if needed[target] else {}
        pending.append(((model, target), finish.options(resources=resources).remote(model, target, options, prepared)))
    rows = []
    for (model, target), ref in pending:
        try:
            rows.append({"model": model, "target": target, **ray.get(ref)})
        except Exception as err:  # a task Ray gave up on after its retries: a row, not the end of the fleet
            rows.append({"model": model, "target": target, "status": "failed", "error": str(err).splitlines()[0]})
    return rows


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
