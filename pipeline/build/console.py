"""What a build prints on the console, and what it keeps off it.

Progress on long work, with tqdm: on stderr, only on a terminal, hidden by `--quiet`; `--verbose` prints each
step's figures as they come (each search candidate, each fallback attempt). Third-party libraries are silenced
during a build step: onnxruntime.quantization, optimum and transformers log advice and warnings at every call,
which is noise in a build's output; errors still raise.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings

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


@contextlib.contextmanager
def silenced(*loggers: str):
    """Raise the named loggers (the root logger when none are named) to ERROR and ignore warnings, for the
    duration of the block."""
    targets = [logging.getLogger(name) for name in loggers] or [logging.getLogger()]
    levels = [logger.level for logger in targets]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in targets:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(targets, levels, strict=True):
                logger.setLevel(level)
