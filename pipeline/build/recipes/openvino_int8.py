"""Recipe `openvino-int8`: NNCF post-training int8 of the plain export (transformer preset) for OpenVINO, with a
sensitivity fallback: the MatMul kinds whose int8 error is largest stay in the compile precision (bf16 or fp32)
until the development split passes.

A transformer's MatMuls come in kinds that repeat in every layer (query, key, value, the attention output, the
two feed-forward ones; OpenVINO fuses the two attention products into ScaledDotProductAttention). One fully
quantized model and one pass over a few calibration feeds rank the kinds by the error each activation quantizer
adds at its own input (a local figure, so an early layer's error is not counted again downstream; each kind's
mean over its layers), and a bisection over that ranking finds the fewest leading kinds to keep out of int8 with
which the model passes: one development pass a try, about log2(kinds) tries.
(The relative error of each MatMul's output against the fp32 model ranked MiniLM's feed-forward output last,
the kind that matters most: it carries all the error from before it.)

NNCF quantizes once. Each try's form is that model with the kept MatMuls' FakeQuantizes bypassed and their
biases as exported: what NNCF's ignored scope gives (its SmoothQuant ignores the scope, and its bias correction
touches only quantized MatMuls), in about a second instead of a quantization a try (25 s on all-mpnet-base-v2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re

import numpy as np

from pipeline.build.console import silenced
from pipeline.build.recipes.base import Built, Job, Recipe
from pipeline.build.recipes.openvino import inference_precision, plain_export, save_ir
from pipeline.runtime.schema import GRAPH

RANKING_FEEDS = 16


def _kind(name: str) -> str:
    """A MatMul's kind: its name with the layer index taken out (`layer.3/output/dense` -> `layer.*/output/dense`)."""
    return re.sub(r"(layers?|h|block)\.\d+", r"\1.*", name)


def matmul_kinds(model) -> dict[str, list[str]]:
    """The model's MatMul friendly names, grouped by kind, in graph order."""
    kinds: dict[str, list[str]] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "MatMul":
            kinds.setdefault(_kind(op.get_friendly_name()), []).append(op.get_friendly_name())
    return kinds


def _activation_quantizers(quantized) -> list[tuple[object, list[str]]]:
    """Each FakeQuantize of an activation in `quantized`, with the MatMuls it feeds."""
    found = []
    for op in quantized.get_ordered_ops():
        if op.get_type_name() != "FakeQuantize" or op.input_value(0).get_node().get_type_name() == "Constant":
            continue
        users = [t.get_node() for t in op.output(0).get_target_inputs()]
        matmuls = [u.get_friendly_name() for u in users if u.get_type_name() == "MatMul"]
        if matmuls:
            found.append((op, matmuls))
    return found


def kind_ranking(quantized, feeds: list[dict]) -> list[str]:
    """The quantized MatMul kinds, most sensitive first: the mean relative error that each activation quantizer
    adds at its own input (its output against its input, in fp32, over `feeds`), over the kind's layers. The
    error is local: what earlier layers' quantization did does not count again."""
    import openvino as ov

    quantizers = _activation_quantizers(quantized)
    probe = quantized.clone()
    twins = {op.get_friendly_name(): op for op in probe.get_ops()}
    ports = []
    for op, _ in quantizers:
        twin = twins[op.get_friendly_name()]
        ports += [twin.input_value(0), twin.output(0)]
    probe.add_outputs(ports)
    compiled = ov.Core().compile_model(probe, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    first = len(compiled.outputs) - len(ports)
    results = [compiled(feed) for feed in feeds]
    errors: dict[str, list[float]] = {}
    for i, (_, matmuls) in enumerate(quantizers):
        before, after = compiled.outputs[first + 2 * i], compiled.outputs[first + 2 * i + 1]
        error = np.mean([np.linalg.norm(r[after] - r[before]) / max(np.linalg.norm(r[before]), 1e-12) for r in results])
        for name in matmuls:
            errors.setdefault(_kind(name), []).append(float(error))
    score = {kind: float(np.mean(values)) for kind, values in errors.items()}
    return sorted(score, key=lambda kind: (-score[kind], kind))  # kinds fed by one quantizer tie: by name


def nncf_int8(model, calibration_feeds: list[dict]):
    """NNCF post-training int8 of an OpenVINO model (transformer preset), with its weights left as fp32 constants
    behind their FakeQuantizes: `kept_wide` makes the forms that the bisection tries from it."""
    import nncf
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters

    nncf.set_log_level(logging.ERROR)
    with silenced("nncf"), contextlib.redirect_stdout(io.StringIO()):  # its progress bars
        return nncf.quantize(
            model.clone(),
            nncf.Dataset(calibration_feeds),
            model_type=nncf.ModelType.TRANSFORMER,
            subset_size=len(calibration_feeds),
            advanced_parameters=AdvancedQuantizationParameters(backend_params={"compress_weights": False}),
        )


def _exported_bias(matmul, plain_ops: dict) -> None:
    """Give the Add after `matmul` its constant from the exported model (`plain_ops`: name -> op), undoing the
    bias correction NNCF made for the MatMul's quantization."""
    import openvino as ov

    for user in matmul.output(0).get_target_inputs():
        add, exported = user.get_node(), plain_ops.get(user.get_node().get_friendly_name())
        if add.get_type_name() != "Add" or exported is None or exported.get_type_name() != "Add":
            continue
        for port in range(2):
            now, then = add.input_value(port).get_node(), exported.input_value(port).get_node()
            if now.get_type_name() == "Constant" and then.get_type_name() == "Constant":
                add.input(port).replace_source_output(ov.op.Constant(then.get_data().copy()).output(0))


def kept_wide(quantized, plain, names: list[str]):
    """The int8 model to run: `quantized` (from `nncf_int8`, not changed) with the MatMuls `names` kept out of
    int8 (their input FakeQuantizes bypassed, their biases as in `plain`), and the quantized weights compressed
    to int8 constants as NNCF does."""
    from openvino._offline_transformations import compress_quantize_weights_transformation

    model = quantized.clone()
    ops = {op.get_friendly_name(): op for op in model.get_ops()}
    plain_ops = {op.get_friendly_name(): op for op in plain.get_ops()}
    for name in names:
        for port in ops[name].inputs():
            source = port.get_source_output().get_node()
            if source.get_type_name() == "FakeQuantize":
                port.replace_source_output(source.input_value(0))
        _exported_bias(ops[name], plain_ops)
    model.validate_nodes_and_infer_types()
    compress_quantize_weights_transformation(model)
    return model


def int8_with_kinds_kept(model, calibration_feeds: list[dict], passes, could_win=None) -> tuple[object, dict]:
    """NNCF int8 of `model`, keeping the fewest most sensitive MatMul kinds out of int8 with which `passes(model)`
    holds (bisection over the ranking). Returns the model (the one with most kinds kept where none passes) and
    its record: kinds and nodes kept, each try. `could_win(quantized)`, where given, runs before the bisection
    and raises to stop it (the fully quantized model is the fastest the bisection can give), and again on each
    try that misses: what the bisection tries after it keeps more kinds wide, so is slower."""
    uncompressed = nncf_int8(model, calibration_feeds)
    quantized = kept_wide(uncompressed, model, [])
    tries = [{"kept_kinds": 0, "passed": passes(quantized)}]
    kinds = matmul_kinds(model)
    if tries[0]["passed"]:
        return quantized, {"kept_kinds": [], "kept_nodes": 0, "matmuls": sum(map(len, kinds.values())), "tries": tries}
    if could_win is not None:
        could_win(quantized)
    ranking = kind_ranking(quantized, calibration_feeds[:RANKING_FEEDS])
    built = {0: quantized}

    def attempt(count: int) -> bool:
        built[count] = kept_wide(uncompressed, model, [n for k in ranking[:count] for n in kinds.get(k, [])])
        tries.append({"kept_kinds": count, "passed": passes(built[count])})
        return tries[-1]["passed"]

    low, high = 0, len(ranking)  # low misses
    if not attempt(high):
        chosen = high
    else:
        while high - low > 1:
            middle = (low + high) // 2
            if attempt(middle):
                high = middle
                continue
            low = middle
            if could_win is not None and high - low > 1:  # every try left keeps more kinds wide: slower still
                could_win(built[middle])
        chosen = high
    kept = ranking[:chosen]
    record = {
        "kept_kinds": kept,
        "kept_nodes": sum(len(kinds.get(k, [])) for k in kept),
        "matmuls": sum(map(len, kinds.values())),
        "tries": tries,
    }
    return built[chosen], record


def split_feeds(job: Job, *splits: str) -> list[list[dict]]:
    """For each of `splits` (keys of `job.texts`), one model feed a text, tokenized as the runtime does."""
    from pipeline.build.manifest import candidate_model

    probe = candidate_model(job.manifest, job.target, job.manifest.stage("optimize").output(GRAPH))
    return [[probe.feeds(probe.encode([text])) for text in job.texts[split]] for split in splits]


def development_passes(job: Job, feeds: list):
    """`passes(openvino_model, session=None)`: whether the model, compiled as the candidate runs (with the artifact
    `session` settings, where given), meets the target's development gate on the development split (`feeds`, one
    text each, against `job.reference`): `development_gate` without headroom. The search's held-out check stands
    behind it, and with ONNX Runtime's headroom (cosine min 0.997 for 0.99) MiniLM kept every MatMul kind out of
    int8."""
    import openvino as ov

    from pipeline.build.accuracy.metrics import compare, development_gate, failures
    from pipeline.build.inputs.tasks import TASKS
    from pipeline.runtime.backends.openvino import compile_config

    metric = TASKS[job.manifest.checkpoint.task].metric
    gate = development_gate(job.target.accuracy, len(feeds))

    def passes(model, session: dict | None = None) -> bool:
        compiled = ov.Core().compile_model(model, "CPU", compile_config(session))
        got = np.concatenate([compiled(feed)[compiled.outputs[0]] for feed in feeds])
        return not failures(compare(metric, job.reference, got), gate)

    return passes


@dataclasses.dataclass(frozen=True)
class OpenVinoInt8Config:
    """OpenVINO's inference precision for what stays out of int8 (None: OpenVINO's default; see
    `inference_precision`)."""

    inference_precision: str | None


class OpenVinoInt8(Recipe):
    """NNCF int8 of the plain export, calibrated on the calibration split, with the MatMul kinds kept out of int8
    that the development split needs."""

    name = "openvino-int8"
    engine = "openvino"
    quantize = "nncf"
    families = ("encoder",)
    precisions = ("int8",)
    Config = OpenVinoInt8Config
    fallback = True

    def config(self, candidate, target) -> OpenVinoInt8Config:
        """The inference precision of the float remainder (`inference_precision`)."""
        return OpenVinoInt8Config(inference_precision(candidate))

    def build(self, config: OpenVinoInt8Config, job: Job) -> Built:
        """The int8 IR in `job.work`, with the fallback's record."""
        job.work.mkdir(parents=True)
        calibration, development = split_feeds(job, "calibration", "development")
        screen = _screened(job, config.inference_precision) if job.could_win else None
        passes = development_passes(job, development)
        model, fallback = int8_with_kinds_kept(plain_export(job), calibration, passes, screen)
        return save_ir(model, job, config.inference_precision, fallback)


def _screened(job: Job, inference_precision: str | None):
    """`could_win(openvino_model)`: `job.could_win` of the model as the candidate would run it (saved as IR in
    `job.work`/screen and opened by the runtime)."""
    from pipeline.build.manifest import candidate_model

    def could_win(model) -> None:
        work = job.work / "screen"
        work.mkdir(exist_ok=True)
        built = save_ir(model, dataclasses.replace(job, work=work), inference_precision)
        job.could_win(candidate_model(job.manifest, job.target, built.graph, built.backend, built.session))

    return could_win
