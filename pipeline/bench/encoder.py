"""Benchmarks: every variant of one artifact, side by side in one process, alternating run by run.

Variants: PyTorch eager fp32 (inference_mode, same threads), the unoptimized ONNX export, the optimized fp32
graph (both from the stage cache) and the published artifact. Model latency is timed on identical token ids;
tokenization, bucketing and the Batcher are measured end to end on text. Writes bench.json, bench.md and
bench.png beside the artifact (not into it: a published artifact is immutable and hashed).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from pipeline.bench.common import bench_folder, identity, percentile, time_alternating, write_results
from pipeline.data import DEFAULT_VALIDATION, read_texts
from pipeline.errors import InputError
from pipeline.reference import checkpoint_from_source, encoder_runner
from pipeline.runtime.artifact import verify_artifact
from pipeline.runtime.backends.onnxruntime import open_session
from pipeline.runtime.encoder import Model

BATCH_SIZES = (1, 8, 32)
SEQ_LENS = (16, 128, 512)
PYTORCH = "pytorch-eager"


def token_rows(model: Model, texts: list[str], batch: int, length: int) -> dict:
    """`batch` rows of exactly `length` real tokens, cut from the concatenated validation text."""
    stream = [i for e in model.tokenizer.encode_batch(texts, add_special_tokens=False) for i in e.ids]
    if len(stream) < batch * length:
        stream = stream * (batch * length // max(len(stream), 1) + 1)
    cls_sep = model.tokenizer.encode("", add_special_tokens=True).ids
    rows = []
    for row in range(batch):
        body = stream[row * (length - 2) : (row + 1) * (length - 2)]
        rows.append(cls_sep[:1] + body + cls_sep[1:] if len(cls_sep) == 2 else (cls_sep + body)[:length])
    ids = np.asarray(rows, dtype=np.int64)
    arrays = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
    return {name: arrays[name] for name in model.input_names}


def _concurrency(model: Model, texts: list[str], callers: int, per_caller: int) -> dict:
    from pipeline.runtime.batcher import Batcher

    def drive(call) -> float:
        barrier = threading.Barrier(callers + 1)

        def caller(offset: int) -> None:
            barrier.wait()
            for i in range(per_caller):
                call(texts[(offset * per_caller + i) % len(texts)])

        threads = [threading.Thread(target=caller, args=(n,)) for n in range(callers)]
        for thread in threads:
            thread.start()
        barrier.wait()
        t0 = time.perf_counter()
        for thread in threads:
            thread.join()
        return time.perf_counter() - t0

    direct = drive(lambda text: model.run([text]))
    with Batcher(model, max_batch_size=32, max_wait_ms=2) as batcher:
        batched = drive(batcher)
    requests = callers * per_caller
    return {
        "callers": callers,
        "requests": requests,
        "direct_requests_per_s": requests / direct,
        "batcher_requests_per_s": requests / batched,
        "batcher_gain": direct / batched,
    }


def _bucketing(model: Model, texts: list[str], reps: int) -> dict:
    by_length = sorted(texts, key=len)
    mixed = by_length[:28] + by_length[-4:]  # mostly short, a few long: a typical mixed request
    rng = np.random.default_rng(0)
    mixed = [mixed[i] for i in rng.permutation(len(mixed))]
    runners = {"padded": lambda _: model.run(mixed, bucketing=False), "bucketed": lambda _: model.run(mixed)}
    times = time_alternating(runners, {}, 3.0, reps, reps * 4)
    padded, bucketed = statistics.median(times["padded"]), statistics.median(times["bucketed"])
    return {"texts": len(mixed), "padded_ms": padded, "bucketed_ms": bucketed, "bucketing_gain": padded / bucketed}


def _tokenization_share(model: Model, texts: list[str], reps: int) -> dict:
    batch = texts[:32]
    runners = {"tokenize": lambda _: model.tokenizer.encode_batch(batch), "end_to_end": lambda _: model.run(batch)}
    times = time_alternating(runners, {}, 2.0, reps, reps * 4)
    tok, total = statistics.median(times["tokenize"]), statistics.median(times["end_to_end"])
    return {"batch": len(batch), "tokenize_ms": tok, "end_to_end_ms": total, "share": tok / total}


def bench(
    artifact: str | Path,
    cache_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    batch_sizes=BATCH_SIZES,
    seq_lens=SEQ_LENS,
    baseline: str | None = "pytorch",
    budget_s: float = 4.0,
    min_reps: int = 5,
    max_reps: int = 60,
) -> dict:
    """Benchmark an artifact against its other variants; returns the results and writes them to `out_dir`."""
    import psutil

    artifact = Path(artifact)
    manifest = verify_artifact(artifact)
    real = artifact.resolve()
    cache_dir = Path(cache_dir or Path(__file__).resolve().parents[2] / ".cache" / "stages")
    threads = os.cpu_count() or 1
    # No spinning: variants alternate, and a spinning ORT pool would steal the cores of the next variant.
    session = {**manifest["session"], "intra_op_threads": threads, "allow_spinning": False}
    texts = read_texts(DEFAULT_VALIDATION, "benchmark")
    process = psutil.Process()
    paths = {
        "onnx-unoptimized": cache_dir / "export" / manifest["stages"]["export"]["key"] / "model.onnx",
        "onnx-fp32-optimized": cache_dir / "optimize" / manifest["stages"]["optimize"]["key"] / "model.onnx",
        f"artifact-{manifest['target_spec']['precision']}": real / "model.onnx",
    }
    missing = [name for name, path in paths.items() if not path.exists()]
    variants, runners, models = {}, {}, {}
    if baseline == "pytorch":
        rss, t0 = process.memory_info().rss, time.perf_counter()
        checkpoint = checkpoint_from_source(manifest["source"])
        runners[PYTORCH] = encoder_runner(checkpoint, manifest["model"]["inputs"], threads)
        variants[PYTORCH] = {"load_s": time.perf_counter() - t0, "rss_mb": (process.memory_info().rss - rss) / 2**20}
    elif baseline is not None:
        raise InputError(f"unknown baseline {baseline!r}; use 'pytorch' or none")
    for name, path in paths.items():
        if name in missing:
            continue
        rss, t0 = process.memory_info().rss, time.perf_counter()
        model = Model(open_session(path, session), real / "tokenizer.json", manifest["model"])
        variants[name] = {
            "load_s": time.perf_counter() - t0,
            "rss_mb": (process.memory_info().rss - rss) / 2**20,
            "size_mb": path.stat().st_size / 2**20,
        }
        models[name] = model
        runners[name] = lambda feeds, s=model.session, o=model.output_name: s.run([o], feeds)[0]
    shipped = models[f"artifact-{manifest['target_spec']['precision']}"]
    limit = int(manifest["model"]["max_length"])
    lengths = sorted({min(n, limit) for n in seq_lens})
    grid = []
    for length in lengths:
        for batch in batch_sizes:
            feeds = token_rows(shipped, texts, batch, length)
            times = time_alternating(runners, feeds, budget_s, min_reps, max_reps)
            base = statistics.median(times[PYTORCH]) if PYTORCH in times else None
            for name, values in times.items():
                p50 = statistics.median(values)
                grid.append({
                    "variant": name, "batch": batch, "seq": length, "reps": len(values),
                    "p50_ms": p50, "p90_ms": percentile(values, 90), "p99_ms": percentile(values, 99),
                    "sequences_per_s": batch / p50 * 1000, "tokens_per_s": batch * length / p50 * 1000,
                    "speedup_vs_pytorch": base / p50 if base else None,
                })  # fmt: skip
    for name in variants:
        variants[name]["peak_rss_mb"] = process.memory_info().rss / 2**20
    results = {
        **identity(manifest, real, threads),
        "variants": variants,
        "missing_variants": missing,
        "grid": grid,
        "bucketing": _bucketing(shipped, texts, min_reps),
        "concurrency": _concurrency(shipped, texts, callers=32, per_caller=8),
        "tokenization": _tokenization_share(shipped, texts, min_reps),
        "process_peak_rss_mb": psutil.Process().memory_info().rss / 2**20,
    }
    out = write_results(results, markdown(results), out_dir or bench_folder(real, manifest))
    from pipeline.bench.plot import plot

    plot(results, out / "bench.png")
    results["written_to"] = str(out)
    return results


def markdown(results: dict) -> str:
    """The results as a Markdown table, ratios against PyTorch eager."""
    lines = [
        f"# {results['model_name']} {results['version']} {results['target']} ({results['threads']} threads)",
        "",
        "| variant | batch | seq | p50 ms | p90 ms | p99 ms | seq/s | tokens/s | vs PyTorch |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["grid"]:
        ratio = f"x{row['speedup_vs_pytorch']:.2f}" if row["speedup_vs_pytorch"] else "-"
        lines.append(
            f"| {row['variant']} | {row['batch']} | {row['seq']} | {row['p50_ms']:.2f} | {row['p90_ms']:.2f} | "
            f"{row['p99_ms']:.2f} | {row['sequences_per_s']:.1f} | {row['tokens_per_s']:.0f} | {ratio} |"
        )
    lines += ["", "| variant | load s | RSS added MB | size MB |", "|---|---|---|---|"]
    for name, v in results["variants"].items():
        lines.append(f"| {name} | {v['load_s']:.2f} | {v['rss_mb']:.0f} | {v.get('size_mb', float('nan')):.1f} |")
    b, c, t = results["bucketing"], results["concurrency"], results["tokenization"]
    lines += [
        "",
        f"- Bucketing, {b['texts']} mixed-length texts: padded {b['padded_ms']:.1f} ms, bucketed "
        f"{b['bucketed_ms']:.1f} ms: x{b['bucketing_gain']:.2f}",
        f"- {c['callers']} concurrent callers, {c['requests']} requests: direct {c['direct_requests_per_s']:.0f}/s, "
        f"Batcher {c['batcher_requests_per_s']:.0f}/s: x{c['batcher_gain']:.2f}",
        f"- Tokenization of {t['batch']} texts: {t['tokenize_ms']:.2f} ms of {t['end_to_end_ms']:.2f} ms "
        f"end to end ({t['share']:.1%})",
        f"- Process peak RSS {results['process_peak_rss_mb']:.0f} MB",
    ]
    if results["missing_variants"]:
        lines.append(f"- Not in the stage cache, so not measured: {', '.join(results['missing_variants'])}")
    return "\n".join(lines) + "\n"
