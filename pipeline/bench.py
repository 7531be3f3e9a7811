"""Benchmarks: every variant of one artifact, side by side in one process, alternating run by run.

Variants: PyTorch eager fp32 (inference_mode, same threads), the unoptimized ONNX export, the optimized fp32
graph (both from the stage cache) and the published artifact. Model latency is timed on identical token ids;
tokenization, bucketing and the Batcher are measured end to end on text. Writes bench.json, bench.md and
bench.png beside the artifact (not into it: a published artifact is immutable and hashed).
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from pipeline.data import DEFAULT_VALIDATION, read_texts
from pipeline.errors import InputError
from pipeline.runtime import Model, verify_artifact

BATCH_SIZES = (1, 8, 32)
SEQ_LENS = (16, 128, 512)
PYTORCH = "pytorch-eager"


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _token_rows(model: Model, texts: list[str], batch: int, length: int) -> dict:
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


def _pytorch_runner(manifest: dict, threads: int):
    import torch

    from pipeline.export import _wrapper, load_torch_model
    from pipeline.manifest import Checkpoint

    torch.set_num_threads(threads)
    checkpoint = Checkpoint(config={}, **manifest["source"])
    wrapper = _wrapper(load_torch_model(checkpoint), checkpoint, manifest["model"]["inputs"])

    def run(feeds: dict):
        with torch.inference_mode():
            return wrapper(*(torch.from_numpy(feeds[n]) for n in manifest["model"]["inputs"])).numpy()

    return run


def _time_alternating(runners: dict, feeds: dict, budget_s: float, min_reps: int, max_reps: int) -> dict:
    """Run every variant in turn, repeatedly, after two warm-ups each; returns latencies in ms per variant."""
    for run in runners.values():
        run(feeds)
        run(feeds)
    times: dict[str, list[float]] = {name: [] for name in runners}
    started = time.perf_counter()
    while True:
        for name, run in runners.items():
            t0 = time.perf_counter()
            run(feeds)
            times[name].append((time.perf_counter() - t0) * 1000)
        reps = len(next(iter(times.values())))
        if reps >= max_reps or (reps >= min_reps and time.perf_counter() - started > budget_s):
            return times


def _concurrency(model: Model, texts: list[str], callers: int, per_caller: int) -> dict:
    from pipeline.batcher import Batcher

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
    times = _time_alternating(runners, {}, 3.0, reps, reps * 4)
    padded, bucketed = statistics.median(times["padded"]), statistics.median(times["bucketed"])
    return {"texts": len(mixed), "padded_ms": padded, "bucketed_ms": bucketed, "bucketing_gain": padded / bucketed}


def _tokenization_share(model: Model, texts: list[str], reps: int) -> dict:
    batch = texts[:32]
    runners = {"tokenize": lambda _: model.tokenizer.encode_batch(batch), "end_to_end": lambda _: model.run(batch)}
    times = _time_alternating(runners, {}, 2.0, reps, reps * 4)
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
    """Benchmark an artifact against its other variants; returns the results and writes them to `out_dir`.
    A decoder artifact gets pipeline.bench_generation's benchmark instead (TTFT and decode tokens/s)."""
    import psutil

    artifact = Path(artifact)
    manifest = verify_artifact(artifact)
    if manifest["model"]["task"] == "text-generation":
        from pipeline.bench_generation import bench_generation

        quick = {"batch_sizes": (1, 8), "new_tokens": 16, "reps": 2} if budget_s < 1 else {}
        return bench_generation(artifact, out_dir, baseline=baseline, **quick)
    real = artifact.resolve()
    cache_dir = Path(cache_dir or Path(__file__).resolve().parent.parent / ".cache" / "stages")
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
        runners[PYTORCH] = _pytorch_runner(manifest, threads)
        variants[PYTORCH] = {"load_s": time.perf_counter() - t0, "rss_mb": (process.memory_info().rss - rss) / 2**20}
    elif baseline is not None:
        raise InputError(f"unknown baseline {baseline!r}; use 'pytorch' or none")
    for name, path in paths.items():
        if name in missing:
            continue
        rss, t0 = process.memory_info().rss, time.perf_counter()
        model = Model(path, real / "tokenizer.json", manifest["model"], session=session)
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
            feeds = _token_rows(shipped, texts, batch, length)
            times = _time_alternating(runners, feeds, budget_s, min_reps, max_reps)
            base = statistics.median(times[PYTORCH]) if PYTORCH in times else None
            for name, values in times.items():
                p50 = statistics.median(values)
                grid.append({
                    "variant": name, "batch": batch, "seq": length, "reps": len(values),
                    "p50_ms": p50, "p90_ms": _percentile(values, 90), "p99_ms": _percentile(values, 99),
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
    out = write_results(results, out_dir or bench_folder(real, manifest))
    plot(results, out / "bench.png")
    results["written_to"] = str(out)
    return results


def identity(manifest: dict, real: Path, threads: int) -> dict:
    """What a benchmark measured: the artifact and the thread count."""
    keys = ("model_name", "version", "target")
    return {"artifact": str(real), **{k: manifest[k] for k in keys}, "threads": threads}


def bench_folder(real: Path, manifest: dict) -> Path:
    """Where an artifact's benchmark results go: beside it, since a published artifact is immutable."""
    return real.parent.parent / "bench" / f"{manifest['version']}-{manifest['target']}"


def write_results(results: dict, out: str | Path) -> Path:
    """Write bench.json and bench.md into `out`; returns it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=1))
    (out / "bench.md").write_text(markdown(results))
    return out


def markdown(results: dict) -> str:
    """The results as a Markdown table, ratios against PyTorch eager (or generate, for decoders)."""
    if "batches" in results:
        from pipeline.bench_generation import markdown as generation_markdown

        return generation_markdown(results)
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


def plot(results: dict, path: Path) -> None:
    """Latency (p50) against batch size, one line per variant, one panel per sequence length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seqs = sorted({r["seq"] for r in results["grid"]})
    fig, axes = plt.subplots(1, len(seqs), figsize=(5 * len(seqs), 4), squeeze=False)
    for ax, seq in zip(axes[0], seqs, strict=True):
        for variant in dict.fromkeys(r["variant"] for r in results["grid"]):
            rows = [r for r in results["grid"] if r["variant"] == variant and r["seq"] == seq]
            ax.plot([r["batch"] for r in rows], [r["p50_ms"] for r in rows], marker="o", label=variant)
        ax.set(title=f"seq {seq}", xlabel="batch size", ylabel="p50 latency (ms)", xscale="log", yscale="log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend()
    fig.suptitle(f"{results['model_name']} {results['version']} {results['target']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _calibrate_in_child(fp32_path: str, tokenizer: str, spec: dict, count: int, method: str, streamed: bool, out: str):
    """Child process: static calibration of `count` examples; returns (peak RSS MB, seconds)."""
    import resource
    import tempfile

    from pipeline.quantize import calibration_reader, quantize_static
    from pipeline.targets import Quantize

    texts = read_texts(DEFAULT_VALIDATION, "calibration")
    texts = (texts * (count // len(texts) + 1))[:count]
    model = Model(Path(fp32_path), Path(tokenizer), spec)
    settings = Quantize(mode="static", calibration_method=method)
    reader = calibration_reader(model, texts, settings.calibration_batch_size)
    if not streamed:  # onnxruntime's own behaviour: every batch's activations held until one final compute
        reader.set_range = None
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        ranges = Path(scratch) / "ranges.json"
        if streamed:
            quantize_static(Path(fp32_path), Path(scratch) / "q.onnx", settings, reader, ranges)
        else:
            from onnxruntime.quantization import CalibrationMethod, create_calibrator

            kind = CalibrationMethod.MinMax if method == "minmax" else CalibrationMethod.Entropy
            calibrator = create_calibrator(Path(fp32_path), ["MatMul", "Attention"], Path(scratch) / "aug.onnx", kind)
            calibrator.collect_data(reader)
            calibrator.compute_data()
    seconds = time.perf_counter() - started
    Path(out).write_text(
        json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "seconds": seconds})
    )


def calibration_memory(
    artifact: str | Path, cache_dir: str | Path | None = None, counts=(1000, 10000), method="minmax"
) -> list[dict]:
    """Peak RSS and time of static calibration for each example count, each in a fresh process; plus
    onnxruntime's unstreamed calibration at the smallest count, for comparison."""
    import subprocess
    import sys
    import tempfile

    manifest = verify_artifact(artifact)
    real = Path(artifact).resolve()
    cache_dir = Path(cache_dir or Path(__file__).resolve().parent.parent / ".cache" / "stages")
    fp32 = cache_dir / "optimize" / manifest["stages"]["optimize"]["key"] / "model.onnx"
    if not fp32.exists():
        raise InputError(f"the fp32 graph of {artifact} is not in the stage cache {cache_dir}; rebuild it first")
    shaped = Path(tempfile.mkdtemp()) / "shaped.onnx"
    from pipeline.quantize import with_shapes

    with_shapes(fp32, shaped)
    rows = []
    # Unstreamed, onnxruntime's histogram calibrators stack every batch into one array and fail unless all have
    # the same shape, so that comparison uses whole batches only.
    runs = [(n, True) for n in counts] + [(max(16, min(counts) // 16 * 16), False)]
    for count, streamed in runs:
        out = shaped.parent / f"{count}-{streamed}.json"
        args = [str(shaped), str(real / "tokenizer.json"), manifest["model"], count, method, streamed, str(out)]
        code = "import json, sys; from pipeline.bench import _calibrate_in_child as f; f(*json.loads(sys.argv[1]))"
        child = subprocess.run([sys.executable, "-c", code, json.dumps(args)], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent.parent)  # fmt: skip
        result = json.loads(out.read_text()) if child.returncode == 0 else {"peak_rss_mb": None, "seconds": None}
        rows.append(
            {"examples": count, "method": method, "streamed": streamed, "exit_code": child.returncode, **result}
        )
    return rows
