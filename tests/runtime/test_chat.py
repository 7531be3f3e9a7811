"""Chat: the runtime renders a checkpoint's chat template to the text and token ids transformers'
apply_chat_template gives, and generate(messages=...) continues them as transformers' generate does."""

import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers

from pipeline.build.inputs.chat_template import chat_template_spec
from pipeline.errors import ArtifactError, InputError
from pipeline.runtime import load
from pipeline.runtime.chat import ChatPrompts, check_messages, render_chats
from pipeline.runtime.generation import Generator
from pipeline.runtime.load import open_model
from pipeline.runtime.text import open_tokenizer
from tests.chat_templates import STYLES, add_chat_template
from tests.conftest import REPO
from tests.tiny import make_decoder
from tools.smollm2 import DEFAULT as SMOLLM2_CHECKPOINT

# Each style on a family whose tokenizer it suits: SmolLM2 is a llama (whose tiny tokenizer adds <s> to plain
# text, which a chat must not get), Qwen2.5 a qwen2, Gemma's template writes the BOS itself.
FAMILIES = {"smollm2": "llama", "qwen2": "qwen2", "gemma": "llama"}
SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is the capital of France?"}],
    "system": [SYSTEM, {"role": "user", "content": "What is the capital of France?"}],
    "multi-turn": [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "  Name a café in Zürich.\n"},
    ],
    "system multi-turn": [
        SYSTEM,
        {"role": "user", "content": "Two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And times three?"},
    ],
}
# Qwen2.5's template also renders tool calls (their arguments through tojson, non-ASCII kept) and tool results.
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Zürich?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": "weather", "arguments": {"city": "Zürich", "unit": "°C"}}}
        ],
    },
    {"role": "tool", "content": "21 degrees"},
]


@pytest.fixture(scope="module")
def chat_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A tiny decoder per chat template style, with the runtime's tokenizer.json saved as the export saves it."""
    root = tmp_path_factory.mktemp("chat")
    folders = {}
    for style, family in FAMILIES.items():
        folder = add_chat_template(make_decoder(root / style, family), style)
        runtime = root / f"{style}-runtime"
        runtime.mkdir()
        transformers.AutoTokenizer.from_pretrained(folder).backend_tokenizer.save(str(runtime / "tokenizer.json"))
        folders[style] = folder
    return folders


def _runtime_ids(spec: dict, tokenizer_json: Path, conversations) -> list[list[int]]:
    # Generator.encode reads only self.tokenizer: the artifact's Rust tokenizer is all it needs here.
    encoder = SimpleNamespace(tokenizer=open_tokenizer(tokenizer_json))
    return [list(e.ids) for e in Generator.encode(encoder, render_chats(spec, conversations))]


def _cases():
    for style in STYLES:
        for name in CONVERSATIONS:
            yield pytest.param(style, CONVERSATIONS[name], id=f"{style}-{name}")
    yield pytest.param("qwen2", TOOL_TURNS, id="qwen2-tool-calls")


@pytest.mark.parametrize("style, conversation", list(_cases()))
def test_render_chats_text_and_ids_equal_transformers_apply_chat_template(chat_checkpoints, style, conversation):
    folder = chat_checkpoints[style]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    spec = {"chat_template": chat_template_spec(tokenizer)}
    [text] = render_chats(spec, [conversation])
    assert text == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    expected = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
    assert _runtime_ids(spec, folder.parent / f"{style}-runtime" / "tokenizer.json", [conversation]) == [expected]


# Zephyr's template leans on trim_blocks and lstrip_blocks (one block per line, no whitespace control).
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""
# What else transformers gives templates: tojson with its options (no HTML escaping), loop controls, the
# {% generation %} tag, strftime_now, and tools and documents as None.
FEATURES = """{% for message in messages %}
    {% if loop.index0 == 3 %}{% break %}{% endif %}
    {% generation %}{{ message | tojson(indent=1, sort_keys=True) }}<&>{% endgeneration %}
{% endfor %}
{{ strftime_now('%Y') }} {{ tools is none }} {{ documents is none }} {{ eos_token }}"""


@pytest.mark.parametrize("template", [ZEPHYR, FEATURES], ids=["zephyr", "features"])
def test_render_chats_equals_transformers_on_whitespace_rules_and_template_globals(tiny_gpt2, template):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_gpt2)
    tokenizer.chat_template = template
    spec = {"chat_template": chat_template_spec(tokenizer)}
    for conversation in [*CONVERSATIONS.values(), TOOL_TURNS]:
        [text] = render_chats(spec, [conversation])
        assert text == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)


def test_chat_ids_hold_the_templates_bos_once_and_none_where_it_writes_none(chat_checkpoints):
    conversation = CONVERSATIONS["user"]
    for style, bos_count in (("gemma", 1), ("smollm2", 0)):  # the tiny llama tokenizer adds <s> to plain text
        tokenizer = transformers.AutoTokenizer.from_pretrained(chat_checkpoints[style])
        spec = {"chat_template": chat_template_spec(tokenizer)}
        [ids] = _runtime_ids(
            spec, chat_checkpoints[style].parent / f"{style}-runtime" / "tokenizer.json", [conversation]
        )
        assert ids.count(tokenizer.bos_token_id) == bos_count, style


@pytest.fixture(scope="module")
def chat_artifact(chat_checkpoints, texts_file, tmp_path_factory) -> Path:
    """The Gemma-style tiny llama built for cpu-fp32 (exact), once per module."""
    from pipeline.build.table import build

    root = tmp_path_factory.mktemp("chat-build")
    manifest = build(
        chat_checkpoints["gemma"],
        "cpu-fp32",
        artifacts_dir=root / "a",
        cache_dir=root / "c",
        validation=texts_file,
        calibration=texts_file,
    )
    return Path(manifest.published.path)


def test_generate_messages_equals_transformers_generate_on_apply_chat_template_ids(chat_artifact, chat_checkpoints):
    model = load(chat_artifact)
    folder = chat_checkpoints["gemma"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    conversations = [CONVERSATIONS[name] for name in ("user", "system", "system multi-turn")]
    completions = model.generate(messages=conversations, max_new_tokens=16, batch_size=len(conversations))
    streamed = {}
    for event in model.stream(messages=conversations, max_new_tokens=16, batch_size=1):
        streamed.setdefault(event.index, []).append(event.token_id)
    for i, (conversation, completion) in enumerate(zip(conversations, completions, strict=True)):
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        assert [list(e.ids) for e in model.encode(render_chats(model.spec, [conversation]))] == [ids]
        prompt = torch.tensor([ids])
        with torch.inference_mode():
            out = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=16,
                pad_token_id=tokenizer.eos_token_id,
            )
        assert completion.token_ids == tuple(out[0, len(ids) :].tolist())
        assert tuple(streamed[i]) == completion.token_ids


def test_published_spec_carries_the_checkpoints_template_and_special_tokens(chat_artifact, chat_checkpoints):
    spec = json.loads((chat_artifact / "manifest.json").read_text())["model"]["chat_template"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(chat_checkpoints["gemma"])
    assert spec["template"] == tokenizer.chat_template
    assert spec["special_tokens"]["bos_token"] == "<s>" and spec["special_tokens"]["eos_token"] == "<end_of_turn>"


def test_cli_generate_chat_sends_each_prompt_as_one_user_message(chat_artifact):
    prompts = ["What is the capital of France?", "Hi!"]
    expected = load(chat_artifact).generate(
        messages=[[{"role": "user", "content": p}] for p in prompts], max_new_tokens=8, batch_size=1
    )
    out = subprocess.run(
        [sys.executable, "-m", "pipeline", "generate", str(chat_artifact), *prompts, "--chat", "--max-new-tokens", "8"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    for prompt, completion in zip(prompts, expected, strict=True):
        assert f"{prompt}\n{completion.text}\n[{completion.finish_reason}]" in out.stdout


def test_generate_messages_raises_input_error_when_the_checkpoint_has_no_chat_template(chat_artifact):
    spec = json.loads((chat_artifact / "manifest.json").read_text())["model"]
    plain = open_model(chat_artifact / "model.onnx", chat_artifact / "tokenizer.json", {**spec, "chat_template": None})
    with pytest.raises(InputError, match="this checkpoint has no chat template") as err:
        plain.generate(messages=[CONVERSATIONS["user"]])
    assert "\n" not in str(err.value)
    older = {k: v for k, v in spec.items() if k != "chat_template"}  # built before artifacts carried templates
    with pytest.raises(InputError, match="built without its chat template; rebuild it"):
        open_model(chat_artifact / "model.onnx", chat_artifact / "tokenizer.json", older).stream(messages=[[SYSTEM]])


def test_generate_raises_input_error_when_given_prompts_and_messages_or_neither(chat_artifact):
    model = load(chat_artifact)
    with pytest.raises(InputError, match="takes prompts or messages, not both"):
        model.generate(["hello"], messages=[CONVERSATIONS["user"]])
    with pytest.raises(InputError, match=r"needs prompts \(a list of strings\) or messages"):
        model.stream()


def test_template_refusal_is_an_input_error_with_its_message(chat_artifact):
    model = load(chat_artifact)
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InputError, match=r"refused messages\[1\] \(TemplateError: Conversation roles must alternate"):
        model.generate(messages=[CONVERSATIONS["user"], two_users])


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user", "content": "hi"}], "got one conversation; wrap it: messages=[conversation]"),
        ({"role": "user", "content": "hi"}, "got one conversation"),
        ("hi", 'takes a list of conversations, each a list of {"role": ..., "content": ...} dicts, got str'),
        ([], "got an empty list"),
        ([[]], "messages[0] is an empty list"),
        ([["hi"]], "messages[0][0] is str, not a dict"),
        ([[{"role": "user"}]], "messages[0][0] has no string 'content' (keys: 'role')"),
        ([[{"role": "user", "content": 3}]], "has no string 'content'"),
        ([[{"content": "hi"}], "x"], "has no string 'role'"),
        ([[{"role": "assistant", "content": None}]], "has no string 'content'"),
    ],
)
def test_check_messages_raises_one_line_input_error_naming_the_problem(messages, message):
    with pytest.raises(InputError, match=re.escape(message)) as err:
        check_messages(messages, "generate()")
    assert "\n" not in str(err.value)


# Tools as transformers' apply_chat_template(tools=...) passes them to Qwen2.5's template, and a conversation that
# sends a call back as OpenAI's clients do (content null).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city, in °C.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "local_time", "parameters": {"type": "object"}}},
]
TOOL_RESULT = [TOOL_TURNS[0], {**TOOL_TURNS[1], "content": None}, {**TOOL_TURNS[2], "tool_call_id": "call_1"}]


@pytest.mark.parametrize("conversation", [CONVERSATIONS["system"], TOOL_RESULT], ids=["system", "tool-result"])
def test_render_chats_with_tools_equals_transformers_and_holds_each_tools_json(chat_checkpoints, conversation):
    folder = chat_checkpoints["qwen2"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    spec = {"chat_template": chat_template_spec(tokenizer)}
    [text] = render_chats(spec, [conversation], tools=TOOLS)
    assert text == tokenizer.apply_chat_template(conversation, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert all(json.dumps(tool, ensure_ascii=False) in text for tool in TOOLS)
    assert render_chats(spec, [conversation], tools=[]) == render_chats(spec, [conversation])
    assert "<tools>" not in render_chats(spec, [conversation])[0]


def test_render_chats_refuses_tools_where_the_template_does_not_use_them():
    from tests.chat_templates import QWEN2, SMOLLM2

    smollm2 = {"chat_template": {"template": SMOLLM2, "special_tokens": {}}}
    with pytest.raises(InputError, match="the artifact's chat template does not use tools") as err:
        render_chats(smollm2, [CONVERSATIONS["user"]], tools=TOOLS)
    assert "\n" not in str(err.value)
    qwen2 = {"chat_template": {"template": QWEN2, "special_tokens": {}}}
    with pytest.raises(InputError, match="tools takes a list of tool dicts"):
        render_chats(qwen2, [CONVERSATIONS["user"]], tools="weather")
    with pytest.raises(InputError, match="tools go with messages"):
        Generator.generate(SimpleNamespace(spec=qwen2), ["a prompt"], tools=TOOLS)


def test_render_chats_raises_artifact_error_on_a_damaged_spec():
    with pytest.raises(ArtifactError, match="model.chat_template is not a table"):
        render_chats({"chat_template": {"template": 3}}, [CONVERSATIONS["user"]])


def test_render_chats_runs_templates_in_a_sandbox():
    spec = {"chat_template": {"template": "{{ messages.__class__.__mro__ }}", "special_tokens": {}}}
    with pytest.raises(InputError, match="SecurityError"):
        render_chats(spec, [CONVERSATIONS["user"]])
    mutating = {"chat_template": {"template": "{{ messages.append(1) }}", "special_tokens": {}}}
    with pytest.raises(InputError, match="SecurityError"):
        render_chats(mutating, [CONVERSATIONS["user"]])


def test_render_chats_returns_prompts_marked_to_encode_without_special_tokens():
    spec = {
        "chat_template": {
            "template": "{{ bos_token }}{{ messages[0].content }}",
            "special_tokens": {"bos_token": "<s>"},
        }
    }
    rendered = render_chats(spec, [CONVERSATIONS["user"]])
    assert isinstance(rendered, ChatPrompts) and rendered == ["<s>What is the capital of France?"]


@pytest.mark.slow
@pytest.mark.skipif(not (SMOLLM2_CHECKPOINT / "tokenizer_config.json").is_file(), reason="needs `make smollm2`")
def test_smollm2_rendered_chat_and_ids_equal_transformers(tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(SMOLLM2_CHECKPOINT)
    tokenizer.backend_tokenizer.save(str(tmp_path / "tokenizer.json"))
    spec = {"chat_template": chat_template_spec(tokenizer)}
    assert spec["chat_template"] is not None
    for conversation in CONVERSATIONS.values():
        [text] = render_chats(spec, [conversation])
        assert text == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.apply_chat_template(conversation, tokenize=True, add_generation_prompt=True)
        assert _runtime_ids(spec, tmp_path / "tokenizer.json", [conversation]) == [ids]


_HUNG = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize(
    "template, why",
    [
        (_HUNG, "rendering took over"),
        ("{{ 'a' * 10**9 }}", "repetition to 1000000000 items"),
        ("{{ 'a'|center(1000000000) }}", "a count of 1000000000"),
        ("{{ 'a'.ljust(1000000000) }}", "a count of 1000000000"),
        ("{{ 10 ** 10000000 }}", "the power 10 \\*\\* 10000000"),
        ("{% set n = namespace(s='ab') %}{% for i in range(40) %}{% set n.s = n.s ~ n.s %}{% endfor %}", "joined"),
        ("{% set n = namespace(s='ab') %}{% for i in range(40) %}{% set n.s = n.s + n.s %}{% endfor %}", "concat"),
        ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "rendered text is over"),
    ],
)
def test_render_chats_refuses_a_template_past_its_budget_in_one_line(template, why):
    spec = {"chat_template": {"template": template, "special_tokens": {}}}
    with pytest.raises(InputError, match=f"ran out of its budget on messages\\[0\\] \\(.*{why}") as err:
        render_chats(spec, [[{"role": "user", "content": "hi"}]])
    assert "\n" not in str(err.value)


def test_render_chats_bounds_a_template_that_loops_only_on_some_messages():
    template = (
        "{% for m in messages %}{% if m.content.startswith('!!') %}" + _HUNG + "{% endif %}{{ m.content }}{% endfor %}"
    )
    spec = {"chat_template": {"template": template, "special_tokens": {}}}
    assert render_chats(spec, [[{"role": "user", "content": "hello"}]]) == ["hello"]
    with pytest.raises(InputError, match="rendering took over"):
        render_chats(spec, [[{"role": "user", "content": "!!hello"}]])
    assert render_chats(spec, [[{"role": "user", "content": "again"}]]) == ["again"]  # still serves
