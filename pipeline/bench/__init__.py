"""Benchmarks: the compared variants side by side in one process, alternating run by run.

encoder.py      encoders: PyTorch, the unoptimized and fp32 graphs, the artifact; bucketing
serving.py      direct calls, the Batcher, Triton and Ray Serve at 1, 8 and 32 concurrent callers
generation.py   decoders: time to first token and decode tokens/s against transformers' generate
speech.py       speech recognition: real-time factor and word error rate against faster-whisper and transformers
images.py       image encoders: images/s at batch 1 and 32 against OpenVINO's default compile and PyTorch
calibration.py  peak memory of static calibration
profile.py      per-op time by class against the host's GEMM limit (op_times.py: the engines' profilers; gemm_limit.py)
plot.py, common.py
"""

from __future__ import annotations

from pathlib import Path


def run(
    artifact: str | Path,
    cache_dir=None,
    out_dir=None,
    baseline: str | None = "pytorch",
    quick: bool = False,
    peers: dict | None = None,
):
    """Benchmark an artifact: the decoder benchmark for text generation (with onnxruntime-genai `peers`, {name:
    model folder}), else the encoder one."""
    from pipeline.runtime.artifact import verify_artifact

    manifest = verify_artifact(artifact)
    if manifest["model"]["task"] == "automatic-speech-recognition":
        from pipeline.bench.speech import bench_speech

        return bench_speech(artifact, out_dir, quick=quick)
    if manifest["model"].get("modality") == "image":
        from pipeline.bench.images import bench_images

        return bench_images(artifact, cache_dir, out_dir, quick=quick, baseline=baseline)
    if manifest["model"]["task"] == "text-generation":
        from pipeline.bench.generation import bench_generation

        settings = {"batch_sizes": (1, 8), "new_tokens": 16, "reps": 2} if quick else {}
        return bench_generation(artifact, out_dir, baseline=baseline, peers=peers, **settings)
    from pipeline.bench.encoder import bench

    settings = {"batch_sizes": (1, 8), "seq_lens": (16, 128), "min_rounds": 3, "max_rounds": 10, "servers": False}
    settings = settings if quick else {}
    return bench(artifact, cache_dir, out_dir, baseline=baseline, **settings)


def markdown(results: dict) -> str:
    """A benchmark's results as Markdown."""
    if "audio_seconds" in results:
        from pipeline.bench.speech import markdown as speech_markdown

        return speech_markdown(results)
    if "batches" in results:
        from pipeline.bench.images import markdown as images_markdown

        return images_markdown(results)
    if "runs" in results:
        from pipeline.bench.generation import markdown as generation_markdown

        return generation_markdown(results)
    from pipeline.bench.encoder import markdown as encoder_markdown

    return encoder_markdown(results)
