"""Commands that build: build (one model, or a fleet), check, targets, host, gc."""

from __future__ import annotations

import sys

import click

from pipeline.errors import InputError, PipelineError, TargetError
from pipeline.ops.summary import candidate_table
from pipeline.runtime.artifact import TASKS


@click.command()
@click.option(
    "--model", "model", default=None, help="local Hugging Face checkpoint folder (default: packaged all-MiniLM-L6-v2)"
)
@click.option(
    "--target",
    default="native",
    show_default=True,
    help="target name (see `pipeline targets`), .toml path, or native: the target of this host's CPU",
)
@click.option("--name", default=None, help="artifact name (default: the checkpoint folder's name)")
@click.option(
    "--task",
    default=None,
    help=f"{', '.join(TASKS)} (default: what config.json's architectures names)",
)
@click.option("--artifacts-dir", default=None, help="where artifacts are published (default: ./artifacts)")
@click.option("--cache-dir", default=None, help="stage cache (default: ./.cache/stages)")
@click.option("--validation", default=None, help="held-out text for validation (default: data/validation.txt)")
@click.option("--calibration", default=None, help="calibration text (default: data/calibration.txt)")
@click.option("--models", "models_file", default=None, help="a fleet: a file of checkpoint folders, one a line")
@click.option(
    "--targets", "target_list", default=None, help="a fleet: targets, comma-separated (e.g. cpu-avx2,cpu-amx)"
)
@click.option("--cluster", default=None, help="a Ray cluster (ray://host:10001 or host:6379) to run the fleet on")
def build(
    model, target, name, task, artifacts_dir, cache_dir, validation, calibration, models_file, target_list, cluster
) -> None:
    """Build, validate and publish MODEL for TARGET (or, with --models/--targets/--cluster, a fleet of builds)."""
    from pipeline.build.inputs.targets import load_target
    from pipeline.build.table import build as run_build
    from pipeline.ops.summary import build_summary

    options = {
        "artifacts_dir": artifacts_dir,
        "cache_dir": cache_dir,
        "validation": validation,
        "calibration": calibration,
    }
    _check_build_options(locals())
    if models_file is not None or target_list is not None or cluster is not None:
        _fleet(model, target, models_file, target_list, cluster, {k: v for k, v in options.items() if v})
        return

    from pipeline.runtime.host import kernel_class

    if target == "native":
        from pipeline.build.inputs.targets import native_target

        click.echo(
            f"native: this host's kernel class is {kernel_class()}, so the target is {native_target(kernel_class())}"
        )

    def show(record) -> None:
        state = "reused" if record.reused else "built"
        if record.metrics.get("status") == "pending":
            state = "pending"
        click.echo(f"  {record.name:<11} {state:<7} {record.seconds:8.2f}s")
        if record.name == "search":
            click.echo(candidate_table(record.metrics))

    manifest = run_build(model, target, name, task, on_stage=show, **{k: v for k, v in options.items() if v})
    click.echo(build_summary(manifest, load_target(target), kernel_class()))


@click.command()
@click.option("--targets-dir", default=None, help="folder of target files (default: ./targets)")
def targets(targets_dir) -> None:
    """List the available targets; a broken file is named on stderr and the rest are still listed."""
    from pathlib import Path

    from pipeline.build.inputs.targets import TARGETS_DIR, available_targets, load_target

    folder = Path(targets_dir) if targets_dir else TARGETS_DIR
    if not folder.is_dir():
        raise TargetError(f"--targets-dir {folder} is not a folder; pass the folder of target .toml files")
    names = available_targets(folder)
    if not names:
        raise TargetError(f"--targets-dir {folder} holds no .toml target files; pass the folder that does")
    broken = []
    for name in names:
        try:
            spec = load_target(name, folder)
        except PipelineError as err:
            broken.append(str(err))
            continue
        state = "" if spec.supported else "  (not yet supported)"
        click.echo(f"{name:<12} {spec.description}{state}")
    for problem in broken:
        click.echo(f"error: {problem}", err=True)
    if broken:
        sys.exit(TargetError.exit_code)


def _check_build_options(given: dict) -> None:
    """Refuse, in one line, an empty option (it would fall back to a default) and options a fleet does not take
    beside those that make one."""
    from click.core import ParameterSource

    names = {k: f"--{k.replace('_', '-')}" for k in ("model", "target", "name", "task", "cluster", "calibration")}
    names |= {k: f"--{k.replace('_', '-')}" for k in ("artifacts_dir", "cache_dir", "validation")}
    names |= {"models_file": "--models", "target_list": "--targets"}
    empty = [names[k] for k in names if isinstance(given.get(k), str) and not given[k].strip()]
    if empty:
        raise InputError(f"{empty[0]} is empty; pass a value, or leave the option out for its default")
    fleet = [names[k] for k in ("models_file", "target_list", "cluster") if given.get(k) is not None]
    if not fleet:
        return
    context = click.get_current_context()
    clashing = [("--model", "--models")] if given["model"] and given["models_file"] else []
    if given["target_list"] and context.get_parameter_source("target") == ParameterSource.COMMANDLINE:
        clashing.append(("--target", "--targets"))
    clashing += [(names[k], fleet[0]) for k in ("name", "task") if given.get(k)]
    if clashing:
        one, other = clashing[0]
        raise InputError(f"{one} does not go with {other}; a fleet takes --models, --targets and --cluster")


def _fleet(model, target, models_file, target_list, cluster, options: dict) -> None:
    from pipeline.ops.fleet import fleet, fleet_table, read_models

    models = read_models(models_file) if models_file else [model] if model else []
    if not models:
        raise click.UsageError("a fleet needs --models FILE (or --model FOLDER)")
    targets = [t.strip() for t in (target_list or target).split(",") if t.strip()]
    if not targets:
        raise InputError(f"--targets {target_list!r} names no target; pass names separated by commas")
    rows = fleet(models, targets, cluster, **options)
    click.echo(fleet_table(rows))
    if any(r["status"] == "failed" for r in rows):
        sys.exit(1)


@click.command(name="host")
@click.option("--ray-resources", "ray_resources", is_flag=True, help="print the `ray start` line for this host")
@click.option("--head", default=None, help="with --ray-resources: the head's address to join (host:6379)")
def host(ray_resources, head) -> None:
    """Describe this host: its kernel class and flags, or the `ray start` line that joins it to a fleet."""
    from pipeline.runtime.host import cpu_model, kernel_class

    if ray_resources:
        from pipeline.ops.fleet import AUTH_NOTE, ray_start_line

        line = ray_start_line(head)
        click.echo(AUTH_NOTE)
        click.echo(line)
        return
    click.echo(f"{cpu_model()}: kernel class {kernel_class()}")


@click.command(name="check")
@click.argument("model")
@click.option("--target", default="native", show_default=True, help="target name, .toml path, or native")
def check_model(model, target) -> None:
    """Say in seconds what building MODEL for TARGET would do (task, family, passes, candidates), building nothing."""
    from pipeline.ops.check import check
    from pipeline.ops.summary import check_summary

    if target == "native":
        from pipeline.build.inputs.targets import native_target
        from pipeline.runtime.host import kernel_class

        target = native_target(kernel_class())
    click.echo(check_summary(check(model, target)))


@click.command(name="gc")
@click.option("--artifacts-dir", default=None, help="published artifacts (default: ./artifacts)")
@click.option("--cache-dir", default=None, help="stage cache (default: ./.cache/stages)")
@click.option(
    "--keep", type=int, default=None, help="also remove versions beyond the newest N of each model and target"
)
@click.option(
    "--min-age",
    type=float,
    default=3600.0,
    show_default=True,
    help="seconds a cache entry must be old before removal (a running build may still need a newer one)",
)
@click.option("--dry-run", is_flag=True, help="print what would be removed and the space it would free; remove nothing")
@click.option(
    "--force", is_flag=True, help="go on where --artifacts-dir holds no published artifact: every old entry goes"
)
def gc(artifacts_dir, cache_dir, keep, min_age, dry_run, force) -> None:
    """Remove stage-cache entries no published version references, and with --keep old versions; never what a
    `latest` link points to, what a running build holds, anything through a symlink, or a folder gc cannot prove
    is a cache entry. With --verbose, also print what was kept and why."""
    from pipeline.build.console import note
    from pipeline.build.table import REPO
    from pipeline.ops.gc import collect, describe

    _check_build_options({"artifacts_dir": artifacts_dir, "cache_dir": cache_dir})
    artifacts = artifacts_dir or REPO / "artifacts"
    cache = cache_dir or REPO / ".cache" / "stages"
    found = collect(artifacts, cache, keep=keep, min_age_s=min_age, dry_run=dry_run, force=force)
    for kept in found.kept:
        note(f"kept {kept.path}: {kept.reason}")
    click.echo(describe(found, dry_run))
