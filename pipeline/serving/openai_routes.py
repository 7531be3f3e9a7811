"""OpenAI API requests run on a loaded artifact (pipeline.runtime): what the Ray Serve replica calls once
pipeline.serving.openai_api has parsed a request. No Ray import here; these run in a worker thread of the replica.

Where the decoder's cache layout allows it ("shared": GroupQueryAttention graphs), a replica's chat and completion
requests go through one ContinuousBatcher (pipeline.runtime.continuous): each joins the running batch and gets the
tokens it would get alone. Elsewhere ("concat") each request runs alone, on the runtime's own batching of its
prompts. A streamed request yields each chunk as its token comes; a client that goes away frees its slot.
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

# Requests a replica decodes together (at most the artifact's batch size): each slot holds a max_length cache.
SLOTS = 16


def continuous_batcher(model, slots: int | None = None):
    """A ContinuousBatcher over a decoder whose cache layout lets requests join a running batch, else None (each
    request then runs alone). `slots`: requests decoding together (default: SLOTS, at most the artifact's batch
    size)."""
    from pipeline.runtime.continuous import ContinuousBatcher

    if model.task != "text-generation" or model.spec.get("cache") != "shared" or not model.right_padded:
        return None
    return ContinuousBatcher(model, max_slots=slots or min(SLOTS, model.batch_size))


def _submitted(batcher, request: GenerationRequest, settings: dict) -> list:
    """The request's prompts submitted to the batcher, each seeded by its index as generate() seeds it."""
    submitted = []
    try:
        if request.route == CHAT:
            tools = list(request.tools) if request.tools else None
            return [batcher.submit(messages=list(request.conversation), tools=tools, seed=request.seed, **settings)]
        for i, prompt in enumerate(request.prompts):
            submitted.append(batcher.submit(prompt, index=i, seed=request.seed, **settings))
        return submitted
    except BaseException:
        for done in submitted:  # a later prompt was refused: the request is refused as a whole
            done.cancel()
        raise


def _events(requests: list):
    """Each request's events in turn (they run together in the batcher); closed early, frees their slots."""
    try:
        for request in requests:
            yield from request
    finally:
        for request in requests:
            request.cancel()


def _prompts(model, request: GenerationRequest):
    """The prompt texts the runtime encodes: the conversation rendered with the chat template (and the request's
    tools, refused where the template does not read them), or the prompts."""
    if request.route == CHAT:
        from pipeline.runtime.chat import render_chats, template_uses_tools

        if request.tools and not template_uses_tools(model.spec):
            raise APIError(
                "tools are not supported by this model: the artifact's chat template does not use tools, so they "
                "would be ignored; send the request without tools",
                "tools",
            )
        tools = list(request.tools) if request.tools else None
        return render_chats(model.spec, [list(request.conversation)], "chat", tools)
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


def generate(model, served: Served, request: GenerationRequest, batcher=None, timing=None) -> dict:
    """The whole answer of a request that is not streamed (through `batcher` where there is one). Raises
    InputError for a request the model refuses. `timing` (pipeline.serving.metrics.Timing) times the tokens of
    its first prompt as the batcher makes them."""
    prompts, settings, prompt_tokens = _prepared(model, request)
    if batcher is None:
        completions = model.generate(prompts, seed=request.seed, **settings)
    else:
        requests = _submitted(batcher, request, settings)
        try:
            # The other prompts' tokens queue up meanwhile: read in turn, their gaps would not be the engine's.
            for _ in timing.timed(requests[0]) if timing else ():
                pass
            completions = [r.result() for r in requests]
        finally:
            for r in requests:
                r.cancel()
    return generation_answer(request, served, *_identity(request), completions, prompt_tokens)


def start_stream(model, served: Served, request: GenerationRequest, batcher=None, timing=None) -> Iterator[bytes]:
    """The server-sent events of a streamed request (through `batcher` where there is one). The request is checked
    here, before the first event (an InputError for one the model refuses); a failure while streaming ends the
    stream with an error event. `timing` (pipeline.serving.metrics.Timing) times its tokens and counts them."""
    prompts, settings, prompt_tokens = _prepared(model, request)
    if batcher is None:
        events = model.stream(prompts, seed=request.seed, **settings)
    else:
        events = _events(_submitted(batcher, request, settings))
    if timing is not None:
        events = timing.timed(events, prompt_tokens)
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
