"""The engine search over an encoder-decoder model's candidates (speech: pipeline/build/speech/search.py;
text-to-text: pipeline/build/text2text/search.py): each candidate builds both graphs, is judged by the family's gate
on the development split, and is timed on it; the fastest that passes is held to its thresholds on the held-out
data (pipeline/build/stages/search.py chooses, as for the other families).

    fp32                 the exported graphs as they are
    int8 (dynamic)       ONNX Runtime's dynamic int8 of every MatMul of both graphs, weights per channel
    int8 (weight_only)   the decoder's MatMul weights in int8 blocks (MatMulNBits), the encoder fp32: a decoding
                         step reads the weights once a token (the LM head alone is vocabulary x width), and an
                         int8 block is a quarter of the fp32 traffic; the encoder runs the whole input at once
                         and is bound by arithmetic, not by reading its weights
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

from pipeline.build.accuracy.measured import measured, measurement_key
from pipeline.build.accuracy.metrics import compare, development_gate, failures, measure, outputs
from pipeline.build.accuracy.reference import pytorch_outputs
from pipeline.build.console import silenced
from pipeline.build.inputs.targets import Candidate, Target
from pipeline.build.manifest import Manifest, runtime_spec, session_of
from pipeline.build.recipes.base import Built
from pipeline.build.search.candidates import NO_SPINNING, attach_timings, judge_candidates, time_shapes
from pipeline.errors import TargetError
from pipeline.runtime.schema import DECODER_GRAPH, ENCODER_GRAPH


def _int8_dynamic(source: Path, out: Path, target: Target) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    settings = target.quantize
    quantize_dynamic(
        source,
        out,
        op_types_to_quantize=["MatMul"],
        per_channel=settings.per_channel,
        reduce_range=settings.reduce_range,
        weight_type=QuantType.QInt8 if settings.weight_type == "int8" else QuantType.QUInt8,
    )


def _weight_only(source: Path, out: Path, target: Target, candidate: Candidate) -> None:
    from pipeline.build.passes.weight_only import quantize_weight_only

    settings = dataclasses.replace(
        target.quantize,
        bits=candidate.bits,
        blocks=candidate.blocks,
        block_size=candidate.block_size or target.quantize.block_size,
        head_bits=max(candidate.bits, target.quantize.head_bits),
    )
    quantize_weight_only(source, out, settings)


def built_graphs(manifest: Manifest, target: Target, candidate: Candidate, out: Path) -> Built:
    """Both graphs of `candidate` in `out`, made from the export's."""
    export = manifest.stage("export")
    out.mkdir(parents=True, exist_ok=True)
    kind = (candidate.engine, candidate.precision, candidate.quantize)
    for name in (ENCODER_GRAPH, DECODER_GRAPH):
        with silenced():  # ONNX Runtime's quantizers log each tensor's parameters, and advise pre-processing
            _build_graph(export.output(name), out / name, target, candidate, kind)
    return Built(out / ENCODER_GRAPH, "onnxruntime", {})


def _build_graph(source: Path, dest: Path, target: Target, candidate: Candidate, kind: tuple) -> None:
    """One graph of `candidate` (`kind`: engine, precision, quantize) from the export's `source`, into `dest`."""
    if kind == ("onnxruntime", "fp32", "none") or (candidate.quantize == "weight_only" and dest.name == ENCODER_GRAPH):
        shutil.copyfile(source, dest)
    elif kind == ("onnxruntime", "int8", "dynamic"):
        _int8_dynamic(source, dest, target)
    elif candidate.engine == "onnxruntime" and candidate.quantize == "weight_only":
        _weight_only(source, dest, target, candidate)
    else:
        raise TargetError(
            f"candidate {candidate.name}: encoder-decoder models are built as onnxruntime fp32, or int8 with "
            f'quantize = "dynamic" or "weight_only", not {candidate.engine} {candidate.precision} '
            f"({candidate.quantize})"
        )


@dataclasses.dataclass(frozen=True)
class Family:
    """What differs between encoder-decoder families in the search: the candidates' family name in the target, the
    gate's metric, the runtime's opener (encoder graph, preprocessor, spec, providers, session -> model), what one
    development input is called in the timing's shapes, what is timed (model, work, batch size -> outputs), and
    how the development inputs become that work."""

    name: str
    metric: str
    opener: Callable
    unit: str
    run: Callable
    prepare: Callable = list


def _open(family: Family, manifest: Manifest, target: Target, graph: Path, session: dict):
    """A runtime model over the encoder graph `graph` (its decoder beside it) and the exported preprocessor."""
    return family.opener(graph, manifest.preprocessor()[1], runtime_spec(manifest, target), None, session)


def _time(family: Family, models: dict, inputs: list, batch: int) -> tuple[dict, dict]:
    """Each model's ms on the development inputs one at a time and as one batch, alternating."""
    work, unit = family.prepare(inputs), family.unit
    shapes = {f"{unit}_1": (work[:1], 1), f"{unit}s_{len(work)}": (work, batch)}
    calls = {
        shape: {name: (lambda m=m, w=w, n=n: family.run(m, w, n)) for name, m in models.items()}
        for shape, (w, n) in shapes.items()
    }
    return time_shapes(calls.items(), len(calls), max_rounds=5, budget_s=30.0)


def search_encoder_decoder(manifest: Manifest, target: Target, texts: dict, flags, out: Path, family: Family):
    """Build, judge and time every candidate of `family`; returns (rows, {name: Built}, held-out check), as the
    encoder and decoder searches do."""
    development = texts["development"]
    reference = pytorch_outputs(manifest.checkpoint, development)
    session = {**session_of(target), **NO_SPINNING}
    batch = target.shapes.batch_size

    def make(candidate: Candidate):
        made = built_graphs(manifest, target, candidate, out / "work" / candidate.name)
        model = _open(family, manifest, target, made.graph, session)
        stats = compare(family.metric, reference, outputs(model, development, family.metric, batch, teacher=reference))
        gate = development_gate(target.with_candidate(candidate.name).accuracy, len(development))
        return made, model, stats, gate, {}

    rows, built = judge_candidates(target.family_candidates(family.name), flags, "search: building candidates", make)
    models = {name: model for name, (_, model) in built.items() if model is not None}
    if models:
        attach_timings(rows, *_time(family, models, development, batch))
    held_out = texts["held_out"]

    def check(name: str):
        made = built[name][0]
        model = _open(family, manifest, target, made.graph, session)
        truth = pytorch_outputs(manifest.checkpoint, held_out)
        key = measurement_key(manifest, target, made.graph, made.backend, made.session, held_out, family.metric)
        stats, _ = measured(key, lambda: measure(model, held_out, truth, family.metric, batch))
        return stats, failures(stats, target.with_candidate(name).accuracy)

    return rows, {name: made for name, (made, _) in built.items()}, check
