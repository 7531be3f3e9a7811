"""onnx_from_text2text_checkpoint: an encoder-decoder text model (T5, mT5, BART, mBART, Marian, M2M100/NLLB)
becomes two ONNX graphs and a tokenizer.

    encoder.onnx  input_ids [b, t], attention_mask [b, t] -> cross.{i}.key / cross.{i}.value [b, h, t, d]
    decoder.onnx  input_ids [b, s], encoder_attention_mask [b, t], past.{i}.key / .value [b, h, p, d],
                  cross.{i}.key / .value -> logits [b, s, vocab], present.{i}.key / .value [b, h, p + s, d]

Both graphs are the checkpoint's own transformers modules, traced; no family's attention is written out here, so
any family whose decoder takes transformers' EncoderDecoderCache exports the same way. The encoder graph runs the
encoder, then one decoder step on an empty cache, and returns the cross-attention keys and values that step put in
the cache (the rest of the step is dead and the exporter drops it): they are computed once per input. The decoder
graph rebuilds the cache from its inputs with the cross-attention part marked filled, so each step reads it rather
than projecting the encoder's states again. Every row decodes in step from the same prompt, so the decoder needs
no padding mask of its own; `encoder_attention_mask` masks the padded source tokens.
The probe checks both graphs against transformers' model on a padded batch of two texts, at the prompt and at one
cached step: a family whose modules do not trace this way is refused here, not published.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.build.accuracy.models import load_hf_tokenizer, load_torch_model
from pipeline.build.inputs.architectures import architecture_of
from pipeline.build.inputs.tokenizer_patterns import check_tokenizer_patterns
from pipeline.build.manifest import Checkpoint
from pipeline.build.onnx_files import traced_to_onnx
from pipeline.errors import ExportError
from pipeline.runtime.schema import DECODER_GRAPH, ENCODER_GRAPH, TOKENIZER
from pipeline.runtime.seq2seq import cache_names
from pipeline.runtime.text import padded_rows

OPSET = 17
PROBE_TEXTS = ("A short probe.", "A somewhat longer probe sentence, so that the batch needs padding.")


def _cache_tensors(cache) -> list:
    return [t for layer in cache.layers for t in (layer.keys, layer.values)]


def _modules(model, layers: int):
    import torch
    from transformers.cache_utils import DynamicCache, EncoderDecoderCache

    class Encoder(torch.nn.Module):
        """The text encoder, then the cross-attention cache of one decoder step over its output."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            hidden = self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
            start = torch.zeros(input_ids.shape[0], 1, dtype=torch.long)
            self.model.get_decoder()(
                input_ids=start,
                encoder_hidden_states=hidden,
                encoder_attention_mask=attention_mask,
                past_key_values=cache,
                use_cache=True,
            )
            return tuple(_cache_tensors(cache.cross_attention_cache))

    class Decoder(torch.nn.Module):
        """One decoding step over new tokens, with the self-attention cache in and out."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, encoder_attention_mask, *caches):
            past, cross = caches[: 2 * layers], caches[2 * layers :]
            own, fixed = DynamicCache(), DynamicCache()
            for i in range(layers):
                own.update(past[2 * i], past[2 * i + 1], i)
                fixed.update(cross[2 * i], cross[2 * i + 1], i)
            cache = EncoderDecoderCache(own, fixed)
            for i in range(layers):
                cache.is_updated[i] = True  # cross-attention reads the cache, never the (absent) encoder states
            batch, frames = cross[0].shape[0], cross[0].shape[2]
            hidden = self.model.get_decoder()(
                input_ids=input_ids,
                encoder_hidden_states=torch.zeros(batch, frames, 1),
                encoder_attention_mask=encoder_attention_mask,
                past_key_values=cache,
                use_cache=True,
                cache_position=torch.arange(input_ids.shape[1]) + past[0].shape[2],
            ).last_hidden_state
            return (_logits(self.model, hidden), *_cache_tensors(cache.self_attention_cache))

    return Encoder().eval(), Decoder().eval()


def _logits(model, hidden):
    """The LM head as the family's forward applies it: T5 scales tied embeddings' states, BART-likes add a bias."""
    if getattr(model.config, "model_type", "") in ("t5", "mt5", "umt5") and model.config.tie_word_embeddings:
        hidden = hidden * (model.config.d_model**-0.5)
    logits = model.lm_head(hidden)
    bias = getattr(model, "final_logits_bias", None)
    return logits if bias is None else logits + bias


def decoder_layers(config) -> int:
    """The decoder's layer count under the config's name for it."""
    for name in ("decoder_layers", "num_decoder_layers", "num_layers"):
        if isinstance(getattr(config, name, None), int):
            return int(getattr(config, name))
    raise ExportError(f"{config.model_type}: the config names no decoder layer count (decoder_layers, num_layers)")


def _probe_batch(tokenizer):
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return padded_rows([tokenizer(t)["input_ids"] for t in PROBE_TEXTS], pad)


def _export_graphs(model, tokenizer, out: Path, prompt: list[int], layers: int) -> None:
    import torch

    encoder, decoder = _modules(model, layers)
    ids, mask = (torch.from_numpy(a) for a in _probe_batch(tokenizer))
    cross_names, past_names = cache_names(layers, "cross"), cache_names(layers, "past")
    with torch.no_grad():
        cross = encoder(ids, mask)
    source_axes = {"input_ids": {0: "batch", 1: "source"}, "attention_mask": {0: "batch", 1: "source"}}
    cache_axes = {n: {0: "batch", 2: "source"} for n in cross_names}
    names = (["input_ids", "attention_mask"], cross_names)
    traced_to_onnx(encoder, (ids, mask), out / ENCODER_GRAPH, names, {**source_axes, **cache_axes}, OPSET)
    # Traced with a non-empty past and several new tokens, so neither length is taken for a constant.
    heads, head_dim = cross[0].shape[1], cross[0].shape[3]
    past = [torch.zeros(len(ids), heads, 2, head_dim) for _ in past_names]
    new = torch.tensor([prompt[:1] * 3] * len(ids))
    axes = {
        "input_ids": {0: "batch", 1: "tokens"},
        "encoder_attention_mask": {0: "batch", 1: "source"},
        "logits": {0: "batch", 1: "tokens"},
        **{n: {0: "batch", 2: "past"} for n in past_names},
        **cache_axes,
        **{n: {0: "batch", 2: "total"} for n in cache_names(layers, "present")},
    }
    names = (
        ["input_ids", "encoder_attention_mask", *past_names, *cross_names],
        ["logits", *cache_names(layers, "present")],
    )
    traced_to_onnx(decoder, (new, mask, *past, *cross), out / DECODER_GRAPH, names, axes, OPSET)
    model.eval()  # the exporter puts the wrappers back in their mode, which reaches the model


def _probe(model, tokenizer, out: Path, prompt: list[int], layers: int) -> tuple[float, int, int]:
    """Max |ONNX - PyTorch| of the logits at the prompt (empty cache) and at one more token fed with the cache;
    with the cache's heads and head size, as the graphs give them."""
    import numpy as np
    import onnxruntime as ort
    import torch

    ids, mask = _probe_batch(tokenizer)
    options = {"providers": ["CPUExecutionProvider"]}
    encoder = ort.InferenceSession(str(out / ENCODER_GRAPH), **options)
    decoder = ort.InferenceSession(str(out / DECODER_GRAPH), **options)
    cross = dict(
        zip(cache_names(layers, "cross"), encoder.run(None, {"input_ids": ids, "attention_mask": mask}), strict=True)
    )
    heads, head_dim = cross["cross.0.key"].shape[1], cross["cross.0.key"].shape[3]
    past = {n: np.zeros((len(ids), heads, 0, head_dim), np.float32) for n in cache_names(layers, "past")}
    start = np.array([prompt] * len(ids), dtype=np.int64)
    feeds = {"encoder_attention_mask": mask, **cross}
    first = decoder.run(None, {"input_ids": start, **past, **feeds})
    token = first[0][:, -1:].argmax(-1).astype(np.int64)
    past = dict(zip(cache_names(layers, "past"), first[1:], strict=True))
    second = decoder.run(None, {"input_ids": token, **past, **feeds})[0]
    with torch.inference_mode():
        decoded = torch.from_numpy(np.concatenate([start, token], axis=1))
        expected = model(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), decoder_input_ids=decoded
        ).logits.numpy()
    got = np.concatenate([first[0], second], axis=1)
    if not np.isfinite(got).all():
        raise ExportError("the exported text-to-text model outputs NaN or inf on a probe input")
    return float(np.abs(got - expected).max()), heads, head_dim


def onnx_from_text2text_checkpoint(checkpoint: Checkpoint, out: Path) -> dict:
    """Export an encoder-decoder text checkpoint to `out`/encoder.onnx, decoder.onnx and tokenizer.json, checked
    against PyTorch on a probe batch; returns the runtime spec and the probe's difference."""
    from pipeline.build.text2text.settings import text2text_spec

    model = load_torch_model(checkpoint)
    tokenizer = load_hf_tokenizer(checkpoint)
    layers = decoder_layers(model.config)
    spec = text2text_spec(checkpoint, model.config, tokenizer, layers)
    try:
        _export_graphs(model, tokenizer, out, spec["prompt"], layers)
        diff, heads, head_dim = _probe(model, tokenizer, out, spec["prompt"], layers)
    except (RuntimeError, TypeError, AttributeError, ValueError, IndexError) as err:
        first = (str(err).splitlines() or [""])[0][:200]
        raise ExportError(
            f"{checkpoint.path}: {model.config.model_type}'s decoder does not trace with a cache of tensors "
            f"({type(err).__name__}: {first}); text-to-text families built so far: T5, BART, mBART, Marian, M2M100"
        ) from None
    architecture_of(checkpoint).check_probe(diff, "the exported text-to-text model")
    spec.update(heads=heads, head_dim=head_dim)
    check_tokenizer_patterns(tokenizer.backend_tokenizer.to_str(), checkpoint.path)
    tokenizer.backend_tokenizer.save(str(out / TOKENIZER))
    return {"spec": spec, "probe_max_abs_diff": diff, "graphs": [ENCODER_GRAPH, DECODER_GRAPH]}
