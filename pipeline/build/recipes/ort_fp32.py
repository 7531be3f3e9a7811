"""Recipe `ort-fp32`: the optimized fp32 graph as it is, on ONNX Runtime, for encoders and decoders."""

from __future__ import annotations

import dataclasses

from pipeline.build.recipes.base import Built, Job, Recipe, optimized_graph
from pipeline.runtime.schema import GRAPH


@dataclasses.dataclass(frozen=True)
class OrtFp32Config:
    """Nothing to set: the graph is the optimize stage's."""


class OrtFp32(Recipe):
    """The optimized fp32 graph, copied (with its data file) into the work folder."""

    name = "ort-fp32"
    engine = "onnxruntime"
    quantize = "none"
    families = ("encoder", "decoder", "speech", "text2text")  # two graphs: search/encoder_decoder.py
    precisions = ("fp32",)
    Config = OrtFp32Config

    def config(self, candidate, target) -> OrtFp32Config:
        """The (empty) config."""
        return OrtFp32Config()

    def build(self, config: OrtFp32Config, job: Job) -> Built:
        """Copy the optimized graph into `job.work`."""
        from pipeline.build.onnx_files import copy_graph

        job.work.mkdir(parents=True)
        copy_graph(optimized_graph(job), job.work / GRAPH)
        return Built(job.work / GRAPH)
