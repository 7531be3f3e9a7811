"""Fleet builds: each target's host-dependent stages on a node of its class, on a real two-node Ray cluster kept
inside a network namespace that has only loopback (tests/fleet_cluster.py)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.build.inputs.targets import load_target
from pipeline.build.inputs.targets.choices import KERNEL_CLASSES
from pipeline.errors import InputError
from pipeline.ops.fleet import fleet, host_resources, ray_start_line, read_models, target_resource
from pipeline.runtime.artifact import verify_artifact
from pipeline.runtime.host import kernel_class
from tests.conftest import write_target

REPO = Path(__file__).resolve().parents[2]
# Two classes for the two nodes: the host's own and another. A class resource is a label a node advertises; the
# builds run on this host's kernels whichever label routes them.
OWN = kernel_class()
OTHER, MISSING = [c for c in KERNEL_CLASSES if c not in (OWN, "any")][:2]


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


needs_namespace = pytest.mark.skipif(
    not _unshare_works(), reason="needs `unshare -n` (root) for a loopback-only network"
)


def test_host_resources_and_ray_start_line_name_this_hosts_class():
    assert host_resources()[f"kernel_class:{OWN}"] == 1.0
    with pytest.raises(InputError, match="is not host:port"):
        ray_start_line("x; rm -rf /")
    line = ray_start_line("10.0.0.1:6379")
    assert line.startswith("RAY_AUTH_MODE=token ray start --address=10.0.0.1:6379 --resources='{")
    assert f'"kernel_class:{OWN}":1.0' in ray_start_line()


def test_target_resource_is_the_targets_class_or_none_for_any():
    assert target_resource(load_target("cpu-avx2")) == "kernel_class:avx2"
    assert target_resource(load_target("cpu-amx")) == "kernel_class:amx"
    assert target_resource(load_target("a100")) == "gpu:sm80"


def test_read_models_refuses_what_is_not_a_folder(tmp_path, tiny_bert):
    listing = tmp_path / "models.txt"
    listing.write_text(f"# the fleet\n{tiny_bert}\n\n{tmp_path / 'missing'}  # gone\n")
    with pytest.raises(InputError, match=r"lists .*missing, which are not folders"):
        read_models(listing)
    listing.write_text(f"{tiny_bert}\n")
    assert read_models(listing) == [str(tiny_bert)]


def test_an_unreachable_cluster_fails_within_seconds_before_any_work(tiny_bert, tmp_path):
    from pipeline.errors import ServingError

    with pytest.raises(ServingError, match="no Ray cluster answers at 127.0.0.1:9"):
        fleet([str(tiny_bert)], ["cpu-fp32"], "127.0.0.1:9", artifacts_dir=tmp_path / "a", cache_dir=tmp_path / "c")
    assert not (tmp_path / "c").exists()


def _targets(tmp_path: Path, classes=(OWN, OTHER)) -> list[str]:
    return [
        str(write_target(tmp_path, f"fleet-{cls}", base="cpu-fp32", kernel_class=cls, required_cpu_flags=[]))
        for cls in classes
    ]


def _spec(model: Path, texts_file: Path, targets: list[str], tmp_path: Path, **extra) -> dict:
    """What tests/fleet_cluster.py runs: `model` for `targets`, the head holding this host's class and the worker
    another, with `extra` settings (missing_target, kill_worker)."""
    return {
        "models": [str(model)],
        "targets": targets,
        "head_resource": f"kernel_class:{OWN}",
        "worker_resource": f"kernel_class:{OTHER}",
        "artifacts_dir": str(tmp_path / "a"),
        "cache_dir": str(tmp_path / "c"),
        "validation": str(texts_file),
        "calibration": str(texts_file),
        **extra,
    }


def _run_cluster(tmp_path: Path, spec: dict) -> dict:
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = subprocess.run(
        [
            "unshare",
            "-n",
            sys.executable,
            "-m",
            "tests.fleet_cluster",
            str(tmp_path / "spec.json"),
            str(tmp_path / "result.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        # Ray settings an earlier test left in this process (Serve's loopback-only, single-node mode) are not the
        # cluster's.
        env={k: v for k, v in os.environ.items() if not k.startswith("RAY_")},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((tmp_path / "result.json").read_text())


@pytest.mark.slow
@needs_namespace
def test_a_two_target_fleet_runs_each_target_on_the_node_of_its_class(tiny_bert, texts_file, tmp_path):
    targets = _targets(tmp_path)
    spec = _spec(tiny_bert, texts_file, targets, tmp_path, missing_target=_targets(tmp_path, [MISSING])[0])
    result = _run_cluster(tmp_path, spec)
    # A class no node advertises is a one-line error before any work.
    assert result["missing"].startswith(f"the cluster at 127.0.0.2:6391 has no node with kernel_class:{MISSING}")
    holder = {r: n["id"] for n in result["nodes"] for r in n["resources"] if r.startswith("kernel_class:")}
    rows = {Path(r["target"]).stem: r for r in result["rows"]}
    assert [r["status"] for r in rows.values()] == ["published", "published"], rows
    assert rows[f"fleet-{OWN}"]["node_id"] == holder[f"kernel_class:{OWN}"]
    assert rows[f"fleet-{OTHER}"]["node_id"] == holder[f"kernel_class:{OTHER}"]
    for row in rows.values():
        verify_artifact(row["path"])
    # Both builds shared one export: the content-addressed cache holds a single entry per host-independent stage.
    assert len([p for p in (tmp_path / "c" / "export").iterdir() if not p.name.startswith(".")]) == 1
    # The namespace has loopback alone, so no listener of the cluster is reachable from another host.
    assert result["interfaces"] == ["lo"] and result["listeners"]


@pytest.mark.slow
@needs_namespace
def test_killing_the_worker_mid_build_still_publishes_once_it_is_back(tiny_bert, texts_file, tmp_path):
    targets = _targets(tmp_path)[1:]  # the target whose class only the worker has
    result = _run_cluster(tmp_path, _spec(tiny_bert, texts_file, targets, tmp_path, kill_worker=True))
    assert result["restarted"].get("back_at"), result
    [row] = result["rows"]
    assert row["status"] == "published", row
    verify_artifact(row["path"])
    assert not list((tmp_path / "a").rglob(".staging*")) and not list((tmp_path / "a").rglob(".tmp*"))


@pytest.mark.slow
@needs_namespace
def test_a_class_whose_only_node_dies_for_good_is_a_failed_row_and_a_bad_model_its_own_line(
    tiny_bert, texts_file, tmp_path
):
    targets = _targets(tmp_path)[1:]  # the target whose class only the worker has
    not_a_checkpoint = tmp_path / "empty"
    not_a_checkpoint.mkdir()
    spec = _spec(tiny_bert, texts_file, targets, tmp_path, kill_worker="for good", node_grace_s=10)
    spec["models"] = [str(tiny_bert), str(not_a_checkpoint)]
    result = _run_cluster(tmp_path, spec)
    rows = {Path(r["model"]).name: r for r in result["rows"]}
    lost = rows[tiny_bert.name]
    assert lost["status"] == "failed" and lost["error"].startswith(f"no live node advertises kernel_class:{OTHER}")
    bad = rows["empty"]  # the build's own one-line error, not Ray's task header
    assert bad["status"] == "failed" and "has no config.json" in bad["error"] and "\x1b" not in bad["error"]
    assert result["fleet_seconds"] < 300
    assert not list((tmp_path / "a").rglob("manifest.json"))  # nothing half-published
