"""One batch's decoding state on an ONNX Runtime session: the KV cache, the attention mask and the IO binding.

Batches are padded on the left, or on the right where the artifact says so ("padding": "right", GroupQueryAttention
graphs: each row is read and written at its own length, so it computes as it would alone).

Two cache layouts, per the artifact's spec:

- "shared" (graphs with GroupQueryAttention): past and present are bound once to the same preallocated buffer
  [b, kv heads, capacity, head size]; each step writes its new keys and values into it in place. No step
  allocates or copies the cache.
- "concat" (other graphs): present = Concat(past, new) is a new buffer each step, and becomes the next step's
  past without leaving ONNX Runtime's memory.

`SlotCache` is the "shared" layout for continuous batching (pipeline.runtime.continuous): one buffer
[slots, kv heads, capacity, head size] a layer, each request in its own slot, runs bound to a block of slots.

Per step, only the new token ids and the grown mask are bound again; position ids are advanced, not recomputed.
The mask is a view of one preallocated array for a batch of one; a larger batch copies its [b, length] mask each
step (a prefix of each row's columns is not one contiguous block, and ONNX Runtime binds only contiguous arrays).
Imports only numpy and onnxruntime.
"""

from __future__ import annotations

import numpy as np


def position_ids(mask: np.ndarray) -> np.ndarray:
    """Positions of a left-padded batch, as transformers' generate computes them: the count of real tokens
    before each one; padding gets 1 (it is masked)."""
    positions = np.cumsum(mask, axis=-1) - 1
    positions[mask == 0] = 1
    return positions.astype(np.int64)


def padded(rows: list[list[int]], pad_id: int, right: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Token id rows as one batch, padded with `pad_id` on the left (or the right), and its attention mask."""
    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for row, tokens in enumerate(rows):
        place = slice(0, len(tokens)) if right else slice(width - len(tokens), width)
        ids[row, place] = tokens
        mask[row, place] = 1
    return ids, mask


def last_logits(logits: np.ndarray, lengths, right: bool) -> np.ndarray:
    """Each row's next-token logits [b, V] from a graph's logits [b, s, V]: the last position's, or, where a
    right-padded graph returns every position's, those at each row's own length (`lengths`)."""
    if right and logits.shape[1] > 1:
        return logits[np.arange(len(logits)), np.asarray(lengths) - 1]
    return logits[:, -1]


class Decoding:
    """Decoding of one padded batch of prompts for up to `capacity` tokens in all (prompt width included).

    state = Decoding(generator, rows, capacity)
    logits = state.step()            # the prompts: next-token logits [b, V]
    logits = state.step(chosen)      # then one token per row, [b] ids
    """

    def __init__(self, generator, rows: list[list[int]], capacity: int):
        import onnxruntime as ort

        self.session = generator.session
        self.right = generator.right_padded
        ids, mask = padded(rows, generator.pad_id, right=self.right)
        self.positions = position_ids(mask) if "position_ids" in generator.input_names else None
        # Every step's mask is a prefix of this one, the prompts' mask then ones, and each step's new ids are
        # written into one buffer bound once: right after a step, with the weights just streamed through the
        # caches, each numpy call costs 15 to 40 us (SmolLM2), so no step computes a mask. A batch of one binds
        # a view of it; a larger batch copies its prefix (see the module docstring). Right-padded graphs read
        # the mask only through each row's sum (its length) and its width (pipeline/build/passes/attention.py), so
        # there too
        # the ones after the prompts count each row's new tokens; only the prompt step needs their places.
        self.masks = np.ones((len(rows), max(capacity, mask.shape[1])), dtype=np.int64)
        self.masks[:, : mask.shape[1]] = mask
        self.length = mask.shape[1]
        self.prompt_lengths = np.array([len(r) for r in rows], dtype=np.int64)
        self.added = 0  # tokens added to every row since the prompts
        self.new_ids = np.zeros((len(rows), 1), dtype=np.int64)
        self.new_ids_value = ort.OrtValue.ortvalue_from_numpy(self.new_ids)  # shares the array's memory (CPU)
        self.shared = generator.spec.get("cache") == "shared"
        self.binding = self.session.io_binding()
        self.logits_name = generator.output_names[0]
        self.present_names = generator.output_names[1:]
        self.device = generator.device
        length = capacity if self.shared else 0
        self.past = {
            name: ort.OrtValue.ortvalue_from_numpy(np.zeros((len(rows), h, length, d), np.float32), self.device, 0)
            for name, (h, d) in generator.past_shapes.items()
        }
        for name, value in self.past.items():
            self.binding.bind_ortvalue_input(name, value)
        self.prompt_ids, self.decoding = ids, False
        self.binding.bind_cpu_input("input_ids", self.prompt_ids)
        self.capacity = capacity
        # A last-position graph's logits are [b, 1, V] at every step: with a shared cache, every output is bound
        # once, to buffers that live as long as the batch, and a step only binds the new ids and the mask.
        shape = generator.session.get_outputs()[0].shape
        self.logits = None  # [b, V]: a view of the bound [b, 1, V] buffer, made once
        if self.shared and shape[1] == 1 and isinstance(shape[2], int) and self.device == "cpu":
            bound = np.empty((len(rows), 1, shape[2]), np.float32)
            self.binding.bind_ortvalue_output(self.logits_name, ort.OrtValue.ortvalue_from_numpy(bound))
            self.logits = bound[:, 0]
            for value, present in zip(self.past.values(), self.present_names, strict=True):
                self.binding.bind_ortvalue_output(present, value)

    def _bind_outputs(self) -> None:
        # An output bound before is reused as a preallocated buffer, and logits (and a growing cache) change shape,
        # so outputs are bound afresh each step, logits first: get_outputs() follows the binding order.
        self.binding.clear_binding_outputs()
        self.binding.bind_output(self.logits_name, "cpu")
        for value, present in zip(self.past.values(), self.present_names, strict=True):
            if self.shared:
                self.binding.bind_ortvalue_output(present, value)
            else:
                self.binding.bind_output(present, self.device)

    @property
    def lengths(self) -> np.ndarray:
        """Each row's tokens so far (right-padded: where its next token goes)."""
        return self.prompt_lengths + self.added

    def buffers(self) -> list[int]:
        """Addresses of the cache buffers the next step reads (what a test checks for copies)."""
        return [value.data_ptr() for value in self.past.values()]

    def step(self, chosen: np.ndarray | None = None) -> np.ndarray:
        """Run one step: the prompts when `chosen` is None, else one new token per row. Returns the last position's
        logits [b, V], which the next step may overwrite: copy them to keep them."""
        if chosen is not None:
            if self.length >= self.capacity:
                raise ValueError(f"the cache holds {self.capacity} tokens and is full")
            if not self.decoding:
                self.binding.bind_ortvalue_input("input_ids", self.new_ids_value)
                self.decoding = True
            self.new_ids[:, 0] = chosen
            self.length += 1
            self.added += 1
            if self.positions is not None:
                self.positions = (self.lengths - 1)[:, None] if self.right else self.positions[:, -1:] + 1
        # Bound arrays share their memory with ONNX Runtime, so they are kept alive as attributes until the next step.
        self.mask = np.ascontiguousarray(self.masks[:, : self.length])
        self.binding.bind_cpu_input("attention_mask", self.mask)
        if self.positions is not None:
            self.binding.bind_cpu_input("position_ids", self.positions)
        if self.logits is not None:
            self.session.run_with_iobinding(self.binding)
            return self.logits
        self._bind_outputs()
        self.session.run_with_iobinding(self.binding)
        outputs = self.binding.get_outputs()
        if not self.shared:
            self.past = dict(zip(self.past, outputs[1:], strict=True))
            for name, value in self.past.items():
                self.binding.bind_ortvalue_input(name, value)
        return last_logits(outputs[0].numpy(), self.lengths, self.right)


class SlotCache:
    """The KV cache of a continuous batch ("shared" layout only): per layer one preallocated buffer
    [slots, kv heads, capacity, head size], each slot a request's own cache for as long as the request runs.

    Slot is the first axis, so slots `first .. first + n - 1` are one contiguous block: a run binds past and present
    to that block by address (an IO binding over a view of the buffer, no copy), and the graph reads and writes each
    row at its own length. A request's prompt goes in as runs of one row (a chunk at a time); decode steps run the
    block of slots up to the highest busy one.

    cache = SlotCache(generator, slots=16, capacity=512)
    logits = cache.run(first=3, ids=np.array([[5, 6, 7]]), lengths=np.array([3]))   # slot 3's first 3 tokens
    logits = cache.run(first=0, ids=chosen[:, None], lengths=lengths)                # one token each, slots 0..n-1
    """

    def __init__(self, generator, slots: int, capacity: int):
        import onnxruntime as ort

        self.session = generator.session
        self.device = generator.device
        self.slots, self.capacity = slots, capacity
        self.logits_name = generator.output_names[0]
        self.has_positions = "position_ids" in generator.input_names
        types = {i.name: i.type for i in self.session.get_inputs()}
        self.layers = []  # (past name, present name, dtype, [h, capacity, d], buffer)
        presents = generator.output_names[1:]
        for (name, (heads, size)), present in zip(generator.past_shapes.items(), presents, strict=True):
            dtype = np.float16 if types[name] == "tensor(float16)" else np.float32
            shape = [heads, capacity, size]
            buffer = ort.OrtValue.ortvalue_from_shape_and_type([slots, *shape], dtype, self.device, 0)
            self.layers.append((name, present, dtype, shape, buffer))
        self._bindings: dict[tuple[int, int], object] = {}  # (first slot, rows) -> its IO binding

    def slot_bytes(self, layer: int) -> int:
        """Bytes of one slot's cache in a layer's buffer (the distance between consecutive slots)."""
        _, _, dtype, shape, _ = self.layers[layer]
        return int(np.prod(shape)) * np.dtype(dtype).itemsize

    def _binding(self, first: int, rows: int):
        """The IO binding of slots `first .. first + rows - 1`, made once: binding a layer's past and present by
        address costs about 40 us a layer, a quarter of a one-row decode step of SmolLM2 when done every run."""
        binding = self._bindings.get((first, rows))
        if binding is None:
            binding = self.session.io_binding()
            binding.bind_output(self.logits_name, "cpu")  # first: get_outputs() follows the binding order
            for layer, (past, present, dtype, shape, buffer) in enumerate(self.layers):
                address = buffer.data_ptr() + first * self.slot_bytes(layer)
                binding.bind_input(past, self.device, 0, dtype, [rows, *shape], address)
                binding.bind_output(present, self.device, 0, dtype, [rows, *shape], address)
            self._bindings[(first, rows)] = binding
        return binding

    def addresses(self) -> list[int]:
        """Addresses of the per-layer buffers (what a test checks for copies)."""
        return [layer[-1].data_ptr() for layer in self.layers]

    def run(self, first: int, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Run slots `first .. first + len(ids) - 1`: `ids` [n, s] int64 are each row's next `s` tokens, `lengths` [n]
        each row's tokens in its slot once they are in (its past plus `s`). Returns each row's last-position logits
        [n, V]; rows of a run of several are one token each (s = 1)."""
        rows, new = ids.shape
        if first < 0 or first + rows > self.slots or int(lengths.max()) > self.capacity:
            raise ValueError(f"slots {first}..{first + rows - 1} at lengths up to {int(lengths.max())} do not fit")
        binding = self._binding(first, rows)
        # Right-padded graphs read the mask through each row's sum (its length) and its width: ones, then zeros.
        mask = (np.arange(int(lengths.max()))[None, :] < lengths[:, None]).astype(np.int64)
        binding.bind_cpu_input("input_ids", np.ascontiguousarray(ids, dtype=np.int64))
        binding.bind_cpu_input("attention_mask", mask)
        if self.has_positions:
            positions = (lengths[:, None] - new + np.arange(new)[None, :]).astype(np.int64)
            binding.bind_cpu_input("position_ids", positions)
        binding.bind_output(self.logits_name, "cpu")  # in its place: a new buffer, whatever shape it has this run
        self.session.run_with_iobinding(binding)
        # A prompt chunk is one unpadded row and a decode step one token a row: the last position is each row's own.
        return binding.get_outputs()[0].numpy()[:, -1]
