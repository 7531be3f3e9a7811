"""Silence third-party libraries during a build step: onnxruntime.quantization, optimum and transformers log
advice and warnings at every call, which is noise in a build's output. Errors still raise."""

from __future__ import annotations

import contextlib
import logging
import warnings


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
