"""OpenAI's function calling (pipeline.serving.openai_tools): the checks of tools, tool_choice, response_format and
tool messages, the tool calls read from a generated text, the answers and stream chunks that carry them, then a tiny
Llama with Qwen2.5's chat template served live and called with tools through the `openai` client."""

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pipeline.serving.openai_api import CHAT, APIError, Served, generation_answer, parse_generation, stream_chunks
from pipeline.serving.openai_tools import MAX_CALLS, extract_tool_calls

DECODER = Served("tiny-llama/v1", "text-generation", 128, 0)
HELLO = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "local-time", "parameters": {"type": "object"}}}


def _chat(**fields) -> bytes:
    return json.dumps({"messages": HELLO, **fields}).encode()


def _parse(**fields):
    return parse_generation(CHAT, _chat(**fields), DECODER, max_texts=4)


def _block(name: str, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _function(**function) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": {"get_weather": {}}}, "tools"),
        ({"tools": [{"type": "code_interpreter"}]}, "tools[0]"),
        ({"tools": [WEATHER, {"function": {"name": "f"}}]}, "tools[1]"),
        ({"tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
        ({"tools": [_function()]}, "tools[0].function.name"),
        ({"tools": [_function(name="get weather")]}, "tools[0].function.name"),
        ({"tools": [_function(name="f" * 65)]}, "tools[0].function.name"),
        ({"tools": [_function(name="f", description=3)]}, "tools[0].function.description"),
        ({"tools": [_function(name="f", parameters="{}")]}, "tools[0].function.parameters"),
        ({"tools": [_function(name="f", strict=True)]}, "tools[0].function.strict"),
        ({"tools": [_function(name="f", returns={})]}, "tools[0].function.returns"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [_function(name=f"f{i}") for i in range(129)]}, "tools"),
        ({"tools": [_function(name="f", description="x" * 70_000)]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": _function(name="get_weather")}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": _function(name="get_time")}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, "response_format"),
        ({"response_format": "json"}, "response_format"),
        ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "tool", "tool_call_id": "c", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "tool_calls": "f()"}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]}, "messages[0].tool_calls[0]"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
            "messages[0].tool_calls[0].function.arguments",
        ),
        ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "messages[0].tool_call_id"),
    ],
)
def test_bad_tools_tool_choice_response_format_and_tool_messages_are_400s_naming_the_parameter(fields, param):
    with pytest.raises(APIError) as err:
        _parse(**fields)
    assert err.value.status == 400 and err.value.param == param and "\n" not in str(err.value)


def test_json_output_and_forced_calls_are_refused_as_not_constrained():
    for fields in ({"response_format": {"type": "json_object"}}, {"tools": [WEATHER], "tool_choice": "required"}):
        with pytest.raises(APIError, match="not supported: the output is not constrained"):
            _parse(**fields)


def test_tools_are_kept_in_openais_shape_and_tool_choice_none_leaves_them_out():
    request = _parse(tools=[WEATHER, TIME], tool_choice="auto", response_format={"type": "text"})
    assert request.tools == (WEATHER, TIME)
    assert _parse(tools=[WEATHER]).tools == (WEATHER,)
    assert _parse(tools=[WEATHER], tool_choice="none").tools is None
    assert _parse(tools=[], tool_choice="none").tools is None and _parse().tools is None


def test_tool_messages_reach_the_template_as_transformers_takes_them():
    sent = [
        *HELLO,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    conversation = _parse(messages=sent, tools=[WEATHER]).conversation
    assert conversation[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "P"}}}
        ],
    }
    assert conversation[2] == {"role": "tool", "content": "21 degrees", "tool_call_id": "call_1"}


def test_extract_tool_calls_reads_each_block_and_keeps_the_text_around_them():
    text = "Let me look.\n" + _block("get_weather", {"city": "Zürich"}) + "\n" + _block("local-time", {})
    content, calls = extract_tool_calls(text, [WEATHER, TIME])
    assert content == "Let me look."
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
        {"name": "local-time", "arguments": "{}"},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert extract_tool_calls(_block("get_weather", {"city": "P"}), [WEATHER])[0] is None


@pytest.mark.parametrize(
    "bad",
    [
        "<tool_call>\n{'name': 'get_weather'}\n</tool_call>",  # not JSON
        _block("delete_everything", {}),  # not offered
        "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": "city=P"}) + "\n</tool_call>",
        "<tool_call>\n" + "[" * 50_000 + "\n</tool_call>",  # nests past the parser's depth
    ],
    ids=["not-json", "unknown-function", "arguments-not-object", "deep"],
)
def test_a_block_that_is_no_offered_call_stays_content(bad):
    assert extract_tool_calls(bad, [WEATHER]) == (bad, [])
    unclosed = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {}})
    assert extract_tool_calls(unclosed, [WEATHER]) == (unclosed, [])
    content, calls = extract_tool_calls(bad + _block("get_weather", {"city": "P"}), [WEATHER])
    assert content == bad.strip() and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_no_tools_no_calls():
    text = _block("get_weather", {"city": "P"})
    assert extract_tool_calls(text, None) == (text, [])


def test_extract_tool_calls_is_bounded_on_huge_hostile_text():
    many = _block("get_weather", {"city": "P"}) * (MAX_CALLS + 10)
    content, calls = extract_tool_calls(many, [WEATHER])
    assert len(calls) == MAX_CALLS and content.count("<tool_call>") == 10
    hostile = [
        "<tool_call>" * 200_000,  # opened, never closed
        "<tool_call></tool_call>" * 100_000,  # empty blocks
        "<tool_call>" + '{"name": "' + "a" * 2_000_000 + "</tool_call>",  # one huge block
        "<tool_" * 300_000 + "</tool_call>",
    ]
    for text in hostile:
        started = time.perf_counter()
        content, calls = extract_tool_calls(text, [WEATHER])
        assert calls == [] and content == text and time.perf_counter() - started < 1.0


def _completion(text: str, reason: str = "eos"):
    return SimpleNamespace(text=text, token_ids=[1, 2, 3], finish_reason=reason)


def test_chat_answer_carries_tool_calls_with_finish_reason_tool_calls():
    request = _parse(tools=[WEATHER])
    text = "Checking. " + _block("get_weather", {"city": "Paris"})
    [choice] = generation_answer(request, DECODER, "chatcmpl-1", 0, [_completion(text)], 9)["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # Without tools, or without a call, the text is the content as it is.
    for request, text in ((_parse(), _block("get_weather", {})), (_parse(tools=[WEATHER]), " plain ")):
        [choice] = generation_answer(request, DECODER, "chatcmpl-1", 0, [_completion(text, "length")], 9)["choices"]
        assert choice["message"] == {"role": "assistant", "content": text} and choice["finish_reason"] == "length"


def _stream(request, pieces: list[str]) -> list[dict]:
    events = [SimpleNamespace(index=0, text=p, finish_reason=None) for p in pieces]
    events[-1].finish_reason = "eos"
    chunks = list(stream_chunks(request, DECODER, "chatcmpl-1", 0, events, 9))
    assert chunks[-1] == b"data: [DONE]\n\n"
    return [json.loads(c[len(b"data: ") :]) for c in chunks[:-1]]


def test_a_stream_sends_its_text_then_the_tool_calls_in_one_delta_before_the_finish():
    text = "Checking. " + _block("get_weather", {"city": "Paris"})
    pieces = [text[i : i + 5] for i in range(0, len(text), 5)]
    chunks = _stream(_parse(tools=[WEATHER], stream=True), pieces)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text
    calls, finish = chunks[-2]["choices"][0], chunks[-1]["choices"][0]
    assert calls["finish_reason"] is None and set(calls["delta"]) == {"tool_calls"}
    [call] = calls["delta"]["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert finish == {"index": 0, "delta": {}, "finish_reason": "tool_calls", "logprobs": None}
    plain = _stream(_parse(tools=[WEATHER], stream=True), ["no ", "call"])
    assert plain[-1]["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in str(plain)


# Live: a tiny random Llama (GroupQueryAttention: the continuous batcher's path) with Qwen2.5's chat template.

openai = pytest.importorskip("openai", reason="the openai client is in the `dev` extra")


@pytest.fixture(scope="module")
def tools_llama(texts_file, tmp_path_factory) -> Path:
    from tests.serving.test_openai_api import chat_decoder

    return chat_decoder(tmp_path_factory.mktemp("openai-tools"), "llama", "qwen2", texts_file)


@pytest.fixture(scope="module")
def tools_client(tools_llama):
    pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")
    from pipeline.serving import ray_serve
    from pipeline.serving.triton_server import free_port

    url = ray_serve.deploy(tools_llama, port=free_port(), max_texts=4, max_body_bytes=64 * 1024)
    try:
        yield openai.OpenAI(base_url=url + "v1", api_key="none", max_retries=0, timeout=120)
    finally:
        ray_serve.shutdown()


@pytest.mark.slow  # a live Ray Serve deployment
def test_a_served_chat_with_tools_is_answered_as_the_runtime_generates_it_with_the_tools(tools_client, tools_llama):
    from pipeline.runtime import load

    model = load(tools_llama)
    assert model.spec["cache"] == "shared" and model.right_padded  # the replica batches it: submit() gets the tools
    [model_id] = [m.id for m in tools_client.models.list().data]
    settings = {"max_tokens": 8, "temperature": 0}
    with_tools = tools_client.chat.completions.create(model=model_id, messages=HELLO, tools=[WEATHER], **settings)
    plain = tools_client.chat.completions.create(model=model_id, messages=HELLO, **settings)
    expected = model.generate(messages=[HELLO], tools=[WEATHER], max_new_tokens=8, temperature=0)[0]
    [choice] = with_tools.choices
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    # The tools' JSON is in the prompt the model saw: more prompt tokens than the same chat without them.
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    # A conversation that sends a call and its result back is answered, streamed too.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turns = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [call]}]
    turns.append({"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"})
    chunks = list(
        tools_client.chat.completions.create(model=model_id, messages=turns, tools=[WEATHER], stream=True, **settings)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The template gets the call's arguments as an object, as transformers' templates take them.
    sent = [
        *turns[:1],
        {**turns[1], "tool_calls": [{**call, "function": {**call["function"], "arguments": {"city": "Paris"}}}]},
        turns[2],
    ]
    assert text == model.generate(messages=[sent], tools=[WEATHER], max_new_tokens=8, temperature=0)[0].text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_the_openai_clients_types_and_stream_accumulator_read_the_tool_calls():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    text = "Checking. " + _block("get_weather", {"city": "Paris"})
    answer = generation_answer(_parse(tools=[WEATHER]), DECODER, "chatcmpl-1", 0, [_completion(text)], 9)
    [call] = ChatCompletion.model_validate(answer).choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    state = ChatCompletionStreamState()
    for chunk in _stream(_parse(tools=[WEATHER], stream=True), [text[:7], text[7:]]):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    [choice] = state.get_final_completion().choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == text  # streamed as generated
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
