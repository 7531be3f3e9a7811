"""A published encoder's per-op profile against the host's GEMM limit (`pipeline bench ARTIFACT --profile`).

The artifact runs as it loads (its engine, session settings and precision, every core) on rows of real tokens at
batch 1 and 32, sequence 128, under its engine's own profiler (pipeline/bench/op_times.py). Its node times are
summed per op class, averaged over the measured runs; its GEMM nodes' FLOPs over their time is what it achieves,
set against the best GFLOP/s the same engine reaches on large MatMuls on this host (pipeline/bench/gemm_limit.py):

    share of the limit = sum over GEMM nodes of (FLOPs / limit at the node's precision) / the nodes' time

so an artifact whose GEMMs run partly in int8 and partly in fp32 is held to each precision's own limit.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from pipeline.bench.common import bench_folder, host_line, identity
from pipeline.bench.gemm_limit import SHAPES, gemm_limit
from pipeline.bench.op_times import CLASSES, onnxruntime_node_times, openvino_node_times
from pipeline.errors import InputError
from pipeline.runtime.schema import TOKENIZER

PROFILE_SHAPES = ((1, 128), (32, 128))
TOP_OPS = 8


def _node_times(model, graph: Path, backend: str, feeds: dict, runs: int, warmups: int) -> dict:
    if backend == "openvino":
        return openvino_node_times(graph, model.session.config, feeds, runs, warmups)
    # The session's own options (threads, graph level, spinning) with profiling switched on, in a new session.
    return onnxruntime_node_times(graph, model.session.get_session_options(), feeds, runs, warmups)


def summarize(node_runs: list[list[dict]], run_us: list[float]) -> dict:
    """One shape's profile from its node records per run: per class ms (mean per run), share of the op time and
    FLOPs; the top op types; the GEMM nodes' FLOPs and ms by compute precision; the engine's own run time (median)
    and the share of it the nodes cover (on a busy host a run also holds gaps where the process waited)."""
    count = max(len(node_runs), 1)
    nodes = [node for run in node_runs for node in run]
    op_ms = sum(n["us"] for n in nodes) / count / 1000
    classes = {}
    for cls in CLASSES:
        members = [n for n in nodes if n["class"] == cls]
        ms = sum(n["us"] for n in members) / count / 1000
        flops = sum(n["flops"] or 0 for n in members) // count
        classes[cls] = {"ms": ms, "share": ms / op_ms if op_ms else 0.0, "flops": flops, "nodes": len(members) // count}
    by_op: dict[tuple, float] = {}
    for n in nodes:
        by_op[(n["op"], n["class"])] = by_op.get((n["op"], n["class"]), 0.0) + n["us"]
    top = sorted(by_op.items(), key=lambda item: -item[1])[:TOP_OPS]
    gemm_by_precision: dict[str, dict] = {}
    for n in nodes:
        if n["class"] == "gemm":
            entry = gemm_by_precision.setdefault(n["precision"] or "unknown", {"flops": 0, "ms": 0.0})
            entry["flops"] += (n["flops"] or 0) / count
            entry["ms"] += n["us"] / count / 1000
    return {
        "run_ms": statistics.median(run_us) / 1000 if run_us else None,
        "coverage": _coverage(node_runs, run_us),
        "op_ms": op_ms,
        "classes": classes,
        "top_ops": [
            {"op": op, "class": cls, "ms": us / count / 1000, "share": us / count / 1000 / op_ms if op_ms else 0.0}
            for (op, cls), us in top
        ],
        "gemm_by_precision": gemm_by_precision,
    }


def _coverage(node_runs: list[list[dict]], run_us: list[float]) -> float | None:
    """The nodes' time over the engine's time of the fastest run, the run least stretched by other processes:
    near 1 when the profile holds the whole run. Where the engine gives only means over the runs (OpenVINO), the
    mean nodes' time over the mean run: against the fastest, a busy host's slow runs would count as coverage."""
    if not run_us:
        return None
    if len(node_runs) != len(run_us):
        return sum(n["us"] for n in node_runs[0]) / statistics.fmean(run_us)
    fastest = min(range(len(run_us)), key=run_us.__getitem__)
    return sum(n["us"] for n in node_runs[fastest]) / run_us[fastest]


def gemm_share(shape: dict, limits: dict) -> dict:
    """The GEMM class against the limit: achieved GFLOP/s, the limit's GFLOP/s at the GEMMs' precision (FLOP-weighted
    where they mix), and the share = time at the limit / time taken. GEMMs of a precision with no measured limit are
    left out of the share and named."""
    compared = {p: v for p, v in shape["gemm_by_precision"].items() if p in limits and v["ms"] > 0}
    flops = sum(v["flops"] for v in compared.values())
    ms = sum(v["ms"] for v in compared.values())
    ideal_ms = sum(v["flops"] / (limits[p]["gflops_per_s"] * 1e6) for p, v in compared.items())
    achieved = flops / ms / 1e6 if ms else None
    return {
        "flops": flops,
        "ms": ms,
        "gflops_per_s": achieved,
        "limit_gflops_per_s": flops / ideal_ms / 1e6 if ideal_ms else None,
        "share_of_limit": ideal_ms / ms if ms else None,
        "precisions": sorted(compared),
        "not_compared": sorted(set(shape["gemm_by_precision"]) - set(compared)),
    }


def profile(
    artifact: str | Path,
    out_dir: str | Path | None = None,
    shapes=PROFILE_SHAPES,
    runs: int = 5,
    warmups: int = 2,
    limit_shapes=SHAPES,
    limit_runs: int = 3,
) -> dict:
    """Profile an encoder artifact at each (batch, sequence) of `shapes` and measure the host's GEMM limit at
    `limit_shapes`; writes profile.json and profile.md beside the artifact (or into `out_dir`) and returns them."""
    from pipeline.build.inputs.data import DEFAULT_VALIDATION, read_texts
    from pipeline.build.timing import token_rows
    from pipeline.runtime.artifact import verify_artifact
    from pipeline.runtime.host import usable_cores
    from pipeline.runtime.load import open_model

    artifact = Path(artifact)
    manifest = verify_artifact(artifact)
    if manifest["model"]["task"] == "text-generation":
        raise InputError(f"{artifact} is a decoder; --profile profiles encoders, so run `pipeline bench` without it")
    backend = manifest["backend"]
    if backend not in ("onnxruntime", "openvino"):
        raise InputError(f"{artifact} runs on {backend}; --profile profiles the CPU engines onnxruntime and openvino")
    real = artifact.resolve()
    threads = usable_cores()
    session = {**manifest["session"], "intra_op_threads": threads, "allow_spinning": False}
    graph = real / manifest["graph"]
    model = open_model(graph, real / TOKENIZER, manifest["model"], session=session, backend=backend)
    texts = read_texts(DEFAULT_VALIDATION, "benchmark")
    limit = int(manifest["model"]["max_length"])
    profiled = []
    for batch, length in shapes:
        feeds = token_rows(model, texts, batch, min(length, limit))
        times = _node_times(model, graph, backend, feeds, runs, warmups)
        profiled.append({"batch": batch, "seq": min(length, limit), **summarize(times["runs"], times["run_us"])})
    precisions = {p for s in profiled for p in s["gemm_by_precision"] if p in ("fp32", "int8", "bf16")}
    host_limit = gemm_limit(backend, tuple(sorted(precisions | {"fp32"})), limit_shapes, threads, limit_runs)
    for shape in profiled:
        shape["gemm"] = gemm_share(shape, host_limit["limits"])
    results = {
        **identity(manifest, real, threads),
        "engine": backend,
        "precision": manifest.get("precision"),
        "runs": runs,
        "warmups": warmups,
        "shapes": profiled,
        "limit": host_limit,
    }
    out = Path(out_dir or bench_folder(real, manifest))
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(results, indent=1))
    (out / "profile.md").write_text(markdown(results))
    results["written_to"] = str(out)
    return results


def _gflops(value) -> str:
    return "-" if value is None else f"{value:.1f}"


def markdown(results: dict) -> str:
    """The profile as Markdown: per shape the op classes' ms and share, the top ops, the host's GEMM limit per
    precision, and the GEMM class's GFLOP/s against it."""
    lines = [
        f"# Profile: {results['model_name']} {results['version']} {results['target']} ({results['engine']}, "
        f"{results['precision'] or 'fp32'})",
        "",
        f"{host_line(results)} Per-op time from the engine's profiler, mean of {results['runs']} runs after "
        f"{results['warmups']} warm-ups; share is of the summed op time.",
        "",
        "| shape | class | ms | share | GFLOP/s |",
        "|---|---|---|---|---|",
    ]
    for s in results["shapes"]:
        name = f"b{s['batch']} x {s['seq']}"
        for cls, c in s["classes"].items():
            if c["nodes"]:
                rate = c["flops"] / c["ms"] / 1e6 if c["flops"] and c["ms"] else None
                lines.append(f"| {name} | {cls} | {c['ms']:.2f} | {c['share']:.1%} | {_gflops(rate)} |")
        run = "-" if s["run_ms"] is None else f"{s['run_ms']:.2f} ms, nodes cover {s['coverage']:.0%} of a run"
        lines.append(f"| {name} | all ops (engine's run: {run}) | {s['op_ms']:.2f} | 100% | |")
    lines += ["", "| shape | top op | class | ms | share |", "|---|---|---|---|---|"]
    for s in results["shapes"]:
        for op in s["top_ops"]:
            lines.append(
                f"| b{s['batch']} x {s['seq']} | {op['op']} | {op['class']} | {op['ms']:.2f} | {op['share']:.1%} |"
            )
    limit = results["limit"]
    lines += [
        "",
        f"The host's measured GEMM limit ({limit['kernel_class']}, {limit['threads']} threads; best of the shapes):",
        "",
        "| precision | engine | best shape (M x K x N) | GFLOP/s |",
        "|---|---|---|---|",
    ]
    for precision, best in limit["limits"].items():
        lines.append(
            f"| {precision} | {best['engine']} | {best['m']} x {best['k']} x {best['n']} | {best['gflops_per_s']:.1f} |"
        )
    lines += [f"| {p} | - | not measured: {why} | - |" for p, why in limit["skipped"].items()]
    lines += ["", "| shape | GEMM GFLOP/s | limit GFLOP/s | share of the limit |", "|---|---|---|---|"]
    for s in results["shapes"]:
        g = s["gemm"]
        share = "-" if g["share_of_limit"] is None else f"{g['share_of_limit']:.1%}"
        left = f" ({', '.join(g['not_compared'])} GEMMs not compared)" if g["not_compared"] else ""
        lines.append(
            f"| b{s['batch']} x {s['seq']} | {_gflops(g['gflops_per_s'])} | {_gflops(g['limit_gflops_per_s'])} "
            f"({', '.join(g['precisions'])}) | {share}{left} |"
        )
    return "\n".join(lines) + "\n"
