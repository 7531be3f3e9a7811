"""Recipe `openvino`: the plain export (not ONNX Runtime's fused graph) converted to OpenVINO IR and compiled at
the candidate's inference precision (fp32, or bf16 on hosts with the flags). NNCF int8 is `openvino_int8`."""

from __future__ import annotations

import dataclasses

from pipeline.build.recipes.base import Built, Job, Recipe
from pipeline.runtime.schema import GRAPH, OPENVINO_GRAPH

# A candidate's precision as OpenVINO's inference precision hint; others: see `inference_precision`.
OV_PRECISION = {"fp32": "f32", "bf16": "bf16"}


def inference_precision(candidate) -> str | None:
    """What a candidate's model runs its float ops at: the candidate's precision where it is one (fp32, bf16). An
    int8 candidate's float remainder gets "f32" where that is this build host's default, so that a host whose
    default is bf16 does not run in bf16 what was validated in f32; else None, OpenVINO's default (bf16 where the
    CPU has it natively, f32 elsewhere), never less exact than what was validated."""
    if candidate.precision in OV_PRECISION:
        return OV_PRECISION[candidate.precision]
    import openvino as ov

    default = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name()
    return "f32" if default == "f32" else None


def plain_export(job: Job):
    """The export stage's plain graph as an OpenVINO model."""
    import openvino as ov

    return ov.convert_model(str(job.manifest.stage("export").output(GRAPH)))


def save_ir(model, job: Job, inference_precision: str | None, fallback: dict | None = None) -> Built:
    """Write `model` as IR (model.xml, model.bin) into `job.work`; it runs at `inference_precision`."""
    import openvino as ov

    ov.save_model(model, str(job.work / OPENVINO_GRAPH), compress_to_fp16=False)
    session = {"inference_precision": inference_precision} if inference_precision else {}
    return Built(job.work / OPENVINO_GRAPH, "openvino", session, fallback)


@dataclasses.dataclass(frozen=True)
class OpenVinoConfig:
    """OpenVINO's inference precision ("f32" or "bf16")."""

    inference_precision: str | None


class OpenVino(Recipe):
    """The plain export, compiled by OpenVINO at the candidate's precision."""

    name = "openvino"
    engine = "openvino"
    quantize = "none"
    families = ("encoder",)
    precisions = ("fp32", "bf16")
    Config = OpenVinoConfig

    def config(self, candidate, target) -> OpenVinoConfig:
        """The candidate's precision as OpenVINO's inference precision."""
        return OpenVinoConfig(inference_precision(candidate))

    def build(self, config: OpenVinoConfig, job: Job) -> Built:
        """The plain export as IR in `job.work`."""
        job.work.mkdir(parents=True)
        return save_ir(plain_export(job), job, config.inference_precision)
