"""Held-out measurements, answered once per build process.

The search holds its fastest passing candidate to the held-out texts; validation then measures the chosen graph on
the same texts, at the same batch size, with the same runtime settings: the same computation, which for a decoder
is a teacher-forced pass and greedy continuations at two batch sizes (about 40 s of Gemma 3 270M's build). The
second asks with the same key and gets the first's statistics. The key covers every input of the measurement: the
graph's bytes, the engine, the session settings that can change a result (not thread spinning), the runtime spec,
the texts, the metric, the batch size and the number of new tokens.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

from pipeline.build.onnx_files import graph_files
from pipeline.runtime.artifact import sha256_file
from pipeline.runtime.schema import DECODER_GRAPH, ENCODER_GRAPH

# Session settings that change how fast a run is, never what it computes.
_TIMING_ONLY = frozenset({"allow_spinning"})
_KEPT = 4
_MEASURED: dict[str, dict] = {}


def measurement_key(manifest, target, graph: Path, backend: str, session: dict, texts: list, metric: str) -> str:
    """The key of one measurement of the graph file `graph` (its data files, or OpenVINO's weights, included) run
    on `backend` with the target's session settings and `session` over them, as `candidate_model` opens it."""
    from pipeline.build.manifest import runtime_spec, session_of

    digest = hashlib.sha256()
    graph = Path(graph)
    files = graph_files(graph) if graph.suffix == ".onnx" else [graph, graph.with_suffix(".bin")]
    if graph.name == ENCODER_GRAPH:  # a speech model runs the decoder beside it
        files += graph_files(graph.parent / DECODER_GRAPH)
    for file in files:
        digest.update(f"{file.name}:{sha256_file(file)}\n".encode())
    settings = {k: v for k, v in {**session_of(target), **session}.items() if k not in _TIMING_ONLY}
    tokens = target.generation.new_tokens if metric == "generation" else 0
    inputs = [backend, settings, runtime_spec(manifest, target), texts, metric, target.shapes.batch_size, tokens]
    digest.update(json.dumps(inputs, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def measured(key: str, compute) -> tuple[dict, bool]:
    """`compute()`'s statistics for `key`, and whether they were measured earlier in this process (a copy: callers
    may change them)."""
    reused = key in _MEASURED
    if not reused:
        while len(_MEASURED) >= _KEPT:
            _MEASURED.pop(next(iter(_MEASURED)))
        _MEASURED[key] = compute()
    return copy.deepcopy(_MEASURED[key]), reused
