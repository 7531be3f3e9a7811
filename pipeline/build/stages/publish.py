"""The publish stage: an immutable, versioned artifact.

    artifacts/<model>/v<N>/<target>/   model.onnx  [model.onnx.data]  tokenizer.json  report.json  manifest.json
    artifacts/<model>/latest/<target>  -> ../v<N>/<target>

The artifact is assembled in a staging folder beside the versions and renamed into place in one step, under a
lock (pipeline.build.store owns the layout and the lock), so a killed build never leaves a half-written version.
Published versions are never overwritten; a rebuild whose content equals a published version reports that version
instead of adding one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import shutil
from pathlib import Path

from pipeline.build import faults
from pipeline.build.cache import package_versions
from pipeline.build.engine_cache import cache_built_engines
from pipeline.build.inputs.targets import Target
from pipeline.build.manifest import Manifest, Published, runtime_spec
from pipeline.build.store import (
    model_lock,
    model_root,
    new_staging,
    next_version,
    point_latest,
    remove_stale_staging,
    version_folders,
)
from pipeline.build.timing import COST
from pipeline.errors import ArtifactError
from pipeline.runtime.artifact import (
    MANIFEST_NAME,
    canonical_json,
    manifest_digest,
    sha256_file,
    verify_artifact,
)
from pipeline.runtime.host import describe_host, kernel_class
from pipeline.runtime.schema import REPORT, PublishedManifest

PACKAGES = (
    "torch",
    "transformers",
    "sentence-transformers",
    "optimum",
    "optimum-onnx",
    "onnx",
    "onnxruntime",
    "openvino",
    "nncf",
    "tokenizers",
    "numpy",
)
# Stages whose key holds the build host itself: what they found is recorded, but is not the artifact's identity.
HOST_STAGES = ("tune",)


def _package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    versions.update({k: v for k, v in package_versions(PACKAGES).items() if v != "absent"})
    return versions


def _host() -> dict:
    return {k: v for k, v in describe_host().items() if k != "kernel_flags"}


def _content(manifest: Manifest, target: Target, files: dict[str, str]) -> dict:
    """What defines an artifact's identity: its files, how to run them, and how they were made. Not the build
    host's tuned session or timings: identical files built on another host are the same version."""
    chosen = manifest.chosen()
    return {
        "files": {k: v for k, v in files.items() if k != REPORT},
        "graph": chosen.graph,
        "backend": "tensorrt" if target.engine == "tensorrt" else chosen.backend,
        "precision": chosen.precision or target.precision,
        "model": runtime_spec(manifest, target),
        "engine": getattr(manifest.ran("engine"), "metrics", None),
        "target_spec": target.to_dict(),
        "stages": {r.name: {"key": r.key, "config": r.config} for r in manifest.stages if r.name not in HOST_STAGES},
    }


# Figures timed on the build host: they go to report.json with their spread, host and date, never to the manifest,
# where they would pose as a property of the immutable artifact.
TIMED = ("latency_ms", "latency_range_ms", "screen_ratios", *COST)
SPEED_MEANING = (
    "timed on the build host while it built (possibly busy): they explain the search's choice and are not a "
    "property of the artifact; `make bench` measures speed side by side"
)


def _candidates(manifest: Manifest) -> list | None:
    """The engine search's table (each candidate's accuracy on the development split, score, choice), untimed."""
    record = manifest.ran("search")
    if record is None:
        return None
    return [{k: v for k, v in row.items() if k not in TIMED} for row in record.metrics["candidates"]]


def build_speed(manifest: Manifest) -> dict:
    """The build's timed figures with their spread (median and p10-p90), host and date, for report.json."""
    search = getattr(manifest.ran("search"), "metrics", None)
    validation = manifest.stage("validate").metrics
    return {
        "meaning": SPEED_MEANING,
        "host": _host(),
        "search": {
            "measured_at": search.get("timed_at"),
            "candidates": {r["name"]: {k: r.get(k) for k in TIMED} for r in search["candidates"]},
        }
        if search
        else None,
        "generation": validation.get("speed"),
        "stage_seconds": {r.name: r.seconds for r in manifest.stages},
    }


def measured_on(target: Target) -> dict:
    """The kernel class the build host measured accuracy and speed on, against the one the target is for."""
    host = kernel_class()
    return {
        "kernel_class": host,
        "target_kernel_class": target.kernel_class,
        "matches": target.kernel_class in ("any", host),
    }


def _model_spec(manifest: Manifest, content: dict) -> dict:
    """The runtime spec, with the tune stage's shape-bucket plan where it won on this host
    (pipeline.build.shape_buckets).
    Kept out of the artifact's identity, as the tuned session is: the plan is the build host's choice."""
    plan = manifest.tuned().shape_buckets
    return {**content["model"], "shape_buckets": plan} if plan else content["model"]


def _existing(root: Path, target: str, content_id: str) -> str | None:
    """The newest version already holding this content, intact: a damaged or tampered one is passed over, so the
    build publishes a new version instead of pointing `latest` at files that no longer verify."""
    for _, version_dir in reversed(version_folders(root)):
        with contextlib.suppress(OSError, ValueError, ArtifactError):
            existing = json.loads((version_dir / target / MANIFEST_NAME).read_text())
            if existing.get("content_id") == content_id and verify_artifact(version_dir / target):
                return version_dir.name
    return None


def _report(manifest: Manifest) -> dict:
    return {r.name: {"reused": r.reused, "seconds": r.seconds, "metrics": r.metrics} for r in manifest.stages}


def _write_staging(
    staging: Path, manifest: Manifest, target: Target, sources: dict, content: dict, version: str
) -> None:
    """Copy the files and write report.json and manifest.json into `staging`, then make them read-only."""
    files = dict(content["files"])
    for name, path in sources.items():
        shutil.copyfile(path, staging / name)
        if sha256_file(staging / name) != files[name]:
            raise ArtifactError(f"{path} changed while it was being published; rebuild")
    report = {
        "model_name": manifest.model_name,
        "version": version,
        "target": target.name,
        "build_speed": build_speed(manifest),
        "stages": _report(manifest),
    }
    (staging / REPORT).write_text(json.dumps(report, indent=1, sort_keys=True, default=str))
    files[REPORT] = sha256_file(staging / REPORT)
    published = PublishedManifest(
        model_name=manifest.model_name,
        version=version,
        target=target.name,
        content_id=hashlib.sha256(canonical_json(content)).hexdigest(),
        created_at=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        files=files,
        graph=content["graph"],
        backend=content["backend"],
        model=_model_spec(manifest, content),
        precision=content["precision"],
        session={**dataclasses.asdict(target.runtime), **manifest.chosen().session, **manifest.tuned().session},
        candidates=_candidates(manifest),
        measured_on=measured_on(target),
        engine=content["engine"],
        target_spec=content["target_spec"],
        source={k: v for k, v in dataclasses.asdict(manifest.checkpoint).items() if k != "config"},
        stages={r.name: {"key": r.key, "config": r.config} for r in manifest.stages},
        validation={k: v for k, v in manifest.stage("validate").metrics.items() if k != "speed"},
        packages=_package_versions(),
        host=_host(),
        reused_stages=[r.name for r in manifest.stages if r.reused],
    )
    published = dataclasses.replace(published, manifest_sha256=manifest_digest(published.to_dict()))
    (staging / MANIFEST_NAME).write_text(published.to_json())
    for file in staging.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
        file.chmod(0o444)


def _check_validated(manifest: Manifest, digests: dict[str, str]) -> None:
    """Nothing unvalidated is published: the verdict must name exactly these files, by digest."""
    measured = manifest.stage("validate").metrics.get("measured_files")
    if measured != digests:
        changed = sorted(n for n in set(digests) | set(measured or {}) if (measured or {}).get(n) != digests.get(n))
        raise ArtifactError(
            f"the validation verdict was measured on other files than those to publish ({', '.join(changed)} "
            f"differ): a stage-cache entry changed after validation. Nothing was published; remove "
            f"{manifest.cache_dir} (or the changed entries) and rebuild"
        )


def run(manifest: Manifest, target: Target) -> Manifest:
    """Publish the validated graph, or report the identical version already published."""
    sources = manifest.artifact_sources()
    digests = {name: sha256_file(path) for name, path in sources.items()}
    _check_validated(manifest, digests)
    root = model_root(manifest.artifacts_dir, manifest.model_name)
    content = _content(manifest, target, digests)
    content_id = hashlib.sha256(canonical_json(content)).hexdigest()
    try:
        with model_lock(root):
            remove_stale_staging(root)
            version = _existing(root, target.name, content_id)
            reused = version is not None
            if not reused:
                version = next_version(root, target.name)
                staging = new_staging(root)
                try:
                    _write_staging(staging, manifest, target, sources, content, version)
                    faults.point("publish-staged")
                    (root / version).mkdir(exist_ok=True)
                    os.rename(staging, root / version / target.name)
                except BaseException:
                    shutil.rmtree(staging, ignore_errors=True)
                    raise
                faults.point("publish-renamed")
            point_latest(root, version, target.name)
    except OSError as err:
        raise ArtifactError(
            f"publishing {manifest.model_name} to {root} failed: {err.strerror or err} "
            f"({err.filename or root}); nothing was published. Free space or fix permissions, then rebuild."
        ) from None
    path = root / version / target.name
    engines = cache_built_engines(manifest, path)
    return dataclasses.replace(manifest, published=Published(version, str(path), reused, content_id, engines))
