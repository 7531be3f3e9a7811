"""The export stage: onnx_from_checkpoint. A PyTorch checkpoint becomes one ONNX graph plus a Rust tokenizer file.

Encoders: the graph has dynamic batch and sequence axes. For feature extraction the pooling (and a
sentence-transformers checkpoint's Dense modules and normalization) is part of the graph, so its
`sentence_embedding` output equals `SentenceTransformer.encode`, and the engine optimizes and quantizes the Dense
with the rest. The TorchScript exporter is used because ONNX Runtime's transformer fusions recognise its
attention pattern; they find none in the dynamo exporter's graph.

Decoders (causal LMs): optimum-onnx's exporter, which patches each family's attention and cache for tracing,
writes one graph with the KV cache as inputs and outputs, serving both the prompt (past length 0) and each new
token, with dynamic batch, sequence and past-length axes:

    input_ids [b, s], attention_mask [b, p+s], position_ids [b, s], past_key_values.{i}.key/value [b, h, p, d]
      -> logits [b, 1, vocab], present.{i}.key/value [b, h, p+s, d]

Only the last position's logits are computed (see `last_token_logits`).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from pipeline.build.accuracy.reference import load_hf_tokenizer, load_torch_model, pooled_module
from pipeline.build.cache import StageSpec, run_cached
from pipeline.build.console import silenced
from pipeline.build.image_export import export_image_model
from pipeline.build.inputs.architectures import Architecture, architecture_of
from pipeline.build.inputs.architectures.encoders import encoder_inputs, graph_inputs
from pipeline.build.inputs.chat_template import chat_template_spec
from pipeline.build.inputs.targets import Target
from pipeline.build.inputs.tasks import TASKS
from pipeline.build.inputs.tokenizer_patterns import check_tokenizer_patterns
from pipeline.build.manifest import Checkpoint, Manifest
from pipeline.build.memory import release_freed
from pipeline.build.onnx_files import load_graph, save_graph, traced_to_onnx
from pipeline.build.passes.lm_head import last_token_logits
from pipeline.build.speech.export import onnx_from_speech_checkpoint
from pipeline.build.text2text.export import onnx_from_text2text_checkpoint
from pipeline.errors import ExportError, PipelineError
from pipeline.runtime.schema import GRAPH, TOKENIZER

OPSET = 17
VERSION = 12  # 11: speech models (two graphs); 12: their cross-attention keys transposed (text-to-text: new)


@dataclasses.dataclass(frozen=True)
class ExportConfig:
    """What shapes the exported graph and tokenizer. Runtime-only settings (batch size, overlong policy) are not
    here: they change how the artifact is run, not what is exported."""

    opset: int
    task: str
    pooling: dict | None
    max_length: int


STAGE = StageSpec(
    "export",
    VERSION,
    ExportConfig,
    packages=(
        "torch",
        "transformers",
        "optimum",
        "optimum-onnx",
        "onnx",
        "onnxscript",
        "onnxruntime",
        "tokenizers",
        "sentence-transformers",
    ),
)
PROBE_TEXTS = ("A short probe.", "A somewhat longer probe sentence, so that the batch needs padding to line up.")


# generation_config.json settings the runtime's generate() follows; others that change the output are refused.
GENERATION_DEFAULTS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
UNSUPPORTED_GENERATION = {
    "num_beams": 1,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "min_p": None,
    "typical_p": 1.0,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
    "encoder_repetition_penalty": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
}


def _failed(what: str, err: Exception) -> ExportError:
    """One line for an exporter's failure: what could not be done, the exception's type and first line."""
    first = (str(err).splitlines() or [""])[0]
    return ExportError(f"{what} ({type(err).__name__}: {first})")


def generation_settings(checkpoint: Checkpoint, tokenizer) -> dict:
    """The end-of-sequence ids and sampling defaults of the checkpoint's generation_config.json."""
    from transformers import AutoConfig, GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(checkpoint.path).to_dict()
    except OSError:  # no generation_config.json: transformers falls back to the model config
        model_config = AutoConfig.from_pretrained(checkpoint.path, trust_remote_code=False)
        config = GenerationConfig.from_model_config(model_config).to_dict()
    changed = sorted(k for k, default in UNSUPPORTED_GENERATION.items() if config.get(k, default) != default)
    if changed:
        raise ExportError(
            f"{checkpoint.path}/generation_config.json sets {', '.join(changed)}, which the runtime's generate() "
            f"does not implement (it follows {', '.join(GENERATION_DEFAULTS)}); remove them from the file"
        )
    eos = config.get("eos_token_id")
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    return {"eos_token_ids": eos, "defaults": {k: config[k] for k in GENERATION_DEFAULTS}}


def runtime_spec(checkpoint: Checkpoint, tokenizer, input_names: list[str]) -> dict:
    """What the runtime loader needs to feed the graph and read its output: the graph's own inputs, its output,
    the labels of a classifier head, the mask token of a masked-LM head."""
    config = checkpoint.config
    labels = config.get("id2label") if TASKS[checkpoint.task].labelled else None
    spec = {
        "task": checkpoint.task,
        "inputs": input_names,
        "output": TASKS[checkpoint.task].output,
        "max_length": checkpoint.max_length,
        "pad_id": int(tokenizer.pad_token_id or 0),
        "labels": {str(k): v for k, v in labels.items()} if labels else None,
    }
    if checkpoint.task == "fill-mask":
        if tokenizer.mask_token_id is None:
            raise ExportError(f"{checkpoint.path}: a fill-mask model needs a tokenizer with a mask token; it has none")
        spec["mask_id"] = int(tokenizer.mask_token_id)
    return spec


def _decoder_probe(session, model, tokenizer, past_names: list[str], right: bool, max_length: int) -> float:
    """Max |ONNX - PyTorch| of next-token logits on a padded batch (left-padded, or right-padded where the graph
    gives each row its own length): once on the prompts (empty cache), once on one more token fed with the graph's
    own cache, against PyTorch run on the whole left-padded sequence. The prompts stop short of `max_length`, as
    the runtime's do."""
    import numpy as np
    import torch

    from pipeline.runtime.kv_cache import padded, position_ids

    rows = [(tokenizer(t)["input_ids"] or [0])[: max(max_length - 1, 1)] for t in PROBE_TEXTS]
    ids, mask = padded(rows, 0)
    shapes = {i.name: i.shape for i in session.get_inputs()}
    inputs = [i.name for i in session.get_inputs()]

    def onnx_step(new_ids, full_mask, past):
        feeds = {"input_ids": new_ids, "attention_mask": full_mask, **past}
        if "position_ids" in inputs:
            last = (full_mask.sum(1, keepdims=True) - 1) if right else position_ids(full_mask)[:, -1:]
            feeds["position_ids"] = position_ids(full_mask) if new_ids.shape[1] > 1 else last
        outs = session.run(None, feeds)
        # Each row's own last real position: a right-padded row's is not the last column.
        past_length = full_mask.shape[1] - new_ids.shape[1]
        last = np.maximum(full_mask.sum(1) - 1 - past_length, 0) if right else np.full(len(new_ids), -1)
        logits = outs[0][np.arange(len(new_ids)), np.minimum(last, outs[0].shape[1] - 1)]
        return logits, dict(zip(past_names, outs[1:], strict=True))

    def torch_logits(full_ids, full_mask):
        kwargs = {"input_ids": torch.from_numpy(full_ids), "attention_mask": torch.from_numpy(full_mask)}
        if "position_ids" in inputs:
            kwargs["position_ids"] = torch.from_numpy(position_ids(full_mask))
        with torch.inference_mode():
            return model(**kwargs, use_cache=False).logits[:, -1].numpy()

    empty = {n: np.zeros((len(ids), shapes[n][1], 0, shapes[n][3]), dtype=np.float32) for n in past_names}
    onnx_ids, onnx_mask = padded(rows, 0, right=right)
    first, past = onnx_step(onnx_ids, onnx_mask, empty)
    diffs = [np.abs(first - torch_logits(ids, mask)).max()]
    nxt = first.argmax(-1)[:, None].astype(np.int64)
    ids, mask = np.concatenate([ids, nxt], 1), np.concatenate([mask, np.ones_like(nxt)], 1)
    if right:  # each row's new token at its own end
        onnx_mask = np.concatenate([onnx_mask, np.zeros_like(nxt)], 1)
        onnx_mask[np.arange(len(rows)), [len(r) for r in rows]] = 1
    else:
        onnx_mask = mask
    second, _ = onnx_step(nxt, onnx_mask, past)
    diffs.append(np.abs(second - torch_logits(ids, mask)).max())
    if not all(np.isfinite(d) for d in diffs):
        raise ExportError("the exported decoder outputs NaN or inf on a probe input")
    return float(max(diffs))


def _fused_attention(graph, model, arch: Architecture, max_length: int) -> dict:
    """Rewrite the graph's attention into GroupQueryAttention where the architecture allows; what was done, or
    why not. `cache` tells the runtime whether present may share past's buffer ("shared") or grows ("concat")."""
    from pipeline.build.passes.attention import body, gqa_from_decomposed, rotary_cache

    problem = arch.why_not_fused(model)
    if problem is None:
        config = model.config
        layers, heads = config.num_hidden_layers, config.num_attention_heads
        options = [arch.layer_attention_options(config, layer) for layer in range(layers)]
        has_rotary = hasattr(body(model), "rotary_emb")
        names = {o.get("rotary", "rotary_emb") for o in options} - {None} if has_rotary else set()
        rotary = {name: rotary_cache(model, max_length, name) for name in sorted(names)}
        try:
            counts = gqa_from_decomposed(
                graph, arch.attention, layers, heads, getattr(config, "num_key_value_heads", heads), rotary, options
            )
            attributes = [{k: v for k, v in o.items() if k != "rotary"} for o in options]
            return {**counts, "cache": "shared", "attributes": attributes}
        except LookupError as err:
            problem = f"the export's attention is not laid out as expected: no {err}"
    return {"op": None, "why": problem, "nodes": len(graph.graph.node), "cache": "concat"}


def _export_decoder(checkpoint: Checkpoint, arch: Architecture, out: Path) -> dict:
    import onnxruntime as ort
    from optimum.exporters.onnx import main_export

    tokenizer = load_hf_tokenizer(checkpoint)
    generation = generation_settings(checkpoint, tokenizer)
    scratch = out / "optimum"
    with silenced("optimum", "transformers"):
        try:
            main_export(
                checkpoint.path,
                scratch,
                task="text-generation-with-past",
                opset=OPSET,
                do_validation=False,
                # Its post-processing only replaces a tied head's transposed weight copy by a Transpose of the
                # embedding, which the optimize stage folds back into a copy; Gemma 3's is not even found. It
                # reloads, checks and rewrites the whole graph for that (24 s of Gemma 3 270M's export).
                no_post_process=True,
                library_name="transformers",
                local_files_only=True,
                trust_remote_code=False,
            )
        except Exception as err:  # optimum and torch raise many types; all mean the same to the user
            what = f"optimum could not export {checkpoint.path} for text generation with a KV cache"
            raise _failed(what, err) from None
    release_freed()  # optimum's copy of the model, before this stage loads its own
    model = load_torch_model(checkpoint)
    graph = load_graph(scratch / GRAPH)
    sliced = last_token_logits(graph)
    attention = _fused_attention(graph, model, arch, checkpoint.max_length)
    save_graph(graph, out / GRAPH, consume=True)  # the stage reads the file from here on
    del graph
    release_freed()  # the graph's weights, before ONNX Runtime loads them again beside the PyTorch model
    shutil.rmtree(scratch)
    session = ort.InferenceSession(str(out / GRAPH), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    past = [n for n in names if n.startswith("past_key_values.")]
    present = [o.name for o in session.get_outputs()][1:]
    if not past or len(past) != len(present):
        raise ExportError(f"the exported graph of {checkpoint.path} has no KV cache inputs and outputs: {names}")
    right = attention["cache"] == "shared"  # GroupQueryAttention: each row its own length, padded on the right
    diff = _decoder_probe(session, model, tokenizer, past, right, checkpoint.max_length)
    arch.check_probe(diff, "the exported decoder")
    check_tokenizer_patterns(tokenizer.backend_tokenizer.to_str(), checkpoint.path)  # what is published
    tokenizer.backend_tokenizer.save(str(out / TOKENIZER))
    inputs = [n for n in names if n not in past]
    spec = runtime_spec(checkpoint, tokenizer, inputs)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (generation["eos_token_ids"] or [0])[0]
    spec.update(pad_id=int(pad), past=past, present=present, cache=attention["cache"], **generation)
    spec["padding"] = "right" if right else "left"
    spec["chat_template"] = chat_template_spec(tokenizer)
    return {"spec": spec, "probe_max_abs_diff": diff, "last_token_logits": sliced, "attention": attention}


def onnx_from_checkpoint(checkpoint: Checkpoint, out: Path) -> dict:
    """Export `checkpoint` to `out`/model.onnx and `out`/tokenizer.json, checked against PyTorch on a probe input;
    returns the runtime spec and the probe's difference."""
    arch = architecture_of(checkpoint)
    try:
        if arch.family == "decoder":
            return _export_decoder(checkpoint, arch, out)
        if arch.family == "speech":
            return onnx_from_speech_checkpoint(checkpoint, out)
        if arch.family == "text2text":
            return onnx_from_text2text_checkpoint(checkpoint, out)
        if arch.modality == "image":
            return export_image_model(checkpoint, out)
        return _export_encoder(checkpoint, out)
    except (PipelineError, MemoryError):
        raise
    except Exception as err:  # the model's own forward, or ONNX Runtime on the exported graph, on the probe input
        what = (
            f"{checkpoint.path} ({checkpoint.model_type}) did not export and run on a probe input, so it cannot be "
            "built; the families built end to end are in docs/architectures.md"
        )
        raise _failed(what, err) from err


def _export_encoder(checkpoint: Checkpoint, out: Path) -> dict:
    import numpy as np
    import onnxruntime as ort
    import torch

    tokenizer = load_hf_tokenizer(checkpoint)
    model = load_torch_model(checkpoint)
    offered = encoder_inputs(tokenizer, model)
    probe = tokenizer(list(PROBE_TEXTS), padding=True, return_tensors="pt")
    args = tuple(probe[name] for name in offered)
    wrapper = pooled_module(model, checkpoint, offered)
    task = TASKS[checkpoint.task]
    axes = {name: {0: "batch", 1: "sequence"} for name in offered}
    axes[task.output] = {0: "batch", 1: "sequence"} if task.per_token else {0: "batch"}
    with torch.inference_mode():
        expected = wrapper(*args).numpy()
    if not np.isfinite(expected).all():
        raise ExportError(f"{checkpoint.path}: the PyTorch model itself outputs NaN or inf; its weights are broken")
    try:
        traced_to_onnx(wrapper, args, out / GRAPH, (offered, [task.output]), axes, OPSET)
    except Exception as err:  # torch raises many types while tracing; all mean the same to the user
        what = f"torch.onnx could not export {checkpoint.path} ({checkpoint.model_type}) for {checkpoint.task}"
        raise _failed(what, err) from None
    session = ort.InferenceSession(str(out / GRAPH), providers=["CPUExecutionProvider"])
    try:
        input_names = graph_inputs(session, offered)
    except ValueError as err:
        raise ExportError(f"{checkpoint.path}: {err}") from None
    got = session.run(None, {name: probe[name].numpy() for name in input_names})[0]
    if not np.isfinite(got).all():
        raise ExportError(f"the exported graph of {checkpoint.path} outputs NaN or inf on a probe input")
    diff = float(np.abs(got - expected).max())
    architecture_of(checkpoint).check_probe(diff, "the exported graph")
    check_tokenizer_patterns(tokenizer.backend_tokenizer.to_str(), checkpoint.path)  # what is published
    tokenizer.backend_tokenizer.save(str(out / TOKENIZER))
    spec = runtime_spec(checkpoint, tokenizer, input_names)
    return {"spec": spec, "probe_max_abs_diff": diff, "dropped_inputs": [n for n in offered if n not in input_names]}


def run(manifest: Manifest, target: Target) -> Manifest:
    """Export the checkpoint to ONNX (cached by checkpoint digest and the declared export settings)."""
    checkpoint = manifest.checkpoint
    config = ExportConfig(
        opset=OPSET, task=checkpoint.task, pooling=checkpoint.pooling, max_length=checkpoint.max_length
    )
    inputs = {"checkpoint": checkpoint.digest}
    record = run_cached(manifest.cache_dir, STAGE, config, inputs, lambda out: onnx_from_checkpoint(checkpoint, out))
    return manifest.with_stage(record)
