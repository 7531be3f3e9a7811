"""fused_from_onnx: dead-node removal, constant folding and ONNX Runtime's transformer fusions, where its optimizer
knows the family (an `ort_model_type`); otherwise only the generic passes (ONNX Runtime's basic level).

    MatMul+Add+Softmax+...  ->  Attention        Add+LayerNorm  ->  SkipLayerNormalization
    Add(bias)+Gelu          ->  BiasGelu         Gather*3+LayerNorm -> EmbedLayerNormalization

and, where the config asks (decoders), MatMuls that read one input packed into one (pipeline/passes/packing.py).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from pipeline.console import silenced
from pipeline.errors import ExportError
from pipeline.onnx_files import INLINE_BELOW, data_name, graph_files, load_graph, load_structure, save_graph
from pipeline.passes.packing import matmuls_packed, packable


def op_counts(path: Path) -> dict[str, int]:
    """Number of nodes of each op type in an ONNX file."""
    import onnx

    return dict(sorted(Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node).items()))


def fused_from_onnx(source: Path, config, out: Path) -> dict:
    """Write the optimized graph of `source` to `out`/model.onnx; returns node counts before and after."""
    import onnxruntime as ort
    from onnxruntime.transformers.optimizer import optimize_model

    before = op_counts(source)
    target_file = out / "model.onnx"
    if config.fusions and config.model_type:
        with silenced("onnxruntime.transformers"), silenced():
            optimized = optimize_model(
                str(source),
                model_type=config.model_type,
                num_heads=0,
                hidden_size=0,
                opt_level=config.level,
                use_gpu=False,
            )
        fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
        optimized.topological_sort()
        packed = matmuls_packed(optimized.model) if config.packed else 0
        save_graph(optimized.model, target_file, consume=True)
    else:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        options.optimized_model_filepath = str(target_file)
        if len(graph_files(source)) > 1:  # ONNX Runtime cannot write it as one protobuf either
            options.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", data_name(target_file)
            )
            options.add_session_config_entry(
                "session.optimized_model_external_initializers_min_size_in_bytes", str(INLINE_BELOW)
            )
        ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        fused, packed = {}, 0
        if config.packed and packable(load_structure(target_file)):  # loaded whole only where something packs
            model = load_graph(target_file)
            packed = matmuls_packed(model)
            save_graph(model, target_file, consume=True)
            del model
    after = op_counts(target_file)
    if not after:
        raise ExportError(f"optimizing {source} left an empty graph")
    return {
        "nodes_before": sum(before.values()),
        "nodes_after": sum(after.values()),
        "op_counts_before": before,
        "op_counts_after": after,
        "fused": fused,
        "packed_matmuls": packed,
        "passes": f"onnxruntime {config.model_type} fusions" if config.fusions and config.model_type else "generic",
    }
