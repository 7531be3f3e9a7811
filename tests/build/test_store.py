import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from pipeline.build import store
from pipeline.errors import ArtifactError, CacheError, InputError

# Exits 3 where another process holds a lock on the file argv[1] (shared with "sh" as argv[2], else exclusive).
TRY_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
mode = fcntl.LOCK_SH if sys.argv[2:] == ["sh"] else fcntl.LOCK_EX
try:
    fcntl.flock(fd, mode | fcntl.LOCK_NB)
except BlockingIOError:
    sys.exit(3)
"""


def _locked_elsewhere(path: Path, mode: str = "ex") -> bool:
    """Whether another process is refused the lock on `path` (real flock, in a child process)."""
    code = subprocess.run([sys.executable, "-c", TRY_LOCK, str(path), mode], timeout=60).returncode
    assert code in (0, 3), code
    return code == 3


def test_layout_paths_follow_the_documented_tree(tmp_path):
    root = store.model_root(tmp_path / "artifacts", "minilm")
    assert root == tmp_path / "artifacts" / "minilm"
    entry = store.cache_entry(tmp_path / "cache", "export", "ab" * 32)
    assert entry == tmp_path / "cache" / "export" / ("ab" * 32)
    assert store.lease_path(entry) == tmp_path / "cache" / "export" / f".lease-{'ab' * 32}"
    assert store.leased_entry(store.lease_path(entry)) == entry


@pytest.mark.parametrize(
    ("name", "number"),
    [("v1", 1), ("v10", 10), ("v007", 7), ("v", None), ("v1a", None), ("latest", None), ("x1", None)],
)
def test_version_number_reads_only_vN_names(name, number):
    assert store.version_number(name) == number


def test_version_folders_are_listed_by_number_and_files_are_not_versions(tmp_path):
    for name in ("v2", "v10", "v1", "latest", ".staging-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "v3").write_text("a file, not a version")
    assert store.version_folders(tmp_path) == [(1, tmp_path / "v1"), (2, tmp_path / "v2"), (10, tmp_path / "v10")]
    assert store.version_folders(tmp_path / "absent") == []


def test_next_version_counts_per_target(tmp_path):
    assert store.next_version(tmp_path, "cpu-fp32") == "v1"
    (tmp_path / "v1" / "cpu-fp32").mkdir(parents=True)
    (tmp_path / "v2" / "cpu-avx2").mkdir(parents=True)
    assert store.next_version(tmp_path, "cpu-fp32") == "v2"  # beside cpu-avx2's v2
    assert store.next_version(tmp_path, "cpu-avx2") == "v3"


def test_point_latest_repoints_atomically_and_clears_stale_scratch_links(tmp_path):
    for version in ("v1", "v2"):
        (tmp_path / version / "cpu-fp32").mkdir(parents=True)
    store.point_latest(tmp_path, "v1", "cpu-fp32")
    link = tmp_path / "latest" / "cpu-fp32"
    assert os.readlink(link) == "../v1/cpu-fp32"
    stale = tmp_path / "latest" / ".cpu-fp32.dead"
    os.symlink("../v1/cpu-fp32", stale)  # a build killed between making its link and renaming it
    store.point_latest(tmp_path, "v2", "cpu-fp32")
    assert os.readlink(link) == "../v2/cpu-fp32" and not stale.is_symlink()
    assert sorted(p.name for p in (tmp_path / "latest").iterdir()) == ["cpu-fp32"]


def test_latest_targets_resolve_links_and_leave_dangling_ones_out(tmp_path):
    (tmp_path / "v1" / "cpu-fp32").mkdir(parents=True)
    store.point_latest(tmp_path, "v1", "cpu-fp32")
    os.symlink("../v9/cpu-avx2", tmp_path / "latest" / "cpu-avx2")  # names a version that is gone
    assert store.latest_targets(tmp_path) == {(tmp_path / "v1" / "cpu-fp32").resolve()}
    assert store.latest_targets(tmp_path / "absent") == set()


def test_stale_staging_folders_are_removed_and_versions_kept(tmp_path):
    (tmp_path / "v1" / "cpu-fp32").mkdir(parents=True)
    staging = store.new_staging(tmp_path)
    assert staging.parent == tmp_path and staging.name.startswith(".staging-") and not any(staging.iterdir())
    (staging / "model.onnx").write_bytes(b"half")
    store.remove_stale_staging(tmp_path)
    assert not staging.exists() and (tmp_path / "v1" / "cpu-fp32").is_dir()


@pytest.mark.parametrize("lock", ["model", "gc"])
def test_lock_is_exclusive_across_processes_and_free_after_the_block(lock, tmp_path):
    held, path = {
        "model": (store.model_lock(tmp_path / "m"), tmp_path / "m" / ".lock"),
        "gc": (store.gc_lock(tmp_path), tmp_path / ".gc.lock"),
    }[lock]
    with held:
        assert _locked_elsewhere(path)
    assert not _locked_elsewhere(path)


def test_model_lock_makes_a_second_holder_wait_until_the_first_leaves(tmp_path):
    entered = threading.Event()

    def second():
        with store.model_lock(tmp_path / "m"):
            entered.set()

    with store.model_lock(tmp_path / "m"):
        thread = threading.Thread(target=second)
        thread.start()
        assert not entered.wait(0.5)
    assert entered.wait(30)
    thread.join(timeout=30)


@pytest.mark.parametrize("lock", ["model", "gc"])
def test_a_symlink_planted_as_a_lock_file_is_refused_and_its_target_untouched(lock, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    folder = tmp_path / "m"
    folder.mkdir()
    name, held, error = {
        "model": (".lock", store.model_lock(folder), ArtifactError),
        "gc": (".gc.lock", store.gc_lock(folder), InputError),
    }[lock]
    (folder / name).symlink_to(elsewhere)
    with pytest.raises(error, match=f"{name}.*symlink"), held:
        pass
    assert not elsewhere.exists()  # not made through the link


def test_gc_lock_is_a_no_op_where_there_is_no_cache(tmp_path):
    with store.gc_lock(tmp_path / "absent"):
        pass
    assert not (tmp_path / "absent").exists()


def test_a_leased_entry_cannot_be_claimed_until_the_lease_is_released(tmp_path):
    entry = store.cache_entry(tmp_path, "export", "k" * 64)
    entry.parent.mkdir()
    leases = store.Leases()
    leases.hold(entry)
    assert _locked_elsewhere(store.lease_path(entry))  # another process's gc would be refused
    assert not _locked_elsewhere(store.lease_path(entry), "sh")  # another build shares it
    with store.claim(entry) as free:
        assert not free
    leases.release()
    with store.claim(entry) as free:
        assert free
        assert _locked_elsewhere(store.lease_path(entry), "sh")  # a build waits while gc removes it


def test_claim_without_create_makes_no_lease_file(tmp_path):
    entry = store.cache_entry(tmp_path, "export", "k" * 64)
    entry.parent.mkdir()
    with store.claim(entry, create=False) as free:
        assert free
    assert not store.lease_path(entry).exists()


def test_a_symlink_planted_as_a_lease_file_is_refused(tmp_path):
    entry = store.cache_entry(tmp_path, "export", "k" * 64)
    entry.parent.mkdir()
    store.lease_path(entry).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        store.Leases().hold(entry)
    with pytest.raises(OSError), store.claim(entry):
        pass
    assert not (tmp_path / "elsewhere").exists()


def test_leases_check_names_an_entry_that_lost_a_file(tmp_path):
    entry = store.cache_entry(tmp_path, "export", "k" * 64)
    entry.mkdir(parents=True)
    (entry / "model.onnx").write_bytes(b"graph")
    leases = store.Leases()
    leases.hold(entry)
    leases.record(entry, ["model.onnx"])
    leases.check()
    (entry / "model.onnx").unlink()
    with pytest.raises(CacheError, match=f"{entry}.*was removed while the build ran"):
        leases.check()
    leases.release()


def test_dead_builds_scratch_folder_is_removed_and_a_live_one_kept(tmp_path):
    stage_dir = tmp_path / "quantize"
    dead = stage_dir / ".tmp-0123-dead"
    dead.mkdir(parents=True)
    (dead / store.OWNER).write_text("")  # its builder held a lock on this file, and is gone
    (dead / "big.onnx").write_bytes(b"x" * 1000)
    with store.scratch_for(stage_dir / ("k" * 64), "k" * 64) as live:
        assert live.parent == stage_dir and live.name.startswith(".tmp-" + "k" * 16)
        assert store.remove_dead_scratch(stage_dir) == [dead]
        assert live.is_dir() and not dead.exists()
    assert store.remove_dead_scratch(stage_dir) == [live]  # its builder left without renaming it


def test_a_symlinked_scratch_folder_or_stage_folder_is_never_removed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("x")
    stage_dir = tmp_path / "cache" / "quantize"
    stage_dir.mkdir(parents=True)
    (stage_dir / ".tmp-0123-link").symlink_to(outside, target_is_directory=True)
    (tmp_path / "cache" / "linked").symlink_to(outside, target_is_directory=True)
    (outside / ".tmp-4567-dead").mkdir()
    for old in (outside, outside / ".tmp-4567-dead"):
        os.utime(old, (1, 1))  # unowned and old: taken for dead, were the link followed
    assert store.remove_dead_scratch(stage_dir) == []
    assert store.remove_dead_scratch(tmp_path / "cache" / "linked") == []
    assert (outside / "keep").exists() and (outside / ".tmp-4567-dead").exists()
