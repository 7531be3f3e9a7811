"""Commands over a published artifact: validate, inspect, engine, export triton."""

from __future__ import annotations

import json

import click

from pipeline.ops.summary import verdict_table


@click.command()
@click.argument("artifact")
@click.option("--data", default=None, help="held-out text (default: data/validation.txt)")
def validate(artifact, data) -> None:
    """Re-validate a published ARTIFACT on this host against its PyTorch source checkpoint: PASS or FAIL per
    threshold; the exit code is non-zero when any fails."""
    from pipeline.build.stages.validate import validate_artifact
    from pipeline.errors import AccuracyError

    try:
        stats = validate_artifact(artifact, data)
    except AccuracyError as err:
        if err.stats is not None:
            click.echo(verdict_table(err.stats["verdict"]))
        raise
    click.echo(verdict_table(stats["verdict"]))
    click.echo(f"PASS: {artifact} meets every threshold of its target on this host")


@click.command(name="inspect")
@click.argument("artifact")
@click.option("--json", "as_json", is_flag=True, help="print the verified description as JSON instead")
def inspect_artifact(artifact, as_json) -> None:
    """Verify ARTIFACT's hashes and print a summary: what it is, the search's table, the gate, size."""
    from pipeline.ops.summary import summary
    from pipeline.runtime import describe

    info = describe(artifact)
    click.echo(json.dumps(info, indent=1, sort_keys=True) if as_json else summary(info))


@click.command()
@click.argument("artifact")
@click.option("--graph", "graphs", multiple=True, help="graph to build (default: every graph of the artifact)")
@click.option("--data", default=None, help="held-out text to validate the engine on (default: data/validation.txt)")
def engine(artifact, graphs, data) -> None:
    """Build ARTIFACT's TensorRT engines on this GPU host, into its engine cache, validated against its graphs."""
    from pipeline.build.stages.engine import build_artifact_engine
    from pipeline.runtime import artifact_graphs, verify_artifact

    graphs = graphs or artifact_graphs(verify_artifact(artifact))
    for graph in graphs:
        click.echo(f"{graph}: engine {build_artifact_engine(artifact, graph, data)}")


@click.group(name="export")
def export_group() -> None:
    """Hand an artifact to a serving engine's format."""


@export_group.command(name="triton")
@click.argument("artifact")
@click.argument("out_dir")
@click.option(
    "--name", default=None, help="the graph model's name and folder: letters, digits, _ or - (default: the artifact's)"
)
@click.option(
    "--variant",
    "variants",
    multiple=True,
    type=click.Choice(["graph", "ensemble", "python"]),
    help="what to write (repeatable; default: all the artifact's kind takes)",
)
@click.option(
    "--python-env",
    default=None,
    help="Python environment (with `pipeline` installed) for the Python-backend models (default: Triton's)",
)
def export_triton(artifact, out_dir, name, variants, python_env) -> None:
    """Write a Triton Inference Server model repository for ARTIFACT into OUT_DIR, each config.pbtxt checked
    against Triton's schema."""
    from pipeline.serving.triton import repository_from_artifact

    def notify(line: str) -> None:
        click.echo(f"note: {line}")

    for path in repository_from_artifact(artifact, out_dir, name, tuple(variants) or None, python_env, notify):
        click.echo(f"wrote {path}")
