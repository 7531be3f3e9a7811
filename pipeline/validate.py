"""Stage 5: validate the candidate graph against the PyTorch baseline on held-out text.

The candidate runs through the runtime loader's own classes, so what is measured is what ships. It is run at
batch size 1 and at the target's batch size (dynamic int8 depends on what shares a batch) and the worse of the
two counts. Every threshold miss is collected, then raised as one AccuracyError; nothing is published.

Decoders are held to two things on each held-out prompt: their next-token logits (top-1 agreement, max abs and
probability differences) and greedy generation of `generation.new_tokens` tokens, which must equal transformers'
`generate(do_sample=False)` token for token on the target's share of prompts (`greedy_match`). Their time to
first token and decode tokens/s, against PyTorch generate, go into the report.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline import generation, runtime
from pipeline.cache import run_cached
from pipeline.checkpoint import checkpoint_digest
from pipeline.data import DEFAULT_VALIDATION, read_texts, texts_digest
from pipeline.errors import AccuracyError, InputError
from pipeline.manifest import INT8_GRAPH, Checkpoint, Manifest
from pipeline.runtime import load, open_model, sha256_file, verify_artifact
from pipeline.targets import Accuracy, Generation, Target
from pipeline.tasks import ARCHITECTURES, TASKS

# metric name -> (threshold field, True when higher is better)
CHECKS = {
    "cosine_min": ("cosine_min", True),
    "cosine_mean": ("cosine_mean", True),
    "top10_agreement": ("top10_agreement", True),
    "top1_agreement": ("top1_agreement", True),
    "max_probability_diff": ("max_probability_diff", False),
    "max_abs_diff": ("max_abs_diff", False),
    "greedy_match": ("greedy_match", True),
}


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _top_k(vectors: np.ndarray, k: int) -> np.ndarray:
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True).clip(1e-12)
    sims = unit @ unit.T
    np.fill_diagonal(sims, -np.inf)
    return np.argsort(-sims, axis=1)[:, :k]


def greedy_stats(reference: list, candidate: list) -> dict:
    """How far greedy continuations agree: the share of prompts that match token for token, and the mean share
    of each reference continuation reproduced before the first differing token."""
    exact, prefix = [], []
    for ref, cand in zip(reference, candidate, strict=True):
        ref, cand = list(ref), list(cand)
        same = next((i for i, (a, b) in enumerate(zip(ref, cand, strict=False)) if a != b), min(len(ref), len(cand)))
        exact.append(ref == cand)
        prefix.append(same / max(len(ref), 1))
    return {"greedy_match": float(np.mean(exact)), "greedy_prefix_agreement": float(np.mean(prefix))}


def compare(metric: str, reference, candidate) -> dict:
    """Accuracy statistics of `candidate` against `reference` for a task's metric kind (for generation, both are
    {"logits": next-token logits, "tokens": greedy continuations})."""
    if metric == "generation":
        stats = compare("classification", reference["logits"], candidate["logits"])
        return {**stats, **greedy_stats(reference["tokens"], candidate["tokens"])}
    if metric == "token-classification":
        reference, candidate = np.concatenate(reference), np.concatenate(candidate)
    reference = np.asarray(reference, dtype=np.float64)
    candidate = np.asarray(candidate, dtype=np.float64)
    if not np.isfinite(candidate).all():
        return {"finite": False, "max_abs_diff": float("inf")}
    stats = {"max_abs_diff": float(np.abs(reference - candidate).max())}
    if metric == "embedding":
        cos = (reference * candidate).sum(1) / (
            np.linalg.norm(reference, axis=1) * np.linalg.norm(candidate, axis=1)
        ).clip(1e-12)
        stats["cosine_min"] = float(cos.min())
        stats["cosine_mean"] = float(cos.mean())
        k = min(10, len(reference) - 1)
        if k > 0:
            ref, cand = _top_k(reference, k), _top_k(candidate, k)
            stats["top10_agreement"] = float(
                np.mean([len(set(a) & set(b)) / k for a, b in zip(ref, cand, strict=True)])
            )
    else:
        stats["top1_agreement"] = float((reference.argmax(-1) == candidate.argmax(-1)).mean())
        stats["max_probability_diff"] = float(np.abs(_softmax(reference) - _softmax(candidate)).max())
    return stats


def worst(a: dict, b: dict) -> dict:
    """Per statistic, the worse of two measurements."""
    merged = {}
    for key in a.keys() | b.keys():
        values = [d[key] for d in (a, b) if key in d]
        higher_better = CHECKS.get(key, (None, True))[1]
        merged[key] = min(values) if higher_better else max(values)
    return merged


def failures(stats: dict, accuracy: Accuracy) -> list[str]:
    """One line per threshold missed; an empty list means the candidate passes."""
    if stats.get("finite") is False:
        return ["the candidate outputs NaN or inf"]
    missed = []
    for name, (field, higher_better) in CHECKS.items():
        threshold = getattr(accuracy, field)
        if threshold is None or name not in stats:
            continue
        value = stats[name]
        if (value < threshold) if higher_better else (value > threshold):
            relation = ">=" if higher_better else "<="
            missed.append(f"{name} = {value:.4f}, needs {relation} {threshold}")
    return missed


def outputs(model, texts: list[str], metric: str, batch_size: int, new_tokens: int = 0):
    """What validation compares, from a runtime model: its outputs, or for generation its next-token logits and
    its greedy continuations of `new_tokens` tokens."""
    if metric != "generation":
        return model.run(texts, batch_size=batch_size)
    completions = model.generate(texts, batch_size=batch_size, max_new_tokens=new_tokens, do_sample=False)
    return {"logits": model.run(texts, batch_size=batch_size), "tokens": [c.token_ids for c in completions]}


def measure(model, texts: list[str], reference, metric: str, batch_size: int, new_tokens: int = 0) -> dict:
    """Statistics of the model at batch size 1 and at `batch_size`, the worse of each."""
    at_one = compare(metric, reference, outputs(model, texts, metric, 1, new_tokens))
    at_batch = compare(metric, reference, outputs(model, texts, metric, batch_size, new_tokens))
    return worst(at_one, at_batch)


def pytorch_generation(model, tokenizer, texts: list[str], new_tokens: int, max_length: int) -> dict:
    """transformers' next-token logits and `generate(do_sample=False)` continuations, one prompt at a time
    (no padding), with the checkpoint's generation_config.json as it stands; prompts are cut from the left to
    leave room for the new tokens, as the runtime cuts them."""
    import torch

    logits, tokens = [], []
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"][-(max_length - new_tokens) :]])
            mask = torch.ones_like(ids)
            logits.append(model(input_ids=ids, attention_mask=mask).logits[0, -1].numpy())
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens, pad_token_id=pad
            )
            tokens.append(tuple(out[0, ids.shape[1] :].tolist()))
    return {"logits": np.stack(logits), "tokens": tokens}


def pytorch_outputs(checkpoint: Checkpoint, texts: list[str], new_tokens: int = 0):
    """The PyTorch baseline: SentenceTransformer.encode for sentence-transformers checkpoints, else the
    transformers model with the same pooling or head; token classification gives one array per text; text
    generation gives next-token logits and greedy continuations of `new_tokens` tokens."""
    import torch

    from pipeline.export import load_hf_tokenizer, load_torch_model

    if checkpoint.task == "feature-extraction" and (checkpoint.pooling or {}).get("normalize"):
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(checkpoint.path, device="cpu")
        model.max_seq_length = checkpoint.max_length
        return model.encode(texts, batch_size=32, convert_to_numpy=True, normalize_embeddings=True)
    tokenizer = load_hf_tokenizer(checkpoint)
    model = load_torch_model(checkpoint)
    if checkpoint.task == "text-generation":
        return pytorch_generation(model, tokenizer, texts, new_tokens, checkpoint.max_length)
    inputs = {"input_ids", "attention_mask"} | (
        {"token_type_ids"} if ARCHITECTURES[checkpoint.model_type].token_type_ids else set()
    )
    outputs = []
    with torch.inference_mode():
        for text in texts:
            pair = (text,) if isinstance(text, str) else text
            enc = tokenizer(
                *([p] for p in pair), truncation=True, max_length=checkpoint.max_length, return_tensors="pt"
            )
            out = model(**{k: v for k, v in enc.items() if k in inputs})
            if checkpoint.task == "feature-extraction":
                hidden = out.last_hidden_state[0]
                mode = checkpoint.pooling["mode"]
                vector = hidden[0] if mode == "cls" else hidden.max(0).values if mode == "max" else hidden.mean(0)
                outputs.append(vector.numpy())
            else:
                outputs.append(out.logits[0].numpy())
    return outputs if checkpoint.task == "token-classification" else np.stack(outputs)


def runtime_code_digest() -> str:
    """sha256 of the loaders' source: validation measured one runtime's batching and generation, so a new one
    measures again."""
    return sha256_file(Path(runtime.__file__)) + sha256_file(Path(generation.__file__))


def candidate_model(manifest: Manifest, target: Target, onnx_path=None):
    """The runtime object (Model or Generator) over the latest graph of this build (or `onnx_path`) and the
    exported tokenizer."""
    export = manifest.stage("export")
    session = {
        "intra_op_threads": target.runtime.intra_op_threads,
        "graph_optimization_level": target.runtime.graph_optimization_level,
    }
    return open_model(
        onnx_path or manifest.last_model().output("model.onnx"),
        export.output("tokenizer.json"),
        export.metrics["spec"],
        session=session,
    )


def examples(texts: list, task: str, generation_spec: Generation) -> list:
    """The held-out (or calibration) examples a build uses: decoders take the first `generation.prompts`."""
    if task != "text-generation":
        return texts
    return texts[: generation_spec.prompts]


def _validate(manifest: Manifest, target: Target, texts: list[str]) -> dict:
    checkpoint = manifest.checkpoint
    metric = TASKS[checkpoint.task].metric
    candidate = candidate_model(manifest, target)
    new_tokens = target.generation.new_tokens
    speed = None
    if metric == "generation":
        from pipeline.bench_generation import ARTIFACT, PYTORCH, artifact_runner, generation_speed, pytorch_runner
        from pipeline.export import load_hf_tokenizer, load_torch_model

        tokenizer, model = load_hf_tokenizer(checkpoint), load_torch_model(checkpoint)
        reference = pytorch_generation(model, tokenizer, texts, new_tokens, checkpoint.max_length)
        runners = {PYTORCH: pytorch_runner(model, tokenizer), ARTIFACT: artifact_runner(candidate)}
        speed_tokens = min(target.generation.speed_new_tokens, checkpoint.max_length // 2)
        speed = generation_speed(runners, texts, target.generation.speed_batch_sizes, speed_tokens)
    else:
        reference = pytorch_outputs(checkpoint, texts)
    stats = measure(candidate, texts, reference, metric, target.shapes.batch_size, new_tokens)
    missed = failures(stats, target.accuracy)
    extra = {}
    graphs = manifest.graphs()
    if INT8_GRAPH in graphs:
        int8 = candidate_model(manifest, target, graphs[INT8_GRAPH])
        extra["int8_qdq"] = measure(int8, texts, reference, metric, target.shapes.batch_size, new_tokens)
        missed += [f"{INT8_GRAPH}: {m}" for m in failures(extra["int8_qdq"], target.accuracy)]
    if missed:
        raise AccuracyError(
            f"{manifest.model_name} for {target.name} missed its accuracy thresholds on {len(texts)} held-out "
            f"examples ({manifest.validation_path}): " + "; ".join(missed) + ". Nothing was published. "
            "Loosen the target's [accuracy] only if that is acceptable, or raise quantize.max_fp32_nodes."
        )
    result = {"examples": len(texts), "batch_sizes": [1, target.shapes.batch_size], **stats, **extra}
    if speed is not None:
        result.update(new_tokens=new_tokens, speed=speed)
    return result


def run(manifest: Manifest, target: Target) -> Manifest:
    """Validate the latest graph; raises AccuracyError listing every threshold it misses."""
    texts = examples(read_texts(manifest.validation_path, "validation"), manifest.checkpoint.task, target.generation)
    model = manifest.last_model()
    config = {
        "data": texts_digest(texts),
        "accuracy": target.to_dict()["accuracy"],
        "batch_size": target.shapes.batch_size,
    }
    if manifest.checkpoint.task == "text-generation":
        config["generation"] = target.to_dict()["generation"]
    int8 = manifest.graph_records().get(INT8_GRAPH)
    if int8:
        config["int8_qdq"] = int8.key
    record = run_cached(
        manifest.cache_dir, "validate", config, model.key, target.name, lambda out: _validate(manifest, target, texts)
    )
    return manifest.with_stage(record)


def validate_artifact(path, data=None) -> dict:
    """Validate a published artifact again, on this host, against its source checkpoint and its thresholds."""
    published = verify_artifact(path)
    source = published["source"]
    if not Path(source["path"]).is_dir():
        raise InputError(f"the source checkpoint {source['path']} of {path} is gone; validation needs it")
    if checkpoint_digest(Path(source["path"])) != source["digest"]:
        raise InputError(f"the checkpoint at {source['path']} has changed since {path} was built; rebuild instead")
    checkpoint = Checkpoint(config={}, **source)
    spec = published["target_spec"]
    settings = spec.get("generation", {})
    generation_spec = Generation(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})
    texts = examples(read_texts(data or DEFAULT_VALIDATION, "validation"), checkpoint.task, generation_spec)
    metric = TASKS[checkpoint.task].metric
    new_tokens = generation_spec.new_tokens
    reference = pytorch_outputs(checkpoint, texts, new_tokens)
    stats = measure(load(path), texts, reference, metric, published["model"]["batch_size"], new_tokens)
    missed = failures(stats, Accuracy(**spec["accuracy"]))
    if missed:
        raise AccuracyError(f"{path} misses its thresholds on this host: " + "; ".join(missed))
    return stats
