"""What a serving request may hold, and how its body and texts are read: the limits a server applies to each
request (body size, texts a request, the time a body may take to arrive, bodies read at once) and the one-line
errors a client gets when it breaks one. Shared by the Ray Serve application; no Ray or Starlette import here.
"""

from __future__ import annotations

import json
import math

from pipeline.errors import InputError

MAX_BODY_BYTES = 1 << 20
MAX_TEXTS = 256
BODY_TIMEOUT_S = 10.0
# Bodies a replica reads at once (one more is answered 503 at once); it takes as many requests in flight beyond a
# batch's places, so that clients slow to send a body cannot take those.
MAX_BODY_READS = 128
USAGE = 'POST JSON {"texts": ["a text", ...]}'
AUDIO_USAGE = "POST the bytes of one PCM WAV file (Content-Type: audio/wav)"
IMAGE_USAGE = "POST the bytes of one image file (PNG, JPEG, ...; Content-Type: image/png or the like)"
MAX_AUDIO_SECONDS = 600.0  # a request's audio: twenty windows of 30 s
MAX_FILE_BYTES = 32 << 20  # one picture or clip in a Triton request row (600 s of 16-bit 16 kHz is 19.2 MB)


def answer_key(task: str) -> str:
    keys = {
        "feature-extraction": "embeddings",
        "text-generation": "completions",
        "automatic-speech-recognition": "texts",
        "text2text-generation": "outputs",
        "zero-shot-image-classification": "embeddings",  # a picture's image embedding
    }
    return keys.get(task, "logits")


def run_model(model, items: list):
    """A batch of one kind of item through the artifact's own entry: transcripts of a speech artifact's clips,
    completions of a decoder's or a text-to-text model's texts (as strings), else its run() array (embeddings,
    logits; a two-tower model's image embeddings)."""
    task = model.task
    if task == "automatic-speech-recognition":
        return model.transcribe(items)
    if task == "text-generation":
        return [c.text for c in model.generate(items)]
    if task == "text2text-generation":  # greedy, with the checkpoint's generation config
        return model.generate(items)
    return model.run(items)


def read_image(body: bytes) -> list:
    """The one picture of an image request: its file's bytes, never a path (the runtime reads paths; a client names
    none), else a one-line InputError. Pillow decodes it in the batch, which refuses a picture over its pixel limit
    from the header."""
    if not body:
        raise InputError(f"the request has no body; {IMAGE_USAGE}")
    return [bytes(body)]


def read_audio(body: bytes) -> list:
    """The one clip of a speech request: a WAV file's bytes as 16 kHz samples, else a one-line InputError."""
    from pipeline.runtime.audio import read_wav

    if not body:
        raise InputError(f"the request has no body; {AUDIO_USAGE}")
    try:
        return [read_wav(body, max_bytes=len(body), max_seconds=MAX_AUDIO_SECONDS)]
    except InputError as err:
        raise InputError(f"{err}; {AUDIO_USAGE}") from None


def check_limit(value, option: str, most: int | None = None) -> int:
    """A request limit: a positive int (at most `most`), else an InputError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (most is not None and value > most):
        upto = f" up to {most}" if most is not None else ""
        raise InputError(f"{option} {value!r}: pass a positive whole number{upto}")
    return value


def check_seconds(value, option: str) -> float:
    """A time limit: a positive finite number of seconds, else an InputError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise InputError(f"{option} {value!r}: pass a positive number of seconds")
    return float(value)


_JSON_KINDS = {dict: "a JSON object", list: "a JSON array", bool: "a boolean", int: "a number", float: "a number"}


def _json_kind(value) -> str:
    return "null" if value is None else _JSON_KINDS.get(type(value), type(value).__name__)


def read_texts(body: bytes, max_texts: int = MAX_TEXTS) -> list[str]:
    """The texts of a request body `{"texts": [...]}`, else a one-line InputError saying what was wrong and how
    to send it."""
    try:
        payload = json.loads(body)
    except RecursionError:
        raise InputError(f"the request's JSON nests too deeply; {USAGE}") from None
    except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise InputError(f"the request is not JSON ({err}); {USAGE}") from None
    if not isinstance(payload, dict) or "texts" not in payload:
        raise InputError(f'the request has no "texts"; {USAGE}')
    texts = payload["texts"]
    if isinstance(texts, str):
        raise InputError('"texts" is a single string; send a list of strings: {"texts": ["a text"]}')
    if not isinstance(texts, list):
        raise InputError(f'"texts" is {_json_kind(texts)}; {USAGE}')
    if not texts:
        raise InputError('"texts" is an empty list; send at least one text')
    if len(texts) > max_texts:
        raise InputError(
            f'"texts" holds {len(texts)} texts, over the limit of {max_texts} a request (max_texts, '
            "`pipeline serve --max-texts`); split them across requests"
        )
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise InputError(f'"texts" entry {i} is {_json_kind(text)}, not str; send text only')
        if not text.strip():
            raise InputError(f'"texts" entry {i} is empty; send text in every entry')
    from pipeline.runtime.text import check_texts

    return check_texts(texts, "request")


async def read_body(request, max_body_bytes: int) -> bytes:
    """A starlette request's body, else an InputError once it is over `max_body_bytes` (read no further). The
    caller bounds it in time: it waits on the client."""
    too_large = InputError(
        f"the request body is over the limit of {max_body_bytes} bytes (max_body_bytes, "
        "`pipeline serve --max-body-bytes`); send fewer or shorter texts a request"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_body_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_body_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)
