"""What every candidate recipe is: a kind (an engine and how it quantizes), the families it serves, a frozen
config of exactly what it reads, derived from the parsed [[candidates]] row and its target, and a build that
writes the candidate's graph into a work folder.

    [[candidates]] row + target --config()--> frozen config --build(config, job)--> Built (graph, backend, ...)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.runtime.schema import GRAPH

# The columns of the search table that only some recipes fill; the others leave them None.
ROW_COLUMNS = ("bits", "blocks", "block_size")


@dataclasses.dataclass(frozen=True)
class Job:
    """What one build of a candidate works with: the build so far (`manifest`), its `target`, the empty-to-be
    `work` folder, and, for encoder recipes that calibrate or judge as they build, `texts` ({"calibration",
    "development"}) and PyTorch's outputs on the development texts (`reference`). `wide`: MatMul nodes a
    weight-only build keeps at the target's head bits (layer bisection). `could_win(model)`, where given, raises
    when a runtime model of the candidate's fastest form cannot beat a candidate that passed: a recipe calls it
    before its fallback."""

    manifest: object
    target: object
    work: Path
    texts: dict | None = None
    reference: object = None
    wide: tuple[str, ...] = ()
    could_win: object = None


@dataclasses.dataclass(frozen=True)
class Built:
    """A built candidate: its graph file, the backend and session settings it runs with, and the record of the
    fallback its build ran (None where it has none)."""

    graph: Path
    backend: str = "onnxruntime"
    session: dict = dataclasses.field(default_factory=dict)
    fallback: dict | None = None


class Recipe:
    """One candidate kind. Subclasses set the class attributes and `Config`, and define `config` and `build`;
    `row` and `bisection` have defaults for recipes without row columns or layer bisection."""

    name: str
    engine: str
    quantize: str
    families: tuple[str, ...]
    precisions: tuple[str, ...]
    Config: type
    # Whether a build may run a fallback (more builds and passes until the gate is met): the searches build these
    # candidates after the others, and screen them first.
    fallback: bool = False

    @property
    def kind(self) -> tuple[str, str]:
        """The registry key: (engine, quantize) of the [[candidates]] rows this recipe builds."""
        return (self.engine, self.quantize)

    def config(self, candidate, target):
        """The frozen config of `candidate` (a parsed [[candidates]] row) on `target`."""
        raise NotImplementedError

    def build(self, config, job: Job) -> Built:
        """Write the candidate's graph into `job.work` (created here) and say how it runs."""
        raise NotImplementedError

    def row(self, candidate) -> dict:
        """The values of ROW_COLUMNS that `candidate`'s search-table row shows (the others are None)."""
        return {}

    def bisection(self, config) -> str:
        """Which layers a candidate that misses its gate is bisected over, kept at the target's head bits:
        "leading", "trailing", or "none" (no bisection)."""
        return "none"


def optimized_graph(job: Job) -> Path:
    """The optimize stage's fp32 graph, which the ONNX Runtime recipes start from."""
    return job.manifest.stage("optimize").output(GRAPH)
