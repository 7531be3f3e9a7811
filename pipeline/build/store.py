"""Where builds keep what they make, and the locks that keep concurrent builds and gc apart.

    <artifacts>/<model>/v<N>/<target>/    a published version (manifest.json and its files, read-only)
    <artifacts>/<model>/latest/<target>   -> ../v<N>/<target>
    <artifacts>/<model>/.staging-<uuid>/  a version being assembled, renamed to v<N>/<target> when complete
    <artifacts>/<model>/.lock             held (exclusive flock) while a version is chosen and renamed into place

    <cache>/<stage>/<key>/                a stage's output (record.json lists its files and their sha256)
    <cache>/<stage>/.lease-<key>          shared flock: a build uses <key>; exclusive: gc is removing it
    <cache>/<stage>/.tmp-<key16>-<uuid>/  scratch of a build that is writing <key> (its .owner file locked)
    <cache>/.gc.lock                      held (exclusive flock) by the one gc that runs on this cache

Every lock file is opened with O_NOFOLLOW: a symlink planted as one is refused, never a file elsewhere created,
truncated or locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pipeline.errors import ArtifactError, CacheError, InputError, PipelineError
from pipeline.runtime.artifact import artifact_holding, version_number

LATEST = "latest"
STAGING_PREFIX = ".staging-"
MODEL_LOCK = ".lock"

RECORD = "record.json"
OWNER = ".owner"
LEASE_PREFIX = ".lease-"
SCRATCH_PREFIX = ".tmp-"
GC_LOCK = ".gc.lock"
# A scratch folder without an owner lock file older than this is taken for one whose builder died before locking.
UNOWNED_SCRATCH_S = 600


# Artifacts


def model_root(artifacts_dir: str | Path, model_name: str) -> Path:
    """The folder that holds every version of one model."""
    return Path(artifacts_dir) / model_name


def check_outside_artifacts(path: Path, what: str) -> None:
    """Refuse, in one line, a folder to write into that lies inside a published artifact (a file added to one fails
    its verification, and a version folder holds only its targets)."""
    holder = artifact_holding(path)
    if holder is not None:
        raise InputError(
            f"{what} {path} lies inside the published artifact {holder}, which must not change; pass a folder "
            "outside every artifact"
        )


def version_folders(root: Path) -> list[tuple[int, Path]]:
    """The vN folders of a model (`root`), oldest first, each with its number."""
    found = [(n, p) for p in root.glob("v*") if (n := version_number(p.name)) is not None and p.is_dir()]
    return sorted(found)


def next_version(root: Path, target: str) -> str:
    """The name of the version a new artifact for `target` gets: one past the newest that holds `target`."""
    return f"v{max([n for n, p in version_folders(root) if (p / target).exists()], default=0) + 1}"


def point_latest(root: Path, version: str, target: str) -> None:
    """Point `latest/<target>` at `<version>/<target>`, atomically: readers see the old version or the new one."""
    latest = root / LATEST
    latest.mkdir(exist_ok=True)
    link = latest / target
    for stale in latest.glob(f".{target}.*"):  # left by a build killed between link and rename
        stale.unlink(missing_ok=True)
    scratch = latest / f".{target}.{uuid.uuid4().hex}"
    os.symlink(f"../{version}/{target}", scratch)
    os.replace(scratch, link)


def latest_targets(root: Path) -> set[Path]:
    """The version folders the `latest/<target>` links of a model resolve to (dangling links left out)."""
    latest = root / LATEST
    pointed = set()
    for link in latest.iterdir() if latest.is_dir() and not latest.is_symlink() else ():
        if link.is_symlink():
            with contextlib.suppress(OSError):
                pointed.add(link.resolve(strict=True))
    return pointed


def new_staging(root: Path) -> Path:
    """A fresh, empty staging folder beside a model's versions. Only a holder of `model_lock` stages."""
    staging = root / f"{STAGING_PREFIX}{uuid.uuid4().hex}"
    staging.mkdir()
    return staging


def remove_stale_staging(root: Path) -> None:
    """Remove staging folders left by builds killed while publishing; call under `model_lock`, when none is in use."""
    for stale in root.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)


# Locks


def _lock_fd(path: Path, flags: int) -> int:
    """A descriptor of `path` to flock, never through a symlink: opened for writing where allowed, since NFS (which
    emulates flock with fcntl locks) grants an exclusive lock only on a file open for writing; read-only where the
    file is another user's, which a local file system locks all the same."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, flags | os.O_RDWR, 0o644)
    except PermissionError:
        return os.open(path, flags | os.O_RDONLY, 0o644)


@contextlib.contextmanager
def exclusive_lock(path: Path, refused: Callable[[OSError], PipelineError]):
    """An exclusive flock on the file `path`, made if missing and never through a symlink; `refused(err)` is the
    error raised where it cannot be opened."""
    try:
        fd = _lock_fd(path, os.O_CREAT)
    except OSError as err:
        raise refused(err) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # a file system without flock (or NFS refusing it)
            raise refused(err) from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def model_lock(root: Path):
    """An exclusive lock on one model's artifact tree, held while a version is chosen and renamed into place."""
    root.mkdir(parents=True, exist_ok=True)

    def refused(err: OSError) -> ArtifactError:
        return ArtifactError(
            f"cannot take the lock {root / MODEL_LOCK} ({err.strerror or err}); remove it if it is a symlink, "
            "or fix the folder's permissions"
        )

    with exclusive_lock(root / MODEL_LOCK, refused):
        yield


@contextlib.contextmanager
def gc_lock(cache_dir: Path):
    """One gc at a time on a cache folder (an exclusive flock on its .gc.lock); nothing where there is no cache."""
    if not cache_dir.is_dir():
        yield
        return

    def refused(err: OSError) -> InputError:
        return InputError(
            f"gc cannot take its lock {cache_dir / GC_LOCK} ({err.strerror or err}); nothing was removed. Remove "
            "that file if it is a symlink, or fix the folder's permissions"
        )

    with exclusive_lock(cache_dir / GC_LOCK, refused):
        yield


# Cache entries


def cache_entry(cache_dir: str | Path, stage: str, key: str) -> Path:
    """The folder of the stage's output whose content address is `key`."""
    return Path(cache_dir) / stage / key


def lease_path(entry: Path) -> Path:
    """The file whose flock leases `entry`: beside it, so that it outlives the entry's removal."""
    return entry.parent / f"{LEASE_PREFIX}{entry.name}"


def leased_entry(lease: Path) -> Path:
    """The cache entry a lease file is for."""
    return lease.parent / lease.name.removeprefix(LEASE_PREFIX)


@contextlib.contextmanager
def scratch_for(entry: Path, key: str):
    """A new scratch folder beside `entry`, locked by this process (its .owner file) until the block ends, so
    that no other build takes it for a dead one's. The caller renames or removes it."""
    scratch = entry.parent / f"{SCRATCH_PREFIX}{key[:16]}-{uuid.uuid4().hex}"
    scratch.mkdir(parents=True)
    # Locked before it takes its name: another build finding an unlocked .owner would reap the folder as dead.
    owner = open(scratch / f"{OWNER}.new", "w")
    try:
        fcntl.flock(owner, fcntl.LOCK_EX)
        os.rename(scratch / f"{OWNER}.new", scratch / OWNER)
        yield scratch
    finally:
        owner.close()


def discard(folder: Path) -> None:
    """Remove a folder of the cache (an entry gc collects, a damaged entry): first renamed aside under a scratch
    name, so a kill during the removal leaves scratch that the next build reaps, never a key-named folder without
    its record, which gc would take for someone else's. A symlink is unlinked, never followed; a folder another
    process removed first is no error."""
    if folder.is_symlink():
        folder.unlink(missing_ok=True)
        return
    aside = folder.parent / f"{SCRATCH_PREFIX}discarded-{uuid.uuid4().hex}"
    try:
        os.rename(folder, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def _owner_dead(scratch: Path) -> bool:
    """Whether the build that made this scratch folder is gone: its lock is free (or it never took one and the
    folder is old)."""
    try:
        fd = _lock_fd(scratch / OWNER, 0)
    except FileNotFoundError:
        return time.time() - scratch.stat().st_mtime > UNOWNED_SCRATCH_S
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def remove_dead_scratch(stage_dir: Path) -> list[Path]:
    """Remove the scratch folders of builds that died (SIGKILL, power cut) in this stage's cache folder."""
    removed = []
    for scratch in stage_dir.glob(f"{SCRATCH_PREFIX}*") if stage_dir.is_dir() and not stage_dir.is_symlink() else ():
        with contextlib.suppress(OSError):
            if not scratch.is_symlink() and _owner_dead(scratch):
                shutil.rmtree(scratch, ignore_errors=True)
                removed.append(scratch)
    return removed


def _open_lease(path: Path, create: bool = True) -> int:
    # O_NOFOLLOW: a symlink planted as a lease file is an error (ELOOP), never a file elsewhere created or locked.
    return _lock_fd(path, os.O_CREAT if create else 0)


def _take_lease(entry: Path) -> int:
    """A shared flock on `entry`'s lease file, on the file that is there now (gc unlinks it as it removes the
    entry: one that waited for gc takes a fresh file)."""
    path = lease_path(entry)
    while True:
        fd = _open_lease(path)
        fcntl.flock(fd, fcntl.LOCK_SH)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                return fd
        os.close(fd)


class Leases:
    """The cache entries one build uses, each leased (gc skips it) until the build ends."""

    def __init__(self):
        self._held: dict[Path, tuple[int, tuple[str, ...] | None]] = {}

    def hold(self, entry: Path) -> None:
        """Lease `entry` (a no-op where this build holds it already)."""
        if entry not in self._held:
            self._held[entry] = (_take_lease(entry), None)

    def record(self, entry: Path, files) -> None:
        """Note the files `entry` holds, checked by `check`."""
        self._held[entry] = (self._held[entry][0], tuple(files))

    def check(self) -> None:
        """A CacheError naming the first entry of this build that lost a file since it was leased (an entry whose
        stage failed before writing it was never there to lose)."""
        for entry, (_, files) in self._held.items():
            if files is None:
                continue
            if not entry.is_dir() or not all((entry / name).is_file() for name in files):
                raise CacheError(
                    f"the stage-cache entry {entry}, which this build uses, was removed while the build ran (by "
                    "hand, or by a gc that does not honour leases); run the build again: it makes the entry anew"
                )

    def release(self) -> None:
        """Give back every lease."""
        for fd, _ in self._held.values():
            os.close(fd)
        self._held.clear()


@contextlib.contextmanager
def claim(entry: Path, create: bool = True):
    """For gc: yields True while it holds `entry`'s lease exclusively (no build holds it), else False; with
    `create` False, a missing lease file counts as free and is not made."""
    try:
        fd = _open_lease(lease_path(entry), create)
    except FileNotFoundError:
        if create:
            raise
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
