"""Content-addressed stage outputs.

A stage's output folder is named by sha256 over the sorted JSON of (stage, config, input id, target), so a
rebuild with nothing changed finds it and skips the work. Outputs are written to a temporary folder and renamed
into place; each entry's record.json holds the sha256 of every file, checked on reuse, so a truncated or edited
entry is rebuilt rather than trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pipeline import faults
from pipeline.manifest import StageRecord
from pipeline.runtime import canonical_json, sha256_file

RECORD = "record.json"


def stage_key(stage: str, config: dict, input_id: str, target: str | None) -> str:
    """The content address of a stage's output."""
    body = {"stage": stage, "config": config, "input": input_id, "target": target}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def _intact(entry: Path) -> dict | None:
    """The entry's record if every file it lists is present with the recorded hash, else None."""
    try:
        record = json.loads((entry / RECORD).read_text())
        for name, digest in record["files"].items():
            if sha256_file(entry / name) != digest:
                return None
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_cached(
    cache_dir: str | Path,
    stage: str,
    config: dict,
    input_id: str,
    target: str | None,
    produce: Callable[[Path], dict],
) -> StageRecord:
    """Reuse the stage's cached output, or call `produce(folder)` to write it and return its metrics."""
    started = time.perf_counter()
    key = stage_key(stage, config, input_id, target)
    entry = Path(cache_dir) / stage / key
    record = _intact(entry) if entry.exists() else None
    reused = record is not None
    if not reused:
        if entry.exists():
            shutil.rmtree(entry)  # damaged: a truncated file or a missing record
        scratch = entry.parent / f".tmp-{key[:16]}-{uuid.uuid4().hex}"
        scratch.mkdir(parents=True)
        try:
            metrics = produce(scratch)
            files = {p.name: sha256_file(p) for p in sorted(scratch.iterdir()) if p.is_file()}
            record = {"stage": stage, "key": key, "config": config, "files": files, "metrics": metrics}
            (scratch / RECORD).write_text(json.dumps(record, indent=1, sort_keys=True))
            faults.point(f"cache-{stage}")
            try:
                os.rename(scratch, entry)
            except OSError:
                # A concurrent build renamed the same content into place first; keep that one.
                shutil.rmtree(scratch)
                record = _intact(entry)
                if record is None:
                    raise
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise
    outputs = {name: str(entry / name) for name in record["files"]}
    return StageRecord(
        name=stage,
        key=key,
        config=config,
        outputs=outputs,
        metrics=record["metrics"],
        seconds=round(time.perf_counter() - started, 3),
        reused=reused,
    )
