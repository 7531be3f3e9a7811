"""onnx_from_speech_checkpoint: a Whisper checkpoint becomes two ONNX graphs and a tokenizer.

    encoder.onnx  input_features [b, mels, 3000] -> cross.{i}.key [b, h, d, 1500], cross.{i}.value [b, h, 1500, d]
    decoder.onnx  input_ids [b, s], past.{i}.key / past.{i}.value [b, h, p, d], cross.{i}.key / .value (as above)
                  -> logits [b, s, vocab], present.{i}.key / present.{i}.value [b, h, p + s, d]

The encoder computes each decoder layer's cross-attention keys and values once per window of audio, so a decoding
step projects only its new token; the keys come transposed, so no step transposes them again. The decoder is
written out here from the checkpoint's own modules (the layer norms, projections and MLPs are transformers' objects;
only the attention arithmetic and the cache are spelled out), which gives the exporter a graph without
transformers' cache classes. Every row of a batch decodes in step (the prompt tokens are the same for every row),
so no padding mask is needed: a finished row feeds its end token.
The probe checks both graphs against transformers' model on a probe window, at the first step and one cached step.
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

OPSET = 17


def _heads(x, heads: int):
    """[b, s, h * d] -> [b, h, s, d]."""
    b, s, _ = x.shape
    return x.view(b, s, heads, -1).transpose(1, 2)


def _attend(q, k_t, v, mask=None):
    """Softmax attention of pre-scaled queries `q` [b, h, s, d] over transposed keys `k_t` [b, h, d, t] and values
    [b, h, t, d] -> [b, s, h * d]."""
    import torch

    weights = q @ k_t
    if mask is not None:
        weights = weights + mask
    out = torch.softmax(weights, dim=-1) @ v
    b, h, s, d = out.shape
    return out.transpose(1, 2).reshape(b, s, h * d)


def _modules(model):
    import torch

    class Encoder(torch.nn.Module):
        """The audio encoder, then each decoder layer's cross-attention keys and values of its output."""

        def __init__(self):
            super().__init__()
            self.encoder, self.layers = model.model.encoder, model.model.decoder.layers
            self.heads = model.config.decoder_attention_heads

        def forward(self, input_features):
            hidden = self.encoder(input_features).last_hidden_state
            out = []
            for layer in self.layers:
                attention = layer.encoder_attn
                keys = _heads(attention.k_proj(hidden), self.heads).transpose(2, 3)
                out += [keys, _heads(attention.v_proj(hidden), self.heads)]
            return tuple(out)

    class Decoder(torch.nn.Module):
        """One decoding step over new tokens, with the self-attention cache in and out."""

        def __init__(self):
            super().__init__()
            self.decoder, self.head = model.model.decoder, model.proj_out
            self.heads, self.count = model.config.decoder_attention_heads, len(model.model.decoder.layers)

        def forward(self, input_ids, *caches):
            past, cross = caches[: 2 * self.count], caches[2 * self.count :]
            start, length = past[0].shape[2], input_ids.shape[1]
            positions = self.decoder.embed_positions.weight[start : start + length]
            x = self.decoder.embed_tokens(input_ids) + positions
            query_at = torch.arange(length) + start
            mask = (torch.arange(start + length)[None, :] > query_at[:, None]).to(x.dtype) * torch.finfo(x.dtype).min
            presents = []
            for i, layer in enumerate(self.decoder.layers):
                attention, h = layer.self_attn, layer.self_attn_layer_norm(x)
                q = _heads(attention.q_proj(h) * attention.scaling, self.heads)
                k = torch.cat([past[2 * i], _heads(attention.k_proj(h), self.heads)], dim=2)
                v = torch.cat([past[2 * i + 1], _heads(attention.v_proj(h), self.heads)], dim=2)
                presents += [k, v]
                x = x + attention.out_proj(_attend(q, k.transpose(2, 3), v, mask))
                attention, h = layer.encoder_attn, layer.encoder_attn_layer_norm(x)
                q = _heads(attention.q_proj(h) * attention.scaling, self.heads)
                x = x + attention.out_proj(_attend(q, cross[2 * i], cross[2 * i + 1]))
                x = x + layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(x))))
            return (self.head(self.decoder.layer_norm(x)), *presents)

    return Encoder().eval(), Decoder().eval()


def _probe_features(model):
    """A probe window: log-mel features of a fixed pseudo-random 2 s signal, as the runtime computes them."""
    import numpy as np

    from pipeline.runtime.audio import log_mel_features

    signal = np.random.default_rng(0).standard_normal(32000).astype(np.float32) * 0.1
    return log_mel_features(signal, model.config.num_mel_bins)[None]


def _export_graphs(model, out: Path, prompt: list[int]) -> None:
    import torch

    encoder, decoder = _modules(model)
    config = model.config
    layers, heads = config.decoder_layers, config.decoder_attention_heads
    head_dim = config.d_model // heads
    features = torch.from_numpy(_probe_features(model))
    cross_names, past_names = cache_names(layers, "cross"), cache_names(layers, "past")
    present_names = cache_names(layers, "present")
    with torch.no_grad():  # not inference_mode: the exporter traces through these tensors
        cross = encoder(features)
    cache_axes = {n: {0: "batch", 3 if n.endswith(".key") else 2: "frames"} for n in cross_names}
    names = (["input_features"], cross_names)
    traced_to_onnx(
        encoder, (features,), out / ENCODER_GRAPH, names, {"input_features": {0: "batch"}, **cache_axes}, OPSET
    )
    # Traced with a non-empty past and several new tokens, so neither length is taken for a constant.
    ids = torch.tensor([prompt[:1] * 3])
    past = [torch.zeros(1, heads, 2, head_dim) for _ in past_names]
    axes = {
        "input_ids": {0: "batch", 1: "tokens"},
        "logits": {0: "batch", 1: "tokens"},
        **{n: {0: "batch", 2: "past"} for n in past_names},
        **cache_axes,
        **{n: {0: "batch", 2: "total"} for n in present_names},
    }
    names = (["input_ids", *past_names, *cross_names], ["logits", *present_names])
    traced_to_onnx(decoder, (ids, *past, *cross), out / DECODER_GRAPH, names, axes, OPSET)


def _probe(model, out: Path, prompt: list[int]) -> float:
    """Max |ONNX - PyTorch| of the logits at the prompt (empty cache) and at one more token fed with the cache."""
    import numpy as np
    import onnxruntime as ort
    import torch

    features = _probe_features(model)
    layers = model.config.decoder_layers
    options = {"providers": ["CPUExecutionProvider"]}
    encoder = ort.InferenceSession(str(out / ENCODER_GRAPH), **options)
    decoder = ort.InferenceSession(str(out / DECODER_GRAPH), **options)
    cross = dict(zip(cache_names(layers, "cross"), encoder.run(None, {"input_features": features}), strict=True))
    heads, head_dim = cross["cross.0.value"].shape[1], cross["cross.0.value"].shape[3]
    past = {n: np.zeros((1, heads, 0, head_dim), np.float32) for n in cache_names(layers, "past")}
    ids = np.array([prompt], dtype=np.int64)
    first = decoder.run(None, {"input_ids": ids, **past, **cross})
    token = first[0][:, -1:].argmax(-1).astype(np.int64)
    past = dict(zip(cache_names(layers, "past"), first[1:], strict=True))
    second = decoder.run(None, {"input_ids": token, **past, **cross})[0]
    with torch.inference_mode():
        full = torch.from_numpy(np.concatenate([ids, token], axis=1))
        expected = model(input_features=torch.from_numpy(features), decoder_input_ids=full).logits.numpy()
    got = np.concatenate([first[0], second], axis=1)
    if not np.isfinite(got).all():
        raise ExportError("the exported speech model outputs NaN or inf on a probe input")
    return float(np.abs(got - expected).max())


def onnx_from_speech_checkpoint(checkpoint: Checkpoint, out: Path) -> dict:
    """Export a Whisper checkpoint to `out`/encoder.onnx, decoder.onnx and tokenizer.json, checked against
    PyTorch on a probe window; returns the runtime spec and the probe's difference."""
    from pipeline.build.speech.settings import speech_spec

    model = load_torch_model(checkpoint)
    tokenizer = load_hf_tokenizer(checkpoint)
    spec = speech_spec(checkpoint, model.config)
    _export_graphs(model, out, spec["prompt"])
    diff = _probe(model, out, spec["prompt"])
    architecture_of(checkpoint).check_probe(diff, "the exported speech model")
    check_tokenizer_patterns(tokenizer.backend_tokenizer.to_str(), checkpoint.path)
    tokenizer.backend_tokenizer.save(str(out / TOKENIZER))
    return {"spec": spec, "probe_max_abs_diff": diff, "graphs": [ENCODER_GRAPH, DECODER_GRAPH]}
