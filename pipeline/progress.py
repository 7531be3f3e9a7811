"""Progress on long work, with tqdm: on stderr, only on a terminal, hidden by `--quiet`; `--verbose` prints each
step's figures as they come (each search candidate, each fallback attempt)."""

from __future__ import annotations

import sys

_state = {"quiet": False, "verbose": False}


def configure(quiet: bool = False, verbose: bool = False) -> None:
    """Set for this process: `quiet` hides every bar, `verbose` prints figures as they come."""
    _state.update(quiet=quiet, verbose=verbose and not quiet)


def shown() -> bool:
    """Whether bars are drawn: stderr is a terminal and --quiet was not given."""
    return not _state["quiet"] and sys.stderr.isatty()


def progress(iterable, desc: str, total: int | None = None):
    """`iterable`, with a bar named `desc` on stderr where progress is shown."""
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, disable=not shown(), leave=False, dynamic_ncols=True)


def note(message: str) -> None:
    """Print a step's figures to stderr when --verbose was given."""
    if _state["verbose"]:
        from tqdm.auto import tqdm

        tqdm.write(message, file=sys.stderr)
