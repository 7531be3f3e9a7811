"""The development split: the part of the calibration text held back to judge the quantize stage's fallback and
the searches' candidates, so that neither is tuned on the text it is scored on, filled up from the repository's
own text where the user's is too small to judge on."""

from __future__ import annotations

from pipeline.build.inputs.data import DEFAULT_CALIBRATION, read_texts
from pipeline.build.inputs.targets import Target
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import Manifest, examples

# A development split under this many examples predicts held-out accuracy badly (a 60-line calibration file
# leaves 15): the repository's own development text is added to it, for judging only.
MIN_DEVELOPMENT = 64


def development_split(texts: list, manifest: Manifest | None = None, target: Target | None = None) -> tuple[list, list]:
    """(calibration, development): every fourth example is held back to judge the fallback and the search, so
    neither is tuned on the text it is scored on. A single example serves as both. Given the build's `manifest`
    and `target`, a development split under MIN_DEVELOPMENT examples is filled up from the repository's own
    calibration text (never a text of the user's calibration or held-out files), since 15 examples let a graph
    pass that misses on a few hundred; the calibration ranges still come from the user's file alone."""
    if len(texts) < 2:
        calibration, development = texts, list(texts)
    else:
        calibration = [t for i, t in enumerate(texts) if i % 4 != 3]
        development = [t for i, t in enumerate(texts) if i % 4 == 3]
    # Text encoders only: the repository's examples are text, and a decoder's split is its few prompts, each one
    # generated from (more would multiply the search's time, not sharpen a per-token gate).
    task = TASKS[manifest.checkpoint.task] if manifest is not None else None
    text_encoder = task is not None and (task.family, task.modality) == ("encoder", "text")
    if text_encoder and target is not None and len(development) < MIN_DEVELOPMENT:
        development += _repository_development(manifest, target, texts, MIN_DEVELOPMENT - len(development))
    return calibration, development


def filled_examples(texts: list, development: list) -> int:
    """How many of `development`'s examples came from the repository's text rather than the user's `texts`."""
    return len(development) - len(development_split(texts)[1])


def _repository_development(manifest: Manifest, target: Target, texts: list, count: int) -> list:
    """Up to `count` examples of the repository's calibration text that are neither the user's calibration
    examples nor held-out validation examples (from the end of the file: the default calibration takes the start)."""
    task = manifest.checkpoint.task
    taken = {repr(t) for t in texts}
    taken |= {repr(t) for t in examples(read_texts(manifest.validation_path, "validation"), task, target.generation)}
    own = examples(read_texts(DEFAULT_CALIBRATION, "calibration"), task, target.generation)
    return [t for t in reversed(own) if repr(t) not in taken][:count]


def calibration_texts(manifest: Manifest, target: Target, settings) -> list:
    """The calibration examples a quantization uses: the first `calibration_examples` (decoders: prompts)."""
    texts = read_texts(manifest.calibration_path, "calibration")[: settings.calibration_examples]
    return examples(texts, manifest.checkpoint.task, target.generation)
