"""Image encoders' speed: images/s of an image artifact's graph against OpenVINO's default compile of the plain
export (the one-line alternative) and PyTorch fp32, at batch 1 and 32, alternating round by round in one process;
and each one's cosine against PyTorch on the same pictures.

    scikit-image's photographs --the runtime's preprocessing--> pixel_values [n, 3, H, W] (the same for all)
        --> each variant, in turn, round after round: pixel_values in -> embeddings (or logits) out

What is timed is the model alone, on the same pixel batch for every variant: the artifact as it loads (its engine,
precision and tuned session settings, a batch split over its streams where it has them), OpenVINO's
`compile_model(export, "CPU")` with no settings (bf16 where the CPU has it), and the transformers model under
inference_mode. Preprocessing is the same for all and is left out. The ratios pair rounds: the peer's time over the
artifact's, above 1 the artifact is faster.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from pipeline.bench.common import bench_folder, figure, figure_cell, host_line, identity, write_results
from pipeline.bench.encoder import OPENVINO_DEFAULT, PYTORCH, cosines_against_pytorch, openvino_default
from pipeline.build.timing import ARTIFACT, alternate
from pipeline.errors import InputError
from pipeline.runtime.schema import GRAPH

BATCHES, QUICK_BATCHES = (1, 32), (1, 4)
ROUNDS, QUICK_ROUNDS = 10, 2
SETTLE_S = 0.3  # the previous engine's spinning threads park before the next is timed


def _pictures(count: int, spec) -> np.ndarray:
    """`count` pixel batches' rows from scikit-image's photographs (repeated to fill), as the runtime prepares them."""
    import skimage

    from pipeline.runtime.images import pixel_values

    root = Path(skimage.data.__path__[0])
    files = sorted(p for p in root.glob("*.png") if p.stat().st_size > 20_000)[:8]
    return pixel_values([str(files[i % len(files)]) for i in range(count)], spec)


def _variants(manifest: dict, real: Path, cache_dir: Path | None, threads: int) -> dict:
    from pipeline.runtime.load import load

    model = load(real, intra_op_threads=threads)
    image_model = getattr(model, "image_model", model)  # a two-tower artifact's image tower
    name = image_model.output_name
    runners = {ARTIFACT: lambda pixels: image_model.run_pixels(pixels, len(pixels))}
    export = (cache_dir or Path(".cache/stages")) / "export" / manifest["stages"]["export"]["key"] / GRAPH
    if export.exists():
        default = openvino_default(export, name)
        runners[OPENVINO_DEFAULT] = lambda pixels: default({"pixel_values": pixels})
    return runners


def _pytorch(manifest: dict, threads: int):
    import torch

    from pipeline.build.accuracy.reference import checkpoint_from_source, image_head, load_torch_model

    torch.set_num_threads(threads)
    checkpoint = checkpoint_from_source(manifest["source"])
    head = image_head(load_torch_model(checkpoint), checkpoint)

    def run(pixels):
        with torch.inference_mode():
            return head(torch.from_numpy(pixels)).numpy()

    return run


def image_speed(runners: dict, batches: dict[int, np.ndarray], rounds: int) -> dict:
    """Per batch size: each variant's ms and images/s (median and p10-p90 of `rounds` alternating rounds), its
    cosine against PyTorch's output, and the artifact's paired ratio against each other variant."""
    results = {}
    for size, pixels in batches.items():
        times = alternate(runners, pixels, rounds, warmups=2, settle_s=SETTLE_S)
        cosines = cosines_against_pytorch(runners, pixels)
        row = {}
        for name, ms in times.items():
            row[name] = {"ms": figure(ms), "images_per_s": figure([size * 1000 / t for t in ms])}
            row[name]["cosine"] = cosines.get(name)
            if name != ARTIFACT:
                row[name]["artifact_speedup"] = figure([o / a for o, a in zip(ms, times[ARTIFACT], strict=True)])
        results[str(size)] = row
    return results


def bench_images(artifact, cache_dir=None, out_dir=None, quick: bool = False, baseline: str | None = "pytorch"):
    """Benchmark an image artifact against OpenVINO's default compile of its plain export (from the stage cache)
    and PyTorch fp32; writes bench.json and bench.md beside it (or to `out_dir`) and returns the results."""
    from pipeline.build.cache import package_versions
    from pipeline.runtime.artifact import verify_artifact
    from pipeline.runtime.host import usable_cores
    from pipeline.runtime.images import ImageSpec

    real = Path(artifact).resolve()
    manifest = verify_artifact(real)
    if manifest["model"].get("modality") != "image":
        raise InputError(f"{artifact} is a {manifest['model']['task']} artifact; the image benchmark takes image ones")
    threads = min(int(manifest.get("session", {}).get("intra_op_threads", 0) or 0) or usable_cores(), usable_cores())
    runners = _variants(manifest, real, Path(cache_dir) if cache_dir else None, threads)
    if baseline == "pytorch":
        runners[PYTORCH] = _pytorch(manifest, threads)
    spec = ImageSpec.from_json(json.loads((real / manifest["model"]["preprocessor"]).read_text()))
    sizes = QUICK_BATCHES if quick else BATCHES
    started = time.perf_counter()
    speed = image_speed(runners, {n: _pictures(n, spec) for n in sizes}, QUICK_ROUNDS if quick else ROUNDS)
    results = {
        "task": manifest["model"]["task"],
        **identity(manifest, real, threads),
        "peer_versions": package_versions(("openvino", "torch", "onnxruntime")),
        "batches": speed,
        "variants": list(runners),
        "bench_seconds": time.perf_counter() - started,
    }
    results["written_to"] = str(write_results(results, markdown(results), out_dir or bench_folder(real, manifest)))
    return results


def markdown(results: dict) -> str:
    """One table a batch size: each variant's images/s and ms (median [p10, p90]), cosine, and the artifact's
    speedup over it."""
    name = " ".join(str(results[k]) for k in ("model_name", "version", "target"))
    lines = [f"# Images: {name}", "", host_line(results), ""]
    for size, row in results["batches"].items():
        lines += [
            f"## batch {size}",
            "",
            "| variant | images/s | ms | cosine vs PyTorch | artifact speedup over it |",
            "|---|---|---|---|---|",
        ]
        for variant, figures in row.items():
            cells = [figure_cell(figures["images_per_s"], digits=1), figure_cell(figures["ms"], digits=1)]
            cosine = "-" if figures["cosine"] is None else f"{figures['cosine']:.5f}"
            speedup = figure_cell(figures["artifact_speedup"]) if "artifact_speedup" in figures else "-"
            lines.append(f"| {variant} | {cells[0]} | {cells[1]} | {cosine} | {speedup} |")
        lines.append("")
    return "\n".join(lines)
