"""The build: one explicit table of stages, run in order over a manifest.

checkpoint -> export -> optimize -> search | quantize | fp16 (+ int8_qdq) -> validate -> tune | engine -> publish

A stage the target does not ask for returns the manifest unchanged: `search` runs for CPU targets with
[[candidates]] (encoders), `quantize` for the others that quantize.
"""

from __future__ import annotations

import dataclasses
import re
import tempfile
import time
from pathlib import Path

from pipeline.build import faults
from pipeline.build.cache import leases
from pipeline.build.inputs.architectures import ENCODER_DECODER_FAMILIES, architecture_of
from pipeline.build.inputs.data import (
    AUDIO_SUFFIXES,
    DEFAULT_CALIBRATION,
    DEFAULT_VALIDATION,
    IMAGE_SUFFIXES,
    check_calibration,
    check_held_out,
    is_image_file,
    read_texts,
)
from pipeline.build.inputs.image_data import default_image_data
from pipeline.build.inputs.speech_data import default_speech_data
from pipeline.build.inputs.targets import TARGETS_DIR, available_targets, load_target
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import Manifest
from pipeline.build.recipes import checked_target
from pipeline.build.stages import checkpoint, engine, export, fp16, optimize, publish, quantize, search, tune, validate
from pipeline.build.store import check_outside_artifacts
from pipeline.errors import ArtifactError, InputError, TargetError

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_NAME = "all-minilm-l6-v2"

STAGES = (
    ("checkpoint", checkpoint.run),
    ("export", export.run),
    ("optimize", optimize.run),
    ("search", search.run),
    ("quantize", quantize.run),
    ("fp16", fp16.run),
    ("int8_qdq", quantize.run_int8_qdq),
    ("validate", validate.run),
    ("tune", tune.run),
    ("engine", engine.run),
    ("publish", publish.run),
)


def _check_writable(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        raise ArtifactError(
            f"cannot publish to {folder} ({err.strerror or err}); pass a writable --artifacts-dir or fix its "
            "permissions"
        ) from None


def _check_candidates(spec, family: str) -> None:
    """A target none of whose candidates for the model's family this host can build is a one-line error naming
    the flags and the target that fits the host."""
    from pipeline.build.inputs.targets import NATIVE
    from pipeline.runtime.host import cpu_flags, kernel_class

    flags = cpu_flags() or frozenset()
    candidates = spec.family_candidates(family)
    if family in ENCODER_DECODER_FAMILIES and not candidates:
        having = [name for name in available_targets() if load_target(name).family_candidates(family)]
        raise TargetError(
            f"target {spec.name} lists no [[candidates]] for {family} models, which are built by the engine search "
            f"only; build for one that does ({', '.join(having) or 'none'}), or add {family} candidates to it"
        )
    missing = [sorted(set(c.required_cpu_flags) - flags) for c in candidates]
    if candidates and all(missing):
        needed = sorted({f for m in missing for f in m})
        fits = NATIVE.get(kernel_class(flags), "cpu-fp32")
        raise TargetError(
            f"target {spec.name}: every candidate needs CPU flags this build host lacks ({', '.join(needed)}); "
            f"build on a host that has them, or build {fits}, the target of this host"
        )


# What a non-text model's data is: its default held-out and calibration sets, and the files a data folder holds.
_MEDIA = {
    "image": (default_image_data, IMAGE_SUFFIXES, "an image model", "image files"),
    "audio": (default_speech_data, AUDIO_SUFFIXES, "a speech model", "16 kHz WAV files"),
}


def _media_data(manifest: Manifest, spec) -> Manifest:
    """An image or speech model's data: the default pictures or speech in place of the default text, and folders
    of such files only."""
    modality = TASKS[manifest.checkpoint.task].modality
    if modality not in _MEDIA:
        return manifest
    make_default, suffixes, kind, files = _MEDIA[modality]
    validation, calibration = manifest.validation_path, manifest.calibration_path
    if Path(validation) == DEFAULT_VALIDATION or Path(calibration) == DEFAULT_CALIBRATION:
        defaults = make_default(manifest.cache_dir)
        validation = str(defaults[0]) if Path(validation) == DEFAULT_VALIDATION else validation
        calibration = str(defaults[1]) if Path(calibration) == DEFAULT_CALIBRATION else calibration
    for option, path in (("--validation", validation), ("--calibration", calibration)):
        texts = read_texts(path, option.removeprefix("--"))
        if not all(is_image_file(t, suffixes) for t in texts):
            raise InputError(
                f"{option} {path} holds other examples than {files}, and {manifest.model_name} is {kind}; pass a "
                f"folder of {files} (or leave the option out for the default ones)"
            )
    held_out, calibration_examples = read_texts(validation, "validation"), read_texts(calibration, "calibration")
    if spec.calibrates:
        check_calibration(calibration_examples, calibration, spec.quantize.calibration_examples)
    check_held_out(held_out, calibration_examples, validation, calibration)
    return dataclasses.replace(manifest, validation_path=validation, calibration_path=calibration)


def model_name_for(source: Path) -> str:
    """A file-system-safe artifact name from a checkpoint folder's name."""
    name = re.sub(r"[^a-z0-9._-]+", "-", source.resolve().name.lower()).strip("-.")
    if not name:
        raise InputError(f"cannot derive an artifact name from {source}; pass --name")
    return name


def _check_outside_checkpoint(folder: Path, source: Path, option: str) -> None:
    """Refuse an output folder inside the checkpoint folder: each build's output would change the checkpoint's
    digest, so no build would reuse another's stages and validate would refuse every earlier version."""
    if folder.resolve().is_relative_to(source.resolve()):  # the folder itself included
        raise InputError(
            f"{option} {folder} lies inside the checkpoint folder {source}; what a build writes there would change "
            f"the checkpoint it builds. Pass a folder outside {source}"
        )


def build(
    model: str | Path | None = None,
    target: str = "cpu-avx2",
    name: str | None = None,
    task: str | None = None,
    artifacts_dir: str | Path = REPO / "artifacts",
    cache_dir: str | Path = REPO / ".cache" / "stages",
    validation: str | Path = DEFAULT_VALIDATION,
    calibration: str | Path = DEFAULT_CALIBRATION,
    targets_dir: str | Path = TARGETS_DIR,
    on_stage=None,
    until: str | None = None,
) -> Manifest:
    """Build, validate and publish one model for one target; returns the final manifest.

    `model` is a local Hugging Face checkpoint folder (default: the packaged all-MiniLM-L6-v2). `on_stage`, if
    given, is called with each StageRecord as it finishes. `until` names a stage after which to stop, publishing
    nothing: a fleet runs the host-independent stages ("optimize" and before) anywhere, caching them for the rest.
    """
    spec = checked_target(target, targets_dir)
    if spec.engine == "tensorrt" and spec.device != "gpu":
        raise TargetError(f'target {spec.name}: engine tensorrt needs device = "gpu"')
    if not spec.supported:
        raise TargetError(f"target {spec.name} is not yet supported: {spec.unsupported_reason}")
    # Bad data or an unwritable artifacts folder is found before the expensive stages, not after them.
    held_out, calibration_texts = read_texts(validation, "validation"), read_texts(calibration, "calibration")
    if spec.calibrates:
        check_calibration(calibration_texts, calibration, spec.quantize.calibration_examples)
        check_held_out(held_out, calibration_texts, validation, calibration)
    if model is None:
        source, name = checkpoint.default_checkpoint(), name or DEFAULT_MODEL_NAME
    else:
        source = Path(model)
    for option, folder in (("--artifacts-dir", artifacts_dir), ("--cache-dir", cache_dir)):
        check_outside_artifacts(Path(folder), option)
        _check_outside_checkpoint(Path(folder), source, option)
    _check_writable(Path(artifacts_dir))
    if name is not None and not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name):
        raise InputError(f"artifact name {name!r} must be lower-case letters, digits, '.', '_' or '-'")
    manifest = Manifest(
        model_name=name or model_name_for(source),
        source=str(source),
        cache_dir=str(cache_dir),
        artifacts_dir=str(artifacts_dir),
        validation_path=str(validation),
        calibration_path=str(calibration),
        task_override=task,
    )
    started = time.perf_counter()
    with leases():  # gc removes no cache entry this build uses until it has published (or stopped, with until)
        for stage_name, stage in STAGES:
            count = len(manifest.stages)
            manifest = stage(manifest, spec)
            if stage_name == "checkpoint":  # a cheap stage: the checks that need the model's family come next
                _check_candidates(spec, architecture_of(manifest.checkpoint).family)
                manifest = _media_data(manifest, spec)
            if stage_name == "search":  # the chosen candidate's thresholds hold from here on
                spec = search.chosen_target(manifest, spec)
            if on_stage and len(manifest.stages) > count:
                on_stage(manifest.stages[-1])
            faults.point(f"after-{stage_name}")
            if stage_name == until:
                return manifest
    seconds = round(time.perf_counter() - started, 2)
    return dataclasses.replace(manifest, published=dataclasses.replace(manifest.published, seconds=seconds))
