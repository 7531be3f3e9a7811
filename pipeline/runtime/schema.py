"""The artifact's file names, declared once: the writer (pipeline.build.stages.publish) and the reader
(pipeline.runtime.artifact, load) and everything between them name files through these.

    artifacts/<model>/v<N>/<target>/
      model.onnx | model.xml + model.bin   the graph (ONNX Runtime, TensorRT | OpenVINO), [<graph>.data] beside it
      model.int8.onnx                      a TensorRT target's int8 Q/DQ graph, beside its fp16 model.onnx
      encoder.onnx + decoder.onnx          a speech or text-to-text model's two graphs, in place of model.onnx
      tokenizer.json | preprocessor_config.json   what turns input into the graph's tensors (text | pictures)
      text.onnx + tokenizer.json           a two-tower model's text tower, beside its image tower and processor
      report.json                          the build's timings and stage metrics (hashed, not the identity)
      manifest.json                        names and hashes every file above; the loader verifies it first
"""

from __future__ import annotations

import dataclasses
import json
import typing

from pipeline.errors import ArtifactError

MANIFEST = "manifest.json"
REPORT = "report.json"
TOKENIZER = "tokenizer.json"
IMAGE_PROCESSOR = "preprocessor_config.json"  # an image model's, in place of a tokenizer
GRAPH = "model.onnx"  # the graph an artifact runs on ONNX Runtime or TensorRT
INT8_GRAPH = "model.int8.onnx"
OPENVINO_GRAPH = "model.xml"
OPENVINO_WEIGHTS = "model.bin"
DATA_SUFFIX = ".data"  # a graph's weights that did not fit in it: `<graph name>.data`, beside it
ENCODER_GRAPH = "encoder.onnx"  # a speech or text-to-text encoder (it also computes the cross-attention cache)
TEXT_GRAPH = "text.onnx"  # a two-tower image-text model's text tower, beside its image tower (model.onnx)
DECODER_GRAPH = "decoder.onnx"  # its text decoder, one step with its self-attention cache

MANIFEST_SCHEMA = 2  # the layout of manifest.json this loader reads


@dataclasses.dataclass(frozen=True)
class PublishedManifest:
    """manifest.json, declared once: the publish stage writes one (`to_json`), the loader parses one (`from_json`,
    which checks every field against the type declared here). `model` is the runtime spec, whose settings
    pipeline.runtime.artifact checks key by key; `files` names every file of the artifact with its sha256."""

    model_name: str
    version: str
    target: str
    files: dict  # file name -> sha256: the graphs, their data files, the preprocessor, report.json
    graph: str  # the graph the backend opens (model.onnx, model.xml, encoder.onnx)
    backend: str  # onnxruntime, openvino or tensorrt
    model: dict  # the runtime spec: task, inputs, output, lengths, and a decoder's cache and defaults
    session: dict  # the engine session's settings, the build host's tuned ones among them
    target_spec: dict
    host: dict  # the build host: CPU flags and kernel class
    manifest_sha256: str = ""  # sha256 of the canonical JSON of every other field (set by `with_digest`)
    schema: int = MANIFEST_SCHEMA
    content_id: str | None = None  # the sha256 of what defines the artifact: files, spec, stage keys
    created_at: str | None = None
    precision: str | None = None
    candidates: list | None = None  # the engine search's rows, untimed
    validation: dict | None = None  # the held-out verdict against PyTorch
    measured_on: dict | None = None  # the kernel class accuracy was measured on, against the target's
    engine: dict | None = None  # a TensorRT target's engine profile
    source: dict | None = None  # the checkpoint: path, digest, model type, task
    stages: dict | None = None  # each stage's cache key and config
    packages: dict | None = None
    reused_stages: list | None = None

    @classmethod
    def from_dict(cls, fields: dict, where: str) -> PublishedManifest:
        """The manifest in `fields` (parsed JSON), or ArtifactError naming what is wrong: another schema, a field
        that is missing, of another type than declared, or not declared at all; `where` names the file."""
        if fields.get("schema") != MANIFEST_SCHEMA:
            raise ArtifactError(
                f"{where}: manifest schema {fields.get('schema')!r}, but this loader reads schema {MANIFEST_SCHEMA}; "
                "rebuild the artifact with this version"
            )
        declared = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - set(declared))
        if unknown:
            raise ArtifactError(f"{where}: field {unknown[0]!r} is not one this loader knows; rebuild it")
        for name, kinds in _kinds().items():
            if name not in fields and declared[name].default is dataclasses.MISSING:
                raise ArtifactError(f"{where}: field {name!r} is missing; rebuild it")
            value = fields.get(name)
            if not isinstance(value, kinds) or isinstance(value, bool):
                kind = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
                raise ArtifactError(f"{where}: field {name!r} is a {type(value).__name__}, not a {kind}; rebuild it")
        return cls(**fields)

    @classmethod
    def from_json(cls, text: str, where: str) -> PublishedManifest:
        """Parse manifest.json's text (see `from_dict`)."""
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as err:
            raise ArtifactError(f"{where} is not valid JSON ({err}); the artifact is damaged, rebuild it") from None
        except RecursionError:
            raise ArtifactError(
                f"{where} nests too deeply to be a manifest; the artifact is damaged, rebuild it"
            ) from None
        if not isinstance(fields, dict):
            raise ArtifactError(f"{where} holds a {type(fields).__name__}, not a manifest; rebuild the artifact")
        return cls.from_dict(fields, where)

    def to_dict(self) -> dict:
        """The fields as manifest.json holds them."""
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """manifest.json's text: sorted keys, one space of indent."""
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)


def _kinds() -> dict[str, tuple]:
    """Each PublishedManifest field's declared types, as isinstance takes them."""
    hints = typing.get_type_hints(PublishedManifest)
    return {name: typing.get_args(hint) or (hint,) for name, hint in hints.items()}
