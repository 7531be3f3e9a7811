"""llama.cpp as a peer in the decoder bench, through llama-cpp-python's C API (`pip install pipeline[llama]`,
which builds llama.cpp from source: minutes on 2 cores, cached by pip after the first build).

The peer runs a GGUF file of the same checkpoint as the artifact: the file the checkpoint came from (SmolLM2's
Q4_1, Gemma 3's Q4_K_M), or a Q8_0 requantized from it (`gguf_requantized`). It is fed the artifact's token ids,
so both sides see the same prompts of the same lengths, and decodes a batch of rows as llama.cpp's own batched
decoding does: one sequence id a row in one llama_batch, all rows' prompts in the first decode. Greedy, with the
end-of-generation tokens suppressed, so every row runs exactly n steps as the other variants do.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

from pipeline.errors import InputError


def _llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        raise InputError(
            "a llama.cpp peer needs llama-cpp-python: pip install 'pipeline[llama]' (it builds llama.cpp from "
            "source, minutes on 2 cores)"
        ) from None
    return llama_cpp


_QUIET = None  # the log callback, kept alive as long as llama.cpp may call it


def _quiet(llama_cpp) -> None:
    global _QUIET
    if _QUIET is None:
        _QUIET = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
        llama_cpp.llama_backend_init()


class LlamaPeer:
    """One GGUF model and a context of `max_rows` sequences of `room` tokens each, on `threads` threads."""

    def __init__(self, gguf: Path, threads: int, max_rows: int, room: int):
        self.lib = llama_cpp = _llama_cpp()
        gguf = Path(gguf)
        if not gguf.is_file() or gguf.suffix != ".gguf":
            raise InputError(f"{gguf} is not a .gguf file; pass the GGUF file of the artifact's checkpoint")
        _quiet(llama_cpp)
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise InputError(f"llama.cpp could not load {gguf}; pass a GGUF file llama.cpp reads")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max = room * max_rows, max_rows
        params.n_batch = room * max_rows  # a whole prefill in one decode; llama.cpp splits it by n_ubatch
        params.n_threads = params.n_threads_batch = threads
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        self.batch = llama_cpp.llama_batch_init(room * max_rows, 0, max_rows)
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.vocab_size = llama_cpp.llama_vocab_n_tokens(vocab)
        self.ends = [t for t in range(self.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    def close(self) -> None:
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.context)
        lib.llama_model_free(self.model)

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, row, wants logits) entries."""
        batch = self.batch
        batch.n_tokens = len(tokens)
        for j, (token, position, row, logits) in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = token, position, 1, logits
            batch.seq_id[j][0] = row
        code = self.lib.llama_decode(self.context, batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def logits(self, index: int) -> np.ndarray:
        """The logits of the `index`-th entry of the last decode that asked for them."""
        pointer = self.lib.llama_get_logits_ith(self.context, index)
        return np.ctypeslib.as_array(pointer, shape=(self.vocab_size,))

    def clear(self) -> None:
        # Forget every sequence without zeroing the buffers (data=False): zeroing a context of 8 x 2048 tokens
        # costs about as much as a short prompt's prefill, and no peer pays that between calls.
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.context), False)

    def greedy(self, rows: list[list[int]], n: int) -> float:
        """Exactly `n` greedy tokens after each row; the perf_counter time at which every row's first was chosen."""
        self.clear()
        self._decode([(t, i, r, i == len(row) - 1) for r, row in enumerate(rows) for i, t in enumerate(row)])
        chosen = [self._choose(int(last)) for last in np.cumsum([len(row) for row in rows]) - 1]
        first = time.perf_counter()
        for step in range(n - 1):
            self._decode([(chosen[r], len(row) + step, r, True) for r, row in enumerate(rows)])
            chosen = [self._choose(r) for r in range(len(rows))]
        return first

    def _choose(self, index: int) -> int:
        scores = self.logits(index).copy()
        scores[self.ends] = -np.inf
        return int(scores.argmax())

    def teacher_logits(self, prompt: list[int], continuation: list[int]) -> np.ndarray:
        """Next-token logits [len(continuation), vocab] along `continuation` after `prompt`, in one decode."""
        self.clear()
        tokens = prompt + continuation
        self._decode([(t, i, 0, i >= len(prompt) - 1 and i < len(tokens) - 1) for i, t in enumerate(tokens)])
        start = len(prompt) - 1
        return np.stack([self.logits(start + k).copy() for k in range(len(continuation))]).astype(np.float32)


def llama_runner(gguf: Path, tokenizer, threads: int, max_rows: int, room: int):
    """generate(batch, n): llama.cpp's greedy generation of exactly n tokens per prompt, on the artifact's token
    ids of each prompt."""
    peer = LlamaPeer(gguf, threads, max_rows, room)

    def run(batch: list[str], n: int) -> float:
        return peer.greedy([e.ids for e in tokenizer.encode_batch(batch)], n)

    return run


def llama_teacher_logits(gguf: Path, teacher: dict, threads: int) -> list[np.ndarray]:
    """llama.cpp's next-token logits along each held-out continuation of `teacher`."""
    pairs = list(zip(teacher["prompts"], teacher["continuations"], strict=True))
    peer = LlamaPeer(gguf, threads, 1, max(len(p) + len(c) for p, c in pairs))
    try:
        return [peer.teacher_logits(prompt, continuation) for prompt, continuation in pairs]
    finally:
        peer.close()


def gguf_requantized(source: Path, out: Path, ftype: str = "Q8_0", threads: int = 0) -> Path:
    """`source` requantized by llama.cpp to `ftype` (e.g. Q8_0) at `out`, unless it is there already."""
    llama_cpp = _llama_cpp()
    out = Path(out)
    if out.is_file():
        return out
    kind = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}", None)
    if kind is None:
        raise InputError(f"llama.cpp has no file type {ftype!r}; pass one such as Q8_0, Q4_K_M or Q4_0")
    _quiet(llama_cpp)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread, params.allow_requantize = kind, threads, True
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        partial.unlink(missing_ok=True)
        raise InputError(f"llama.cpp could not requantize {source} to {ftype}")
    partial.replace(out)
    return out
