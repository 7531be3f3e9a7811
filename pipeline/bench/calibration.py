"""Peak memory of static calibration as the example count grows, each count in a fresh process."""

from __future__ import annotations

import json
import time
from pathlib import Path

from pipeline.build.inputs.data import DEFAULT_VALIDATION, read_texts
from pipeline.errors import InputError
from pipeline.runtime.artifact import verify_artifact
from pipeline.runtime.schema import GRAPH, TOKENIZER


def _calibrate_in_child(fp32_path: str, tokenizer: str, spec: dict, count: int, method: str, streamed: bool, out: str):
    """Child process: static calibration of `count` examples; returns (peak RSS MB, seconds)."""
    import resource
    import tempfile

    from pipeline.build.inputs.targets import Quantize
    from pipeline.build.passes.int8 import calibration_reader, quantize_static
    from pipeline.runtime.backends.onnxruntime import open_session
    from pipeline.runtime.encoder import Model

    texts = read_texts(DEFAULT_VALIDATION, "calibration")
    texts = (texts * (count // len(texts) + 1))[:count]
    model = Model(open_session(Path(fp32_path), None), Path(tokenizer), spec)
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
    cache_dir = Path(cache_dir or Path(__file__).resolve().parents[2] / ".cache" / "stages")
    fp32 = cache_dir / "optimize" / manifest["stages"]["optimize"]["key"] / GRAPH
    if not fp32.exists():
        raise InputError(f"the fp32 graph of {artifact} is not in the stage cache {cache_dir}; rebuild it first")
    from pipeline.build.passes.int8 import with_shapes

    with tempfile.TemporaryDirectory() as scratch:
        shaped = Path(scratch) / "shaped.onnx"
        with_shapes(fp32, shaped)
        rows = []
        # Unstreamed, onnxruntime's histogram calibrators stack every batch into one array and fail unless all have
        # the same shape, so that comparison uses whole batches only.
        runs = [(n, True) for n in counts] + [(max(16, min(counts) // 16 * 16), False)]
        for count, streamed in runs:
            out = shaped.parent / f"{count}-{streamed}.json"
            args = [str(shaped), str(real / TOKENIZER), manifest["model"], count, method, streamed, str(out)]
            code = (
                "import json, sys; from pipeline.bench.calibration import _calibrate_in_child as f; "
                "f(*json.loads(sys.argv[1]))"
            )
            child = subprocess.run(
                [sys.executable, "-c", code, json.dumps(args)],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parents[2],
            )
            result = json.loads(out.read_text()) if child.returncode == 0 else {"peak_rss_mb": None, "seconds": None}
            if child.returncode:  # the child's last line says why, for the report
                result["error"] = (child.stderr.strip().splitlines() or ["no message"])[-1]
            rows.append(
                {"examples": count, "method": method, "streamed": streamed, "exit_code": child.returncode, **result}
            )
        return rows


def calibration_lines(rows: list[dict]) -> str:
    """`calibration_memory`'s rows as `pipeline bench --calibration-memory` prints them, a line each."""
    lines = []
    for row in rows:
        kind = "streamed (this pipeline)" if row["streamed"] else "unstreamed (onnxruntime default)"
        failed = f" (failed: {row['error']})" if row.get("error") else ""
        lines.append(
            f"{row['examples']:>6} examples, {row['method']}, {kind}: peak RSS {row['peak_rss_mb']} MB, "
            f"{row['seconds']} s{failed}"
        )
    return "\n".join(lines)
