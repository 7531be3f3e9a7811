"""Generation speed: time to first token and decode tokens/s of a decoder artifact against transformers' generate
in PyTorch, on the same prompts, alternating run by run in one process.

Both sides tokenize, left-pad, and generate exactly N tokens greedily (the end-of-sequence token suppressed, so
every row runs N steps). Time to first token (TTFT) is a run of one new token; decode tokens/s is the
(N - 1) * batch tokens of the remaining steps over the time a run of N takes beyond a run of one.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

from pipeline.bench.common import bench_folder, identity, percentile, write_results
from pipeline.data import DEFAULT_VALIDATION, read_texts
from pipeline.progress import progress
from pipeline.runtime.artifact import verify_artifact
from pipeline.runtime.load import open_model

PYTORCH = "pytorch-generate"
ARTIFACT = "artifact"


def artifact_runner(model):
    """generate(batch, n): the artifact's greedy generation of exactly n tokens per prompt."""

    def run(batch: list[str], n: int):
        return model.generate(batch, batch_size=len(batch), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    return run


def generation_speed(runners: dict, prompts: list[str], batch_sizes, new_tokens: int, reps: int = 3) -> dict:
    """TTFT (ms) and decode tokens/s of each runner at each batch size, medians over `reps` alternating rounds,
    with each runner's ratio to PyTorch where it is among them."""
    results = {}
    for size in progress(batch_sizes, "generation speed: batch sizes"):
        batch = (prompts * (size // len(prompts) + 1))[:size]
        for run in runners.values():
            run(batch, 2)  # warm-up
        first = {name: [] for name in runners}
        full = {name: [] for name in runners}
        for _ in range(reps):
            for name, run in runners.items():
                started = time.perf_counter()
                run(batch, 1)
                first[name].append(time.perf_counter() - started)
                started = time.perf_counter()
                run(batch, new_tokens)
                full[name].append(time.perf_counter() - started)
        row = {}
        for name in runners:
            ttft, total = statistics.median(first[name]), statistics.median(full[name])
            decode = max(total - ttft, 1e-9)
            rates = [size * (new_tokens - 1) / max(t - ttft, 1e-9) for t in full[name]]
            row[name] = {"ttft_ms": ttft * 1000, "decode_tokens_per_s": size * (new_tokens - 1) / decode,
                         "ttft_range_ms": [1000 * percentile(first[name], q) for q in (10, 90)],
                         "decode_range_tokens_per_s": [percentile(rates, q) for q in (10, 90)]}  # fmt: skip
        if PYTORCH in row:
            base = row[PYTORCH]
            for values in row.values():
                values["ttft_speedup"] = base["ttft_ms"] / values["ttft_ms"]
                values["decode_speedup"] = values["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        results[f"batch_{size}"] = row
    return {"new_tokens": new_tokens, "prompts": len(prompts), "reps": reps, "batches": results}


def bench_generation(
    artifact: str | Path,
    out_dir: str | Path | None = None,
    batch_sizes=(1, 8),
    new_tokens: int = 64,
    reps: int = 5,
    baseline: str | None = "pytorch",
) -> dict:
    """Benchmark a decoder artifact against PyTorch generate; writes bench.json and bench.md to `out_dir`."""
    import torch

    from pipeline.reference import checkpoint_from_source, generate_runner, load_hf_tokenizer, load_torch_model

    artifact = Path(artifact)
    manifest = verify_artifact(artifact)
    real = artifact.resolve()
    threads = os.cpu_count() or 1
    session = {**manifest["session"], "intra_op_threads": threads, "allow_spinning": False}
    model = open_model(real / "model.onnx", real / "tokenizer.json", manifest["model"], session=session)
    runners = {ARTIFACT: artifact_runner(model)}
    if baseline == "pytorch":
        torch.set_num_threads(threads)
        checkpoint = checkpoint_from_source(manifest["source"])
        runners = {PYTORCH: generate_runner(load_torch_model(checkpoint), load_hf_tokenizer(checkpoint)), **runners}
    prompts = read_texts(DEFAULT_VALIDATION, "benchmark")[:64]
    new_tokens = max(2, min(new_tokens, int(manifest["model"]["max_length"]) - 64))
    speed = generation_speed(runners, prompts, batch_sizes, new_tokens, reps)
    results = {**identity(manifest, real, threads), **speed}
    out = write_results(results, markdown(results), out_dir or bench_folder(real, manifest))
    from pipeline.bench.plot import plot_generation

    plot_generation(results, out / "bench.png", PYTORCH, ARTIFACT)
    results["written_to"] = str(out)
    return results


def markdown(results: dict) -> str:
    """The results as a Markdown table, ratios against PyTorch generate."""
    host = results["host"]
    versions = ", ".join(f"{k} {v}" for k, v in host["versions"].items())
    lines = [
        f"# {results['model_name']} {results['version']} {results['target']}",
        "",
        f"Host: {host['cpu']} ({host['kernel_class']}; {' '.join(host['flags'])}), {results['threads']} threads; "
        f"{versions}. {results['new_tokens']} new tokens, {results['prompts']} prompts; each figure is the median "
        f"[p10, p90] of {results['reps']} rounds alternating between the variants.",
        "",
        "| variant | batch | TTFT ms | decode tokens/s | TTFT vs PyTorch | decode vs PyTorch |",
        "|---|---|---|---|---|---|",
    ]
    for batch, row in results["batches"].items():
        for name, v in row.items():
            ratios = [f"x{v[k]:.2f}" if k in v else "-" for k in ("ttft_speedup", "decode_speedup")]
            ttft, rate = v["ttft_range_ms"], v["decode_range_tokens_per_s"]
            lines.append(
                f"| {name} | {batch.removeprefix('batch_')} | {v['ttft_ms']:.2f} [{ttft[0]:.2f}, {ttft[1]:.2f}] | "
                f"{v['decode_tokens_per_s']:.1f} [{rate[0]:.1f}, {rate[1]:.1f}] | {ratios[0]} | {ratios[1]} |"
            )
    return "\n".join(lines) + "\n"
