"""The runtime for encoder artifacts: text or pictures in, arrays out (embeddings, sequence and token classification,
masked-LM logits, question-answering start/end logits, image embeddings and labels), and the task's own entry
points: `fill_mask` (top tokens at each mask), `answer` (the best span of a context, as text: its windows and span
are pipeline/runtime/answers.py), `embed_images` and `classify_images`."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import ArtifactError, InputError
from pipeline.runtime.answers import best_answer, question_windows
from pipeline.runtime.streams import chunk_cost, chunk_plan
from pipeline.runtime.text import check_batch_size, check_texts, encode_batch, open_tokenizer


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


def padded_width(longest: int, buckets: list[int] | None) -> int:
    """The length a chunk whose longest text is `longest` tokens is padded to: the smallest of the artifact's
    shape buckets that holds it (see pipeline.build.shape_buckets), or `longest` itself where there is no plan or no
    bucket is long enough."""
    return min((b for b in buckets or () if b >= longest), default=longest)


def masked_row(ids: list[int], mask_id: int) -> tuple[list[int], list[int]]:
    """A token row and the positions of its mask tokens; a row without one gets its middle token masked. What a
    fill-mask graph is judged on: the runtime and the PyTorch reference mask the same position."""
    positions = [i for i, token in enumerate(ids) if token == mask_id]
    if positions:
        return list(ids), positions
    middle = len(ids) // 2
    return [mask_id if i == middle else token for i, token in enumerate(ids)], [middle]


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
        encodings = encode_batch(self.tokenizer, texts, "run()")
        for i, enc in enumerate(encodings):
            if len(enc.ids) > self.max_length:
                raise InputError(
                    f"run() input {i} is {len(enc.ids)} tokens, over the model's {self.max_length}; this target "
                    "refuses overlong input (shapes.overlong = 'refuse'): shorten it or use a truncating target"
                )
        return encodings

    @staticmethod
    def lengths(encodings) -> list[int]:
        return [len(e.ids) for e in encodings]

    def feeds(self, encodings, buckets: bool = True) -> dict:
        """Padded numpy inputs for a list of encodings, keyed by the graph's input names: padded to the spec's
        shape bucket for the longest encoding (`padded_width`), or to the longest itself with `buckets=False` or
        where the spec has no `shape_buckets`. Padding has attention_mask 0."""
        import numpy as np

        longest = max(len(e.ids) for e in encodings)
        width = padded_width(longest, self.spec.get("shape_buckets")) if buckets else longest
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


class ImageInputs:
    """Pictures to an image graph's `pixel_values`, prepared as the checkpoint's image processor prepares them
    (pipeline.runtime.images, from the artifact's preprocessor_config.json)."""

    def __init__(self, path: Path, spec: dict):
        import json

        from pipeline.runtime.images import ImageSpec

        try:
            self.image = ImageSpec.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError, RecursionError) as err:
            raise ArtifactError(f"cannot read the image processor settings {path} ({err}); rebuild it") from None
        self.spec = spec

    def encode(self, images) -> list:
        """Each picture (a path, file bytes, a uint8 array or a Pillow image) as its [3, H, W] pixel values."""
        from pipeline.runtime.images import pixel_values

        return list(pixel_values(images, self.image))

    @staticmethod
    def lengths(encodings) -> list[int]:
        return [1] * len(encodings)

    def feeds(self, encodings, buckets: bool = True) -> dict:
        import numpy as np

        return {"pixel_values": np.stack(encodings)}


class Model:
    """A loaded encoder: a tokenizer and a session of one backend (ONNX Runtime, OpenVINO or TensorRT), with the
    task's input and output handling. `streams`, a pipeline.runtime.streams.StreamPool, runs the chunks of a batch
    concurrently where there is more than one (see `chunk_plan`); a single chunk runs on `session`."""

    def __init__(self, session, tokenizer_path: Path, spec: dict, backend: str = "onnxruntime", streams=None):
        import numpy as np

        self._np = np
        self.spec = spec
        self.task = spec["task"]
        self.max_length = int(spec["max_length"])
        self.batch_size = int(spec["batch_size"])
        self.session = session
        self.backend = backend
        self.streams = streams
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.modality = spec.get("modality", "text")
        if self.modality == "image":
            self.inputs = ImageInputs(tokenizer_path, spec)
        else:
            self.inputs = EncoderInputs(tokenizer_path, spec, self.input_names)
        self.tokenizer = getattr(self.inputs, "tokenizer", None)
        if self.task == "question-answering":
            import threading

            self._qa_tokenizer = open_tokenizer(tokenizer_path)
            self._qa_lock = threading.Lock()
        self.output_name = spec["output"]
        outputs = [o.name for o in self.session.get_outputs()]
        if self.output_name not in outputs:
            raise ArtifactError(f"the manifest's model.output {self.output_name!r} is not a graph output: {outputs}")

    def encode(self, texts) -> list:
        """Tokenize a batch with the Rust tokenizer, applying the target's overlong policy."""
        return self.inputs.encode(texts)

    def feeds(self, encodings, buckets: bool = True) -> dict:
        """Padded numpy inputs for a list of encodings, keyed by the graph's input names (see
        `EncoderInputs.feeds`)."""
        return self.inputs.feeds(encodings, buckets)

    def batches(self, lengths: list[int], batch_size: int, bucketing: bool = True) -> list[list[int]]:
        """Indices of each batch to run (see `length_buckets`)."""
        return length_buckets(lengths, batch_size, bucketing)

    def run(self, texts, batch_size: int | None = None, bucketing: bool = True, shape_buckets: bool = True):
        """Run the model on a list of strings (or of (text, text_pair) tuples, for pair classifiers and
        (question, context) pairs for question answering).

        Inputs are bucketed by length (see `length_buckets`), so a short text does not pay for a long one; each
        chunk is padded to the artifact's shape bucket for it, where its spec has a plan (see `padded_width`;
        `shape_buckets=False` pads each chunk to its longest text instead).
        Returns, by task: feature-extraction, an array [n, dim] of embeddings; sequence-classification, an
        array [n, labels] of logits; token-classification, a list of [tokens, labels] logit arrays; fill-mask, a
        list of [tokens, vocab] logit arrays; question-answering, a list of [tokens, 2] start and end logits.
        A `batch_size` above a TensorRT engine's profile runs in batches of the profile's largest.
        """
        batch_size = check_batch_size(batch_size, "run()") or self.batch_size
        if self.modality == "image":  # pictures are decoded a batch at a time: their pixels are large
            if not isinstance(texts, list | tuple) or not texts:
                self.encode(texts)  # the one-line refusal of what is not a list of pictures
            chunks = [list(texts[i : i + batch_size]) for i in range(0, len(texts), batch_size)]
            return self._np.concatenate([self._outputs(self.encode(c), batch_size, bucketing) for c in chunks])
        return self._outputs(self.encode(texts), batch_size, bucketing, shape_buckets=shape_buckets)

    def run_pixels(self, pixels, batch_size: int | None = None):
        """An image artifact's outputs of pixel values already prepared ([n, 3, H, W], as pipeline.runtime.images
        prepares them), run as `run` runs pictures: in batches, over the artifact's streams where it has them."""
        self._check_modality("image", "run_pixels()")
        return self._outputs(list(pixels), check_batch_size(batch_size, "run_pixels()") or self.batch_size)

    def embed_images(self, images, batch_size: int | None = None):
        """An image-feature-extraction artifact's embeddings [n, dim] of a list of pictures (paths, file bytes,
        uint8 arrays or Pillow images)."""
        self._check_task("image-feature-extraction", "embed_images()")
        return self.run(images, batch_size)

    def classify_images(self, images, top_k: int = 5, batch_size: int | None = None) -> list:
        """An image-classification artifact's `top_k` most probable labels of each picture, as Prediction(label,
        score) lists, most probable first."""
        from pipeline.runtime.images import top_k as best

        self._check_task("image-classification", "classify_images()")
        labels = self.spec.get("labels") or {}
        names = [labels.get(str(i), str(i)) for i in range(len(labels))]
        return best(self.run(images, batch_size), top_k, names)

    def _batch_limit(self, batch_size: int) -> int:
        """`batch_size`, at most the session's largest batch where it has one (a TensorRT engine's profile)."""
        return min(batch_size, getattr(self.session, "max_batch", None) or batch_size)

    def _outputs(
        self, encodings, batch_size: int, bucketing: bool = True, ids: list | None = None, shape_buckets: bool = True
    ):
        """The graph's output for each encoding (`ids`, where given, replace the encodings' token ids)."""
        np = self._np
        per_token = self.task in ("token-classification", "fill-mask", "question-answering")
        results: list = [None] * len(encodings)
        lengths = self.inputs.lengths(encodings)

        def run(session, chunk: list[int]):
            feeds = self.feeds([encodings[i] for i in chunk], shape_buckets)
            if ids is not None:
                for row, index in enumerate(chunk):
                    feeds["input_ids"][row, : lengths[index]] = ids[index]
            return session.run([self.output_name], feeds)[0]

        chunks = self.batches(lengths, self._batch_limit(batch_size), bucketing)
        if self.streams is not None:
            chunks = chunk_plan(chunks, len(self.streams), self.streams.split_min_rows, lengths)
        if self.streams is not None and len(chunks) > 1:
            outs = self.streams.map(run, chunks, [chunk_cost(chunk, lengths) for chunk in chunks])
        else:
            outs = [run(self.session, chunk) for chunk in chunks]
        for chunk, out in zip(chunks, outs, strict=True):
            for row, index in enumerate(chunk):
                results[index] = out[row, : lengths[index]] if per_token else out[row]
        return results if per_token else np.stack(results)

    def _check_modality(self, modality: str, call: str) -> None:
        if self.modality != modality:
            raise InputError(f"{call} is for {modality} artifacts; this one takes {self.modality}")

    def _check_task(self, task: str, call: str) -> None:
        if self.task != task:
            raise InputError(f"{call} needs a {task} artifact; this one is {self.task}: use run()")

    def mask_logits(self, texts, batch_size: int | None = None):
        """Vocabulary logits [masks, vocab] at the mask tokens of each text in turn; a text without one gets its
        middle token masked (`masked_row`). What a fill-mask artifact is validated on."""
        self._check_task("fill-mask", "mask_logits()")
        batch_size = check_batch_size(batch_size, "mask_logits()") or self.batch_size
        encodings = self.encode(texts)
        rows = [masked_row(e.ids, int(self.spec["mask_id"])) for e in encodings]
        logits = self._outputs(encodings, batch_size, ids=[ids for ids, _ in rows])
        return self._np.concatenate([out[positions] for out, (_, positions) in zip(logits, rows, strict=True)])

    def fill_mask(self, texts, top_k: int = 5, batch_size: int | None = None) -> list[list[list[dict]]]:
        """For each text, for each of its mask tokens, the `top_k` most likely tokens, each a dict of token_id,
        token (decoded text) and score (softmax probability), most likely first."""
        self._check_task("fill-mask", "fill_mask()")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise InputError(f"fill_mask(top_k={top_k!r}) must be a positive int")
        np = self._np
        batch_size = check_batch_size(batch_size, "fill_mask()") or self.batch_size
        encodings = self.encode(texts)
        mask_id = int(self.spec["mask_id"])
        results = []
        for enc, logits in zip(encodings, self._outputs(encodings, batch_size), strict=True):
            masks = []
            for position in [i for i, token in enumerate(enc.ids) if token == mask_id]:
                row = logits[position].astype(np.float64)
                probs = np.exp(row - row.max())
                probs /= probs.sum()
                best = np.argsort(-probs, kind="stable")[:top_k]
                masks.append(
                    [
                        {"token_id": int(t), "token": self.tokenizer.decode([int(t)]), "score": float(probs[t])}
                        for t in best
                    ]
                )
            results.append(masks)
        return results

    def answer(
        self,
        questions,
        contexts,
        max_answer_length: int = 30,
        batch_size: int | None = None,
        doc_stride: int | None = None,
    ) -> list[dict]:
        """Extractive question answering: for each (question, context), the best span of the context as a dict of
        answer, start and end (character offsets into the context) and score (see `best_answer`).

        A pair longer than the model is cut into windows of the model's length, each holding the whole question
        and a piece of the context that shares `doc_stride` tokens with the next (None: transformers' default,
        min(128, max_length // 2), or half the room a question leaves where that default does not fit in it);
        every window is run and the best span over all of them is taken, so the target's overlong policy does not
        apply here. A question that leaves no room for context, or a doc_stride not under the room, is refused."""
        self._check_task("question-answering", "answer()")
        questions = check_texts(questions, "answer()")
        contexts = check_texts(contexts, "answer()")
        if len(questions) != len(contexts):
            raise InputError(f"answer() got {len(questions)} questions and {len(contexts)} contexts; pass one each")
        if isinstance(max_answer_length, bool) or not isinstance(max_answer_length, int) or max_answer_length < 1:
            raise InputError(f"answer(max_answer_length={max_answer_length!r}) must be a positive int")
        if doc_stride is not None and (
            isinstance(doc_stride, bool) or not isinstance(doc_stride, int) or doc_stride < 1
        ):
            raise InputError(
                f"answer(doc_stride={doc_stride!r}) must be a positive int (the tokens each window of a long context "
                "shares with the next) or None for the default"
            )
        batch_size = check_batch_size(batch_size, "answer()") or self.batch_size
        # One tokenizer whose truncation is set per call: the lock keeps concurrent calls from mixing settings.
        with self._qa_lock:
            windows = question_windows(self._qa_tokenizer, self.max_length, questions, contexts, doc_stride)
        logits = self._outputs([w for pair in windows for w in pair], batch_size)
        results, first = [], 0
        for pair, context in zip(windows, contexts, strict=True):
            results.append(best_answer(pair, logits[first : first + len(pair)], context, max_answer_length))
            first += len(pair)
        return results
