"""The command line: each command parses, calls one library function, prints. Heavy imports stay inside.

building.py   build, check, targets, host, gc        artifacts.py  validate, inspect, engine, export triton
running.py    generate, classify, transcribe, bench              serve.py      serve
"""

from __future__ import annotations

import sys

import click

from pipeline.errors import PipelineError


def _usage_line(err: click.UsageError) -> str:
    """click's usage error as one line: its message and where the options are listed (click prints three)."""
    where = f"`{err.ctx.command_path} --help`" if err.ctx is not None else "`pipeline --help`"
    return f"error: {err.format_message().rstrip('.')}; {where} lists the options"


class _Commands(click.Group):
    """The one place a PipelineError, or a usage error, becomes a one-line `error:` and its exit code."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as err:
            click.echo(_usage_line(err), err=True)
            sys.exit(err.exit_code)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except PipelineError as err:
            click.echo(f"error: {err}", err=True)
            sys.exit(err.exit_code)
        except click.UsageError as err:  # a command's options, parsed when the group invokes it
            click.echo(_usage_line(err), err=True)
            sys.exit(err.exit_code)


@click.group(cls=_Commands)
@click.version_option(package_name="pipeline", prog_name="pipeline")
@click.option("--quiet", "-q", is_flag=True, help="no progress bars")
@click.option("--verbose", "-v", is_flag=True, help="print each search candidate's and fallback step's figures")
def main(quiet: bool, verbose: bool) -> None:
    """Export Hugging Face checkpoints to validated, versioned, hardware-targeted artifacts."""
    from pipeline.build.console import configure

    configure(quiet=quiet, verbose=verbose)


def _commands() -> None:
    """Add each group's commands to `main` (here, explicitly, rather than each module adding itself)."""
    from pipeline.cli import artifacts, building, running, serve

    for command in (
        building.build,
        building.check_model,
        building.targets,
        building.host,
        building.gc,
        artifacts.validate,
        artifacts.inspect_artifact,
        artifacts.engine,
        artifacts.export_group,
        running.generate,
        running.classify,
        running.transcribe,
        running.bench,
        serve.serve,
    ):
        main.add_command(command)


_commands()
