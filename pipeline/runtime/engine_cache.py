"""The TensorRT engine cache beside an artifact, and the policy of which engine may run where.

Engines are tied to the GPU architecture and the TensorRT version, so they never go into the immutable,
hardware-neutral artifact. They live in its engine cache, one pair of files per engine:

    artifacts/<model>/engines/<version>-<target>/<key>-<graph>.plan   the serialized engine
    artifacts/<model>/engines/<version>-<target>/<key>-<graph>.json   what it was built from and for, and how it
                                                                       validated; written last, so it marks a
                                                                       complete entry
    <key> = sm<compute capability>-trt<TensorRT version>-<profile hash>     (engine_cache_key)
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

from pipeline.errors import ArtifactError
from pipeline.runtime.artifact import sha256_file
from pipeline.runtime.schema import GRAPH

ENGINES_DIR = "engines"
CAPABILITY = re.compile(r"\d{1,2}\.\d{1,2}")


def engine_cache_key(compute_capability: str, tensorrt_version: str, profile_hash: str) -> str:
    """The name of a TensorRT engine in an artifact's engine cache: engines are tied to the GPU architecture
    and the TensorRT version, and to the optimization profiles they were built for."""
    return f"sm{compute_capability.replace('.', '')}-trt{tensorrt_version}-{profile_hash}"


def runs_on(engine: dict, compute_capability: str) -> bool:
    """Whether an engine runs on a GPU of this compute capability: its own, or any Ampere or later GPU for an engine
    built hardware-compatible (`hardware_compatibility = "ampere_plus"`)."""
    if engine.get("hardware_compatibility") == "ampere_plus":
        return float(compute_capability) >= 8.0
    return engine.get("compute_capability") == compute_capability


def check_engine(engine: dict, compute_capability: str, tensorrt_version: str) -> None:
    """Refuse an engine built for another GPU architecture or TensorRT version, naming both."""
    built = (engine.get("compute_capability"), engine.get("tensorrt"))
    if not runs_on(engine, compute_capability) or built[1] != tensorrt_version:
        raise ArtifactError(
            f"the TensorRT engine was built for compute capability {built[0]} with TensorRT {built[1]}, but this "
            f"host has compute capability {compute_capability} with TensorRT {tensorrt_version}; rebuild it here "
            "with `pipeline engine ARTIFACT`, or load with the ONNX Runtime fallback"
        )


def engine_cache_dir(artifact: Path, manifest: dict) -> Path:
    """Where the engines of a published artifact are cached: beside its versions, outside the artifact."""
    return Path(artifact).resolve().parent.parent / ENGINES_DIR / f"{manifest['version']}-{manifest['target']}"


def engine_name(compute_capability: str, tensorrt_version: str, profile_hash: str, graph: str) -> str:
    """The file stem of one graph's engine in the cache (model.onnx -> ...-model, model.int8.onnx -> ...-int8)."""
    stem = "model" if graph == GRAPH else graph.removeprefix("model.").removesuffix(".onnx")
    return f"{engine_cache_key(compute_capability, tensorrt_version, profile_hash)}-{stem}"


def write_engine(cache_dir: Path, name: str, plan: bytes, record: dict) -> dict:
    """Put one engine into the cache: the plan, then its record (with the plan's sha256), each renamed into place,
    so a reader sees a complete entry or none."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = cache_dir / f".{name}.{uuid.uuid4().hex}"
    scratch.write_bytes(plan)
    os.replace(scratch, cache_dir / f"{name}.plan")
    record = {**record, "name": name, "plan_sha256": sha256_file(cache_dir / f"{name}.plan")}
    scratch.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(scratch, cache_dir / f"{name}.json")
    return record


def cached_engines(cache_dir: Path, manifest: dict, graph: str) -> list[tuple[dict, Path]]:
    """(record, plan path) of each engine of `graph` in the cache whose record names its own file, was built from
    this artifact's graph and profiles, and gives a compute capability such as "8.6". Records that do not (damaged,
    renamed, copied from another artifact, or naming a path) are skipped: a record's name becomes a file path. The
    plans' hashes are not checked here."""
    entries = []
    for path in sorted(cache_dir.glob("*.json")) if cache_dir.is_dir() else ():
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (
            isinstance(record, dict)
            and record.get("name") == path.stem
            and record.get("graph") == graph
            and record.get("graph_sha256") == manifest["files"].get(graph)
            and record.get("profile_hash") == manifest["engine"]["profile_hash"]
            and CAPABILITY.fullmatch(str(record.get("compute_capability")))
        ):
            entries.append((record, cache_dir / f"{path.stem}.plan"))
    return entries


def find_engine(cache_dir: Path, manifest: dict, graph: str, host: dict) -> tuple[Path | None, list[dict]]:
    """The cached engine of `graph` for this host's GPU architecture and TensorRT version, checked against the
    artifact's graph and its own hash; else (None, the records of the engines cached for other hosts)."""
    profile_hash = manifest["engine"]["profile_hash"]
    name = engine_name(host["compute_capability"], host["tensorrt"], profile_hash, graph)
    record_path = cache_dir / f"{name}.json"
    if record_path.is_file():
        try:
            record = json.loads(record_path.read_text())
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:
            raise ArtifactError(f"{record_path} is damaged ({err}); delete it and build the engine again") from None
        if record.get("graph_sha256") != manifest["files"].get(graph):
            raise ArtifactError(
                f"{record_path} was built from another {graph} than this artifact's; delete it and run "
                "`pipeline engine ARTIFACT`"
            )
        plan = cache_dir / f"{name}.plan"
        if not plan.is_file() or sha256_file(plan) != record.get("plan_sha256"):
            raise ArtifactError(f"{plan} is missing or does not match its sha256 in {record_path.name}; rebuild it")
        check_engine(record, host["compute_capability"], host["tensorrt"])
        return plan, []
    others = [record for record, _ in cached_engines(cache_dir, manifest, graph)]
    # A hardware-compatible engine built on another Ampere-or-later GPU serves this one too.
    for record in others:
        built_for = record["compute_capability"]
        if built_for != host["compute_capability"] and runs_on(record, host["compute_capability"]):
            if record.get("tensorrt") == host["tensorrt"]:
                return find_engine(cache_dir, manifest, graph, {**host, "compute_capability": built_for})
    return None, others


def engine_for_host(cache_dir: Path, manifest: dict, graph: str, host: dict) -> tuple[Path | None, str]:
    """(the engine of `graph` for this host, "") or (None, why there is none: an engine built for another GPU
    architecture or TensorRT version, naming both, or none at all)."""
    plan, others = find_engine(cache_dir, manifest, graph, host)
    if plan is not None:
        return plan, ""
    for record in others:
        try:
            check_engine(record, host["compute_capability"], host["tensorrt"])
        except ArtifactError as err:
            return None, str(err)
    return None, (
        f"no engine of {graph} for this host (compute capability {host['compute_capability']}, TensorRT "
        f"{host['tensorrt']}) in {cache_dir}; build it with `pipeline engine ARTIFACT`, or load(..., "
        "build_engine=pipeline.build.stages.engine.build_artifact_engine)"
    )
