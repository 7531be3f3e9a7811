"""The typed build manifest that flows through the stages, and the records each stage adds to it.

A stage is `run(manifest, target) -> manifest`: it reads what earlier stages recorded and returns a new
manifest with its own StageRecord appended. Nothing else is passed between stages.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.runtime.artifact import TOKENIZER_NAME
from pipeline.runtime.schema import DECODER_GRAPH, ENCODER_GRAPH, GRAPH, INT8_GRAPH, OPENVINO_GRAPH, OPENVINO_WEIGHTS

MODEL_GRAPH = GRAPH
GRAPHS = (MODEL_GRAPH, OPENVINO_GRAPH, ENCODER_GRAPH)  # the graph an artifact is opened by


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What the checkpoint stage learned of the source folder."""

    path: str
    digest: str  # sha256 over (relative path, file sha256) of every file that defines the model
    model_type: str
    task: str
    config: dict
    pooling: dict | None  # sentence-transformers pooling, or None for plain transformers checkpoints
    max_length: int


@dataclasses.dataclass(frozen=True)
class StageRecord:
    """One stage's result: its cache key, config, output files (name -> path), metrics and timing."""

    name: str
    key: str
    config: dict
    outputs: dict
    metrics: dict
    seconds: float
    reused: bool

    def output(self, name: str) -> Path:
        """Path of one of this stage's output files."""
        return Path(self.outputs[name])


@dataclasses.dataclass(frozen=True)
class Chosen:
    """How the published graph runs: its file name, backend, precision (None: the target's) and session settings."""

    graph: str
    backend: str
    precision: str | None
    session: dict


@dataclasses.dataclass(frozen=True)
class Tuned:
    """What the tune stage chose on the build host: the session settings (threads, execution mode, split rows) and
    the shape-bucket plan where it won (None: padded batches)."""

    session: dict
    shape_buckets: list | None = None


@dataclasses.dataclass(frozen=True)
class Published:
    """Where the publish stage put the artifact: its folder and version, whether an identical version was already
    there (`reused`), its content id, the engine cache entries it wrote, and the whole build's seconds."""

    version: str
    path: str
    reused: bool
    content_id: str
    engines: list
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Manifest:
    """Everything known about one build so far."""

    model_name: str
    source: str
    cache_dir: str
    artifacts_dir: str
    validation_path: str
    calibration_path: str
    task_override: str | None = None
    checkpoint: Checkpoint | None = None
    stages: tuple[StageRecord, ...] = ()
    published: Published | None = None

    def stage(self, name: str) -> StageRecord:
        """The record of an earlier stage, by name."""
        record = self.ran(name)
        if record is not None:
            return record
        done = ", ".join(r.name for r in self.stages) or "none"
        raise PipelineError(f"stage {name!r} has not run yet (done: {done}); the stage table is out of order")

    def ran(self, name: str) -> StageRecord | None:
        """The record of a stage that may not have run for this build (search, tune, engine), or None."""
        return next((record for record in self.stages if record.name == name), None)

    def with_stage(self, record: StageRecord) -> Manifest:
        """A copy with `record` appended."""
        return dataclasses.replace(self, stages=self.stages + (record,))

    def last_model(self) -> StageRecord:
        """The latest stage that produced a graph (model.onnx, or OpenVINO's model.xml): the one later stages
        work on and publish."""
        for record in reversed(self.stages):
            if any(name in record.outputs for name in GRAPHS):
                return record
        raise PipelineError("no stage has produced a model.onnx yet")

    def chosen(self) -> Chosen:
        """How the published graph runs: its file name, backend, precision and session settings (the search's
        choice where one ran, else ONNX Runtime)."""
        record = self.last_model()
        if record.name == "search":
            return Chosen(*(record.metrics[k] for k in ("graph", "backend", "precision", "session")))
        return Chosen(MODEL_GRAPH, "onnxruntime", None, {})

    def tuned(self) -> Tuned:
        """The tune stage's choice, empty where it did not run."""
        record = self.ran("tune")
        best = dict(record.metrics["best"]) if record else {}
        return Tuned(best, best.pop("shape_buckets", None))

    def graph_records(self) -> dict[str, StageRecord]:
        """The stage that made each graph file this build publishes, by file name: model.onnx (or model.xml and
        model.bin), and model.int8.onnx where one was made."""
        last = self.last_model()
        records = {name: last for name in (*GRAPHS, OPENVINO_WEIGHTS, DECODER_GRAPH) if name in last.outputs}
        for record in self.stages:
            if INT8_GRAPH in record.outputs:
                records[INT8_GRAPH] = record
        return records

    def graphs(self) -> dict[str, Path]:
        """The graphs this build publishes, by file name, as paths."""
        return {name: record.output(name) for name, record in self.graph_records().items()}

    def preprocessor(self) -> tuple[str, Path]:
        """(name, path) of the file that turns input into the graph's tensors: the exported tokenizer, or an image
        model's processor settings."""
        export = self.stage("export")
        name = export.metrics["spec"].get("preprocessor", TOKENIZER_NAME)
        return name, export.output(name)

    def artifact_sources(self) -> dict[str, Path]:
        """The files an artifact of this build holds besides its report and manifest, by file name: every graph
        file, the preprocessor, and the export's companion files (a two-tower model's text tower and tokenizer).
        Validation measures these and publish copies these."""
        export = self.stage("export")
        companions = {name: export.output(name) for name in export.metrics["spec"].get("companions", ())}
        return {**self.graph_files(), **dict([self.preprocessor()]), **companions}

    def graph_files(self) -> dict[str, Path]:
        """Every file of the graphs this build publishes, by file name: the graphs, and the data file beside each
        ONNX graph whose weights did not fit in it (referenced by name, so published under that same name)."""
        from pipeline.build.onnx_files import graph_files

        files = {}
        for name, path in self.graphs().items():
            files[name] = path
            for data in graph_files(path)[1:] if name.endswith(".onnx") else ():
                if data.name in files or data.name in self.graphs():
                    raise PipelineError(f"{name} and another graph both keep their weights in {data.name}")
                files[data.name] = data
        return files


def runtime_spec(manifest: Manifest, target) -> dict:
    """What the loader needs to feed the graph and read its output: the export's spec, plus the runtime-only
    settings of the target (batch size, overlong policy), which are not part of what is exported."""
    spec = manifest.stage("export").metrics["spec"]
    return {**spec, "batch_size": target.shapes.batch_size, "overlong": target.shapes.overlong}


def session_of(target) -> dict:
    """The session settings a build measures candidates with: the target's [runtime] table."""
    return {
        "intra_op_threads": target.runtime.intra_op_threads,
        "graph_optimization_level": target.runtime.graph_optimization_level,
    }


def candidate_model(manifest: Manifest, target, graph_path=None, backend: str | None = None, session=None):
    """The runtime object (Model or Generator) over the latest graph of this build (or `graph_path`, run on
    `backend` with `session` settings added) and the exported tokenizer, run the way the published artifact will
    be."""
    from pipeline.runtime.load import open_model

    if graph_path is None:
        chosen = manifest.chosen()
        graph_path = manifest.last_model().output(chosen.graph)
        backend, session = chosen.backend, {**chosen.session, **(session or {})}
    return open_model(
        Path(graph_path),
        manifest.preprocessor()[1],
        runtime_spec(manifest, target),
        session={**session_of(target), **(session or {})},
        backend=backend or "onnxruntime",
    )


def examples(texts: list, task: str, generation) -> list:
    """The held-out (or calibration) examples a build uses: generators (decoders, text-to-text models) take the
    first `generation.prompts`."""
    if task not in ("text-generation", "text2text-generation"):
        return texts
    return texts[: generation.prompts]
