"""The checkpoint's PyTorch model and fast tokenizer, as every baseline loads them (eager attention, no remote
code, local files only). Build-side only: imports torch and transformers, lazily."""

from __future__ import annotations

import warnings

from pipeline.build.inputs.tasks import TASKS
from pipeline.build.manifest import Checkpoint
from pipeline.errors import InputError


def load_torch_model(checkpoint: Checkpoint, dtype: str = "float32"):
    """The checkpoint's PyTorch model for its task, in eval mode, with eager attention."""
    import transformers

    auto = getattr(transformers, TASKS[checkpoint.task].auto_class)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = auto.from_pretrained(
                checkpoint.path,
                attn_implementation="eager",
                dtype=dtype,
                trust_remote_code=False,
                local_files_only=True,
            )
    except Exception as err:  # safetensors, torch and transformers each raise their own types for bad files
        first = (str(err).splitlines() or [""])[0]
        raise InputError(
            f"could not load the weights in {checkpoint.path} ({type(err).__name__}: {first}); "
            "the weight files are missing or corrupt: save the checkpoint again"
        ) from None
    return model.eval()


def load_hf_tokenizer(checkpoint: Checkpoint):
    """The checkpoint's fast tokenizer (the Rust one the runtime uses, through transformers)."""
    from transformers import AutoTokenizer

    try:
        # fix_mistral_regex=False: tokenize as tokenizer.json says, as the runtime does (transformers 4.57 warns
        # of a Mistral regex for every folder another 4.57 release saved, Gemma's included).
        tokenizer = AutoTokenizer.from_pretrained(
            checkpoint.path, use_fast=True, trust_remote_code=False, local_files_only=True, fix_mistral_regex=False
        )
    except (OSError, ValueError) as err:
        raise InputError(f"could not load the tokenizer in {checkpoint.path}: {str(err).splitlines()[0]}") from None
    if not tokenizer.is_fast:
        raise InputError(f"{checkpoint.path} has no fast (Rust) tokenizer; the runtime needs tokenizer.json")
    return tokenizer
