"""OpenAI's function calling over a chat template: the `tools`, `tool_choice` and `response_format` a chat request
may hold, its messages (with the tool calls and tool results clients send back), and the tool calls read out of the
generated text.

    request:  tools=[{"type": "function", "function": {"name", "description", "parameters"}}], tool_choice "auto"
      -> the chat template gets them as transformers' apply_chat_template(tools=...) passes them (Qwen2.5's and
         Hermes-style templates list them in the system turn)
    answer:   '<tool_call>\\n{"name": "weather", "arguments": {"city": "Paris"}}\\n</tool_call>'
      -> message.tool_calls=[{"id": "call_...", "type": "function",
                              "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}],
         finish_reason "tool_calls"

Nothing constrains the output: the model may call a tool or not. So tool_choice "required" or a named function,
strict function schemas and response_format json_object or json_schema are refused (400), not pretended.
Plain functions over parsed JSON, as pipeline.serving.openai_api.
"""

from __future__ import annotations

import json
import re
import uuid

from pipeline.serving.openai_errors import APIError

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

MAX_TOOLS = 128  # OpenAI's limit on tools a request
MAX_TOOLS_BYTES = 64 * 1024  # the tools' JSON, all together: it is rendered into every prompt
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_CALLS = 32  # blocks read from one answer; any after them stay content
MAX_CALL_BYTES = 64 * 1024  # a block's JSON; a longer one stays content


def _function(tool, where: str) -> dict:
    """One tool checked: {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
        raise APIError(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    function = tool["function"]
    if not isinstance(function, dict):
        raise APIError(f"{where}.function must be an object with name, description and parameters", f"{where}.function")
    extra = sorted(set(function) - FUNCTION_KEYS)
    if extra:
        raise APIError(
            f"{where}.function.{extra[0]} is not a function field; remove it", f"{where}.function.{extra[0]}"
        )
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise APIError(f"{where}.function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -", f"{where}.function.name")
    if not isinstance(function.get("description") or "", str):
        raise APIError(f"{where}.function.description must be a string", f"{where}.function.description")
    if not isinstance(function.get("parameters") or {}, dict):
        raise APIError(f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters")
    if function.get("strict") not in (None, False):
        raise APIError(
            f"{where}.function.strict is not supported: the output is not constrained to the schema; omit it",
            f"{where}.function.strict",
        )
    return {"type": "function", "function": {k: v for k, v in function.items() if k != "strict" and v is not None}}


def parse_tools(given: dict) -> tuple[dict, ...] | None:
    """The request's tools, checked, as the chat template takes them (None: no tools, or tool_choice "none"), else
    an APIError naming the parameter at fault."""
    tools, choice = given.get("tools", []), given.get("tool_choice")
    if not isinstance(tools, list):
        raise APIError("tools must be a list of function tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(f"tools holds {len(tools)} tools, over the limit of {MAX_TOOLS}", "tools")
    try:
        size = len(json.dumps(tools, ensure_ascii=False).encode())
    except RecursionError:
        size = MAX_TOOLS_BYTES + 1
    if size > MAX_TOOLS_BYTES:
        raise APIError(f"tools take over {MAX_TOOLS_BYTES} bytes of JSON; send fewer or shorter ones", "tools")
    checked = tuple(_function(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise APIError(f"tools name the function {twice[0]!r} twice; names must be unique", "tools")
    if choice is None or choice == "none":
        return None if choice == "none" else checked or None
    if not checked:
        raise APIError("tool_choice is only allowed when tools are given", "tool_choice")
    if choice == "auto":
        return checked
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or set(choice) != {"type", "function"}:
            raise APIError(
                'tool_choice takes "none", "auto" or {"type": "function", "function": {"name"}}', "tool_choice"
            )
        if name not in names:
            raise APIError(f"tool_choice names the function {name!r}, which tools do not offer", "tool_choice")
    elif choice != "required":
        raise APIError(f"tool_choice {json.dumps(choice)[:80]} is not valid; pass none or auto", "tool_choice")
    raise APIError(
        "tool_choice forcing a tool call is not supported: the output is not constrained, so a call cannot be "
        'guaranteed; pass "auto" (the model may call a tool) or "none"',
        "tool_choice",
    )


def check_response_format(given: dict) -> None:
    """Accept response_format {"type": "text"} (or none); refuse what would need constrained output."""
    value = given.get("response_format")
    if value is None or value == {"type": "text"}:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("json_object", "json_schema"):
        raise APIError(
            f"response_format {kind} is not supported: the output is not constrained to JSON; omit it or pass "
            '{"type": "text"}',
            "response_format",
        )
    raise APIError(f'response_format {json.dumps(value)[:80]} is not valid; pass {{"type": "text"}}', "response_format")


def _sent_call(call, where: str) -> dict:
    """A tool call an assistant message carries, for the template: arguments as the object transformers' templates
    expect (OpenAI's clients send them as a JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise APIError(f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', where)
    if not isinstance(function.get("name"), str):
        raise APIError(f"{where}.function.name must be a string", f"{where}.function.name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments.strip() or "{}")  # a call without arguments may send ""
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):
        raise APIError(f"{where}.function.arguments must be a JSON object (as a string)", f"{where}.function.arguments")
    sent = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        sent["id"] = call["id"]
    return sent


def tool_message(message: dict, role: str, where: str) -> dict | None:
    """The template's form of an assistant message with tool_calls or of a tool result (role "tool", with its
    tool_call_id), as transformers passes them; None for any other message."""
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise APIError(
                f"{where}.tool_call_id must be a string (the id of the call it answers)", f"{where}.tool_call_id"
            )
        if not isinstance(message.get("content"), str):
            raise APIError(f"{where}.content must be a string (the tool's result)", f"{where}.content")
        return {"role": "tool", "content": message["content"], "tool_call_id": message["tool_call_id"]}
    if message.get("tool_calls") is None:
        return None
    calls = message["tool_calls"]
    if role != "assistant" or not isinstance(calls, list) or not calls:
        raise APIError(f"{where}.tool_calls must be a non-empty list, in an assistant message", f"{where}.tool_calls")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise APIError(f"{where}.content must be a string or null", f"{where}.content")
    sent = [_sent_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)]
    return {"role": "assistant", "content": content, "tool_calls": sent}


def conversation(messages) -> tuple:
    """A chat's messages as the chat template takes them: {"role", "content"} dicts, developer taken as system; an
    assistant's tool_calls and a tool's results as tool_message gives them. Else an APIError naming the message."""
    if not isinstance(messages, list) or not messages:
        raise APIError('messages must be a non-empty list of {"role", "content"} objects', "messages")
    turns = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(f"{where} is not an object", where)
        tool_keys = {"tool_calls"} if message.get("role") == "assistant" else set()
        tool_keys |= {"tool_call_id"} if message.get("role") == "tool" else set()
        extra = sorted(set(message) - {"role", "content", "name", *tool_keys})
        if extra:
            raise APIError(
                f"{where}.{extra[0]} is not supported; messages take role and content", f"{where}.{extra[0]}"
            )
        if message.get("role") not in ROLES:
            roles = ", ".join(ROLES)
            raise APIError(
                f"{where}.role {json.dumps(message.get('role'))} is not served; pass {roles}", f"{where}.role"
            )
        tooled = tool_message(message, ROLES[message["role"]], where)
        if tooled is not None:
            turns.append(tooled)
            continue
        if not isinstance(message.get("content"), str):
            raise APIError(f"{where}.content must be a string (content parts are not served)", f"{where}.content")
        turns.append({"role": ROLES[message["role"]], "content": message["content"]})
    return tuple(turns)


def _call(body: str, offered) -> dict | None:
    """The tool call a block's JSON names, or None where it does not parse or names no function offered."""
    if len(body) > MAX_CALL_BYTES:
        return None
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or call.get("name") not in offered or not isinstance(call.get("arguments"), dict):
        return None
    arguments = json.dumps(call["arguments"], ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": arguments},
    }


def extract_tool_calls(text: str, tools) -> tuple[str | None, list[dict]]:
    """The content and the tool calls of a generated text: each <tool_call>{"name", "arguments"}</tool_call> block
    that parses and names an offered function becomes a call; what is left (other blocks included) is the content,
    stripped, or None. Without such a block: (text, []). Linear in the text (str.find, one json.loads a block)."""
    offered = {tool["function"]["name"] for tool in tools or ()}
    if not offered:
        return text, []
    rest, calls, start = [], [], 0
    while len(calls) < MAX_CALLS:
        opened = text.find(OPEN, start)
        closed = text.find(CLOSE, opened + len(OPEN)) if opened >= 0 else -1
        if closed < 0:
            break
        call = _call(text[opened + len(OPEN) : closed].strip(), offered)
        end = closed + len(CLOSE)
        rest.append(text[start:end] if call is None else text[start:opened])
        if call is not None:
            calls.append(call)
        start = end
    if not calls:
        return text, []
    rest.append(text[start:])
    return "".join(rest).strip() or None, calls


def streamed_tool_calls(text: str, tools) -> list[dict]:
    """The tool calls of a streamed answer's whole text, as one delta's tool_calls (each with its index); [] where
    it holds none. Its content was streamed already, as generated."""
    return [{"index": i, **call} for i, call in enumerate(extract_tool_calls(text, tools)[1])]
