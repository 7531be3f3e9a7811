"""Chat: conversations rendered to prompt text with the checkpoint's own chat template, as transformers'
`apply_chat_template(..., add_generation_prompt=True)` renders them, without transformers.

    messages=[[{"role": "user", "content": "What is the capital of France?"}]]
      -> template (Jinja, from the checkpoint's tokenizer_config.json, carried in the artifact's spec)
      -> "<|im_start|>user\\nWhat is the capital of France?<|im_end|>\\n<|im_start|>assistant\\n"
      -> token ids, encoded WITHOUT adding special tokens: the template already put BOS where the model wants it

The template is run in jinja2's ImmutableSandboxedEnvironment with the options, globals and filters transformers
gives it (trim_blocks, lstrip_blocks, loop controls, a `{% generation %}` tag, raise_exception, strftime_now and
transformers' `tojson`), so that the same template gives the same text. A template is code shipped with a
checkpoint: the sandbox lets it format strings and lists, and refuses attribute access to Python internals and
any change to the objects it is given; pipeline.runtime.template_budget bounds its time and the sizes it builds.
jinja2 is imported here only, on the first chat call.
"""

from __future__ import annotations

import functools

from pipeline.errors import ArtifactError, InputError
from pipeline.runtime.template_budget import BudgetExceeded, bound_joins, bounded_filters, budgeted, render_bounded


class ChatPrompts(list):
    """Prompt texts rendered from conversations. They hold the template's special tokens already, so they are
    encoded without adding any (as transformers' `apply_chat_template(tokenize=True)` encodes them)."""


def check_messages(messages, call: str) -> list[list[dict]]:
    """A list of conversations, each a non-empty list of {"role": str, "content": str} dicts (other keys are
    passed to the template as they are; content may be None in a message with tool_calls, as OpenAI's clients send
    it), else a one-line InputError naming the first problem."""
    shape = 'a list of conversations, each a list of {"role": ..., "content": ...} dicts'
    if isinstance(messages, dict) or (
        isinstance(messages, list | tuple) and messages and isinstance(messages[0], dict)
    ):
        raise InputError(f"{call}: messages takes {shape}, got one conversation; wrap it: messages=[conversation]")
    if not isinstance(messages, list | tuple) or not messages:
        got = "an empty list" if isinstance(messages, list | tuple) else type(messages).__name__
        raise InputError(f"{call}: messages takes {shape}, got {got}")
    for i, conversation in enumerate(messages):
        if not isinstance(conversation, list | tuple) or not conversation:
            got = "an empty list" if isinstance(conversation, list | tuple) else type(conversation).__name__
            raise InputError(f"{call}: messages[{i}] is {got}; each conversation is a non-empty list of message dicts")
        for j, message in enumerate(conversation):
            if not isinstance(message, dict):
                raise InputError(
                    f"{call}: messages[{i}][{j}] is {type(message).__name__}, not a dict; "
                    'pass {"role": "user", "content": "..."}'
                )
            bad = [k for k in ("role", "content") if not isinstance(message.get(k), str)]
            if bad == ["content"] and message.get("content") is None and message.get("tool_calls"):
                bad = []
            if bad:
                raise InputError(
                    f"{call}: messages[{i}][{j}] has no string {' or '.join(repr(k) for k in bad)} "
                    f"(keys: {', '.join(map(repr, message)) or 'none'}); each message needs a role and a content string"
                )
    return [list(conversation) for conversation in messages]


@functools.lru_cache(maxsize=8)
def compiled_template(template: str):
    """The template compiled in a sandbox set up as transformers sets up its own (chat_template_utils)."""
    import datetime
    import json

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps its
        body as it is."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes HTML characters; transformers' does not, and takes these options.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    sandbox = budgeted(ImmutableSandboxedEnvironment)
    env = sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = bounded_filters(env.filters)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    compiled = env.from_string(template)
    bound_joins(compiled)
    return compiled


def _chat_spec(spec: dict) -> tuple[str, dict]:
    """The artifact's template and the special tokens it is rendered with; an InputError where it has none."""
    if "chat_template" not in spec:
        raise InputError(
            "this artifact was built without its chat template; rebuild it (the export stage carries it now) to "
            "pass messages, or pass prompts as text"
        )
    chat = spec["chat_template"]
    if chat is None:
        raise InputError(
            "this checkpoint has no chat template (its tokenizer_config.json sets no chat_template), so it cannot "
            "take messages; pass prompts as text, or build a checkpoint that has one"
        )
    if not (
        isinstance(chat, dict)
        and isinstance(chat.get("template"), str)
        and isinstance(chat.get("special_tokens"), dict)
    ):
        raise ArtifactError(
            "the artifact's model.chat_template is not a table of template and special_tokens; rebuild it"
        )
    return chat["template"], chat["special_tokens"]


def _compiled(template_text: str):
    import jinja2

    try:
        return compiled_template(template_text)
    except jinja2.TemplateSyntaxError as err:
        raise ArtifactError(f"the artifact's chat template does not compile ({err}); rebuild it") from None


@functools.lru_cache(maxsize=8)
def _reads_tools(template_text: str) -> bool:
    from jinja2 import meta

    environment = _compiled(template_text).environment
    return "tools" in meta.find_undeclared_variables(environment.parse(template_text))


def template_uses_tools(spec: dict) -> bool:
    """Whether the artifact's chat template reads `tools` at all (a template that does not would drop them)."""
    return _reads_tools(_chat_spec(spec)[0])


def _check_tools(spec: dict, tools, call: str) -> list | None:
    if tools is None:
        return None
    if not isinstance(tools, list | tuple) or not all(isinstance(t, dict) for t in tools):
        raise InputError(f"{call}: tools takes a list of tool dicts (OpenAI's {{'type': 'function', ...}}), or None")
    if tools and not template_uses_tools(spec):
        raise InputError(
            f"{call}: the artifact's chat template does not use tools, so they would be ignored; pass tools=None, "
            "or build from a checkpoint whose template renders them"
        )
    return list(tools) or None


def render_chats(spec: dict, messages, call: str = "generate()", tools=None) -> ChatPrompts:
    """Each conversation of `messages` rendered with the artifact's chat template and the generation prompt (the
    text that opens the assistant's turn), as transformers' apply_chat_template(..., add_generation_prompt=True).
    `tools` (a list of tool dicts, as apply_chat_template(tools=...) takes them) is given to the template; an
    InputError where the template does not read tools."""
    conversations = check_messages(messages, call)
    template_text, special_tokens = _chat_spec(spec)
    template = _compiled(template_text)
    tools = _check_tools(spec, tools, call)
    rendered = ChatPrompts()
    for i, conversation in enumerate(conversations):
        try:
            rendered.append(
                render_bounded(
                    template,
                    messages=conversation,
                    tools=tools,
                    documents=None,
                    add_generation_prompt=True,
                    **special_tokens,
                )
            )
        except BudgetExceeded as err:
            raise InputError(
                f"{call}: the checkpoint's chat template ran out of its budget on messages[{i}] ({err}); send "
                "shorter messages, or rebuild from a checkpoint whose template does not loop or grow without bound"
            ) from None
        except Exception as err:  # a template raises what it likes (raise_exception, TypeError, ...): all mean this
            first = (str(err).splitlines() or [""])[0]
            raise InputError(
                f"{call}: the checkpoint's chat template refused messages[{i}] ({type(err).__name__}: {first})"
            ) from None
    return rendered


def chat_prompts(spec: dict, prompts, messages, call: str, tools=None):
    """What a generation call encodes: its prompts as they are, or its `messages` rendered (ChatPrompts) with
    `tools`."""
    if messages is None:
        if tools is not None:
            raise InputError(f"{call}: tools go with messages (a chat); pass messages, or leave tools out")
        if prompts is None:
            raise InputError(f"{call} needs prompts (a list of strings) or messages (a list of conversations)")
        return prompts
    if prompts is not None:
        raise InputError(f"{call} takes prompts or messages, not both; pass one of them")
    return render_chats(spec, messages, call, tools)
