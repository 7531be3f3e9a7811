"""Giving freed memory back to the system between a build's heavy steps."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def release_freed() -> None:
    """Collect garbage, then ask glibc to return its freed heap pages (`malloc_trim`). After PyTorch's reference
    has run, glibc keeps the arenas its large temporaries lived in, and the process's resident size stays that high
    through the ONNX Runtime sessions that follow; elsewhere (another libc) only the collection happens."""
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)
    except OSError:  # no loadable C library: nothing more to release
        pass
