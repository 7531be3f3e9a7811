"""Content-addressed stage outputs, keyed by what the stage declares.

Each stage declares a `StageSpec`: its name, a `VERSION` bumped when its code changes its output, a frozen
dataclass of the settings it reads, the packages whose versions shape its output, and whether its output depends
on the host (the kernel class, or the whole machine). The cache key is derived from that declaration and the keys
of the stage's inputs, never assembled by hand:

    sha256(stage, version, config fields, input keys, package versions, host)

Outputs are written to a scratch folder (locked by its builder while it works) and renamed into place; each entry's
record.json holds the sha256 of every file, checked on reuse, so a truncated or edited entry is rebuilt rather than
trusted. A scratch folder whose builder died is removed by the next build of that stage.

A build holds a lease on every entry it uses (a shared flock on `<stage>/.lease-<key>`) until it ends, and reuse
refreshes an entry's age: gc removes an entry only under the exclusive lock of that file, so never one a running
build holds, and never one a build has just reused. The folders, lease files and locks are pipeline.build.store's.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import errno
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from pipeline.build import faults
from pipeline.build.manifest import StageRecord
from pipeline.build.store import OWNER, RECORD, Leases, cache_entry, discard, remove_dead_scratch, scratch_for
from pipeline.errors import CacheError, PipelineError
from pipeline.runtime.artifact import canonical_json, sha256_file
from pipeline.runtime.host import cpu_flags, kernel_class, usable_cores

HOST_SCOPES = ("none", "kernels", "machine")
WRITE_ERRORS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.ENOTDIR)
RUNTIME_DIR = Path(__file__).resolve().parents[1] / "runtime"


@dataclasses.dataclass(frozen=True)
class StageSpec:
    """A stage's declaration: everything its cache key is derived from besides its inputs.

    `host`: "none" (the output is the same on any host), "kernels" (it measures accuracy on this host's kernels,
    so the kernel class is part of the key) or "machine" (it times this host: cores and flags are). `runtime_code`:
    it measures through the runtime package, so the runtime's source digest is part of the key."""

    name: str
    version: int
    config: type
    packages: tuple[str, ...] = ()
    host: str = "none"
    runtime_code: bool = False

    def __post_init__(self):
        if not (dataclasses.is_dataclass(self.config) and self.config.__dataclass_params__.frozen):
            raise PipelineError(f"stage {self.name}: its config must be a frozen dataclass")
        if self.host not in HOST_SCOPES:
            raise PipelineError(f"stage {self.name}: host = {self.host!r} is not one of {', '.join(HOST_SCOPES)}")

    def key(self, config, inputs: dict[str, str]) -> str:
        """The content address of this stage's output for `config` over `inputs` (name -> upstream key)."""
        return hashlib.sha256(canonical_json(self.key_body(config, inputs))).hexdigest()

    def key_body(self, config, inputs: dict[str, str]) -> dict:
        """What the key hashes, for records and tests."""
        if type(config) is not self.config:
            raise PipelineError(
                f"stage {self.name} got a {type(config).__name__} config, but it declares {self.config.__name__}"
            )
        fields = dataclasses.asdict(config)
        try:
            canonical_json(fields)
        except (TypeError, ValueError) as err:
            raise PipelineError(f"stage {self.name}: its config is not plain data ({err})") from None
        body = {
            "stage": self.name,
            "version": self.version,
            "config": fields,
            "inputs": dict(sorted(inputs.items())),
            "packages": package_versions(self.packages),
        }
        if self.host == "kernels":
            body["host"] = kernel_class()
        elif self.host == "machine":
            body["host"] = {"cores": usable_cores(), "flags": sorted(cpu_flags() or ())}
        if self.runtime_code:
            body["runtime_code"] = runtime_code_digest()
        return body


def package_versions(names) -> dict[str, str]:
    """Installed version of each named distribution ("absent" where it is not installed)."""
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def runtime_code_digest() -> str:
    """sha256 over the runtime package's source: a stage that measured through one runtime measures again under
    another."""
    digest = hashlib.sha256()
    for file in sorted(RUNTIME_DIR.rglob("*.py")):
        digest.update(f"{file.relative_to(RUNTIME_DIR).as_posix()}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def _intact(entry: Path) -> dict | None:
    """The entry's record if every file it lists is present with the recorded hash, else None."""
    try:
        record = json.loads((entry / RECORD).read_text())
        for name, digest in record["files"].items():
            if sha256_file(entry / name) != digest:
                return None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


_LEASES: contextvars.ContextVar[Leases | None] = contextvars.ContextVar("pipeline_cache_leases", default=None)


@contextlib.contextmanager
def leases():
    """Hold every entry `run_cached` uses inside this block until it ends, so that gc removes none of them. A
    failure inside the block that comes from a leased entry removed anyway becomes a one-line CacheError."""
    held = Leases()
    token = _LEASES.set(held)
    try:
        yield held
    except Exception:
        held.check()
        raise
    finally:
        _LEASES.reset(token)
        held.release()


def _produce(entry: Path, key: str, spec: StageSpec, config: dict, produce: Callable[[Path], dict]) -> dict:
    with scratch_for(entry, key) as scratch:
        try:
            metrics = produce(scratch)
            files = {p.name: sha256_file(p) for p in sorted(scratch.iterdir()) if p.is_file() and p.name != OWNER}
            record = {"stage": spec.name, "key": key, "config": config, "files": files, "metrics": metrics}
            (scratch / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True))
            faults.point(f"cache-{spec.name}")
            (scratch / OWNER).unlink()
            try:
                os.rename(scratch, entry)
            except OSError:
                # A concurrent build renamed the same content into place first; keep that one.
                shutil.rmtree(scratch)
                record = _intact(entry)
                if record is None:
                    raise
            return record
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise


def run_cached(
    cache_dir: str | Path, spec: StageSpec, config, inputs: dict[str, str], produce: Callable[[Path], dict]
) -> StageRecord:
    """Reuse the stage's cached output, or call `produce(folder)` to write it and return its metrics."""
    started = time.perf_counter()
    key = spec.key(config, inputs)
    fields = dataclasses.asdict(config)
    entry = cache_entry(cache_dir, spec.name, key)
    scope = _LEASES.get()
    held = scope if scope is not None else Leases()  # outside a build: leased while this call runs
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        held.hold(entry)
        remove_dead_scratch(entry.parent)
        record = _intact(entry) if entry.exists() else None
        reused = record is not None
        if reused:
            os.utime(entry)  # its age counts from its last use: gc's --min-age spares what builds reuse
        else:
            if entry.exists() or entry.is_symlink():
                discard(entry)  # damaged: a truncated file or a missing record
            record = _produce(entry, key, spec, fields, produce)
        held.record(entry, record["files"])
    except OSError as err:
        if err.errno == errno.ELOOP:  # opened with O_NOFOLLOW: a planted symlink
            raise CacheError(
                f"{err.filename or entry.parent} in the stage cache is a symlink where the cache keeps its own file; "
                "remove it, or pass another --cache-dir"
            ) from None
        if err.errno not in WRITE_ERRORS:
            raise
        raise CacheError(
            f"the stage cache {entry.parent} cannot be written ({err.strerror or err}); free space or fix its "
            "permissions, or pass another --cache-dir"
        ) from None
    finally:
        if scope is None:
            held.release()
    outputs = {name: str(entry / name) for name in record["files"]}
    return StageRecord(
        name=spec.name,
        key=key,
        config=fields,
        outputs=outputs,
        metrics=record["metrics"],
        seconds=round(time.perf_counter() - started, 3),
        reused=reused,
    )
