"""The build side of chat: which template the export carries into a decoder spec, and its check that the runtime
renders it as transformers does."""

import pytest
import transformers

from pipeline.build.inputs.chat_template import chat_template_spec
from pipeline.errors import ExportError
from tests.chat_templates import GEMMA, SMOLLM2


@pytest.fixture
def tokenizer(tiny_gpt2):
    return transformers.AutoTokenizer.from_pretrained(tiny_gpt2)


def test_chat_template_spec_is_none_when_the_tokenizer_has_no_template(tokenizer):
    assert tokenizer.chat_template is None
    assert chat_template_spec(tokenizer) is None


def test_chat_template_spec_carries_the_template_and_special_token_strings(tokenizer):
    tokenizer.chat_template = GEMMA
    spec = chat_template_spec(tokenizer)
    assert spec["template"] == GEMMA
    assert spec["special_tokens"] == {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
    }


def test_chat_template_spec_takes_the_default_of_named_templates_or_none_without_one(tokenizer):
    tokenizer.chat_template = {"default": SMOLLM2, "tool_use": GEMMA}
    assert chat_template_spec(tokenizer)["template"] == SMOLLM2
    tokenizer.chat_template = {"tool_use": GEMMA}
    assert chat_template_spec(tokenizer) is None


def test_chat_template_spec_raises_export_error_when_the_runtime_renders_other_text(tokenizer):
    # jinja's random filter draws anew on each render: transformers' text and the runtime's differ.
    tokenizer.chat_template = "{{ range(100000) | random }}-{{ range(100000) | random }}"
    with pytest.raises(ExportError, match="the runtime renders the checkpoint's chat template as"):
        chat_template_spec(tokenizer)


def test_chat_template_spec_keeps_a_template_that_refuses_the_probe(tokenizer):
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('a system message first') }}{% endif %}x"
    tokenizer.chat_template = template
    assert chat_template_spec(tokenizer)["template"] == template


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}x",
    ],
    ids=["loops", "grows"],
)
def test_chat_template_spec_raises_export_error_before_transformers_renders_an_unbounded_template(tokenizer, template):
    tokenizer.chat_template = template
    with pytest.raises(ExportError, match=r"chat template ran out of its budget on messages\[0\]") as err:
        chat_template_spec(tokenizer)  # transformers' own rendering would hang here, or take gigabytes
    assert "\n" not in str(err.value)
