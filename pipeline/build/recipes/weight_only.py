"""Recipe `weight-only`: a decoder's MatMul weights in int8 or int4 blocks (ONNX Runtime's MatMulNBits),
activations fp32. Blocks are symmetric, with integer zero points, or (4-bit) with float minimums
(pipeline.build.passes.block_minimum); the LM head, and the layers a bisection widens, stay at the target's head
bits."""

from __future__ import annotations

import dataclasses

from pipeline.build.inputs.targets import Quantize
from pipeline.build.recipes.base import Built, Job, Recipe, optimized_graph
from pipeline.runtime.schema import GRAPH


@dataclasses.dataclass(frozen=True)
class WeightOnlyConfig:
    """The candidate's bits, blocks and block size (the [quantize] block size where it sets none), the target's
    accuracy level and head bits, and which layers a missing candidate's bisection keeps wide."""

    bits: int
    blocks: str
    block_size: int
    accuracy_level: int
    head_bits: int
    bisect_layers: str


class WeightOnly(Recipe):
    """MatMulNBits weights; bisected over layers where it misses and its bits are not the head's."""

    name = "weight-only"
    engine = "onnxruntime"
    quantize = "weight_only"
    families = ("decoder", "speech", "text2text")  # two graphs: the decoder, search/encoder_decoder.py
    precisions = ("int8", "int4")
    Config = WeightOnlyConfig
    fallback = True

    def config(self, candidate, target) -> WeightOnlyConfig:
        """The candidate's block settings with the target's accuracy level and head bits."""
        return WeightOnlyConfig(
            bits=candidate.bits,
            blocks=candidate.blocks,
            block_size=candidate.block_size or target.quantize.block_size,
            accuracy_level=target.quantize.accuracy_level,
            head_bits=target.quantize.head_bits,
            bisect_layers=candidate.bisect_layers,
        )

    def build(self, config: WeightOnlyConfig, job: Job) -> Built:
        """The optimized graph's MatMul weights in blocks, into `job.work` (`job.wide` at head bits)."""
        from pipeline.build.passes.weight_only import quantize_weight_only

        job.work.mkdir(parents=True)
        settings = Quantize(
            mode="weight_only",
            bits=config.bits,
            blocks=config.blocks,
            block_size=config.block_size,
            accuracy_level=config.accuracy_level,
            head_bits=config.head_bits,
        )
        quantize_weight_only(optimized_graph(job), job.work / GRAPH, settings, wide=job.wide)
        return Built(job.work / GRAPH)

    def row(self, candidate) -> dict:
        """The candidate's bits, blocks and block size."""
        return {"bits": candidate.bits, "blocks": candidate.blocks, "block_size": candidate.block_size}

    def bisection(self, config: WeightOnlyConfig) -> str:
        """The candidate's bisect_layers, where widening a layer changes it (bits below the head's)."""
        return config.bisect_layers if config.bits != config.head_bits else "none"
