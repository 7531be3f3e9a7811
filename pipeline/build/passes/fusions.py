"""fused_from_onnx: dead-node removal, constant folding and ONNX Runtime's transformer fusions, where its optimizer
knows the family (an `ort_model_type`); otherwise only the generic passes (ONNX Runtime's basic level).

    MatMul+Add+Softmax+...  ->  Attention        Add+LayerNorm  ->  SkipLayerNormalization
    Add(bias)+Gelu          ->  BiasGelu         Gather*3+LayerNorm -> EmbedLayerNormalization

then this project's own attention fusion where the family's record names one
(pipeline/build/passes/encoder_attention.py:
DistilBERT's Where-masked attention, which ONNX Runtime's optimizer does not fuse), and, where the config asks
(decoders), MatMuls that read one input packed into one (pipeline/build/passes/packing.py).
"""

from __future__ import annotations

import secrets
import tempfile
from collections import Counter
from pathlib import Path

from pipeline.build.console import silenced
from pipeline.build.onnx_files import (
    INLINE_BELOW,
    data_name,
    graph_files,
    load_external,
    load_structure,
    read_array,
    save_graph,
)
from pipeline.build.passes.packing import matmuls_packed, packable
from pipeline.errors import ExportError
from pipeline.runtime.schema import GRAPH

# The weights a structure keeps (norms and biases, not matrices): symbolic shape inference reads every constant input
# of an Add or Mul, though it only uses the small ones.
STRUCTURE_INLINE_BELOW = 1 << 20

# ONNX Runtime's optimizer model types whose fusions read weights (BERT's attention joins Q, K and V), so they run on
# the loaded graph. (Others are tried on the structure, and loaded where a fusion reads a weight all the same.)
_FUSIONS_READ_WEIGHTS = frozenset({"bert"})

# Session passes at most (each fuses up to 10 more layers' Reshape shapes; see _session_passes).
MAX_SESSION_PASSES = 6

# What ONNX Runtime's optimize_model disables in its session pass: ConstantSharing always, and at levels above 1 the
# fusions that would hide the patterns its Python fusions look for.
_SESSION_DISABLED = ["ConstantSharing"]
_FUSION_BLOCKERS = [
    "MatMulScaleFusion",
    "MatMulAddFusion",
    "MatmulTransposeFusion",
    "GemmActivationFusion",
    "BiasSoftmaxFusion",
]


def op_counts(path: Path) -> dict[str, int]:
    """Number of nodes of each op type in an ONNX file."""
    import onnx

    return dict(sorted(Counter(n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node).items()))


def _transformer_fused(source: Path, config, target_file: Path) -> tuple[dict, int, bool]:
    """ONNX Runtime's transformer optimizer (its session's graph optimizations, then its Python fusions) and the
    packing pass; returns the fused-operator statistics, the MatMuls packed away, and whether the fusions ran on the
    graph's structure alone (`_structure_fused`: faster, and a 1B graph's stage peaks at 4.2 GB instead of 21 GB),
    as they do where they read no weight."""
    from onnxruntime.transformers.optimizer import optimize_model

    if config.model_type not in _FUSIONS_READ_WEIGHTS and not config.attention_fusion:
        result = _structure_fused(source, config, target_file)
        if result is not None:
            return *result, True
    with silenced("onnxruntime.transformers"), silenced():
        optimized = optimize_model(
            str(source), model_type=config.model_type, num_heads=0, hidden_size=0, opt_level=config.level, use_gpu=False
        )
    fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    if config.attention_fusion:
        from pipeline.build.passes.encoder_attention import FUSIONS

        own = FUSIONS[config.attention_fusion](optimized)
        if own:
            fused["Attention"] = fused.get("Attention", 0) + own
    packed = matmuls_packed(optimized.model) if config.packed else 0
    save_graph(optimized.model, target_file, consume=True)
    return fused, packed, False


def _built_reshapes(path: Path) -> int:
    """The Reshapes of the graph file `path` whose target shape is put together at run time (a Concat's output)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    concats = {o for n in graph.node if n.op_type == "Concat" for o in n.output}
    return sum(1 for n in graph.node if n.op_type == "Reshape" and n.input[1] in concats)


def _session_passes(source: Path, scratch: Path, level: int) -> Path:
    """ONNX Runtime's session pass over `source`, written into `scratch` with its large weights in a data file, and
    run again on its own output while that leaves fewer Reshapes of shapes built at run time. Its graph transformers
    take at most 10 steps, and ReshapeFusion makes one more layer's Reshape shapes constant a step (each needs the
    dimensions the previous layer's fusion revealed): Gemma 3's 18 layers kept 8 layers of Shape, Gather, Unsqueeze
    and Concat nodes (72 nodes, about 4% of a decode step), which a second pass (4 s) removes."""
    from onnxruntime.transformers.optimizer import optimize_by_onnxruntime

    current, left = source, None
    for index in range(MAX_SESSION_PASSES):
        written = scratch / f"pass{index}.onnx"
        # A name nothing else has: a fusion that reads a weight without the graph's folder (onnx resolves it from the
        # working directory) fails to find it, and is retried on the loaded graph, rather than reading another file.
        optimize_by_onnxruntime(
            str(current),
            use_gpu=False,
            optimized_model_path=str(written),
            opt_level=level,
            disabled_optimizers=_SESSION_DISABLED + (_FUSION_BLOCKERS if level > 1 else []),
            save_as_external_data=True,
            external_data_filename=f"weights-{secrets.token_hex(8)}.data",
            external_data_file_threshold=STRUCTURE_INLINE_BELOW,
        )
        if current != source:  # the previous pass's files, in the scratch folder
            for file in graph_files(current):
                file.unlink()
        current, now = written, _built_reshapes(written)
        if now == 0 or (left is not None and now >= left):
            break
        left = now
    return current


def _structure_fused(source: Path, config, target_file: Path) -> tuple[dict, int] | None:
    """The transformer optimizer over a graph whose weights stay in a data file until it is written: ONNX Runtime's
    session writes its optimized graph with a data file, and the Python fusions run on that graph's structure. Over
    the whole graph they make four copies of it for shape inference, each holding every weight (a 1B-parameter
    graph's optimize stage peaked at 21 GB). None where a fusion needs a weight's values (BERT's attention joins
    Q, K and V): the caller then fuses the loaded graph."""
    from onnx.checker import ValidationError
    from onnxruntime.transformers.optimizer import optimize_model

    with tempfile.TemporaryDirectory(dir=target_file.parent) as scratch:
        with silenced("onnxruntime.transformers"), silenced():
            level = _session_passes(source, Path(scratch), config.level)
            try:
                structure = load_structure(level, STRUCTURE_INLINE_BELOW)
                optimized = optimize_model(
                    structure, model_type=config.model_type, num_heads=0, hidden_size=0, opt_level=0
                )
            except (OSError, ValidationError):  # onnx: the data file is "not regular file"
                return None
        if not optimized.enable_shape_infer:  # it read a weight left in the data file, and fused less for it
            return None
        fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
        packed = _packed_and_written(optimized.model, level, target_file, config.packed)
    return fused, packed


def _packed_and_written(structure, graph: Path, target_file: Path, pack: bool) -> int:
    """Pack the MatMuls of `structure` (where `pack`), reading each weight it packs from the graph file `graph` or
    its data file, then read the rest in and write the graph to `target_file`; returns the MatMuls packed away."""
    packed = matmuls_packed(structure, read=lambda tensor: read_array(tensor, graph)) if pack else 0
    load_external(structure, graph)
    save_graph(structure, target_file, consume=True)
    return packed


def fused_passes(model_type: str, attention_fusion: str | None) -> str:
    """The fusions that run for an ONNX Runtime optimizer model type and this project's attention fusion, in the
    words of the report and of `pipeline check`."""
    own = f", then attention from its {attention_fusion} layout" if attention_fusion else ""
    return f"onnxruntime {model_type} fusions{own}"


def fused_from_onnx(source: Path, config, out: Path) -> dict:
    """Write the optimized graph of `source` to `out`/model.onnx; returns node counts before and after."""
    import onnxruntime as ort

    before = op_counts(source)
    target_file = out / GRAPH
    if config.fusions and config.model_type:
        fused, packed, without_weights = _transformer_fused(source, config, target_file)
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
        fused, packed, without_weights = {}, 0, False
        structure = load_structure(target_file) if config.packed else None
        if structure is not None and packable(structure):  # written again only where something packs
            packed = _packed_and_written(structure, target_file, target_file, pack=True)
        del structure
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
        "fused_without_weights": without_weights,
        "passes": fused_passes(config.model_type, config.attention_fusion)
        if config.fusions and config.model_type
        else "generic",
    }
