"""Stage 3: optimized_onnx. Dead-node removal, constant folding and ONNX Runtime's transformer fusions.

    MatMul+Add+Softmax+...  ->  Attention        Add+LayerNorm  ->  SkipLayerNormalization
    Add(bias)+Gelu          ->  BiasGelu         Gather*3+LayerNorm -> EmbedLayerNormalization

Node counts by op type before and after go into the stage's metrics.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pipeline.cache import run_cached
from pipeline.errors import ExportError
from pipeline.manifest import Manifest
from pipeline.quiet import silenced
from pipeline.targets import Target
from pipeline.tasks import ARCHITECTURES


def op_counts(path: Path) -> dict[str, int]:
    """Number of nodes of each op type in an ONNX file."""
    import onnx

    return dict(sorted(Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node).items()))


def _optimize(source: Path, model_type: str, settings, out: Path) -> dict:
    import onnxruntime as ort
    from onnxruntime.transformers.optimizer import optimize_model

    before = op_counts(source)
    target_file = out / "model.onnx"
    if settings.fusions:
        with silenced("onnxruntime.transformers"), silenced():
            optimized = optimize_model(
                str(source), model_type=model_type, num_heads=0, hidden_size=0, opt_level=settings.level, use_gpu=False
            )
        optimized.save_model_to_file(str(target_file))
        fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    else:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(target_file)
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        fused = {}
    after = op_counts(target_file)
    if not after:
        raise ExportError(f"optimizing {source} left an empty graph")
    return {
        "nodes_before": sum(before.values()),
        "nodes_after": sum(after.values()),
        "op_counts_before": before,
        "op_counts_after": after,
        "fused": fused,
    }


def run(manifest: Manifest, target: Target) -> Manifest:
    """Optimize the exported graph (cached by the export's id and the target's optimize settings)."""
    import onnxruntime

    source = manifest.stage("export")
    model_type = ARCHITECTURES[manifest.checkpoint.model_type].ort_model_type
    settings = target.optimize
    config = {
        "fusions": settings.fusions,
        "level": settings.level,
        "model_type": model_type,
        "onnxruntime": onnxruntime.__version__,
    }
    record = run_cached(
        manifest.cache_dir, "optimize", config, source.key, target.device,
        lambda out: _optimize(source.output("model.onnx"), model_type, settings, out),
    )  # fmt: skip
    return manifest.with_stage(record)
