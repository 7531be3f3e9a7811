"""Benchmarks: every variant of one artifact, side by side in one process, alternating run by run.

Variants: PyTorch eager fp32 (inference_mode, same threads), the unoptimized ONNX export, the optimized fp32
graph (both from the stage cache) and the published artifact. Model latency is timed on identical token ids;
tokenization, bucketing and the Batcher are measured end to end on text. Writes bench.json, bench.md and
bench.png beside the artifact (not into it: a published artifact is immutable and hashed).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import numpy as np

from pipeline.bench import serving
from pipeline.bench.common import bench_folder, host_line, identity, write_results
from pipeline.build.accuracy.reference import checkpoint_from_source, encoder_runner
from pipeline.build.console import progress
from pipeline.build.inputs.data import DEFAULT_VALIDATION, read_texts
from pipeline.build.shape_buckets import request_stream
from pipeline.build.timing import percentile, time_alternating, time_until_stable, token_rows
from pipeline.errors import InputError
from pipeline.runtime.artifact import verify_artifact
from pipeline.runtime.backends.onnxruntime import open_session
from pipeline.runtime.encoder import Model
from pipeline.runtime.schema import GRAPH, TOKENIZER

BATCH_SIZES = (1, 8, 32)
SEQ_LENS = (16, 128, 512)
PYTORCH = "pytorch-fp32"
PYTORCH_BF16 = "pytorch-bf16"
OPENVINO_DEFAULT = "openvino-default"
ARTIFACT = "artifact"
UNBUCKETED = "artifact-no-shape-buckets"
REQUEST_BATCHES = 16
REQUEST_MAX_BATCH = 64


def _mixed_texts(texts: list[str], count: int = 32) -> list[str]:
    """`count` texts, mostly short and an eighth long, in a fixed shuffled order: a typical mixed request."""
    by_length = sorted(texts, key=len)
    long = count // 8
    mixed = by_length[: count - long] + by_length[len(by_length) - long :]
    return [mixed[i] for i in np.random.default_rng(0).permutation(len(mixed))]


def _mixed_batch(runners: dict, model: Model, texts: list, accurate: set, batch: int, rounds: tuple) -> list:
    """Every variant on one mixed-length batch of `batch` texts as one call does it: the peers on the batch padded
    to its longest text (what SentenceTransformer.encode and a plain compile do with it), the artifact from text,
    tokenization and length bucketing included. Rows as the grid's, `seq` "mixed"."""
    mixed = _mixed_texts(texts, batch)
    padded = model.feeds(model.encode(mixed), buckets=False)
    calls = {name: run for name, run in runners.items() if name != ARTIFACT}
    calls[ARTIFACT] = lambda _feeds: model.run(mixed)
    times = time_until_stable(calls, padded, *rounds)
    rows = _grid_rows(times, len(mixed), padded["input_ids"].shape[1], accurate)
    for row in rows:
        row.update(seq="mixed", tokens_per_s=None)
    return rows


def _request_stream(
    runners: dict,
    model: Model,
    texts: list,
    accurate: set,
    rounds: tuple,
    batches: int = REQUEST_BATCHES,
    max_batch: int = REQUEST_MAX_BATCH,
) -> list:
    """Every variant on one request stream run back to back: `batches` batches of 1 to `max_batch` texts drawn
    from `texts` (seeded, the same for every variant); the peers on each batch padded to its longest text, the
    artifact from text, and the artifact padded to each chunk's longest where it has shape buckets
    (`UNBUCKETED`). One row per variant: the stream's total ms (median [p10, p90]) and texts/s, and the
    artifact's ratio to the fastest accurate peer."""
    stream = request_stream(texts, batches, max_batch)
    padded = [model.feeds(model.encode(batch), buckets=False) for batch in stream]
    calls = {
        name: (lambda work, run=run: [run(feeds) for feeds in work])
        for name, run in runners.items()
        if name != ARTIFACT
    }
    calls[ARTIFACT] = lambda _work: [model.run(batch) for batch in stream]
    if model.spec.get("shape_buckets"):
        calls[UNBUCKETED] = lambda _work: [model.run(batch, shape_buckets=False) for batch in stream]
    times = time_until_stable(calls, padded, *rounds)
    count = sum(len(batch) for batch in stream)
    rows = _grid_rows(times, count, 0, accurate)
    for row in rows:
        row.update(seq="stream", texts=row.pop("batch"), batches=len(stream), max_batch=max_batch, tokens_per_s=None)
        row["texts_per_s"] = row.pop("sequences_per_s")
    return rows


def _bucketing(model: Model, texts: list[str], reps: int) -> dict:
    mixed = _mixed_texts(texts)
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


def _variants(manifest: dict, real: Path, cache_dir: Path, threads: int, baseline) -> tuple[dict, dict, list]:
    """(runners by name, load figures by name, missing variants): PyTorch fp32 and bf16, OpenVINO's default compile
    of the plain export, the unoptimized and fused ONNX graphs on ONNX Runtime, and the artifact as it loads."""
    import psutil

    from pipeline.runtime.load import open_model

    process = psutil.Process()
    # No spinning: variants alternate, and a spinning ORT pool would steal the cores of the next variant.
    session = {**manifest["session"], "intra_op_threads": threads, "allow_spinning": False}
    export = cache_dir / "export" / manifest["stages"]["export"]["key"] / GRAPH
    factories = {}
    if baseline == "pytorch":
        checkpoint = checkpoint_from_source(manifest["source"])
        inputs = manifest["model"]["inputs"]
        factories[PYTORCH] = lambda: encoder_runner(checkpoint, inputs, threads)
        factories[PYTORCH_BF16] = lambda: encoder_runner(checkpoint, inputs, threads, "bfloat16")
    elif baseline is not None:
        raise InputError(f"unknown baseline {baseline!r}; use 'pytorch' or none")
    graphs = {"onnx-unoptimized": export}
    if "optimize" in manifest["stages"]:
        graphs["onnx-fp32-optimized"] = cache_dir / "optimize" / manifest["stages"]["optimize"]["key"] / GRAPH
    missing = [name for name, path in graphs.items() if not path.exists()]
    for name, path in graphs.items():
        if path.exists():
            factories[name] = lambda path=path: _session_runner(
                Model(open_session(path, session), real / TOKENIZER, manifest["model"])
            )
    if export.exists() and _has_openvino():
        factories[OPENVINO_DEFAULT] = lambda: openvino_default(export, manifest["model"]["output"])
    backend = manifest["backend"] if manifest["backend"] != "tensorrt" else "onnxruntime"
    factories[ARTIFACT] = lambda: _session_runner(
        open_model(real / manifest["graph"], real / TOKENIZER, manifest["model"], session=session, backend=backend)
    )
    runners, loads = {}, {}
    for name, factory in factories.items():
        rss, t0 = process.memory_info().rss, time.perf_counter()
        runners[name] = factory()
        loads[name] = {"load_s": time.perf_counter() - t0, "rss_mb": (process.memory_info().rss - rss) / 2**20}
    for name, path in {**graphs, ARTIFACT: real / manifest["graph"]}.items():
        if name in loads:
            loads[name]["size_mb"] = (
                sum(
                    p.stat().st_size
                    for p in path.parent.glob(path.stem + ".*")
                    if p.suffix in (".onnx", ".xml", ".bin")
                )
                / 2**20
            )
    return runners, loads, missing


def _session_runner(model):
    def run(feeds):
        return model.session.run([model.output_name], {k: feeds[k] for k in model.input_names})[0]

    run.model = model
    return run


def _has_openvino() -> bool:
    try:
        import openvino  # noqa: F401
    except ImportError:
        return False
    return True


def openvino_default(export: Path, output: str):
    """OpenVINO's one-line alternative: the plain ONNX export compiled with no settings (bf16 where the CPU has it)."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(export), "CPU")
    names = [p.get_any_name() for p in compiled.inputs]

    def run(feeds):
        return compiled({k: feeds[k] for k in names})[compiled.output(output)]

    return run


def cosines_against_pytorch(runners: dict, feeds: dict) -> dict:
    """Each variant's cosine (min) against PyTorch fp32 on the same padded validation batch."""
    outputs = {name: np.asarray(run(feeds), dtype=np.float64) for name, run in runners.items()}
    reference = outputs.get(PYTORCH)
    if reference is None:
        return {}
    result = {}
    for name, out in outputs.items():
        a, b = reference.reshape(len(reference), -1), out.reshape(len(out), -1)
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)).clip(1e-12)
        result[name] = float(cos.min())
    return result


def _grid_rows(times: dict, batch: int, length: int, accurate: set) -> list[dict]:
    """One row per variant: median and spread, throughput, and the ratios (artifact over the fastest accurate
    peer, each variant over PyTorch fp32)."""
    p50 = {name: statistics.median(t["ms"]) for name, t in times.items()}
    peers = [n for n in p50 if n != ARTIFACT and n in accurate]
    best_peer = min(peers, key=p50.get) if peers else None
    rows = []
    for name, t in times.items():
        row = {
            "variant": name,
            "batch": batch,
            "seq": length,
            "reps": len(t["ms"]),
            "noisy": t["noisy"],
            "p50_ms": p50[name],
            "p10_ms": percentile(t["ms"], 10),
            "p90_ms": percentile(t["ms"], 90),
            "p99_ms": percentile(t["ms"], 99),
            "sequences_per_s": batch / p50[name] * 1000,
            "tokens_per_s": batch * length / p50[name] * 1000,
            "speedup_vs_pytorch": p50[PYTORCH] / p50[name] if PYTORCH in p50 else None,
        }
        if name == ARTIFACT and best_peer:
            peer = times[best_peer]["ms"]
            row.update(
                best_peer=best_peer,
                speedup_vs_best_peer=p50[best_peer] / p50[name],
                speedup_low=percentile(peer, 10) / percentile(t["ms"], 90),
                speedup_high=percentile(peer, 90) / percentile(t["ms"], 10),
            )
        rows.append(row)
    return rows


def bench(
    artifact: str | Path,
    cache_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    batch_sizes=BATCH_SIZES,
    seq_lens=SEQ_LENS,
    baseline: str | None = "pytorch",
    min_rounds: int = 7,
    max_rounds: int = 40,
    servers: bool = True,
    serving_seconds: float = 4.0,
) -> dict:
    """Benchmark an artifact against its peers, alternating round by round until each median's p10-p90 spread is
    within 10% (else the row is marked noisy); returns the results and writes them to `out_dir`."""
    import psutil

    artifact = Path(artifact)
    manifest = verify_artifact(artifact)
    real = artifact.resolve()
    cache_dir = Path(cache_dir or Path(__file__).resolve().parents[2] / ".cache" / "stages")
    threads = os.cpu_count() or 1
    texts = read_texts(DEFAULT_VALIDATION, "benchmark")
    runners, loads, missing = _variants(manifest, real, cache_dir, threads, baseline)
    shipped = runners[ARTIFACT].model  # the artifact is always a session runner
    accuracy = cosines_against_pytorch(runners, shipped.feeds(shipped.encode(texts[:32])))
    gate = manifest["target_spec"]["accuracy"].get("cosine_min") or 0.99
    accurate = {name for name, cos in accuracy.items() if cos >= gate} if accuracy else set(runners)
    limit = int(manifest["model"]["max_length"])
    grid = []
    for length in progress(sorted({min(n, limit) for n in seq_lens}), "bench: sequence lengths"):
        for batch in batch_sizes:
            times = time_until_stable(runners, token_rows(shipped, texts, batch, length), min_rounds, max_rounds)
            grid += _grid_rows(times, batch, length, accurate)
    mixed = _mixed_batch(runners, shipped, texts, accurate, max(batch_sizes), (min_rounds, max_rounds))
    results = {
        **identity(manifest, real, threads),
        "variants": loads,
        "missing_variants": missing,
        "accuracy_cosine_min": accuracy,
        "accuracy_gate": gate,
        "grid": grid,
        "mixed": mixed,
        "request_stream": _request_stream(runners, shipped, texts, accurate, (min_rounds, max_rounds)),
        "bucketing": _bucketing(shipped, texts, min_rounds),
        "concurrency": serving.concurrency(shipped, real, texts, seconds=serving_seconds, servers=servers),
        "tokenization": _tokenization_share(shipped, texts, min_rounds),
        "process_peak_rss_mb": psutil.Process().memory_info().rss / 2**20,
    }
    out = write_results(results, markdown(results), out_dir or bench_folder(real, manifest))
    from pipeline.bench.plot import plot

    plot(results, out / "bench.png")
    results["written_to"] = str(out)
    return results


def _spread(row: dict) -> str:
    return f"{row['p50_ms']:.2f} [{row['p10_ms']:.2f}, {row['p90_ms']:.2f}]" + (" noisy" if row["noisy"] else "")


def _stream_markdown(rows: list) -> list[str]:
    if not rows:
        return []
    first = rows[0]
    lines = [
        "",
        f"Request stream: {first['batches']} batches of 1 to {first['max_batch']} texts drawn from the validation "
        f"text ({first['texts']} texts), run back to back; peers padded to each batch's longest text.",
        "",
        "| variant | total ms: median [p10, p90] | texts/s | artifact vs fastest accurate peer |",
        "|---|---|---|---|",
    ]
    for row in rows:
        peer = "-"
        if "best_peer" in row:
            low, high = row["speedup_low"], row["speedup_high"]
            peer = f"x{row['speedup_vs_best_peer']:.2f} [{low:.2f}, {high:.2f}] over {row['best_peer']}"
        lines.append(f"| {row['variant']} | {_spread(row)} | {row['texts_per_s']:.1f} | {peer} |")
    return lines


def markdown(results: dict) -> str:
    """The results as Markdown: the host, each figure as median [p10, p90], the artifact against the fastest
    peer that meets the accuracy gate, and each variant against PyTorch fp32."""
    lines = [
        f"# {results['model_name']} {results['version']} {results['target']}",
        "",
        f"{host_line(results)} Rounds alternate between variants until each median's p10-p90 spread is within 10%; "
        "'noisy' marks a figure that never got there.",
        "",
        f"Accuracy gate for peers: cosine min >= {results['accuracy_gate']} against PyTorch fp32 on 32 held-out texts.",
        "",
        "| variant | cosine min | load s | RSS added MB | size MB |",
        "|---|---|---|---|---|",
    ]
    for name, v in results["variants"].items():
        cos = results["accuracy_cosine_min"].get(name)
        size = f"{v['size_mb']:.1f}" if "size_mb" in v else "-"
        lines.append(
            f"| {name} | {'-' if cos is None else f'{cos:.4f}'} | {v['load_s']:.2f} | {v['rss_mb']:.0f} | {size} |"
        )
    lines += [
        "",
        "| variant | batch | seq | ms: median [p10, p90] | seq/s | vs PyTorch fp32 | artifact vs fastest "
        "accurate peer |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["grid"] + results.get("mixed", []):
        ratio = f"x{row['speedup_vs_pytorch']:.2f}" if row["speedup_vs_pytorch"] else "-"
        peer = "-"
        if "best_peer" in row:
            low, high = row["speedup_low"], row["speedup_high"]
            peer = f"x{row['speedup_vs_best_peer']:.2f} [{low:.2f}, {high:.2f}] over {row['best_peer']}"
        lines.append(
            f"| {row['variant']} | {row['batch']} | {row['seq']} | {_spread(row)} | "
            f"{row['sequences_per_s']:.1f} | {ratio} | {peer} |"
        )
    lines += _stream_markdown(results.get("request_stream", []))
    b, c, t = results["bucketing"], results["concurrency"], results["tokenization"]
    lines += [
        "",
        f"- Bucketing, {b['texts']} mixed-length texts: padded {b['padded_ms']:.1f} ms, bucketed "
        f"{b['bucketed_ms']:.1f} ms: x{b['bucketing_gain']:.2f}",
        f"- Tokenization of {t['batch']} texts: {t['tokenize_ms']:.2f} ms of {t['end_to_end_ms']:.2f} ms "
        f"end to end ({t['share']:.1%})",
        f"- Process peak RSS {results['process_peak_rss_mb']:.0f} MB",
    ]
    lines += ["", *serving.markdown(c)]
    if results["missing_variants"]:
        lines.append(f"- Not in the stage cache, so not measured: {', '.join(results['missing_variants'])}")
    return "\n".join(lines) + "\n"
