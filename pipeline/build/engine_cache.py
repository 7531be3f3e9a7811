"""The entries the build writes into a published artifact's TensorRT engine cache (the cache's layout and the
policy of which engine may run where are the runtime's: pipeline/runtime/engine_cache.py). The engine stage builds
engines, and `pipeline engine ARTIFACT` builds one later; publish copies the stage's into the cache."""

from __future__ import annotations

import datetime
from pathlib import Path

from pipeline.build.manifest import Manifest
from pipeline.runtime.artifact import verify_artifact
from pipeline.runtime.engine_cache import engine_cache_dir, write_engine


def cache_built_engines(manifest: Manifest, artifact: Path) -> list[str]:
    """After publishing: copy the engines the engine stage built into the artifact's engine cache."""
    record = manifest.ran("engine")
    if record is None or record.metrics.get("status") != "built":
        return []
    published = verify_artifact(artifact)
    cache_dir = engine_cache_dir(artifact, published)
    names = []
    for graph, built in record.metrics["engines"].items():
        entry = engine_entry(published, graph, record.metrics["host"], record.metrics["profiles"], built["validation"])
        write_engine(cache_dir, built["name"], record.output(f"{built['name']}.plan").read_bytes(), entry)
        names.append(built["name"])
    return names


def engine_entry(published: dict, graph: str, host: dict, profile: dict, validation: dict) -> dict:
    """The description an engine cache entry of `published` carries: the graph, GPU host and profile it was built
    for, and how it validated."""
    return {
        "graph": graph,
        "hardware_compatibility": published["target_spec"]["tensorrt"]["hardware_compatibility"],
        "graph_sha256": published["files"][graph],
        "artifact": f"{published['model_name']}/{published['version']}/{published['target']}",
        "profiles": profile,
        "profile_hash": published["engine"]["profile_hash"],
        **host,
        "built_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "validation": validation,
    }
