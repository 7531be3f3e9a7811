"""OpenAI's HTTP API over an artifact: which route fits which artifact, what a request may hold, and the answers
and stream chunks OpenAI's clients read. Plain functions over parsed JSON; no Ray or Starlette import here
(pipeline.serving.ray_serve routes requests to them, pipeline.serving.openai_routes runs them on the model).

    GET  /v1/models              every artifact: its id, <model name>/<version> from the manifest
    POST /v1/chat/completions    text-generation: messages rendered with the checkpoint's chat template
    POST /v1/completions         text-generation: prompt (a string or a list of them) continued as it is
    POST /v1/embeddings          feature-extraction: input (a string or a list of them), float or base64 vectors

A parameter the runtime cannot honour is refused with a 400 naming it, never ignored: an unknown key, n other
than 1, logprobs, penalties other than 0. Each refusal is OpenAI's error shape,
{"error": {"message", "type", "param", "code"}}. A chat's messages, tools, tool_choice and response_format are
checked in pipeline.serving.openai_tools, which also reads the tool calls out of its answer; the refusal itself,
APIError, is pipeline.serving.openai_errors'.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import math

from pipeline.serving.openai_errors import APIError
from pipeline.serving.openai_tools import (
    check_response_format,
    conversation,
    extract_tool_calls,
    parse_tools,
    streamed_tool_calls,
)

MODELS, CHAT, COMPLETIONS, EMBEDDINGS = "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
# Each route: its method and the artifact tasks it serves.
ROUTES = {
    MODELS: ("GET", None),
    CHAT: ("POST", ("text-generation",)),
    COMPLETIONS: ("POST", ("text-generation",)),
    EMBEDDINGS: ("POST", ("feature-extraction",)),
}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 4  # OpenAI's limit on stop strings
FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
CHAT_ONLY = {"tools", "tool_choice"}  # checked by pipeline.serving.openai_tools, as is response_format
# Parameters OpenAI defines that the runtime does not implement: accepted only at the value that changes nothing.
NEUTRAL = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logprobs": (False,),
    "logit_bias": ({},),
}
GENERATION = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user")
ACCEPTED = {
    CHAT: {*GENERATION, "messages", "max_completion_tokens", "response_format", *CHAT_ONLY, *NEUTRAL},
    COMPLETIONS: {*GENERATION, "prompt", "echo", "best_of", "suffix", "response_format", *NEUTRAL},
    EMBEDDINGS: {"model", "input", "encoding_format", "user", "dimensions"},
}
COMPLETION_NEUTRAL = {"echo": (False,), "best_of": (1,), "suffix": ("",)}


@dataclasses.dataclass(frozen=True)
class Served:
    """What the API says about the artifact it serves: its model id, task, token limit and build time."""

    id: str
    task: str
    max_length: int
    created: int

    @classmethod
    def from_manifest(cls, manifest: dict) -> Served:
        created = manifest.get("created_at")
        try:
            created = int(datetime.datetime.fromisoformat(created).timestamp()) if created else 0
        except ValueError:
            created = 0
        model = manifest["model"]
        return cls(f"{manifest['model_name']}/{manifest['version']}", model["task"], int(model["max_length"]), created)

    def routes(self) -> list[str]:
        return [f"{m} {path}" for path, (m, tasks) in ROUTES.items() if tasks is None or self.task in tasks]


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A parsed chat or completion request: one conversation (chat) or its prompts (completion), and its
    settings. `max_tokens` None: the rest of the context (chat) or 16 (completion). `tools`: the chat's tools as
    its template takes them, or None."""

    route: str
    conversation: tuple | None
    prompts: tuple[str, ...] | None
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: tuple[str, ...] | None
    stream: bool
    include_usage: bool
    tools: tuple[dict, ...] | None = None

    def settings(self, max_new_tokens: int) -> dict:
        """The runtime's settings (Generator.stream's keywords) for this request."""
        stop = list(self.stop) if self.stop else None
        return {"max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p, "stop": stop}

    def max_new_tokens(self, max_length: int, prompt_tokens: int) -> int:
        if self.max_tokens is not None:
            return self.max_tokens
        if self.route == COMPLETIONS:
            return min(COMPLETION_DEFAULT_MAX_TOKENS, max_length - 1)
        return max(1, min(max_length - 1, max_length - prompt_tokens))


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    texts: tuple[str, ...]
    base64: bool


def check_route(served: Served, method: str, path: str) -> str:
    """The route of a request, else an APIError: 404 for a path not served (or not for this artifact), 405 for a
    method the route does not take."""
    path = path.rstrip("/") or "/"
    serves = f"this artifact ({served.task}) serves {', '.join(served.routes())} and POST /"
    if path not in ROUTES:
        raise APIError(f"no route {method} {path}; {serves}", status=404, code="unknown_url")
    wanted, tasks = ROUTES[path]
    if tasks is not None and served.task not in tasks:
        raise APIError(f"{path} serves {' and '.join(tasks)} artifacts; {serves}", status=404, code="unsupported_route")
    if method != wanted:
        raise APIError(f"{method} {path} is not served; use {wanted} {path}", status=405, code="method_not_allowed")
    return path


def read_json(body: bytes) -> dict:
    try:
        payload = json.loads(body)
    except RecursionError:
        raise APIError("the request's JSON nests too deeply") from None
    except ValueError as err:
        raise APIError(f"the request body is not JSON ({err})") from None
    if not isinstance(payload, dict):
        raise APIError("the request body is not a JSON object")
    return payload


def _check_keys(payload: dict, route: str, served: Served) -> dict:
    """The payload's set parameters (a null is unset, as OpenAI takes it), after refusing unknown keys, unsupported
    values of known ones, and a model other than the one served (404 model_not_found)."""
    given = {k: v for k, v in payload.items() if v is not None}
    unknown = sorted(set(payload) - ACCEPTED[route])
    if unknown:
        raise APIError(f"unknown or unsupported parameter {unknown[0]!r} for {route}; remove it", param=unknown[0])
    neutral = NEUTRAL | COMPLETION_NEUTRAL
    for key in sorted(set(given) & set(neutral)):
        if not any(type(given[key]) is type(v) and given[key] == v for v in neutral[key]):
            allowed = " or ".join(json.dumps(v) for v in neutral[key])
            raise APIError(f"{key}={json.dumps(given[key])} is not supported here; omit it or pass {allowed}", key)
    if "model" in given and given["model"] != served.id:
        raise APIError(
            f"the model {given['model']!r} does not exist here; this server serves {served.id!r}",
            param="model",
            status=404,
            code="model_not_found",
        )
    return given


def _texts(value, param: str, max_texts: int) -> tuple[str, ...]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise APIError(f"{param} must be a string or a non-empty list of strings (token ids are not served)", param)
    if len(texts) > max_texts:
        raise APIError(f"{param} holds {len(texts)} texts, over the limit of {max_texts} a request", param)
    for i, text in enumerate(texts):
        if not text.strip():
            raise APIError(f"{param}[{i}] is empty; send text in every entry", param)
    return tuple(texts)


def _number(given: dict, key: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = given.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise APIError(f"{key} must be a number, got {json.dumps(value)}", key)
    if value < low or value > high or (low_open and value == low):
        raise APIError(
            f"{key}={value} is out of range; pass {'more than' if low_open else 'from'} {low} to {high}", key
        )
    return float(value)


def _int(given: dict, key: str, low: int, high: int) -> int | None:
    value = given.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise APIError(f"{key}={json.dumps(value)} must be a whole number from {low} to {high}", key)
    return value


def _stop(given: dict) -> tuple[str, ...] | None:
    stop = given.get("stop")
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise APIError(f"stop must be a non-empty string or a list of 1 to {MAX_STOPS} of them", "stop")
    return tuple(stops) or None


def _stream(given: dict) -> tuple[bool, bool]:
    stream, options = given.get("stream", False), given.get("stream_options")
    if not isinstance(stream, bool):
        raise APIError(f"stream must be true or false, got {json.dumps(stream)}", "stream")
    if options is None:
        return stream, False
    if not stream:
        raise APIError("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        extra = sorted(set(options) - {"include_usage"}) if isinstance(options, dict) else []
        raise APIError(
            'stream_options takes {"include_usage": true|false} only',
            f"stream_options.{extra[0]}" if extra else "stream_options",
        )
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise APIError("stream_options.include_usage must be true or false", "stream_options.include_usage")
    return stream, usage


def parse_generation(route: str, body: bytes, served: Served, max_texts: int) -> GenerationRequest:
    """A chat (CHAT) or completion (COMPLETIONS) request's body parsed and checked, else an APIError naming the
    parameter at fault."""
    given = _check_keys(read_json(body), route, served)
    needs = "messages" if route == CHAT else "prompt"
    if needs not in given:
        raise APIError(f"{needs} is required", needs)
    if "max_tokens" in given and "max_completion_tokens" in given:
        raise APIError("pass max_tokens or max_completion_tokens, not both", "max_tokens")
    limit = "max_completion_tokens" if "max_completion_tokens" in given else "max_tokens"
    if given.get("n", 1) != 1 or isinstance(given.get("n"), bool):
        raise APIError(f"n={json.dumps(given['n'])} is not supported; one choice a request (n=1)", "n")
    if "user" in given and not isinstance(given["user"], str):
        raise APIError("user must be a string", "user")
    stream, include_usage = _stream(given)

    check_response_format(given)
    return GenerationRequest(
        route=route,
        conversation=conversation(given["messages"]) if route == CHAT else None,
        prompts=_texts(given["prompt"], "prompt", max_texts) if route == COMPLETIONS else None,
        max_tokens=_int(given, limit, 1, served.max_length - 1),
        temperature=_number(given, "temperature", 0, 2),
        top_p=_number(given, "top_p", 0, 1, low_open=True),
        seed=_int(given, "seed", 0, 2**64 - 1),
        stop=_stop(given),
        stream=stream,
        include_usage=include_usage,
        tools=parse_tools(given) if route == CHAT else None,
    )


def parse_embeddings(body: bytes, served: Served, max_texts: int) -> EmbeddingRequest:
    """An embeddings request's body parsed and checked, else an APIError naming the parameter at fault."""
    given = _check_keys(read_json(body), EMBEDDINGS, served)
    if "input" not in given:
        raise APIError("input is required", "input")
    if "dimensions" in given:
        raise APIError("dimensions is not supported: the artifact's vectors have one size; omit it", "dimensions")
    encoding = given.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise APIError(f"encoding_format {json.dumps(encoding)} is not served; pass float or base64", "encoding_format")
    return EmbeddingRequest(_texts(given["input"], "input", max_texts), encoding == "base64")


def models_answer(served: Served) -> dict:
    model = {"id": served.id, "object": "model", "created": served.created, "owned_by": "pipeline"}
    return {"object": "list", "data": [model]}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    total = prompt_tokens + completion_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": total}


def generation_answer(request: GenerationRequest, served: Served, ident: str, created: int, completions, prompt_tokens):
    """The chat.completion or text_completion answer for `completions` (the runtime's, one a prompt)."""
    choices = []
    for i, completion in enumerate(completions):
        choice = {"index": i, "finish_reason": FINISH[completion.finish_reason], "logprobs": None}
        if request.route == CHAT:
            content, calls = extract_tool_calls(completion.text, request.tools)
            choice["message"] = {"role": "assistant", "content": content}
            if calls:
                choice["message"]["tool_calls"], choice["finish_reason"] = calls, "tool_calls"
        else:
            choice["text"] = completion.text
        choices.append(choice)
    kind = "chat.completion" if request.route == CHAT else "text_completion"
    generated = sum(len(c.token_ids) for c in completions)
    return {
        "id": ident,
        "object": kind,
        "created": created,
        "model": served.id,
        "choices": choices,
        "usage": usage(prompt_tokens, generated),
    }


def sse(data: dict) -> bytes:
    """One server-sent event holding `data` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


def stream_chunks(request: GenerationRequest, served: Served, ident: str, created: int, events, prompt_tokens: int):
    """Server-sent events for the runtime's stream `events` (each with index, text, finish_reason): a chunk per
    event that adds text, a chunk with each prompt's finish_reason, the usage where asked for, then [DONE]. A chat
    given tools whose whole text held tool calls sends them in one delta before the finish chunk ("tool_calls")."""

    chat = request.route == CHAT
    texts: dict[int, list[str]] = {}
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": ident, "object": kind, "created": created, "model": served.id}

    def chunk(index: int, text: str | None, finish: str | None, calls: list | None = None) -> bytes:
        if chat:
            delta = {"tool_calls": calls} if calls else {} if text is None else {"content": text}
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
        return sse({**head, "choices": [choice]})

    if chat:
        yield sse(
            {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
        )
    generated = 0
    for event in events:
        generated += 1
        if event.text:
            yield chunk(event.index, event.text, None)
            if request.tools:
                texts.setdefault(event.index, []).append(event.text)
        if event.finish_reason:
            calls = streamed_tool_calls("".join(texts.get(event.index, [])), request.tools)
            if calls:
                yield chunk(event.index, None, None, calls)
            yield chunk(event.index, None, "tool_calls" if calls else FINISH[event.finish_reason])
    if request.include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompt_tokens, generated)})
    yield DONE


def embeddings_answer(request: EmbeddingRequest, served: Served, vectors, prompt_tokens: int) -> dict:
    """The embeddings answer: each vector as floats, or as base64 of its little-endian float32 bytes."""
    import numpy as np

    data = []
    for i, vector in enumerate(vectors):
        values = np.asarray(vector, dtype="<f4")
        embedding = base64.b64encode(values.tobytes()).decode() if request.base64 else values.tolist()
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    tokens = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": served.id, "usage": tokens}
