"""What the commands print: the summary `pipeline inspect` prints of a verified artifact (`--json` prints describe()
as is), the report after `pipeline build`, and the plan of `pipeline check`."""

from __future__ import annotations

import json
import re

from pipeline.build.timing import COST
from pipeline.errors import ArtifactError


def verdict_table(rows: list[dict]) -> str:
    """Each checked metric with its threshold and PASS or FAIL, one line each; a metric the target does not gate
    is shown as measured."""
    lines = [f"  {'metric':<24} {'value':>12}   {'threshold':<14} verdict"]
    for row in rows:
        value = row["value"] if isinstance(row["value"], bool) else f"{row['value']:.6g}"
        if row.get("threshold") is None or (row["relation"] == ">=" and row["threshold"] <= 0):
            lines.append(f"  {row['metric']:<24} {value:>12}   {'-':<14} measured, not gated")
            continue
        state = "PASS" if row["passed"] else "FAIL"
        threshold = f"{row['relation']} {row['threshold']:.6g}" if not isinstance(row["threshold"], bool) else "== True"
        lines.append(f"  {row['metric']:<24} {value:>12}   {threshold:<14} {state}")
    return "\n".join(lines)


# The accuracy columns of the candidate table: embeddings by cosine, classifiers by label agreement, decoders by
# their teacher-forced gate.
_ACCURACY_COLUMNS = (
    ("cosine_min", "cos min"),
    ("top1_agreement", "labels"),
    ("teacher_top1_agreement", "top1"),
    ("perplexity_ratio", "ppl x"),
)


def candidate_table(search: dict) -> str:
    """The engine search's candidates: accuracy on the development split, latency per shape, and the choice."""
    rows = search["candidates"]
    shapes = next((list(r["latency_ms"]) for r in rows if r.get("latency_ms")), [])
    columns = [(k, label) for k, label in _ACCURACY_COLUMNS if any(k in r for r in rows)] or _ACCURACY_COLUMNS[:1]
    width = max([20] + [len(r["name"]) for r in rows])
    head = f"    {'candidate':<{width}} {'status':<8} " + " ".join(f"{label:>8}" for _, label in columns)
    costs = any(row.get(k) is not None for row in rows for k in COST)
    lines = [head + " " + " ".join(f"{s + ' ms':>12}" for s in shapes) + (f" {'cost s':>8}" if costs else "")]
    for row in rows:
        scores = " ".join(f"{row[k]:>8.4f}" if k in row else f"{'-':>8}" for k, _ in columns)
        times = " ".join(f"{(row.get('latency_ms') or {}).get(s, float('nan')):>12.2f}" for s in shapes)
        if costs:
            times += f" {sum(row.get(k) or 0 for k in COST):>8.1f}"
        mark = "  <- chosen" if row.get("chosen") else f"  ({row['reason']})" if row.get("reason") else ""
        if row.get("bisection"):
            wide = row.get("wide_layers")
            mark += f"  (bisected: {'no' if wide is None else wide} {row['bisect_layers']} layers at 8 bits pass)"
        if (row.get("held_out") or {}).get("status") == "missed":
            mark += f"  (missed on held-out data: {'; '.join(row['held_out']['missed'])})"
        lines.append(f"    {row['name']:<{width}} {row['status']:<8} {scores} {times}{mark}")
    return "\n".join(lines)


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` without control characters but newlines: what is printed from a file cannot move the cursor, clear
    the screen or retitle the terminal (an edited `created_at` held escape codes)."""
    return _CONTROL.sub("", text)


def summary(info: dict) -> str:
    """What a user asks of an artifact first: identity, the choice and its alternatives, the gate, size, hashes.
    Any text taken from the manifest is printed without control characters."""
    try:
        return printable(_summary(info))
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as err:
        raise ArtifactError(
            f"{info.get('path')}: its search table or validation is not of the shape this version writes "
            f"({type(err).__name__}: {str(err)[:80]}); rebuild the artifact"
        ) from None


def _summary(info: dict) -> str:
    validation = info.get("validation") or {}
    total = sum(f["bytes"] for f in info["files"].values())
    lines = [
        f"{info['model_name']} {info['version']} for {info['target']}: {info['task']}",
        f"  engine      {info['backend']}, precision {info.get('precision') or '-'}, graph {info['graph']}",
        f"  built on    kernel class {info.get('kernel_class')}, {info.get('created_at')}",
        f"  size        {_size(total)} in {len(info['files'])} files; "
        + ("every sha256 verified" if info.get("verified") else "NOT verified"),
    ]
    candidates = info.get("candidates")
    if candidates:
        chosen = next((c["name"] for c in candidates if c.get("chosen")), None)
        search = ((info.get("build_speed") or {}).get("search") or {}).get("candidates") or {}
        timed = [{**row, **(search.get(row["name"]) or {})} for row in candidates]
        lines += [
            f"  chosen      {chosen}",
            "",
            "search (accuracy on the development split"
            + ("; times on the build host while it built, `make bench` measures speed):" if search else "):"),
            candidate_table({"candidates": timed}),
        ]
    rows = validation.get("verdict") or []
    if rows:
        lines += ["", "validation on held-out data:", verdict_table(rows)]
    return "\n".join(lines)


def _scores(metrics: dict) -> str:
    """A validation's scores as compact JSON, to 4 decimals."""
    return json.dumps({k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})


def _generation_speed(validation: dict) -> list[str]:
    """The decoder's speed as timed while building, a line a batch."""
    speed = (validation.get("speed") or {}).get("batches", {})
    lines = ["timed on this build host while building (report.json; `make bench` measures speed):"] if speed else []
    for batch, row in speed.items():
        mine, torch = row["artifact"], row["pytorch-generate"]
        low, high = mine["decode_range_tokens_per_s"]
        lines.append(
            f"  {batch.replace('_', ' ')}: time to first token {mine['ttft_ms']:.1f} ms "
            f"(PyTorch {torch['ttft_ms']:.1f}), decode {mine['decode_tokens_per_s']:.0f} tokens/s "
            f"[p10-p90 {low:.0f}-{high:.0f}] (PyTorch {torch['decode_tokens_per_s']:.0f}, "
            f"x{mine['decode_speedup']:.2f})"
        )
    return lines


def _small_calibration(manifest) -> list[str]:
    """A line where the calibration file was too small to judge candidates on alone
    (pipeline.build.search.development)."""
    filled = max((r.metrics.get("development_filled") or 0 for r in manifest.stages), default=0)
    if not filled:
        return []
    own = max(r.metrics.get("calibration_examples") or 0 for r in manifest.stages)
    return [
        f"note: the calibration file gave {own} calibration examples and too few development ones, so {filled} of "
        "the repository's own texts judged the candidates beside them; int8 ranges from so few examples may miss "
        "text unlike them: give 256 or more"
    ]


def build_summary(manifest, spec, host_class: str) -> str:
    """What `pipeline build` prints after its stages: where the artifact went, the validation's verdicts, and a
    note where the target's kernel class is not the build host's (`host_class`)."""
    published = manifest.published
    lines = []
    if spec.kernel_class not in ("any", host_class):
        lines.append(
            f"note: {spec.name} is for {spec.kernel_class} CPUs but this host is {host_class}: accuracy and "
            "timings were measured on other kernels (the manifest says so); re-validate on a "
            f"{spec.kernel_class} host with `pipeline validate ARTIFACT`"
        )
    if published.reused:
        lines.append(f"unchanged: {published.path} already holds this build ({published.version})")
    else:
        lines.append(f"published {published.path}")
    engine = getattr(manifest.ran("engine"), "metrics", None)
    if engine and engine["status"] == "pending":
        lines.append(f"engine pending: {engine['reason']}; every other stage is published")
    lines += _small_calibration(manifest)
    validation = manifest.stage("validate").metrics
    lines += ["validation against PyTorch on held-out data:", verdict_table(validation["verdict"])]
    if "int8_qdq" in validation:
        lines.append(f"validation of model.int8.onnx: {_scores(validation['int8_qdq'])}")
    lines += _generation_speed(validation)
    reused = ", ".join(r.name for r in manifest.stages if r.reused) or "none"
    lines.append(f"reused stages: {reused}; {published.seconds:.1f}s in all")
    return "\n".join(lines)


def check_summary(plan: dict) -> str:
    """What `pipeline check` prints of its plan (pipeline/ops/check.py)."""
    lines = [
        f"{plan['model']}: {plan['model_type']} ({plan['family']}, {plan['record']} family), task {plan['task']}",
        f"  target      {plan['target']}, inputs up to {plan['max_length']} tokens",
        f"  passes      {plan['passes']}",
        f"  attention   {plan['attention']}",
    ]
    for row in plan["candidates"]:
        why = "" if row["buildable"] else f"  (skipped here: lacks {', '.join(row['missing_flags'])})"
        lines.append(f"  candidate   {row['name']}{why}")
    if not plan["candidates"]:
        lines.append("  candidates  none: the target builds one graph, no search")
    return "\n".join(lines)
