"""OpenAI API requests run on a loaded artifact (pipeline.runtime): what the Ray Serve replica calls once
pipeline.serving.openai_api has parsed a request. No Ray import here; these run in a worker thread of the replica.

Each chat or completion request runs alone, on the runtime's own batching of its prompts: there is no continuous
batching across requests yet. A streamed request yields each chunk as the runtime's stream() yields its token.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator

from pipeline.serving.openai_api import (
    CHAT,
    APIError,
    EmbeddingRequest,
    GenerationRequest,
    Served,
    embeddings_answer,
    generation_answer,
    sse,
    stream_chunks,
)


def _prompts(model, request: GenerationRequest):
    """The prompt texts the runtime encodes: the conversation rendered with the chat template, or the prompts."""
    if request.route == CHAT:
        from pipeline.runtime.chat import render_chats

        return render_chats(model.spec, [list(request.conversation)], "chat")
    return list(request.prompts)


def _prepared(model, request: GenerationRequest):
    """The prompts, the runtime settings and the prompt tokens the model sees (after any cut from the left)."""
    prompts = _prompts(model, request)
    lengths = [len(e.ids) for e in model.encode(prompts, "request")]
    new_tokens = request.max_new_tokens(model.max_length, max(lengths))
    seen = sum(min(n, model.max_length - new_tokens) for n in lengths)
    return prompts, request.settings(new_tokens), seen


def _identity(request: GenerationRequest) -> tuple[str, int]:
    prefix = "chatcmpl" if request.route == CHAT else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}", int(time.time())


def generate(model, served: Served, request: GenerationRequest) -> dict:
    """The whole answer of a request that is not streamed. Raises InputError for a request the model refuses."""
    prompts, settings, prompt_tokens = _prepared(model, request)
    completions = model.generate(prompts, seed=request.seed, **settings)
    return generation_answer(request, served, *_identity(request), completions, prompt_tokens)


def start_stream(model, served: Served, request: GenerationRequest) -> Iterator[bytes]:
    """The server-sent events of a streamed request. The request is checked here, before the first event (an
    InputError for one the model refuses); a failure while streaming ends the stream with an error event."""
    prompts, settings, prompt_tokens = _prepared(model, request)
    events = model.stream(prompts, seed=request.seed, **settings)
    chunks = stream_chunks(request, served, *_identity(request), events, prompt_tokens)
    return _guarded(chunks)


def _guarded(chunks: Iterator[bytes]) -> Iterator[bytes]:
    try:
        yield from chunks
    except Exception as err:  # the status line is sent: the client learns of it in the stream
        logging.getLogger("ray.serve").error("a streamed request failed", exc_info=err)
        first = (str(err).strip().splitlines() or [""])[0]
        message = f"the model failed while streaming ({type(err).__name__}: {first})"
        yield sse(APIError(message, status=500).body())


def prompt_tokens(model, request: EmbeddingRequest) -> int:
    """The tokens an embeddings request's texts take, as the model encodes them (special tokens included)."""
    return sum(len(e.ids) for e in model.encode(list(request.texts)))


def embeddings(model, served: Served, request: EmbeddingRequest, vectors) -> dict:
    return embeddings_answer(request, served, vectors, prompt_tokens(model, request))
