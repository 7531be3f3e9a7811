"""Triton Python-backend model: the first step of an exported ensemble, TEXT to the graph's int64 inputs, with
the artifact's tokenizer (./tokenizer.json) and its settings (./spec.json: overlong policy, padding, inputs).

Each request is padded on its own, so the graph's dynamic batcher batches requests of equal length. A request
with an empty or non-text input gets its own INVALID_ARG error. Written by `pipeline export triton`.
"""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from pipeline.errors import PipelineError
from pipeline.runtime.encoder import EncoderInputs
from pipeline.runtime.schema import TOKENIZER


class TritonPythonModel:
    def initialize(self, args):
        here = Path(__file__).resolve().parent
        spec = json.loads((here / "spec.json").read_text())
        self.inputs = EncoderInputs(here / TOKENIZER, spec, spec["inputs"])

    def execute(self, requests):
        responses = []
        for request in requests:
            values = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            try:
                texts = [v.decode("utf-8") for v in values if isinstance(v, bytes)]
                if len(texts) != len(values) or not all(texts):
                    raise ValueError("TEXT must hold non-empty UTF-8 strings, one per row")
                feeds = self.inputs.feeds(self.inputs.encode(texts))
            except (ValueError, PipelineError) as err:
                responses.append(
                    pb_utils.InferenceResponse(
                        output_tensors=[], error=pb_utils.TritonError(str(err), pb_utils.TritonError.INVALID_ARG)
                    )
                )
                continue
            tensors = [pb_utils.Tensor(name, array) for name, array in feeds.items()]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
