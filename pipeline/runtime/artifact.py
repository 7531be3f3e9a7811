"""A published artifact on disk: its manifest schema, the hashing the build and the loader share, and the check
that every file is the one the build validated.

    artifacts/<model>/v<N>/<target>/   <graph files>  [<graph>.data]  tokenizer.json  report.json  manifest.json
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from pipeline.errors import ArtifactError
from pipeline.runtime.schema import (
    DATA_SUFFIX,
    DECODER_GRAPH,
    IMAGE_PROCESSOR,
    MANIFEST,
    MANIFEST_SCHEMA,
    REPORT,
    TEXT_GRAPH,
    TOKENIZER,
    PublishedManifest,
)

MANIFEST_NAME = MANIFEST
REPORT_NAME = REPORT
TOKENIZER_NAME = TOKENIZER
TASKS = (
    "feature-extraction",
    "sequence-classification",
    "token-classification",
    "fill-mask",
    "question-answering",
    "text-generation",
    "image-feature-extraction",
    "image-classification",
    "zero-shot-image-classification",
    "automatic-speech-recognition",
    "text2text-generation",
)
_DECODER_FIELDS = ("past", "present", "eos_token_ids", "defaults")
_MODEL_FIELDS = {"task": str, "output": str, "max_length": int, "pad_id": int, "batch_size": int, "overlong": str}


# Optional settings the loader reads, with the check each must pass: (field, key) -> (test, what it must be).
def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _ascending(v) -> bool:
    return isinstance(v, list) and bool(v) and all(_count(n) and n > 0 for n in v) and v == sorted(set(v))


def _strings(v) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


_SETTINGS = {
    ("session", "intra_op_threads"): (_count, "an int >= 0"),
    ("session", "inter_op_threads"): (_count, "an int >= 0"),
    ("session", "graph_optimization_level"): (lambda v: v in ("disabled", "basic", "extended", "all"), "a level"),
    ("session", "execution_mode"): (lambda v: v in ("sequential", "parallel"), "sequential or parallel"),
    ("session", "allow_spinning"): (lambda v: isinstance(v, bool), "true or false"),
    ("session", "inference_precision"): (lambda v: v in ("f32", "bf16", "f16"), "f32, bf16 or f16"),
    ("session", "dynamic_quantization_group_size"): (_count, "an int >= 0"),
    ("session", "streams"): (lambda v: _count(v) and v > 0, "a positive int"),
    ("session", "split_min_rows"): (lambda v: _count(v) and v > 0, "a positive int"),
    ("target_spec", "required_cpu_flags"): (_strings, "a list of strings"),
    ("target_spec", "precision"): (lambda v: isinstance(v, str), "a string"),
    ("target_spec", "engine"): (lambda v: isinstance(v, str), "a string"),
    ("target_spec", "tensorrt"): (lambda v: isinstance(v, dict), "a table"),
    ("host", "cpu_flags"): (lambda v: v is None or _strings(v), "a list of strings or null"),
    ("host", "kernel_class"): (lambda v: isinstance(v, str), "a string"),
    ("model", "task"): (lambda v: v in TASKS, "one of " + ", ".join(TASKS)),
    ("model", "overlong"): (lambda v: v in ("truncate", "refuse"), "truncate or refuse"),
    ("model", "preprocessor"): (
        lambda v: v in (TOKENIZER_NAME, IMAGE_PROCESSOR),
        f"{TOKENIZER_NAME} or {IMAGE_PROCESSOR}",
    ),
    ("model", "modality"): (lambda v: v in ("text", "image", "audio"), "text, image or audio"),
    # A speech or text-to-text artifact's decoder beside its encoder, cache layout and decoding settings.
    ("model", "decoder_graph"): (lambda v: v == DECODER_GRAPH, DECODER_GRAPH),
    ("model", "layers"): (lambda v: _count(v) and 0 < v <= 1024, "an int from 1 to 1024"),
    ("model", "heads"): (lambda v: _count(v) and 0 < v <= 1024, "an int from 1 to 1024"),
    ("model", "head_dim"): (lambda v: _count(v) and 0 < v <= 4096, "an int from 1 to 4096"),
    ("model", "n_mels"): (lambda v: v in (80, 128), "80 or 128"),
    ("model", "prompt"): (lambda v: isinstance(v, list) and 0 < len(v) <= 8 and all(_count(i) for i in v), "ids"),
    ("model", "suppress_tokens"): (lambda v: isinstance(v, list) and all(_count(i) for i in v), "a list of ids"),
    ("model", "begin_suppress_tokens"): (lambda v: isinstance(v, list) and all(_count(i) for i in v), "ids"),
    ("model", "max_length"): (lambda v: _count(v) and v > 0, "a positive int"),
    # A two-tower model's text tower and scores (pipeline/runtime/zero_shot.py).
    ("model", "companions"): (_strings, "a list of file names"),
    ("model", "text_graph"): (lambda v: v == TEXT_GRAPH, TEXT_GRAPH),
    ("model", "text_inputs"): (lambda v: v in (["input_ids"], ["input_ids", "attention_mask"]), "input_ids[, mask]"),
    ("model", "text_padding"): (lambda v: v in ("longest", "max_length"), "longest or max_length"),
    ("model", "text_max_length"): (lambda v: _count(v) and 0 < v <= 1 << 16, "an int from 1 to 65536"),
    ("model", "text_pad_id"): (_count, "an id"),
    ("model", "score"): (lambda v: v in ("softmax", "sigmoid"), "softmax or sigmoid"),
    ("model", "logit_scale"): (lambda v: isinstance(v, float) and 0 < v < 1e6, "a float in (0, 1e6)"),
    ("model", "logit_bias"): (lambda v: isinstance(v, float) and abs(v) < 1e6, "a float in (-1e6, 1e6)"),
    ("model", "num_beams"): (lambda v: _count(v) and 1 <= v <= 16, "an int from 1 to 16"),
    ("model", "length_penalty"): (lambda v: isinstance(v, float) and abs(v) < 100, "a float in (-100, 100)"),
    ("model", "early_stopping"): (lambda v: v in (True, False, "never"), "true, false or never"),
    ("model", "min_length"): (_count, "an int >= 0"),
    ("model", "no_repeat_ngram_size"): (lambda v: _count(v) and v <= 64, "an int from 0 to 64"),
    ("model", "max_source_length"): (lambda v: _count(v) and v > 0, "a positive int"),
    ("model", "source_pad_id"): (_count, "an id"),
    ("model", "forced_eos_token_id"): (lambda v: v is None or _count(v), "an id or null"),
    ("model", "batch_size"): (lambda v: _count(v) and v > 0, "a positive int"),
    ("model", "inputs"): (_strings, "a list of strings"),
    ("model", "past"): (_strings, "a list of strings"),
    ("model", "eos_token_ids"): (lambda v: isinstance(v, list) and all(_count(i) for i in v), "a list of ids"),
    ("model", "defaults"): (lambda v: isinstance(v, dict), "a table"),
    ("model", "shape_buckets"): (_ascending, "a list of ascending positive ints"),
}
# The files a backend runs, by the graph file the manifest names: OpenVINO IR is an .xml with its .bin weights.
GRAPH_SUFFIXES = (".onnx", ".xml")
_FILE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def canonical_json(value) -> bytes:
    """The one JSON encoding hashed anywhere in the pipeline: sorted keys, no whitespace."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def manifest_digest(manifest: dict) -> str:
    """sha256 of a manifest's canonical JSON without its own `manifest_sha256` field."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def _where_artifacts_are(root: Path) -> str:
    """The fix for a path that is no artifact: the artifact folders one or two levels inside it, where it holds
    some (a model's, a version's or the latest folder)."""
    if root.is_file():
        return f"Pass the folder that holds {root.name}: <model>/<version>/<target>."
    inside = []
    try:
        for child in sorted(root.iterdir())[:64] if root.is_dir() else ():
            grandchildren = sorted(child.iterdir())[:64] if child.is_dir() else []
            inside += [f for f in (child, *grandchildren) if (f / MANIFEST_NAME).is_file()]
    except OSError:  # a folder it cannot list holds nothing it can name
        pass
    if inside:
        names = ", ".join(str(f.relative_to(root)) for f in inside[:3]) + (", ..." if len(inside) > 3 else "")
        return f"It holds artifacts: pass one of them ({names})."
    return "Build one with `make build`, then pass its <model>/<version>/<target> (or latest/<target>) folder."


def _read_manifest(path: Path, root: Path) -> dict:
    manifest_path = root / MANIFEST_NAME
    if manifest_path.is_symlink():
        raise ArtifactError(f"{manifest_path} is a symlink (to {os.readlink(manifest_path)}); it must be a plain file")
    if not manifest_path.is_file():
        raise ArtifactError(f"{path} has no {MANIFEST_NAME}: not a published artifact. {_where_artifacts_are(root)}")
    try:
        text = manifest_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ArtifactError(f"{manifest_path} is not valid JSON ({err}); the artifact is damaged, rebuild it") from None
    manifest = PublishedManifest.from_json(text, str(manifest_path)).to_dict()
    for key, kind in _MODEL_FIELDS.items():
        if not isinstance(manifest["model"].get(key), kind) or isinstance(manifest["model"].get(key), bool):
            raise ArtifactError(f"{manifest_path}: model.{key} is missing or not a {kind.__name__}; rebuild it")
    for (field, key), (test, kind) in _SETTINGS.items():
        if key in manifest[field] and not test(manifest[field][key]):
            raise ArtifactError(
                f"{manifest_path}: {field}.{key} = {manifest[field][key]!r} is not {kind}; rebuild the artifact"
            )
    decoder = manifest["model"]["task"] == "text-generation"
    missing = [k for k in _DECODER_FIELDS if decoder and k not in manifest["model"]]
    if missing:
        raise ArtifactError(f"{manifest_path}: a text-generation model needs model.{missing[0]}; rebuild it")
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise ArtifactError(f"{manifest_path} was edited after publishing (its digest does not match); rebuild it")
    return manifest


def verify_artifact(path: Path) -> dict:
    """Check an artifact folder against its manifest and return the manifest.

    Refuses (ArtifactError naming the file) a missing or changed file, a file the manifest does not list, a
    symlink inside the artifact (the manifest included), an edited manifest, and a manifest whose model name,
    version or target disagrees with the folders it sits in. The hashes prove the files are the ones the build
    validated; they do not prove who built them (see the README's guarantees).
    """
    path = Path(path)
    root = path.resolve()
    manifest = _read_manifest(path, root)
    manifest_path = root / MANIFEST_NAME
    placed = (root.parent.parent.name, root.parent.name, root.name)
    claimed = (manifest["model_name"], manifest["version"], manifest["target"])
    if placed != claimed:
        raise ArtifactError(
            f"{manifest_path} belongs to {'/'.join(claimed)}, but sits in {'/'.join(placed)}: a manifest from "
            "another artifact. Load the folder it came from."
        )
    files = manifest["files"]
    for name, expected in sorted(files.items()):  # first: the names below go into paths and messages
        if not isinstance(expected, str) or not _FILE_NAME.fullmatch(name):
            raise ArtifactError(f"{manifest_path} lists {name!r}, which is not a plain file name; rebuild it")
    preprocessor = manifest["model"].get("preprocessor", TOKENIZER_NAME)
    if manifest["graph"] not in files or preprocessor not in files:
        raise ArtifactError(f"{manifest_path} does not list its graph {manifest['graph']!r} and {preprocessor}")
    present = {p.name for p in root.iterdir()} - {MANIFEST_NAME}
    for name in sorted(files):
        graph = name.removesuffix(DATA_SUFFIX)
        if graph != name and graph in files and name not in present:  # before the unlisted check: a rename
            raise ArtifactError(
                f"{root / name}, the weights of {graph}, is missing from the artifact (renamed or deleted); restore "
                "it under that name or rebuild"
            )
    extra = sorted(present - set(files))
    if extra:
        raise ArtifactError(
            f"{root}/{extra[0]!r} is not listed in the manifest; an artifact holds only what was validated"
        )
    for name, expected in sorted(files.items()):
        file = root / name
        if file.is_symlink():
            raise ArtifactError(f"{file} is a symlink (to {os.readlink(file)}); artifact files must be plain files")
        if not file.is_file():
            raise ArtifactError(f"{file} is missing from the artifact; rebuild it")
        if sha256_file(file) != expected:
            raise ArtifactError(f"{file} does not match its sha256 in the manifest: changed after publishing")
    return manifest


def artifact_graphs(manifest: dict) -> list[str]:
    """The graphs an artifact's manifest lists that a backend can run: model.onnx, model.int8.onnx where there is
    one, model.xml for OpenVINO."""
    beside = set(manifest["model"].get("companions") or ())  # a two-tower model's text tower: not a graph to load
    return sorted(name for name in manifest["files"] if name.endswith(GRAPH_SUFFIXES) and name not in beside)


def describe(path) -> dict:
    """A verified artifact's identity, source, backend, validation, search table and sizes, for `pipeline inspect`."""
    root = Path(path)
    if not root.exists():
        raise ArtifactError(f"no artifact at {root}; build one with `make build` or check the path")
    real = root.resolve()
    manifest = verify_artifact(real)
    return {
        "path": str(real),
        "model_name": manifest["model_name"],
        "version": manifest["version"],
        "target": manifest["target"],
        "task": manifest["model"]["task"],
        "backend": manifest["backend"],
        "precision": manifest.get("precision"),
        "graph": manifest["graph"],
        "created_at": manifest.get("created_at"),
        "source_digest": manifest.get("source", {}).get("digest"),
        "kernel_class": manifest["host"].get("kernel_class"),
        "files": {
            name: {"bytes": (real / name).stat().st_size, "sha256": digest}
            for name, digest in manifest["files"].items()
        },
        "validation": manifest.get("validation"),
        "candidates": manifest.get("candidates"),
        "build_speed": _build_speed(real) if REPORT_NAME in manifest["files"] else None,
        "verified": True,
    }


def _build_speed(root: Path) -> dict | None:
    """The verified report's figures timed while building (the search's, per candidate), or None if unreadable."""
    try:
        speed = json.loads((root / REPORT_NAME).read_text(encoding="utf-8")).get("build_speed")
    except (OSError, ValueError, RecursionError, AttributeError):
        return None
    return speed if isinstance(speed, dict) else None


# A version folder of a model's published artifacts: v1, v2, ...
VERSION_FOLDER = re.compile(r"^v(\d+)$")


def version_number(name: str) -> int | None:
    """N for a version folder's name `vN`, else None."""
    match = VERSION_FOLDER.match(name)
    return int(match.group(1)) if match else None


def _is_manifest(path: Path) -> bool:
    """Whether `path` is a published artifact's manifest (ours: our schema, with its digest)."""
    try:
        if not path.is_file() or path.stat().st_size > 1 << 24:
            return False
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("schema") == MANIFEST_SCHEMA and "manifest_sha256" in manifest


def artifact_holding(path: Path) -> Path | None:
    """The published artifact, or artifact version folder, that `path` (resolved) lies in or is; None if none."""
    real = Path(path).resolve()
    for folder in (real, *real.parents):
        if _is_manifest(folder / MANIFEST_NAME):
            return folder
        if version_number(folder.name) is not None and folder.is_dir():
            try:
                if any(_is_manifest(child / MANIFEST_NAME) for child in folder.iterdir()):
                    return folder
            except OSError:  # a folder it cannot list is no artifact version it can tell
                continue
    return None
