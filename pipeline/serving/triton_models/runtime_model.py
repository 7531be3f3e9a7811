"""Triton Python-backend model: runs the artifact beside it (./<model>/<version>/<target>) through
pipeline.runtime.load, which verifies every file's hash first.

Its one input is TEXT (UTF-8 strings), IMAGE (an image file's bytes) or AUDIO (a PCM WAV file's bytes), one item a
row, as the export's config says for the artifact's task; each file is bounded in bytes (and a clip in seconds)
before it is decoded. Triton's dynamic batcher hands `execute` several requests at once; their items run as one
batch. A request with an empty or undecodable input gets its own INVALID_ARG error; the others are answered. Where
the batch fails on one request's input (an overlong text, a picture that is no image, a tokenizer that panics), each
request runs alone, so only that one fails. Written by `pipeline export triton`; needs `pipeline` (the runtime) in
the Python environment Triton runs it with.
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from pipeline.errors import InputError, PipelineError
from pipeline.runtime import load
from pipeline.runtime.audio import read_wav
from pipeline.serving.requests import MAX_AUDIO_SECONDS, MAX_FILE_BYTES, run_model


def _item(value, kind: str):
    """One row of the input as the runtime takes it; a ValueError names what is wrong."""
    if not isinstance(value, bytes) or not value:
        raise ValueError(f"{kind} must hold one non-empty value a row (bytes, or a UTF-8 string for TEXT)")
    if kind == "TEXT":
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("TEXT must hold UTF-8 strings, one per row") from None
    if len(value) > MAX_FILE_BYTES:
        raise ValueError(
            f"an {kind} row holds {len(value)} bytes, over the limit of {MAX_FILE_BYTES}; send a smaller file"
        )
    if kind == "AUDIO":
        try:
            return read_wav(value, max_bytes=MAX_FILE_BYTES, max_seconds=MAX_AUDIO_SECONDS)
        except InputError as err:
            raise ValueError(f"AUDIO: {str(err).splitlines()[0]}") from None
    return value  # an image file's bytes: the runtime decodes them, bounding its pixels from the header


def request_items(request, kind: str) -> list:
    """The request's input rows, as the runtime takes them; a ValueError names what is wrong."""
    values = pb_utils.get_input_tensor_by_name(request, kind).as_numpy().reshape(-1)
    return [_item(value, kind) for value in values]


def error_response(message: str, internal: bool = False):
    """An error answer: INVALID_ARG (HTTP 400) for a bad request, INTERNAL (500) for a failure of ours."""
    # TritonError exists only once the stub runs the model, not when it imports this file to auto-complete.
    code = pb_utils.TritonError.INTERNAL if internal else pb_utils.TritonError.INVALID_ARG
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.input, self.output = config["input"][0]["name"], config["output"][0]["name"]
        [manifest] = Path(__file__).resolve().parent.glob("*/*/*/manifest.json")
        self.model = load(manifest.parent)

    def _run(self, items: list):
        results = run_model(self.model, items)
        if self.output == "TEXT_OUT":
            return np.array([text.encode() for text in results], dtype=np.object_)[:, None]
        return np.asarray(results, dtype=np.float32)

    def _response(self, items: list):
        """One request's answer: its output, or its own error (INVALID_ARG for its input, INTERNAL otherwise)."""
        try:
            return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(self.output, self._run(items))])
        except PipelineError as err:
            return error_response(str(err).splitlines()[0])
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as err:  # a tokenizer's panic is a BaseException: it fails this request alone
            return error_response(f"the model failed on this request ({type(err).__name__})", internal=True)

    def execute(self, requests):
        items, spans, responses = [], {}, [None] * len(requests)
        for index, request in enumerate(requests):
            try:
                mine = request_items(request, self.input)
            except ValueError as err:
                responses[index] = error_response(str(err))
                continue
            spans[index] = (len(items), len(items) + len(mine))
            items.extend(mine)
        if not items:
            return responses
        try:
            results = self._run(items)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # one request's input failed the batch: each runs alone and gets its own answer
            for index, (start, stop) in spans.items():
                responses[index] = self._response(items[start:stop])
            return responses
        for index, (start, stop) in spans.items():
            tensor = pb_utils.Tensor(self.output, results[start:stop])
            responses[index] = pb_utils.InferenceResponse(output_tensors=[tensor])
        return responses

    def finalize(self):
        self.model = None
