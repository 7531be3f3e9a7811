"""Fault injection for the interruption tests: `PIPELINE_FAULT=<point>` kills the process there with SIGKILL.

The points are the places where a real crash would do the most harm: each stage boundary, a cache entry written
but not yet renamed into place, and an artifact staged but not yet published (or published, before `latest`).
Unset, this costs one dictionary lookup per point.
"""

from __future__ import annotations

import os
import signal

ENV = "PIPELINE_FAULT"


def point(name: str) -> None:
    """Die here, as a power cut or OOM kill would, if the environment asks for this point."""
    if os.environ.get(ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
