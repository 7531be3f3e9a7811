"""Recipe `openvino`: the plain export (not ONNX Runtime's fused graph) converted to OpenVINO IR and compiled at
the candidate's inference precision (fp32, or bf16 on hosts with the flags). NNCF int8 is `openvino_int8`."""

from __future__ import annotations

import dataclasses

from pipeline.recipes.base import Built, Job, Recipe

# A candidate's precision as OpenVINO's inference precision hint; others run at OpenVINO's default.
OV_PRECISION = {"fp32": "f32", "bf16": "bf16"}


def plain_export(job: Job):
    """The export stage's plain graph as an OpenVINO model."""
    import openvino as ov

    return ov.convert_model(str(job.manifest.stage("export").output("model.onnx")))


def save_ir(model, job: Job, inference_precision: str | None, fallback: dict | None = None) -> Built:
    """Write `model` as IR (model.xml, model.bin) into `job.work`; it runs at `inference_precision`."""
    import openvino as ov

    ov.save_model(model, str(job.work / "model.xml"), compress_to_fp16=False)
    session = {"inference_precision": inference_precision} if inference_precision else {}
    return Built(job.work / "model.xml", "openvino", session, fallback)


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
        return OpenVinoConfig(OV_PRECISION.get(candidate.precision))

    def build(self, config: OpenVinoConfig, job: Job) -> Built:
        """The plain export as IR in `job.work`."""
        job.work.mkdir(parents=True)
        return save_ir(plain_export(job), job, config.inference_precision)
