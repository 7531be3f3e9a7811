"""The checkpoint's chat template, carried into a decoder artifact's runtime spec (see docs/chat.md).

transformers reads the template from tokenizer_config.json or chat_template.jinja (`tokenizer.chat_template`) and
renders it with the tokenizer's special tokens (`special_tokens_map`: bos_token, eos_token, ...) as variables. The
spec carries both, so that the runtime (pipeline/runtime/chat.py) renders the same text without transformers:

    "chat_template": {"template": "{{ bos_token }}{% for message in messages %}...", "special_tokens": {...}}

or None where the checkpoint has no template (a base model): the runtime then refuses messages in one line.
"""

from __future__ import annotations

from pipeline.errors import ExportError, PipelineError

# Rendered at build time by transformers and by the runtime: the two must give the same text.
PROBE_CONVERSATION = ({"role": "user", "content": "What is the capital of France?"},)


def chat_template_spec(tokenizer) -> dict | None:
    """The template transformers' `apply_chat_template` would use (the "default" one of a named set) and the
    special-token strings it is rendered with; None where the tokenizer has none. An ExportError where the
    runtime's rendering of a probe conversation differs from transformers'."""
    try:
        template = tokenizer.get_chat_template()
    except ValueError:  # no template, or a named set without a "default" one: transformers cannot pick either
        return None
    if not isinstance(template, str) or not template.strip():
        return None
    tokens = {
        key: value
        for key, value in tokenizer.special_tokens_map.items()
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    }
    spec = {"template": template, "special_tokens": tokens}
    _check_probe(tokenizer, spec)
    return spec


def _check_probe(tokenizer, spec: dict) -> None:
    """The runtime renders a probe conversation first, within its budget (a template that loops or grows without
    bound fails here, where transformers' rendering would hang the export), then compares with transformers'."""
    from pipeline.runtime.chat import render_chats

    conversation = [dict(m) for m in PROBE_CONVERSATION]
    try:
        [got] = render_chats({"chat_template": spec}, [conversation], "export")
        ours = None
    except PipelineError as err:
        if "ran out of its budget" in str(err):
            raise ExportError(f"the checkpoint's chat template {str(err).removeprefix('export: ')}") from None
        got, ours = None, err
    try:
        expected = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    except Exception:  # the template refuses a lone user turn (it wants a system one, say): nothing to compare
        return
    if ours is not None:
        raise ExportError(f"the runtime cannot render the checkpoint's chat template, which transformers can: {ours}")
    if got != expected:
        raise ExportError(
            f"the runtime renders the checkpoint's chat template as {got!r}, transformers as {expected!r}; "
            "the template uses something the runtime's sandbox does not provide"
        )
