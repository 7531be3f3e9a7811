"""A checkpoint's config.json checked against its weight files before any module is built with real memory.

transformers builds a model from config.json first and loads the weights after: `n_positions=120000` asks GPT-2
for 14 GB of attention-mask buffers and `vocab_size=10**12` for terabytes of embeddings, before the weights'
shapes could refuse them. Here the model is built on PyTorch's meta device (shapes only, no memory) and compared
with the tensor shapes in the safetensors headers (read without the tensors):
- each parameter the weight files hold must have the shape config.json gives it;
- the model's parameters may not outgrow the weight files' by more than a slack, nor its buffers a fixed budget.
Checkpoints whose weights are only in pytorch_model.bin are not checked (reading their shapes means unpickling).
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from pathlib import Path

from pipeline.errors import InputError

MAX_HEADER_BYTES = 100 << 20
MAX_BUFFER_BYTES = 1 << 30  # masks and rotary tables of real models are megabytes
PARAMETER_SLACK = 2.0  # parameters the files may lack: tied heads, a fresh classifier


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's JSON header (the tensors are not read)."""
    with open(path, "rb") as handle:
        (size,) = struct.unpack("<Q", handle.read(8) or b"\0" * 8)
        if not 0 < size <= MAX_HEADER_BYTES:
            raise InputError(f"{path} is not a safetensors file (header of {size} bytes); save the checkpoint again")
        header = json.loads(handle.read(size))
    return {
        name: tuple(entry["shape"])
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("shape"), list)
    }


def weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in the checkpoint's safetensors files (empty where it has none)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map") or {}
        files = sorted({f for f in weight_map.values() if isinstance(f, str) and "/" not in f and ".." not in f})
    else:
        files = ["model.safetensors"] if (folder / "model.safetensors").is_file() else []
    shapes = {}
    for name in files:
        try:
            shapes.update(_header_shapes(folder / name))
        except (OSError, ValueError, struct.error) as err:
            why = f"cannot read {folder / name} ({err})"
            raise InputError(f"{why}; the weight files are damaged: save them again") from None
    return shapes


def _meta_model(folder: Path, auto_class: str):
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return getattr(transformers, auto_class).from_config(config, attn_implementation="eager")


def _by_name(shapes: dict) -> dict:
    """`shapes` under their names and under their names without the first part (a base model's, saved from or
    loaded into a model with a head, drops or adds one prefix such as `transformer.` or `model.`)."""
    return {**{name.split(".", 1)[-1]: shape for name, shape in shapes.items()}, **shapes}


def _gigabytes(count: float) -> str:
    return f"{count / 1e9:.1f} GB"


def check_sizes(folder, auto_class: str) -> None:
    """Refuse, in one line, a config.json whose sizes do not fit the checkpoint's weight files (see the module)."""
    folder = Path(folder)
    shapes = weight_shapes(folder)
    if not shapes:
        return
    try:
        model = _meta_model(folder, auto_class)
    except Exception:  # noqa: BLE001 (the export stage says what is wrong with a config it cannot build)
        return
    fix = "fix config.json to match the weights, or save the checkpoint again"
    named = _by_name(shapes)
    for name, parameter in model.named_parameters():
        shape = named.get(name, named.get(name.split(".", 1)[-1]))
        if shape is not None and shape != tuple(parameter.shape):
            raise InputError(
                f"{folder / 'config.json'} gives {name} the shape {tuple(parameter.shape)}, but the weight files "
                f"hold {shape}: the config does not fit the weights; {fix}"
            )
    held = sum(math.prod(shape) for shape in shapes.values())
    wanted = sum(p.numel() for p in model.parameters())
    if wanted > PARAMETER_SLACK * held + 10_000_000:
        raise InputError(
            f"{folder / 'config.json'} asks for {wanted:,} parameters ({_gigabytes(4 * wanted)} in fp32), but the "
            f"weight files hold {held:,}: the config does not fit the weights; {fix}"
        )
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    if buffers > MAX_BUFFER_BYTES:
        raise InputError(
            f"{folder / 'config.json'} asks for {_gigabytes(buffers)} of buffers (attention masks or position tables "
            "sized by n_positions or max_position_embeddings), over the 1 GB a model needs; lower those sizes in "
            "config.json"
        )
