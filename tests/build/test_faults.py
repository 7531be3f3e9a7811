"""Nothing lost, nothing let in: builds killed (SIGKILL) at every fault point, concurrent builds, a full disk."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.runtime import load, verify_artifact
from tests.conftest import CALIBRATION_TEXTS, REPO, write_target

POINTS = [
    f"{kind}-{stage}" for stage in ("export", "optimize", "quantize", "validate", "tune") for kind in ("cache", "after")
] + ["after-checkpoint", "publish-staged", "publish-renamed"]


def _calibration(texts: Path) -> Path:
    """Calibration text beside the held-out `texts`, sharing no example with it."""
    path = texts.parent / "calibration.txt"
    if not path.exists():
        path.write_text("\n".join(CALIBRATION_TEXTS) + "\n", encoding="utf-8")
    return path


def _build_args(checkpoint, texts, artifacts, cache, target="cpu-avx2-dynamic"):
    return [
        sys.executable,
        "-m",
        "pipeline",
        "build",
        "--model",
        str(checkpoint),
        "--target",
        str(target),
        "--validation",
        str(texts),
        "--calibration",
        str(_calibration(Path(texts))),
        "--artifacts-dir",
        str(artifacts),
        "--cache-dir",
        str(cache),
    ]


def _env(fault=None):
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_FAULT"}
    if fault:
        env["PIPELINE_FAULT"] = fault
    return env


def _cli_build(dirs, checkpoint, texts, target="cpu-avx2-dynamic", fault=None):
    args = _build_args(checkpoint, texts, dirs / "artifacts", dirs / "cache", target)
    return subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=_env(fault))


def _published_intact(model_root):
    """Every version folder present verifies, `latest` points at one of them; returns the versions."""
    versions = sorted(p.name for p in model_root.glob("v*"))
    for version in versions:
        for folder in (model_root / version).iterdir():
            verify_artifact(folder)
    latest = model_root / "latest" / "cpu-avx2-dynamic"
    load(latest)
    return versions, os.readlink(latest)


@pytest.fixture(scope="module")
def base(tiny_bert, texts_file, tmp_path_factory):
    """Artifacts with v1 published and a warm cache, and a target whose build will make v2."""
    root = tmp_path_factory.mktemp("faults-base")
    assert _cli_build(root, tiny_bert, texts_file).returncode == 0
    changed = write_target(root, "cpu-avx2-dynamic", accuracy__cosine_mean=0.9991)
    return root, changed


# Two points run in the fast tier; every point runs in the slow one.
FAST_POINTS = ("cache-quantize", "publish-staged")


@pytest.mark.parametrize("fault", [p if p in FAST_POINTS else pytest.param(p, marks=pytest.mark.slow) for p in POINTS])
def test_build_killed_at_fault_point_loses_nothing(fault, base, tiny_bert, texts_file, tmp_path):
    root, changed = base
    for name in ("artifacts", "cache"):
        shutil.copytree(root / name, tmp_path / name, symlinks=True)
    model_root = tmp_path / "artifacts" / "tiny-bert"
    if fault.startswith("cache-"):
        shutil.rmtree(tmp_path / "cache" / fault.removeprefix("cache-"), ignore_errors=True)  # so the stage runs
    killed = _cli_build(tmp_path, tiny_bert, texts_file, changed, fault)
    assert killed.returncode == -9, killed.stderr
    versions, latest = _published_intact(model_root)
    if fault == "publish-renamed":
        assert versions == ["v1", "v2"] and latest == "../v1/cpu-avx2-dynamic"  # complete, not yet latest
    else:
        assert versions == ["v1"] and latest == "../v1/cpu-avx2-dynamic"
    again = _cli_build(tmp_path, tiny_bert, texts_file, changed)
    assert again.returncode == 0, again.stderr
    assert "v2/cpu-avx2-dynamic" in again.stdout
    assert _published_intact(model_root) == (["v1", "v2"], "../v2/cpu-avx2-dynamic")
    assert not list(model_root.glob(".staging-*"))
    if fault in ("after-quantize", "cache-validate", "after-validate", "publish-staged"):
        assert "quantize    reused" in again.stdout  # work finished before the kill is kept


def test_concurrent_builds_publish_one_version(tiny_bert, texts_file, tmp_path):
    args = _build_args(tiny_bert, texts_file, tmp_path / "artifacts", tmp_path / "cache")
    procs = [
        subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=_env())
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(p.name for p in (tmp_path / "artifacts" / "tiny-bert").glob("v*")) == ["v1"]
    assert sum("published" in out for out, _ in outs) == 1
    assert sum("unchanged" in out for out, _ in outs) == 1
    _published_intact(tmp_path / "artifacts" / "tiny-bert")


def test_build_on_full_disk_fails_cleanly(tiny_bert, texts_file, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        args = _build_args(tiny_bert, texts_file, small, tmp_path / "c")
        out = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=_env())
        assert out.returncode == 7, out.stderr
        assert "No space left on device" in out.stderr and "nothing was published" in out.stderr
        assert "Traceback" not in out.stderr
        left = sorted(str(p.relative_to(small)) for p in small.rglob("*"))
        assert left == ["tiny-bert", "tiny-bert/.lock"]
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_read_texts_refuses_huge_file(tmp_path):
    from pipeline.build.inputs.data import MAX_BYTES, read_texts
    from pipeline.errors import InputError

    huge = tmp_path / "huge.txt"
    with open(huge, "wb") as handle:
        handle.truncate(MAX_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(InputError, match=r"huge\.txt is over 256 MiB"):
        read_texts(huge, "calibration")


def test_build_refuses_truncated_cache_entry_and_rebuilds(base, tiny_bert, texts_file, tmp_path):
    root, _ = base
    shutil.copytree(root / "cache", tmp_path / "cache")
    shutil.copytree(root / "artifacts", tmp_path / "artifacts", symlinks=True)
    for model_file in (tmp_path / "cache" / "quantize").rglob("model.onnx"):
        model_file.write_bytes(model_file.read_bytes()[:100])
    out = _cli_build(tmp_path, tiny_bert, texts_file)
    assert out.returncode == 0, out.stderr
    assert "quantize    built" in out.stdout and "unchanged" in out.stdout
    manifest = json.loads(
        (tmp_path / "artifacts" / "tiny-bert" / "v1" / "cpu-avx2-dynamic" / "manifest.json").read_text()
    )
    assert manifest["version"] == "v1"
