"""The runtime for encoder artifacts (embeddings, sequence and token classification): text in, arrays out."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ArtifactError, InputError
from pipeline.runtime.text import check_batch_size, check_texts, open_tokenizer


def length_buckets(lengths: list[int], batch_size: int, bucketing: bool = True) -> list[list[int]]:
    """Indices of each batch to run. With bucketing, texts are sorted by length and a batch is closed when full or
    when the next text is over twice as long as its first, so short texts are not padded to long ones; without,
    texts go in their given order."""
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


class EncoderInputs:
    """Text to an encoder graph's padded int64 inputs: the artifact's tokenizer, its overlong policy and padding.
    Used by `Model` and by the tokenizer step of an exported Triton ensemble."""

    def __init__(self, tokenizer_path: Path, spec: dict, input_names: list[str]):
        self.spec = spec
        self.max_length = int(spec["max_length"])
        self.input_names = list(input_names)
        self.tokenizer = open_tokenizer(tokenizer_path)
        if spec["overlong"] == "truncate":
            self.tokenizer.enable_truncation(self.max_length)

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
        import numpy as np

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


class Model:
    """A loaded encoder: a tokenizer and a session of one backend (ONNX Runtime, OpenVINO or TensorRT), with the
    task's input and output handling."""

    def __init__(self, session, tokenizer_path: Path, spec: dict, backend: str = "onnxruntime"):
        import numpy as np

        self._np = np
        self.spec = spec
        self.task = spec["task"]
        self.max_length = int(spec["max_length"])
        self.batch_size = int(spec["batch_size"])
        self.session = session
        self.backend = backend
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.inputs = EncoderInputs(tokenizer_path, spec, self.input_names)
        self.tokenizer = self.inputs.tokenizer
        self.output_name = spec["output"]
        outputs = [o.name for o in self.session.get_outputs()]
        if self.output_name not in outputs:
            raise ArtifactError(f"the manifest's model.output {self.output_name!r} is not a graph output: {outputs}")

    def encode(self, texts) -> list:
        """Tokenize a batch with the Rust tokenizer, applying the target's overlong policy."""
        return self.inputs.encode(texts)

    def feeds(self, encodings) -> dict:
        """Padded numpy inputs for a list of encodings, keyed by the graph's input names."""
        return self.inputs.feeds(encodings)

    def batches(self, lengths: list[int], batch_size: int, bucketing: bool = True) -> list[list[int]]:
        """Indices of each batch to run (see `length_buckets`)."""
        return length_buckets(lengths, batch_size, bucketing)

    def run(self, texts, batch_size: int | None = None, bucketing: bool = True):
        """Run the model on a list of strings (or of (text, text_pair) tuples, for pair classifiers).

        Inputs are bucketed by length (see `length_buckets`), so a short text does not pay for a long one.
        Returns, by task: feature-extraction, an array [n, dim] of embeddings; sequence-classification, an
        array [n, labels] of logits; token-classification, a list of [tokens, labels] logit arrays.
        """
        np = self._np
        batch_size = check_batch_size(batch_size, "run()") or self.batch_size
        encodings = self.encode(texts)
        results: list = [None] * len(encodings)
        lengths = [len(e.ids) for e in encodings]
        for chunk in self.batches(lengths, batch_size, bucketing):
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
