"""The production loader: verifies a published artifact and runs it.

Imports only the standard library, numpy, onnxruntime and tokenizers (a test proves it in a subprocess), so a
service ships without torch, transformers or onnx. Usage:

    from pipeline.runtime import load
    model = load("artifacts/all-minilm-l6-v2/latest/cpu-avx2")
    vectors = model.run(["a sentence", "another"])
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

from pipeline.errors import ArtifactError, InputError

MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA = 1
_MANIFEST_FIELDS = {
    "manifest_sha256": str,
    "version": str,
    "target": str,
    "files": dict,
    "model": dict,
    "session": dict,
    "target_spec": dict,
    "host": dict,
}
_MODEL_FIELDS = {"task": str, "output": str, "max_length": int, "pad_id": int, "batch_size": int, "overlong": str}
_GRAPH_LEVELS = {"disabled": "ORT_DISABLE_ALL", "basic": "ORT_ENABLE_BASIC", "extended": "ORT_ENABLE_EXTENDED"}


class HostMismatchWarning(UserWarning):
    """The host lacks CPU features the artifact's target requires; it may run slowly or not at all."""


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


def cpu_flags() -> frozenset[str] | None:
    """The host's CPU feature flags from /proc/cpuinfo, or None where they cannot be read (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return None


def verify_artifact(path: Path) -> dict:
    """Check an artifact folder against its manifest and return the manifest.

    Refuses (ArtifactError naming the file) a missing or changed file, a file the manifest does not list, a
    symlink inside the artifact, an edited manifest, and a manifest whose version or target disagrees with
    the folder it sits in. The hashes prove the files are the ones the build validated; they do not prove who
    built them (see the README's guarantees).
    """
    path = Path(path)
    root = path.resolve()
    manifest_path = root / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ArtifactError(f"{path} has no {MANIFEST_NAME}: not a published artifact. Build one with `make build`.")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{manifest_path} is not valid JSON ({err}); the artifact is damaged, rebuild it") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != MANIFEST_SCHEMA:
        raise ArtifactError(f"{manifest_path}: unknown manifest schema; this loader reads schema {MANIFEST_SCHEMA}")
    for key, kind in _MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            raise ArtifactError(f"{manifest_path}: field {key!r} is missing or not a {kind.__name__}; rebuild it")
    for key, kind in _MODEL_FIELDS.items():
        if not isinstance(manifest["model"].get(key), kind):
            raise ArtifactError(f"{manifest_path}: model.{key} is missing or not a {kind.__name__}; rebuild it")
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise ArtifactError(f"{manifest_path} was edited after publishing (its digest does not match); rebuild it")
    if manifest.get("target") != root.name or manifest.get("version") != root.parent.name:
        raise ArtifactError(
            f"{manifest_path} belongs to {manifest.get('version')}/{manifest.get('target')}, but sits in "
            f"{root.parent.name}/{root.name}: a manifest from another artifact. Load the folder it came from."
        )
    files = manifest["files"]
    if "model.onnx" not in files or "tokenizer.json" not in files:
        raise ArtifactError(f"{manifest_path} does not list model.onnx and tokenizer.json; rebuild it")
    present = {p.name for p in root.iterdir()} - {MANIFEST_NAME}
    extra = sorted(present - set(files))
    if extra:
        raise ArtifactError(
            f"{root / extra[0]} is not listed in the manifest; an artifact holds only what was validated"
        )
    for name, expected in sorted(files.items()):
        file = root / name
        if not isinstance(expected, str) or "/" in name or name.startswith("."):
            raise ArtifactError(f"{manifest_path} lists {name!r}, which is not a plain file name")
        if file.is_symlink():
            raise ArtifactError(f"{file} is a symlink (to {os.readlink(file)}); artifact files must be plain files")
        if not file.is_file():
            raise ArtifactError(f"{file} is missing from the artifact; rebuild it")
        if sha256_file(file) != expected:
            raise ArtifactError(f"{file} does not match its sha256 in the manifest: changed after publishing")
    return manifest


def open_tokenizer(path: Path):
    """The artifact's Rust tokenizer, with padding and truncation off (the runtime pads and truncates itself)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def open_session(onnx_path: Path, session: dict | None, providers=None):
    """An ONNX Runtime session with the artifact's session settings (threads, graph level, execution mode)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    session = session or {}
    options.intra_op_num_threads = int(session.get("intra_op_threads", 0))
    options.inter_op_num_threads = int(session.get("inter_op_threads", 1))
    level = session.get("graph_optimization_level", "all")
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _GRAPH_LEVELS.get(level, "ORT_ENABLE_ALL"))
    if not session.get("allow_spinning", True):
        # Idle pool threads otherwise spin for a while after each run, taking cores from whatever runs next.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if session.get("execution_mode") == "parallel":
        options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    return ort.InferenceSession(str(onnx_path), options, providers=providers or ["CPUExecutionProvider"])


def check_texts(texts, call: str, pairs: bool = False) -> list:
    """A list of strings (or, with `pairs`, of (text, text_pair) tuples), else an InputError naming the fix."""
    if isinstance(texts, str):
        raise InputError(f"{call} takes a list of strings, got a single str; wrap it: model.{call[:-2]}([text])")
    try:
        texts = list(texts)
    except TypeError:
        raise InputError(f"{call} takes a list of strings, got {type(texts).__name__}") from None
    if not texts:
        raise InputError(f"{call} got an empty list; pass at least one string")
    for i, text in enumerate(texts):
        if pairs and isinstance(text, tuple) and len(text) == 2 and all(isinstance(t, str) for t in text):
            continue  # a (text, text_pair) pair, for pair classifiers
        if not isinstance(text, str):
            raise InputError(f"{call} input {i} is {type(text).__name__}, not str; pass text only")
    return texts


class Model:
    """A loaded model: a tokenizer and an ONNX Runtime session, with the task's input and output handling."""

    def __init__(self, onnx_path: Path, tokenizer_path: Path, spec: dict, providers=None, session=None, engine=None):
        import numpy as np

        self._np = np
        self.spec = spec
        self.task = spec["task"]
        self.max_length = int(spec["max_length"])
        self.batch_size = int(spec["batch_size"])
        self.tokenizer = open_tokenizer(tokenizer_path)
        if spec["overlong"] == "truncate":
            self.tokenizer.enable_truncation(self.max_length)
        if engine is None:
            self.session = open_session(onnx_path, session, providers)
        else:
            from pipeline.tensorrt_runtime import TensorRTSession

            self.session = TensorRTSession(engine)
        self.backend = "tensorrt" if engine is not None else "onnxruntime"
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_name = spec["output"]

    def encode(self, texts) -> list:
        """Tokenize a batch with the Rust tokenizer, applying the target's overlong policy."""
        texts = check_texts(texts, "run()", pairs=True)
        encodings = self.tokenizer.encode_batch(texts)
        for i, enc in enumerate(encodings):
            if len(enc.ids) > self.max_length:
                raise InputError(
                    f"run() input {i} is {len(enc.ids)} tokens, over the model's {self.max_length}; this target "
                    "refuses overlong input (shapes.overlong = 'refuse'): shorten it or use a truncating target"
                )
        return encodings

    def feeds(self, encodings) -> dict:
        """Padded numpy inputs for a list of encodings, keyed by the graph's input names."""
        np = self._np
        width = max(len(e.ids) for e in encodings)
        pad_id = int(self.spec["pad_id"])
        ids = np.full((len(encodings), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(encodings), width), dtype=np.int64)
        types = np.zeros((len(encodings), width), dtype=np.int64)
        for row, enc in enumerate(encodings):
            n = len(enc.ids)
            ids[row, :n] = enc.ids
            mask[row, :n] = 1
            types[row, :n] = enc.type_ids
        arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        return {name: arrays[name] for name in self.input_names}

    def batches(self, lengths: list[int], batch_size: int, bucketing: bool = True) -> list[list[int]]:
        """Indices of each batch to run. With bucketing, texts are sorted by length and a batch is closed when
        full or when the next text is over twice as long as its first, so short texts are not padded to long
        ones; without, texts go in their given order."""
        order = sorted(range(len(lengths)), key=lengths.__getitem__) if bucketing else list(range(len(lengths)))
        batches: list[list[int]] = []
        for index in order:
            current = batches[-1] if batches else None
            first = lengths[current[0]] if current else 0
            too_long = bucketing and current and lengths[index] > 2 * first and lengths[index] - first > 8
            if not current or len(current) == batch_size or too_long:
                batches.append([index])
            else:
                current.append(index)
        return batches

    def run(self, texts, batch_size: int | None = None, bucketing: bool = True):
        """Run the model on a list of strings (or of (text, text_pair) tuples, for pair classifiers).

        Inputs are bucketed by length (see `batches`), so a short text does not pay for a long one.
        Returns, by task: feature-extraction, an array [n, dim] of embeddings; sequence-classification, an
        array [n, labels] of logits; token-classification, a list of [tokens, labels] logit arrays.
        """
        np = self._np
        encodings = self.encode(texts)
        results: list = [None] * len(encodings)
        lengths = [len(e.ids) for e in encodings]
        for chunk in self.batches(lengths, batch_size or self.batch_size, bucketing):
            feeds = self.feeds([encodings[i] for i in chunk])
            out = self.session.run([self.output_name], feeds)[0]
            for row, index in enumerate(chunk):
                if self.task == "token-classification":
                    results[index] = out[row, : lengths[index]]
                else:
                    results[index] = out[row]
        if self.task == "token-classification":
            return results
        return np.stack(results)


def open_model(onnx_path: Path, tokenizer_path: Path, spec: dict, providers=None, session=None, engine=None):
    """The runtime object for a graph: a Generator (pipeline.generation) for text generation, else a Model.
    With `engine` (a TensorRT plan of that graph), a Model runs the engine instead of ONNX Runtime."""
    if spec["task"] == "text-generation":
        from pipeline.generation import Generator

        return Generator(onnx_path, tokenizer_path, spec, providers, session)
    return Model(onnx_path, tokenizer_path, spec, providers, session, engine)


# ONNX Runtime picks its int8 kernels by these flags at run time, so int8 results can differ between hosts.
INT8_KERNEL_FLAGS = ("avx512_vnni", "avx_vnni", "avx512bw", "amx_int8")


def _check_host(manifest: dict, strict: bool) -> None:
    required = set(manifest["target_spec"].get("required_cpu_flags", ()))
    flags = cpu_flags()
    built_on = set(manifest.get("host", {}).get("cpu_flags") or ())
    if manifest["target_spec"].get("precision") == "int8" and flags is not None and built_on:
        differ = sorted(f for f in INT8_KERNEL_FLAGS if (f in flags) != (f in built_on))
        if differ:
            warnings.warn(
                f"this host and the build host differ in {', '.join(differ)}, so ONNX Runtime runs other int8 "
                "kernels than the ones validated; re-validate here with `pipeline validate ARTIFACT`",
                HostMismatchWarning,
                stacklevel=3,
            )
    if not required:
        return
    if flags is None:
        message = f"cannot read this host's CPU flags to check {sorted(required)} for target {manifest['target']}"
    else:
        missing = sorted(required - flags)
        if not missing:
            return
        message = (
            f"this host lacks CPU flags {', '.join(missing)} that target {manifest['target']} requires; "
            "the artifact may run slowly or fail. Load the artifact built for this host's target instead"
        )
    if strict:
        raise ArtifactError(message)
    warnings.warn(message, HostMismatchWarning, stacklevel=3)


def artifact_graphs(manifest: dict) -> list[str]:
    """The ONNX graphs an artifact's manifest lists: model.onnx, and model.int8.onnx where there is one."""
    return sorted(name for name in manifest["files"] if name.endswith(".onnx"))


class EngineFallbackWarning(UserWarning):
    """A TensorRT target's artifact runs on ONNX Runtime: no engine could be used on this host."""


BACKENDS = ("auto", "tensorrt", "onnxruntime")


def load(path, strict: bool = False, providers=None, intra_op_threads: int | None = None, backend: str = "auto",
         build_engine: bool = False, graph: str = "model.onnx"):  # fmt: skip
    """Verify and load a published artifact (a `.../<version>/<target>` folder, or the `latest` link to one):
    a Model (`run`) for encoder tasks, a pipeline.generation.Generator (`generate`, `stream`, `run`) for text
    generation.

    Every file's sha256 is checked against the manifest first. A host without the target's CPU flags gives a
    HostMismatchWarning, or an ArtifactError with `strict=True`.

    TensorRT targets: `backend="tensorrt"` runs the graph's engine from the artifact's engine cache, for this
    host's GPU architecture and TensorRT version; with `build_engine=True` a missing one is built here first
    (pipeline.engine.build_artifact_engine), else it is an ArtifactError naming what was found. `"auto"` (the
    default) does the same but falls back, with an EngineFallbackWarning, to ONNX Runtime (its TensorRT and CUDA
    providers where onnxruntime-gpu is installed, else the CPU). `graph="model.int8.onnx"` picks the int8 Q/DQ
    graph of a target that made one.
    """
    root = Path(path)
    if not root.exists():
        raise ArtifactError(f"no artifact at {root}; build one with `make build` or check the path")
    if backend not in BACKENDS:
        raise ArtifactError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    manifest = verify_artifact(root)
    if graph not in artifact_graphs(manifest):
        raise ArtifactError(f"{root} has no graph {graph!r}; its graphs: {', '.join(artifact_graphs(manifest))}")
    session = dict(manifest["session"])
    if intra_op_threads is not None:
        session["intra_op_threads"] = intra_op_threads
    real = root.resolve()
    try:
        _check_host(manifest, strict)
        engine = None
        if manifest["target_spec"]["engine"] == "tensorrt" and backend != "onnxruntime" and providers is None:
            engine, providers = _gpu_backend(real, manifest, graph, backend, build_engine)
        elif backend == "tensorrt":
            engine_name = manifest["target_spec"]["engine"]
            raise ArtifactError(f"{root} is built for {manifest['target']} ({engine_name}); it has no TensorRT engine")
        return open_model(real / graph, real / "tokenizer.json", manifest["model"], providers, session, engine)
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise ArtifactError(
            f"{real / MANIFEST_NAME}: its target, session or model settings are invalid ({err!r})"
        ) from None


def _gpu_backend(root: Path, manifest: dict, graph: str, backend: str, build_engine: bool):
    """(engine plan, None) where an engine can run here, else (None, ONNX Runtime providers) with a warning; with
    backend="tensorrt" an ArtifactError instead of the fallback."""
    from pipeline.tensorrt_runtime import engine_cache_dir, engine_for_host, gpu_host

    cache_dir = engine_cache_dir(root, manifest)
    if manifest["model"]["task"] == "text-generation":
        reason = "TensorRT engines are not built for KV-cache decoders"
    else:
        host, reason = gpu_host()
        if host is not None:
            plan, reason = engine_for_host(cache_dir, manifest, graph, host)
            if plan is None and build_engine:
                from pipeline.engine import build_artifact_engine

                plan = build_artifact_engine(root, graph)
            if plan is not None:
                return plan, None
    if backend == "tensorrt":
        raise ArtifactError(f"cannot run {root} on TensorRT: {reason}")
    import onnxruntime

    providers = ort_gpu_providers(manifest, cache_dir, onnxruntime.get_available_providers())
    names = ", ".join(p if isinstance(p, str) else p[0] for p in providers)
    warnings.warn(f"{reason}; running {graph} on ONNX Runtime ({names})", EngineFallbackWarning, stacklevel=3)
    return None, providers


def ort_gpu_providers(manifest: dict, cache_dir: Path, available: list[str]) -> list:
    """ONNX Runtime providers for a TensorRT target's graph, of those `available`: the TensorRT provider (engine
    and timing caches in the artifact's engine cache, the target's profiles and settings), then CUDA, then CPU.
    Decoders skip the TensorRT provider: their KV-cache shapes are outside its profiles."""
    trt = manifest["target_spec"]["tensorrt"]
    profiles = (manifest.get("engine") or {}).get("profiles")
    providers: list = []
    if "TensorrtExecutionProvider" in available and profiles:

        def shapes(kind: str) -> str:
            return ",".join(f"{name}:{'x'.join(map(str, p[kind]))}" for name, p in profiles.items())

        options = {
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": str(Path(cache_dir) / "onnxruntime"),
            "trt_timing_cache_enable": bool(trt["timing_cache"]),
            "trt_timing_cache_path": str(Path(cache_dir) / "onnxruntime"),
            "trt_max_workspace_size": int(trt["workspace_mb"]) << 20,
            "trt_builder_optimization_level": int(trt["builder_optimization_level"]),
            "trt_engine_hw_compatible": trt["hardware_compatibility"] != "none",
            "trt_profile_min_shapes": shapes("min"),
            "trt_profile_opt_shapes": shapes("opt"),
            "trt_profile_max_shapes": shapes("max"),
        }
        providers.append(("TensorrtExecutionProvider", options))
    if "CUDAExecutionProvider" in available:
        providers.append("CUDAExecutionProvider")
    return providers + ["CPUExecutionProvider"]


def describe(path) -> dict:
    """A verified artifact's identity, source, validation and sizes, for `pipeline inspect`."""
    root = Path(path)
    if not root.exists():
        raise ArtifactError(f"no artifact at {root}; build one with `make build` or check the path")
    manifest = verify_artifact(root)
    real = root.resolve()
    return {
        "path": str(real),
        "model_name": manifest["model_name"],
        "version": manifest["version"],
        "target": manifest["target"],
        "task": manifest["model"]["task"],
        "created_at": manifest["created_at"],
        "source_digest": manifest["source"]["digest"],
        "files": {
            name: {"bytes": (real / name).stat().st_size, "sha256": digest}
            for name, digest in manifest["files"].items()
        },
        "validation": manifest["validation"],
        "verified": True,
    }


def engine_cache_key(compute_capability: str, tensorrt_version: str, profile_hash: str) -> str:
    """The name of a TensorRT engine in an artifact's engine cache: engines are tied to the GPU architecture
    and the TensorRT version, and to the optimization profiles they were built for."""
    return f"sm{compute_capability.replace('.', '')}-trt{tensorrt_version}-{profile_hash}"


def runs_on(engine: dict, compute_capability: str) -> bool:
    """Whether an engine runs on a GPU of this compute capability: its own, or any Ampere or later GPU for an engine
    built hardware-compatible (`hardware_compatibility = "ampere_plus"`)."""
    if engine.get("hardware_compatibility") == "ampere_plus":
        return float(compute_capability) >= 8.0
    return engine.get("compute_capability") == compute_capability


def check_engine(engine: dict, compute_capability: str, tensorrt_version: str) -> None:
    """Refuse an engine built for another GPU architecture or TensorRT version, naming both."""
    built = (engine.get("compute_capability"), engine.get("tensorrt"))
    if not runs_on(engine, compute_capability) or built[1] != tensorrt_version:
        raise ArtifactError(
            f"the TensorRT engine was built for compute capability {built[0]} with TensorRT {built[1]}, but this "
            f"host has compute capability {compute_capability} with TensorRT {tensorrt_version}; rebuild it here "
            "with `pipeline engine ARTIFACT`, or load with the ONNX Runtime fallback"
        )
