"""Triton Python-backend model: runs the artifact beside it (./<model>/<version>/<target>) through
pipeline.runtime.load, which verifies every file's hash first.

Triton's dynamic batcher hands `execute` several requests at once; their texts run as one batch. A request with
an empty or non-text input gets its own INVALID_ARG error; the others are answered. Where the batch fails on one
request's input (an overlong text, a tokenizer that panics), each request runs alone, so only that one fails. Written by
`pipeline export triton`; needs `pipeline` (the runtime) in the Python environment Triton runs it with.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.errors import PipelineError
from pipeline.runtime import load


def request_texts(request) -> list[str]:
    """The request's TEXT as strings; a ValueError names what is wrong."""
    values = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
    texts = []
    for value in values:
        try:
            text = value.decode("utf-8") if isinstance(value, bytes) else None
        except UnicodeDecodeError:
            text = None
        if not text:
            raise ValueError("TEXT must hold non-empty UTF-8 strings, one per row")
        texts.append(text)
    return texts


def error_response(message: str, internal: bool = False):
    """An error answer: INVALID_ARG (HTTP 400) for a bad request, INTERNAL (500) for a failure of ours."""
    # TritonError exists only once the stub runs the model, not when it imports this file to auto-complete.
    code = pb_utils.TritonError.INTERNAL if internal else pb_utils.TritonError.INVALID_ARG
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.output = config["output"][0]["name"]
        [manifest] = Path(__file__).resolve().parent.glob("*/*/*/manifest.json")
        self.model = load(manifest.parent)
        self.generates = self.output == "TEXT_OUT"

    def _run(self, texts: list[str]):
        if self.generates:
            return np.array([c.text.encode() for c in self.model.generate(texts)], dtype=np.object_)[:, None]
        return np.asarray(self.model.run(texts), dtype=np.float32)

    def _response(self, texts: list[str]):
        """One request's answer: its output, or its own error (INVALID_ARG for its input, INTERNAL otherwise)."""
        try:
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(self.output, self._run(texts))])
        except PipelineError as err:
            return error_response(str(err).splitlines()[0])
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # a tokenizer's panic is a BaseException: it fails this request alone
            return error_response(f"the model failed on this request ({type(err).__name__})", internal=True)

    def execute(self, requests):
        texts, spans, responses = [], {}, [None] * len(requests)
        for index, request in enumerate(requests):
            try:
                mine = request_texts(request)
            except ValueError as err:
                responses[index] = error_response(str(err))
                continue
            spans[index] = (len(texts), len(texts) + len(mine))
            texts.extend(mine)
        if not texts:
            return responses
        try:
            results = self._run(texts)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # one request's input failed the batch: each runs alone and gets its own answer
            for index, (start, stop) in spans.items():
                responses[index] = self._response(texts[start:stop])
            return responses
        for index, (start, stop) in spans.items():
            tensor = pb_utils.Tensor(self.output, results[start:stop])
            responses[index] = pb_utils.InferenceResponse(output_tensors=[tensor])
        return responses

    def finalize(self):
        self.model = None
