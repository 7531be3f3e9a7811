"""What a production process imports: load a verified artifact and run it.

Imports only the standard library, numpy, tokenizers and the artifact's engine (onnxruntime, openvino or tensorrt),
jinja2 for chat and Pillow for image files, and nothing of the build (a test parses every module here and fails
on any other import). Usage:

    from pipeline.runtime import load
    model = load("artifacts/all-minilm-l6-v2/latest/cpu-avx2")
    vectors = model.run(["a sentence", "another"])

    artifact.py    the manifest schema, hashing, verification        host.py     CPU flags, kernel class, GPU probe
    load.py        load(): verify, pick the backend, open            encoder.py  Model (embeddings, classifiers)
    answers.py     question answering's context windows and best span
    generation.py  Generator (decoders with a KV cache)              batcher.py  Batcher (dynamic batching)
    continuous.py  ContinuousBatcher (requests join and leave a running decoder batch)
    text.py        tokenizer and input checks                        engine_cache.py  TensorRT engine cache policy
    kv_cache.py    the decoder's KV cache buffers and padding          sampling.py greedy and sampled token choice
    chat.py        chat templates rendered in a jinja2 sandbox   template_budget.py  their time and size budget
    images.py      image preprocessing (Pillow decode and resize), labels, top k
    audio.py       WAV reading, resampling, Whisper's log-mel features
    backends/      onnxruntime.py, openvino.py, tensorrt.py: one session interface
"""

from pipeline.runtime.artifact import artifact_graphs, canonical_json, describe, sha256_file, verify_artifact
from pipeline.runtime.host import HostMismatchWarning, cpu_flags, kernel_class
from pipeline.runtime.load import BACKENDS, EngineFallbackWarning, load, open_model

__all__ = [
    "BACKENDS",
    "EngineFallbackWarning",
    "HostMismatchWarning",
    "artifact_graphs",
    "canonical_json",
    "cpu_flags",
    "describe",
    "kernel_class",
    "load",
    "open_model",
    "sha256_file",
    "verify_artifact",
]
