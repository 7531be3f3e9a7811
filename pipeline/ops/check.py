"""`pipeline check MODEL`: what a build would do, in seconds, without building.

It runs the checkpoint stage (which refuses remote code, unknown families and tasks in one line), then reads the
family's record and the target: the task, the graph passes, the attention rewrite and the candidates this host
would search. The attention rewrite is judged on the model built from its config with empty weights.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.build.inputs.architectures import ENCODER_DECODER_FAMILIES, architecture_of
from pipeline.build.manifest import Manifest
from pipeline.build.passes.fusions import fused_passes
from pipeline.build.recipes import checked_target
from pipeline.build.stages import checkpoint


def _attention_plan(arch, folder: str) -> str:
    """What the export does with a decoder's attention: GroupQueryAttention, or why it stays decomposed."""
    if arch.attention is None:
        return f"decomposed: {arch.why_not_fused(None)}"
    if arch.fusion_problem is None:
        return f"GroupQueryAttention ({arch.attention} layout)"
    import warnings

    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=False, local_files_only=True)
    with warnings.catch_warnings(), torch.device("meta"):  # buffers too: shapes only, no memory
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    problem = arch.why_not_fused(model)
    return f"GroupQueryAttention ({arch.attention} layout)" if problem is None else f"decomposed: {problem}"


def check(model: str | Path, target: str = "native") -> dict:
    """What building `model` for `target` would do: task, family, passes, attention, candidates (with those this
    host cannot build named), and the gate. Raises the checkpoint stage's one-line InputError for what it refuses.
    """
    from pipeline.runtime.host import cpu_flags

    spec = checked_target(target)
    manifest = Manifest(
        model_name="check", source=str(model), cache_dir="", artifacts_dir="", validation_path="", calibration_path=""
    )
    info = checkpoint.run(manifest, spec).checkpoint
    arch = architecture_of(info)
    flags = cpu_flags() or frozenset()
    candidates = []
    for candidate in spec.family_candidates(arch.family):
        missing = sorted(set(candidate.required_cpu_flags) - flags)
        candidates.append({"name": candidate.name, "buildable": not missing, "missing_flags": missing})
    passes = fused_passes(arch.ort_model_type, arch.attention_fusion) if arch.ort_model_type else "generic passes only"
    if arch.family in ENCODER_DECODER_FAMILIES:
        passes = "none at build time (two graphs; ONNX Runtime fuses at load)"
    return {
        "model": info.path,
        "model_type": info.model_type,
        "family": arch.family,
        "record": "generic" if arch.generic else "known",
        "task": info.task,
        "pooling": info.pooling,
        "max_length": info.max_length,
        "target": spec.name,
        "passes": passes
        if spec.optimize.fusions or arch.family in ENCODER_DECODER_FAMILIES
        else "generic passes only (the target turns fusions off)",
        "attention": _attention_plan(arch, info.path) if arch.family == "decoder" else "exported as is",
        "candidates": candidates,
    }
