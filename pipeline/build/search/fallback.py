"""The int8 fallback's search: which quantizable nodes to keep in fp32, and how few, for an int8 graph to meet its
development gate (pipeline.build.search.int8 runs it).

Each node's sensitivity is measured (the error it adds when it alone is quantized: one quantization and one
development pass a node) or, for dynamic int8 of an encoder too large for that, simulated from one fp32 pass
(pipeline.build.passes.int8_error); the widest budget is tried first, then a bisection for the fewest that pass.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.build.accuracy.metrics import compare, measure, outputs
from pipeline.build.console import progress
from pipeline.build.inputs.targets import Target
from pipeline.build.manifest import Manifest, candidate_model
from pipeline.build.onnx_files import graph_files
from pipeline.build.passes.int8 import quantizable_nodes
from pipeline.build.passes.int8_error import dynamic_int8_errors
from pipeline.runtime.host import cpu_flags

FALLBACK_STEPS = (1, 2, 3, 4, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
# Examples the simulated sensitivity of dynamic int8 runs on (one fp32 pass each).
SIMULATED_EXAMPLES = 16
# Measuring each node's effect on the output (one quantization of the whole graph and one development pass a node)
# ranks better than the local simulation (docs/targets.md), so it is used while quantizable nodes x graph bytes
# stay within this (MiniLM: 24 x 90 MB); beyond, a 110M-parameter encoder's 72 nodes would take minutes.
MEASURED_SENSITIVITY_BYTES = 4_000_000_000


@dataclasses.dataclass(frozen=True)
class Judge:
    """How every int8 attempt is measured: against the fp32 graph's outputs (`reference`) on the development split
    (`texts`), held to `gate`, at the target's batch size."""

    manifest: Manifest
    target: Target
    texts: list
    reference: object
    gate: object
    metric: str

    def open(self, path: Path, session=None):
        """The graph at `path` through the runtime, as the target runs it."""
        return candidate_model(self.manifest, self.target, path, session=session)

    def stats(self, model) -> dict:
        """`model`'s statistics against the fp32 graph on the development split."""
        target = self.target
        batch, new_tokens = target.shapes.batch_size, target.generation.new_tokens
        return measure(model, self.texts, self.reference, self.metric, batch, new_tokens)


def _error(stats: dict, metric: str) -> float:
    return 1.0 - stats["cosine_mean"] if metric == "embedding" else stats["max_abs_diff"]


def fewest_passing(attempt, excluded: list, ranked: list, limit: int) -> tuple:
    """(graph, missed, nodes kept in fp32): the fewest of the `ranked` nodes (most sensitive first, at most `limit`,
    counts from FALLBACK_STEPS) kept in fp32 besides `excluded` with which `attempt(exclude) -> (graph, missed)`
    passes. The widest is tried first: where it misses, fewer will not pass and the fallback stops there (its
    graph is returned); else a bisection over the counts, each node kept only adding accuracy."""
    counts = sorted({c for c in FALLBACK_STEPS if c < limit} | {limit})
    widest = excluded + ranked[:limit]
    graph, missed = attempt(widest)
    if missed:
        return graph, missed, widest
    best = (graph, widest)
    low, high = -1, len(counts) - 1  # counts[high] passes; counts[low] misses (-1: no nodes kept, which missed)
    for _ in progress(range(max(len(counts) - 1, 1).bit_length()), "quantize: fallback"):
        if high - low <= 1:
            break
        middle = (low + high) // 2
        exclude = excluded + ranked[: counts[middle]]
        graph, failed = attempt(exclude)
        if failed:
            low = middle
        else:
            high, best = middle, (graph, exclude)
    return best[0], [], best[1]


def _simulated(source: Path, nodes: list, excluded: list, fp32, texts: list, settings, metric: str) -> list | None:
    """Each quantizable node's simulated dynamic int8 error (pipeline.build.passes.int8_error), most sensitive first, on
    the first SIMULATED_EXAMPLES of `texts`; None where the measured sensitivity is used instead: static or
    weight-only int8, decoders, a graph too large to simulate in memory, or one small enough to measure (nodes x
    graph bytes within MEASURED_SENSITIVITY_BYTES: each node's own quantization and development pass)."""
    import onnx

    if settings.mode != "dynamic" or metric == "generation":
        return None
    names = {n.name for n in nodes} - set(excluded)
    if len(names) * sum(f.stat().st_size for f in graph_files(source)) <= MEASURED_SENSITIVITY_BYTES:
        return None  # small enough to measure each node's effect on the output, which ranks better
    graph = onnx.load(str(source), load_external_data=False)
    candidates = [n for n in quantizable_nodes(graph, settings.op_types) if n.name in names]
    feeds = [fp32.feeds(fp32.encode([text])) for text in texts[:SIMULATED_EXAMPLES]]
    return dynamic_int8_errors(source, candidates, feeds, settings, cpu_flags() or frozenset())


def _sensitivity(open_graph, quantize_one, nodes, excluded, texts, reference, metric, batch, work) -> list[dict]:
    """Each quantizable node's error when it alone is quantized, most sensitive first."""
    sensitivity = []
    for node in progress(nodes, "quantize: sensitivity of each node"):
        if node.name in excluded:
            continue
        path = work / "single.onnx"
        quantize_one(path, only=[node.name])
        model = open_graph(path)
        # Decoders are ranked on their next-token logits alone: generating for every node would be slow.
        if metric == "generation":
            stats = compare("classification", reference["logits"], model.run(texts, batch_size=batch))
        else:
            stats = compare(metric, reference, outputs(model, texts, metric, batch))
        sensitivity.append({"node": node.name, "op_type": node.op_type, "error": _error(stats, metric)})
    return sorted(sensitivity, key=lambda s: -s["error"])


def sensitivity_ranked(
    judge: Judge, quantize_one, source: Path, nodes, excluded, fp32, settings, work
) -> tuple[list, str]:
    """(the quantizable nodes' sensitivity, most sensitive first; "simulated" or "measured")."""
    simulated = _simulated(source, nodes, excluded, fp32, judge.texts, settings, judge.metric)
    if simulated:
        return simulated, "simulated"
    batch = judge.target.shapes.batch_size
    args = (judge.texts, judge.reference, judge.metric, batch, work)
    return _sensitivity(judge.open, quantize_one, nodes, excluded, *args), "measured"
