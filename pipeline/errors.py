"""The pipeline's exceptions. Library code raises these; only the CLI turns them into exit codes."""


class PipelineError(Exception):
    """Base of every error the pipeline raises on purpose. The message says what, what is available, and the fix."""

    exit_code = 1


class TargetError(PipelineError):
    """A target file is missing, malformed, or asks for something this build cannot do."""

    exit_code = 2


class InputError(PipelineError):
    """A checkpoint, data file or runtime input is missing or malformed."""

    exit_code = 3


class ExportError(PipelineError):
    """The checkpoint could not be turned into a working ONNX graph."""

    exit_code = 4


class QuantizationError(PipelineError):
    """Quantization could not produce a graph."""

    exit_code = 5


class AccuracyError(PipelineError):
    """A candidate missed the target's accuracy thresholds; nothing was published. `stats` holds the measured
    statistics and their verdict rows, where they were measured."""

    exit_code = 6

    def __init__(self, message: str, stats: dict | None = None):
        super().__init__(message)
        self.stats = stats


class ArtifactError(PipelineError):
    """A published artifact is missing, incomplete or has been tampered with."""

    exit_code = 7


class OverloadedError(PipelineError):
    """A Batcher's queue is full; the caller should back off and retry, or the service should scale out."""

    exit_code = 8


class EngineError(PipelineError):
    """A TensorRT engine could not be built here: no GPU or TensorRT, another GPU, or the builder failed."""

    exit_code = 9


class CacheError(PipelineError):
    """The stage cache folder cannot be read or written (full disk, read-only folder)."""

    exit_code = 10


class ServingError(PipelineError):
    """An artifact cannot be handed to a serving engine: a kind it does not take, a port in use, a cluster that
    cannot be reached, a server that did not become ready."""

    exit_code = 11
