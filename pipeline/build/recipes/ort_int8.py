"""Recipes `ort-int8-dynamic` and `ort-int8-static`: ONNX Runtime int8 of the optimized encoder graph with the
target's [quantize] settings, its smoothing and its sensitivity fallback (pipeline.build.search.int8), judged
against the fp32 graph on the development split."""

from __future__ import annotations

import dataclasses

from pipeline.build.inputs.targets import Quantize
from pipeline.build.recipes.base import Built, Job, Recipe, optimized_graph
from pipeline.runtime.schema import GRAPH

# What the row's `fallback` shows of the quantize stage's metrics.
FALLBACK_KEYS = ("quantized_nodes", "fp32_nodes", "smoothed_nodes", "smooth_alpha", "smooth_alpha_scan", "met_headroom")


@dataclasses.dataclass(frozen=True)
class OrtInt8Config:
    """The target's [quantize] settings with the candidate's mode ("dynamic" or "static")."""

    settings: Quantize


class OrtInt8(Recipe):
    """int8 in `mode` ("dynamic": activations quantized at run time; "static": ranges calibrated on text)."""

    engine = "onnxruntime"
    families = ("encoder", "speech", "text2text")  # two graphs: dynamic only, search/encoder_decoder.py
    precisions = ("int8",)
    Config = OrtInt8Config
    fallback = True

    def __init__(self, mode: str):
        self.name = f"ort-int8-{mode}"
        self.quantize = mode

    def config(self, candidate, target) -> OrtInt8Config:
        """The target's [quantize] settings in this recipe's mode."""
        return OrtInt8Config(dataclasses.replace(target.quantize, mode=self.quantize))

    def build(self, config: OrtInt8Config, job: Job) -> Built:
        """Quantize with the fallback into `job.work`; where the fallback's budget misses, its last graph (the
        search judges it at the target's own thresholds)."""
        from pipeline.build.search.int8 import int8_with_fallback

        job.work.mkdir(parents=True)
        calibration, development = job.texts["calibration"], job.texts["development"]
        metrics = int8_with_fallback(
            job.manifest,
            job.target,
            config.settings,
            calibration,
            optimized_graph(job),
            job.work,
            development,
            strict=False,
            could_win=job.could_win,
        )
        return Built(job.work / GRAPH, fallback={k: metrics[k] for k in FALLBACK_KEYS})
