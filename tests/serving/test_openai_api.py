"""The OpenAI-compatible routes: request checks and answers (pipeline.serving.openai_api), then a live Ray Serve
deployment of a tiny chat GPT-2 called through the `openai` client."""

import base64
import json
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pipeline.serving import openai_api
from pipeline.serving.openai_api import CHAT, COMPLETIONS, EMBEDDINGS, APIError, Served, parse_generation
from tests.chat_templates import add_chat_template
from tests.tiny import make_decoder

DECODER = Served("tiny-gpt2/v1", "text-generation", 128, 0)
ENCODER = Served("tiny-bert/v1", "feature-extraction", 128, 0)
HELLO = [{"role": "user", "content": "Hello there"}]


def _chat(**fields) -> bytes:
    return json.dumps({"messages": HELLO, **fields}).encode()


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f f"}}]}, "tools[0].function.name"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"mystery": 1}, "mystery"),
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 128}, "max_tokens"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
        ({"max_tokens": 4, "max_completion_tokens": 4}, "max_tokens"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0].tool_calls"),
    ],
)
def test_parse_generation_refuses_an_unsupported_parameter_with_a_400_naming_it(fields, param):
    with pytest.raises(APIError) as err:
        parse_generation(CHAT, _chat(**fields), DECODER, max_texts=16)
    assert err.value.status == 400 and err.value.param == param and "\n" not in str(err.value)
    body = err.value.body()["error"]
    assert body == {"message": str(err.value), "type": "invalid_request_error", "param": param, "code": None}


def test_parse_generation_takes_neutral_values_of_unsupported_parameters_and_nulls_as_unset():
    neutral = {"frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": False, "tools": [], "n": 1}
    neutral |= {"tool_choice": "none", "response_format": {"type": "text"}}
    request = parse_generation(CHAT, _chat(**neutral, temperature=None, user="u", seed=7), DECODER, 16)
    assert request.conversation == tuple(HELLO) and request.temperature is None and request.seed == 7
    assert not request.stream and request.max_tokens is None


def test_parse_generation_reads_the_settings_of_a_chat():
    body = _chat(max_completion_tokens=9, temperature=0.5, top_p=0.9, stop="x", stream=True)
    request = parse_generation(CHAT, body.replace(b"}]", b'}, {"role": "developer", "content": "terse"}]'), DECODER, 4)
    assert request.conversation[-1] == {"role": "system", "content": "terse"}
    assert request.settings(request.max_new_tokens(128, 20)) == {
        "max_new_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["x"],
    }
    assert request.stream and not request.include_usage


def test_max_new_tokens_defaults_to_the_rest_of_the_context_for_chat_and_16_for_completions():
    chat = parse_generation(CHAT, _chat(), DECODER, 4)
    completion = parse_generation(COMPLETIONS, b'{"prompt": "a"}', DECODER, 4)
    assert chat.max_new_tokens(128, 20) == 108 and chat.max_new_tokens(128, 500) == 1
    assert completion.max_new_tokens(128, 20) == 16 and completion.prompts == ("a",)


def test_a_model_other_than_the_one_served_is_a_404_model_not_found():
    with pytest.raises(APIError) as err:
        parse_generation(CHAT, _chat(model="gpt-4o"), DECODER, 16)
    assert err.value.status == 404 and err.value.body()["error"]["code"] == "model_not_found"
    assert "'tiny-gpt2/v1'" in str(err.value)
    assert parse_generation(CHAT, _chat(model="tiny-gpt2/v1"), DECODER, 16).conversation == tuple(HELLO)


@pytest.mark.parametrize(
    "body, param",
    [
        (b"not json", None),
        (b"[1]", None),
        (b'{"prompt": [1, 2]}', "prompt"),
        (b'{"prompt": ["a", " "]}', "prompt"),
        (b'{"prompt": ["a", "b", "c"]}', "prompt"),
        (b'{"prompt": "a", "echo": true}', "echo"),
        (b'{"prompt": "a", "best_of": 3}', "best_of"),
        (b'{"prompt": "a", "tools": []}', "tools"),
        (b'{"max_tokens": 3}', "prompt"),
    ],
)
def test_parse_generation_refuses_bad_completion_bodies(body, param):
    with pytest.raises(APIError) as err:
        parse_generation(COMPLETIONS, body, DECODER, max_texts=2)
    assert err.value.status == 400 and err.value.param == param


@pytest.mark.parametrize(
    "body, param",
    [
        (b'{"input": "a", "encoding_format": "int8"}', "encoding_format"),
        (b'{"input": "a", "dimensions": 8}', "dimensions"),
        (b'{"input": []}', "input"),
        (b'{"model": "tiny-bert/v1"}', "input"),
        (b'{"input": "a", "logprobs": false}', "logprobs"),
    ],
)
def test_parse_embeddings_refuses_bad_bodies_naming_the_parameter(body, param):
    with pytest.raises(APIError) as err:
        openai_api.parse_embeddings(body, ENCODER, max_texts=4)
    assert err.value.param == param


@pytest.mark.parametrize(
    "served, method, path, status, says",
    [
        (ENCODER, "POST", CHAT, 404, "this artifact (feature-extraction) serves GET /v1/models, POST /v1/embeddings"),
        (DECODER, "POST", EMBEDDINGS, 404, "POST /v1/chat/completions, POST /v1/completions and POST /"),
        (DECODER, "GET", CHAT, 405, "use POST /v1/chat/completions"),
        (DECODER, "POST", "/v1/images/generations", 404, "no route POST /v1/images/generations"),
    ],
)
def test_check_route_refuses_a_route_that_does_not_fit_the_artifact_naming_those_it_serves(
    served, method, path, status, says
):
    with pytest.raises(APIError) as err:
        openai_api.check_route(served, method, path)
    assert err.value.status == status and says in str(err.value)


def test_check_route_returns_the_route():
    assert openai_api.check_route(ENCODER, "GET", "/v1/models/") == openai_api.MODELS
    assert openai_api.check_route(DECODER, "POST", CHAT) == CHAT


def test_served_from_manifest_names_the_model_by_name_and_version():
    manifest = {
        "model_name": "tiny-gpt2",
        "version": "v3",
        "created_at": "2026-12-07T10:00:00+00:00",
        "model": {"task": "text-generation", "max_length": 128},
    }
    served = Served.from_manifest(manifest)
    assert served.id == "tiny-gpt2/v3" and served.created == 1796637600
    assert openai_api.models_answer(served)["data"][0] | {"created": 0} == {
        "id": "tiny-gpt2/v3",
        "object": "model",
        "created": 0,
        "owned_by": "pipeline",
    }


def _events(*items):
    return [SimpleNamespace(index=i, text=t, finish_reason=f) for i, t, f in items]


def test_stream_chunks_send_the_role_each_text_the_finish_reason_usage_and_done():
    request = parse_generation(CHAT, _chat(stream=True, stream_options={"include_usage": True}), DECODER, 4)
    events = _events((0, "Hel", None), (0, "", None), (0, "lo", "eos"))
    chunks = list(openai_api.stream_chunks(request, DECODER, "chatcmpl-1", 5, events, prompt_tokens=7))
    assert chunks[-1] == b"data: [DONE]\n\n" and all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    data = [json.loads(c[6:]) for c in chunks[:-1]]
    assert [d["object"] for d in data] == ["chat.completion.chunk"] * 5
    assert [d["choices"][0]["delta"] for d in data[:4]] == [{"role": "assistant", "content": ""}] + [
        {"content": "Hel"},
        {"content": "lo"},
        {},
    ]
    assert data[3]["choices"][0]["finish_reason"] == "stop"
    assert data[4]["choices"] == [] and data[4]["usage"] == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
    }


def test_embeddings_answer_gives_floats_or_base64_of_little_endian_float32():
    vectors = [[0.5, -1.25], [3.0, 0.0]]
    for fmt in ("float", "base64"):
        request = openai_api.parse_embeddings(
            json.dumps({"input": ["a", "b"], "encoding_format": fmt}).encode(), ENCODER, 4
        )
        answer = openai_api.embeddings_answer(request, ENCODER, vectors, prompt_tokens=6)
        got = [d["embedding"] for d in answer["data"]]
        if fmt == "base64":
            got = [np.frombuffer(base64.b64decode(g), dtype="<f4").tolist() for g in got]
        assert got == vectors and answer["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
        assert answer["model"] == "tiny-bert/v1" and [d["index"] for d in answer["data"]] == [0, 1]


def test_generation_answer_maps_the_runtime_finish_reasons():
    request = parse_generation(COMPLETIONS, b'{"prompt": ["a", "b"]}', DECODER, 4)
    completions = [SimpleNamespace(text="x", token_ids=(1, 2), finish_reason=r) for r in ("eos", "length")]
    answer = openai_api.generation_answer(request, DECODER, "cmpl-1", 5, completions, 4)
    assert [c["finish_reason"] for c in answer["choices"]] == ["stop", "length"]
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 4


# Live: a tiny random GPT-2 with SmolLM2's chat template, built for cpu-fp32, served by Ray Serve.

openai = pytest.importorskip("openai", reason="the openai client is in the `dev` extra")


def chat_decoder(root: Path, model_type: str, style: str, texts_file) -> Path:
    """A tiny random decoder of `model_type` with the chat template of `style` (tests/chat_templates.py), built for
    cpu-fp32 under `root`; its published artifact."""
    from pipeline.build.table import build

    checkpoint = add_chat_template(make_decoder(root / f"tiny-{model_type}", model_type), style)
    manifest = build(
        checkpoint,
        "cpu-fp32",
        artifacts_dir=root / "artifacts",
        cache_dir=root / "cache",
        validation=texts_file,
        calibration=texts_file,
    )
    return Path(manifest.published.path)


@pytest.fixture(scope="module")
def chat_gpt2(texts_file, tmp_path_factory) -> Path:
    return chat_decoder(tmp_path_factory.mktemp("openai-gpt2"), "gpt2", "smollm2", texts_file)


@pytest.fixture(scope="module")
def served_gpt2(chat_gpt2):
    pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")
    from pipeline.serving import ray_serve
    from pipeline.serving.triton_server import free_port

    url = ray_serve.deploy(chat_gpt2, port=free_port(), max_texts=4, max_body_bytes=64 * 1024, slots=8)
    try:
        yield url
    finally:
        ray_serve.shutdown()


@pytest.fixture(scope="module")
def client(served_gpt2):
    return openai.OpenAI(base_url=served_gpt2 + "v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(chat_gpt2) -> str:
    return f"{chat_gpt2.parent.parent.name}/{chat_gpt2.parent.name}"


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.mark.slow  # a live Ray Serve deployment
def test_models_list_names_the_served_artifact(client, model_id):
    [model] = client.models.list().data
    assert model.id == model_id and model.owned_by == "pipeline" and model.object == "model"


@pytest.mark.slow  # a live Ray Serve deployment
def test_chat_equals_the_runtime_greedy_generation_and_streams_the_same_text(client, chat_gpt2, model_id):
    from pipeline.runtime import load

    expected = load(chat_gpt2).generate(messages=[CONVERSATION], max_new_tokens=12, temperature=0)[0]
    answer = client.chat.completions.create(model=model_id, messages=CONVERSATION, max_tokens=12, temperature=0)
    assert answer.object == "chat.completion" and answer.model == model_id
    [choice] = answer.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[expected.finish_reason]
    assert answer.usage.completion_tokens == len(expected.token_ids) and answer.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            messages=CONVERSATION,
            model=model_id,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text and all(c.object == "chat.completion.chunk" for c in chunks)
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == [choice.finish_reason] and chunks[-1].usage.total_tokens == answer.usage.total_tokens


@pytest.mark.slow  # a live Ray Serve deployment
def test_completions_stop_strings_and_streaming(client, chat_gpt2, model_id):
    from pipeline.runtime import load

    model = load(chat_gpt2)
    expected = model.generate(["Once upon a time", "The cat"], max_new_tokens=10, temperature=0)
    answer = client.completions.create(
        model=model_id, prompt=["Once upon a time", "The cat"], max_tokens=10, temperature=0
    )
    assert answer.object == "text_completion" and [c.text for c in answer.choices] == [c.text for c in expected]
    streamed = {}
    for chunk in client.completions.create(model=model_id, prompt="The cat", max_tokens=10, temperature=0, stream=True):
        streamed.setdefault(chunk.choices[0].index, []).append(chunk.choices[0].text)
    assert "".join(streamed[0]) == expected[1].text
    # A sampled text (the same seed gives the same text in and out of the server), cut before a stop string.
    sampled = model.generate(["Once upon a time"], max_new_tokens=12, temperature=1.0, seed=5)[0].text
    again = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=5)
    assert again.choices[0].text == sampled
    stop = sampled.strip()[2:4]
    cut = client.completions.create(
        model=model_id, prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=5, stop=[stop, "never seen"]
    )
    assert stop.strip() and cut.choices[0].finish_reason == "stop" and cut.choices[0].text == sampled.split(stop)[0]


@pytest.mark.slow  # a live Ray Serve deployment
def test_sixteen_concurrent_streaming_chats_each_get_the_text_they_get_alone(client, chat_gpt2, model_id):
    from concurrent.futures import ThreadPoolExecutor

    from pipeline.runtime import load
    from tests.conftest import SMALL_TEXTS

    model = load(chat_gpt2)
    assert model.spec["cache"] == "shared"  # the replica batches its requests continuously
    chats = [[{"role": "user", "content": SMALL_TEXTS[i % 12] + " Why?" * (i // 4)}] for i in range(16)]

    def settings(i: int) -> dict:  # greedy and seeded sampling, of several lengths
        return {"max_tokens": 4 + 2 * i, "temperature": 0.9 if i % 2 else 0, "seed": i}

    def alone(i: int) -> str:
        given = settings(i)
        [completion] = model.generate(
            messages=[chats[i]], max_new_tokens=given["max_tokens"], temperature=given["temperature"], seed=i
        )
        return completion.text

    def streamed(i: int) -> str:
        stream = client.chat.completions.create(model=model_id, messages=chats[i], stream=True, **settings(i))
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(streamed, range(16)))
    assert texts == [alone(i) for i in range(16)]


@pytest.mark.slow  # a live Ray Serve deployment
def test_a_seed_repeats_a_sampled_chat(client):
    def sample(seed: int) -> str:
        answer = client.chat.completions.create(
            model=openai.omit, messages=CONVERSATION, max_tokens=16, temperature=1.0, seed=seed
        )
        return answer.choices[0].message.content

    first = sample(1)
    assert sample(1) == first and {sample(s) for s in (2, 3, 4)} != {first}


@pytest.mark.slow  # a live Ray Serve deployment
def test_an_unknown_parameter_is_a_bad_request_naming_it_and_serving_goes_on(client, served_gpt2, model_id):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_id, messages=CONVERSATION, extra_body={"mystery": 1})
    assert err.value.body["param"] == "mystery" and "mystery" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-4o", messages=CONVERSATION)
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError, match="serves GET /v1/models, POST /v1/chat/completions"):
        client.embeddings.create(model=model_id, input="a")
    # POST / answers as before.
    request = urllib.request.Request(served_gpt2, data=b'{"texts": ["hi"]}', method="POST")
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert len(json.load(answer)["completions"]) == 1
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(served_gpt2 + "v1/chat/completions", data=b"x" * (100 * 1024)))
    assert err.value.code == 413 and json.load(err.value)["error"]["type"] == "invalid_request_error"


@pytest.mark.slow  # a live Ray Serve deployment
def test_tools_for_a_template_that_ignores_them_and_json_output_are_bad_requests_saying_why(client, model_id):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as err:  # SmolLM2's template never reads tools
        client.chat.completions.create(model=model_id, messages=CONVERSATION, tools=[weather], max_tokens=2)
    assert err.value.body["param"] == "tools" and "chat template does not use tools" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_id, messages=CONVERSATION, stream=True, tools=[weather], tool_choice="auto", max_tokens=2
        )
    assert err.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=model_id, messages=CONVERSATION, response_format={"type": "json_object"}, max_tokens=2
        )
    assert err.value.body["param"] == "response_format" and "not constrained" in err.value.body["message"]
    # tool_choice "none" renders without the tools: answered as the chat without them.
    answer = client.chat.completions.create(
        model=model_id, messages=CONVERSATION, tools=[weather], tool_choice="none", max_tokens=2
    )
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].finish_reason in ("stop", "length")
