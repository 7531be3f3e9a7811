"""Generation speed: time to first token and decode tokens/s of a decoder artifact against transformers' generate
in PyTorch and, given them, onnxruntime-genai's models and llama.cpp's GGUF files (pipeline/bench/llama_peer.py) of
the same checkpoint, on the same prompts
(16 and 128 tokens), alternating run by run in one process.

Every variant tokenizes, pads, and generates exactly N tokens greedily (the end-of-sequence token suppressed, so
every row runs N steps). Both figures come from the same run: time to first token (TTFT) is the time from the call
to the moment the first new token of every row is chosen, and decode tokens/s is the (N - 1) * batch tokens of the
remaining steps over the rest of the run.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from pipeline.bench.common import bench_folder, host_line, identity, write_results
from pipeline.build.accuracy.metrics import teacher_forced_stats, teacher_outputs, teacher_scores
from pipeline.build.inputs.data import DEFAULT_VALIDATION, read_texts
from pipeline.build.timing import ARTIFACT, PYTORCH, artifact_runner, generation_speed
from pipeline.errors import InputError
from pipeline.runtime.artifact import verify_artifact
from pipeline.runtime.load import open_model
from pipeline.runtime.schema import GRAPH, TOKENIZER

ACCURACY_TEXTS = 32  # held-out texts the accuracy table is measured on (the decoder gate's default prompt count)


class _TimedSession:
    """An ONNX Runtime session that adds up the seconds spent inside run_with_iobinding; the rest is the loop's."""

    def __init__(self, session):
        self.session, self.seconds, self.runs = session, 0.0, 0

    def run_with_iobinding(self, binding, *args):
        started = time.perf_counter()
        try:
            return self.session.run_with_iobinding(binding, *args)
        finally:
            self.seconds += time.perf_counter() - started
            self.runs += 1

    def __getattr__(self, name):
        return getattr(self.session, name)


def loop_overhead(model, prompt: str, new_tokens: int, reps: int = 5) -> dict:
    """The generation loop's own cost per step at batch 1, outside ONNX Runtime: median over `reps` runs of
    (the time of a greedy generate of `new_tokens` tokens - the time inside the session) / steps."""
    real, timed = model.session, _TimedSession(model.session)
    model.session = timed
    per_step, inside = [], []
    try:
        for _ in range(reps + 1):  # the first is a warm-up
            timed.seconds, timed.runs = 0.0, 0
            started = time.perf_counter()
            model.generate([prompt], max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            total = time.perf_counter() - started
            per_step.append((total - timed.seconds) / timed.runs * 1000)
            inside.append(timed.seconds / timed.runs * 1000)
    finally:
        model.session = real
    return {
        "overhead_ms_per_step": statistics.median(per_step[1:]),
        "session_ms_per_step": statistics.median(inside[1:]),
    }


def exact_prompts(tokenizer, texts: list[str], length: int, count: int) -> list[str]:
    """`count` different prompts that the artifact's tokenizer makes exactly `length` tokens of (special tokens
    included), cut from `texts` run together at different offsets."""
    ids = [i for text in texts for i in tokenizer.encode(text, add_special_tokens=False).ids]
    prompts, offset = [], 0
    while len(prompts) < count and offset + length + 2 < len(ids):
        for cut in (length, length - 1, length - 2, length + 1):
            text = tokenizer.decode(ids[offset : offset + cut])
            if len(tokenizer.encode(text).ids) == length:
                prompts.append(text)
                break
        offset += 13
    if len(prompts) < count:
        raise InputError(f"the benchmark text holds too few tokens for {count} prompts of {length} tokens")
    return prompts


def _genai_model(folder: Path, threads: int | None = None):
    """(onnxruntime_genai, its model of `folder` on `threads` intra-op threads (its config's own setting when
    None), the model's pad token id)."""
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise InputError("a genai peer needs onnxruntime-genai: pip install pipeline[genai]") from None
    folder = Path(folder)
    if not (folder / "genai_config.json").is_file():
        raise InputError(f"{folder} has no genai_config.json; pass a folder onnxruntime-genai's builder wrote")
    pad = int(json.loads((folder / "genai_config.json").read_text())["model"]["pad_token_id"])
    config = og.Config(str(folder))
    if threads:
        # Left to its builder's config, genai may run on one core: every variant gets the artifact's thread count.
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
    return og, og.Model(config), pad


def _window(folder: Path) -> int:
    """The sliding window of a genai model folder's decoder (0 without one): genai 0.18 refuses a KV cache shorter
    than the window (Gemma 3: 512), so a shorter request still gets that much room."""
    decoder = json.loads((Path(folder) / "genai_config.json").read_text())["model"]["decoder"]
    return int((decoder.get("sliding_window") or {}).get("window_size", 0))


def genai_teacher_logits(folder: Path, teacher: dict) -> list[np.ndarray]:
    """onnxruntime-genai's next-token logits along each held-out continuation of `teacher` (as
    `reference_decoder.teacher_forced` splits the texts): genai returns logits for every position of what it is
    given."""
    og, model, _ = _genai_model(folder)
    logits = []
    for prompt, continuation in zip(teacher["prompts"], teacher["continuations"], strict=True):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=max(len(prompt) + len(continuation) + 1, _window(folder)))
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([prompt + continuation], dtype=np.int32))
        logits.append(np.asarray(generator.get_output("logits"))[0, len(prompt) - 1 : -1].astype(np.float32))
    return logits


def is_gguf(peer) -> bool:
    """Whether a peer is a llama.cpp GGUF file (else an onnxruntime-genai model folder)."""
    return str(peer).endswith(".gguf")


def variant_accuracy(model, teacher: dict, peers: dict, threads: int) -> dict:
    """The decoder gate's behavioural measure for the artifact and each peer (genai folder or llama.cpp GGUF):
    teacher-forced top-1 agreement and perplexity ratio against PyTorch fp32 (`teacher`) on held-out text."""
    from pipeline.bench.llama_peer import llama_teacher_logits

    stats = {ARTIFACT: teacher_forced_stats(teacher, teacher_outputs(model, teacher, batch_size=8))}
    for name, peer in peers.items():
        logits = llama_teacher_logits(peer, teacher, threads) if is_gguf(peer) else genai_teacher_logits(peer, teacher)
        scores = [teacher_scores(x, c) for x, c in zip(logits, teacher["continuations"], strict=True)]
        stats[name] = teacher_forced_stats(teacher, scores)
    return stats


def genai_runner(folder: Path, tokenizer, threads: int | None = None):
    """generate(batch, n): onnxruntime-genai's greedy generation of exactly n tokens per prompt, from a model folder
    its builder wrote (genai_config.json), on `threads` intra-op threads. Token ids come from the artifact's
    tokenizer, right-padded as genai pads: genai 0.18's own tokenizer encodes SmolLM2's tokenizer.json into -1
    ids."""
    og, model, pad = _genai_model(folder, threads)

    def run(batch: list[str], n: int) -> float:
        rows = [e.ids for e in tokenizer.encode_batch(batch)]
        width = max(map(len, rows))
        ids = np.full((len(rows), width), pad, dtype=np.int32)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = row
        params = og.GeneratorParams(model)
        length = max(width + n, _window(folder))
        params.set_search_options(do_sample=False, batch_size=len(rows), max_length=length, min_length=width + n)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)  # the prompt's step; the first token is chosen from its logits
        generator.generate_next_token()
        first = time.perf_counter()
        for _ in range(n - 1):
            generator.generate_next_token()
        return first

    return run


def bench_generation(
    artifact: str | Path,
    out_dir: str | Path | None = None,
    batch_sizes=(1, 8),
    new_tokens: int = 64,
    reps: int = 5,
    baseline: str | None = "pytorch",
    prompt_tokens=(16, 128),
    peers: dict | None = None,
) -> dict:
    """Benchmark a decoder artifact against PyTorch generate and any `peers` ({name: an onnxruntime-genai model
    folder, or a llama.cpp GGUF file}), at prompts of each of `prompt_tokens` tokens; writes bench.json, bench.md
    and one picture per prompt length to `out_dir`."""
    import torch

    from pipeline.build.accuracy.reference import (
        checkpoint_from_source,
        generate_runner,
        load_hf_tokenizer,
        load_torch_model,
    )
    from pipeline.build.accuracy.reference_decoder import teacher_forced

    artifact = Path(artifact)
    manifest = verify_artifact(artifact)
    real = artifact.resolve()
    threads = os.cpu_count() or 1
    # The artifact runs as it loads: its threads spin between steps, as published. Variants alternate a whole
    # generate at a time, so a pool's spin after its last step overlaps one step of the next variant; that its
    # peers lose nothing by it is measured in docs/benchmarks.md.
    session = {**manifest["session"], "intra_op_threads": threads}
    model = open_model(real / GRAPH, real / TOKENIZER, manifest["model"], session=session)
    runners = {ARTIFACT: artifact_runner(model)}
    texts = read_texts(DEFAULT_VALIDATION, "benchmark")
    room = int(manifest["model"]["max_length"])
    for name, peer in (peers or {}).items():
        if is_gguf(peer):
            from pipeline.bench.llama_peer import llama_runner

            runners[name] = llama_runner(peer, model.tokenizer, threads, max(batch_sizes), room)
        else:
            runners[name] = genai_runner(peer, model.tokenizer, threads)
    accuracy = None
    if baseline == "pytorch":
        torch.set_num_threads(threads)
        checkpoint = checkpoint_from_source(manifest["source"])
        torch_model, hf_tokenizer = load_torch_model(checkpoint), load_hf_tokenizer(checkpoint)
        runners = {PYTORCH: generate_runner(torch_model, hf_tokenizer), **runners}
        teacher = teacher_forced(torch_model, hf_tokenizer, texts[:ACCURACY_TEXTS], room)
        accuracy = variant_accuracy(model, teacher, peers or {}, threads)
    runs = {}
    for length in prompt_tokens:
        n = max(2, min(new_tokens, room - length))
        prompts = exact_prompts(model.tokenizer, texts, length, max(batch_sizes))
        runs[str(length)] = generation_speed(runners, prompts, batch_sizes, n, reps)
        runs[str(length)]["loop"] = loop_overhead(model, prompts[0], n)
    results = {
        **identity(manifest, real, threads),
        "reps": reps,
        "prompt_tokens": list(prompt_tokens),
        "accuracy": accuracy,
        "runs": runs,
    }
    out = write_results(results, markdown(results), out_dir or bench_folder(real, manifest))
    from pipeline.bench.plot import plot_generation

    for length, speed in runs.items():
        plot_generation({**results, **speed}, out / f"bench-prompt{length}.png", PYTORCH, ARTIFACT)
    results["written_to"] = str(out)
    return results


def markdown(results: dict) -> str:
    """The results as Markdown tables, one per prompt length, ratios against PyTorch generate."""
    lines = [
        f"# {results['model_name']} {results['version']} {results['target']}",
        "",
        f"{host_line(results)} Each figure is the median [p10, p90] of {results['reps']} rounds alternating "
        "between the variants.",
    ]
    if results.get("accuracy"):
        lines += [
            "",
            "## Accuracy against PyTorch fp32 (teacher-forced, held-out text)",
            "",
            "| variant | top-1 agreement | perplexity ratio |",
            "|---|---|---|",
        ]
        for name, v in results["accuracy"].items():
            lines.append(f"| {name} | {v['teacher_top1_agreement']:.4f} | {v['perplexity_ratio']:.4f} |")
    for length, speed in results["runs"].items():
        loop = speed["loop"]
        lines += [
            "",
            f"## Prompts of {length} tokens, {speed['new_tokens']} new tokens",
            "",
            f"The artifact's generation loop costs {loop['overhead_ms_per_step']:.3f} ms a step outside ONNX Runtime "
            f"at batch 1 ({loop['session_ms_per_step']:.3f} ms inside it).",
            "",
            "| variant | batch | TTFT ms | decode tokens/s | TTFT vs PyTorch | decode vs PyTorch |",
            "|---|---|---|---|---|---|",
        ]
        for batch, row in speed["batches"].items():
            for name, v in row.items():
                ratios = [f"x{v[k]:.2f}" if k in v else "-" for k in ("ttft_speedup", "decode_speedup")]
                ttft, rate = v["ttft_range_ms"], v["decode_range_tokens_per_s"]
                lines.append(
                    f"| {name} | {batch.removeprefix('batch_')} | {v['ttft_ms']:.2f} [{ttft[0]:.2f}, {ttft[1]:.2f}] | "
                    f"{v['decode_tokens_per_s']:.1f} [{rate[0]:.1f}, {rate[1]:.1f}] | {ratios[0]} | {ratios[1]} |"
                )
    return "\n".join(lines) + "\n"
