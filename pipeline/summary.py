"""The readable summary `pipeline inspect` prints of a verified artifact (`--json` prints describe() as is)."""

from __future__ import annotations

from pipeline.timing import COST


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


# The accuracy columns of the candidate table: encoders by cosine, decoders by their teacher-forced gate.
_ACCURACY_COLUMNS = (("cosine_min", "cos min"), ("teacher_top1_agreement", "top1"), ("perplexity_ratio", "ppl x"))


def candidate_table(search: dict) -> str:
    """The engine search's candidates: accuracy on the development split, latency per shape, and the choice."""
    rows = search["candidates"]
    shapes = next((list(r["latency_ms"]) for r in rows if r.get("latency_ms")), [])
    columns = [(k, label) for k, label in _ACCURACY_COLUMNS if any(k in r for r in rows)] or _ACCURACY_COLUMNS[:1]
    head = f"    {'candidate':<20} {'status':<8} " + " ".join(f"{label:>8}" for _, label in columns)
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
            mark += f"  (missed on held-out text: {'; '.join(row['held_out']['missed'])})"
        lines.append(f"    {row['name']:<20} {row['status']:<8} {scores} {times}{mark}")
    return "\n".join(lines)


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


def summary(info: dict) -> str:
    """What a user asks of an artifact first: identity, the choice and its alternatives, the gate, size, hashes."""
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
        lines += [
            f"  chosen      {chosen}",
            "",
            "search (development split):",
            candidate_table({"candidates": candidates}),
        ]
    rows = validation.get("verdict") or []
    if rows:
        lines += ["", "validation on held-out text:", verdict_table(rows)]
    return "\n".join(lines)
