"""The runtime for decoder (text-generation) artifacts: next-token scoring, and generation with a KV cache.

Like `pipeline.runtime`, it imports only the standard library, numpy, onnxruntime and tokenizers. Usage:

    from pipeline.runtime import load
    model = load("artifacts/tiny-gpt2/latest/cpu-avx2")
    [completion] = model.generate(["Once upon a time"], max_new_tokens=32)     # greedy by default
    for token in model.stream(["Once upon a time"], temperature=0.8, top_p=0.9, seed=0):
        print(token.text, end="", flush=True)

One graph serves the prompt and every new token: the first step feeds the (padded) prompts with an empty
cache, each later step feeds one token per row with the cache the step before returned.

    step 0:  input_ids [b, s]   past [b, h, 0, d]        -> logits [b, 1, V], present [b, h, s, d]
    step t:  input_ids [b, 1]   past = present of t - 1  -> logits [b, 1, V], present [b, h, s + t, d]

The cache stays in ONNX Runtime's memory between steps (see `kv_cache.Decoding`); with GroupQueryAttention
graphs it is one preallocated buffer written in place. Sampling follows
transformers' order: repetition penalty, then temperature, top-k and top-p; greedy takes the argmax.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from pipeline.errors import InputError
from pipeline.runtime.backends.onnxruntime import open_session
from pipeline.runtime.chat import ChatPrompts, chat_prompts
from pipeline.runtime.kv_cache import Decoding, last_logits, padded, position_ids
from pipeline.runtime.sampling import CONTEXT_TOKENS, Detokenizer, Sampling, choose_tokens, is_int, setting_problems
from pipeline.runtime.text import check_batch_size, check_texts, encode_batch, open_tokenizer


@dataclasses.dataclass(frozen=True)
class Token:
    """One streamed event: prompt `index` got `token_id`; `text` is the new text it completes (it can be empty
    while a character or a possible stop string is incomplete). `finish_reason` is set on a prompt's last
    event: "eos", "stop" or "length"."""

    index: int
    token_id: int
    text: str
    finish_reason: str | None = None


def token_event(index: int, token: int, detokenizer, sampling: Sampling, generated: int) -> Token:
    """The event of prompt `index`'s `generated`-th new token: its text from `detokenizer` (None: no text decoded
    per step) and why the prompt ended, if it did: a stop string, an end-of-sequence token, or the last token
    allowed."""
    text, stopped = detokenizer.add(token) if detokenizer else ("", False)
    reason = "stop" if stopped else "eos" if token in sampling.eos else None
    if reason is None and generated == sampling.max_new_tokens:
        reason = "length"
    if reason in ("eos", "length") and detokenizer:
        rest, stopped = detokenizer.flush()  # a held-back tail can complete a stop string
        text, reason = text + rest, "stop" if stopped else reason
    return Token(index, token, text, reason)


@dataclasses.dataclass(frozen=True)
class Completion:
    """A prompt's generated text (cut before any stop string), its token ids (the end-of-sequence token
    included, as transformers returns it) and why it ended: "eos", "stop" or "length"."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str


class Generator:
    """A loaded decoder artifact: its tokenizer, its ONNX Runtime session and the checkpoint's generation
    defaults (generation_config.json), applied where a call leaves a setting as None, as transformers does."""

    def __init__(self, onnx_path: Path, tokenizer_path: Path, spec: dict, providers=None, session=None):
        self.spec = spec
        self.task = spec["task"]
        self.max_length = int(spec["max_length"])
        self.batch_size = int(spec["batch_size"])
        self.pad_id = int(spec["pad_id"])
        self.defaults = dict(spec["defaults"])
        self.eos = frozenset(int(t) for t in spec["eos_token_ids"])
        self.tokenizer = open_tokenizer(tokenizer_path)
        self.session = open_session(onnx_path, session, providers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.past_names = list(spec["past"])
        # GroupQueryAttention graphs give each row its own length: their batches are padded on the right.
        self.right_padded = spec.get("padding") == "right"
        self.output_names = [o.name for o in self.session.get_outputs()]
        # With ONNX Runtime's CUDA provider the cache stays on the GPU between steps; only logits come back.
        self.device = "cuda" if "CUDAExecutionProvider" in self.session.get_providers() else "cpu"
        shapes = {i.name: i.shape for i in self.session.get_inputs()}
        # [batch, kv heads, past length, head size]: heads and head size are fixed numbers in the graph.
        self.past_shapes = {name: (int(shapes[name][1]), int(shapes[name][3])) for name in self.past_names}

    def encode(self, prompts, call: str = "generate()") -> list:
        """Tokenize prompts with the Rust tokenizer (special tokens such as BOS added as the checkpoint does, except
        to rendered chats, which hold the ones their template puts in)."""
        special = not isinstance(prompts, ChatPrompts)
        prompts = check_texts(prompts, call)
        encodings = encode_batch(self.tokenizer, prompts, call, add_special_tokens=special)
        for i, enc in enumerate(encodings):
            if not enc.ids:
                raise InputError(
                    f"{call} prompt {i} is empty after tokenization and this tokenizer adds no start token; "
                    "pass at least one character"
                )
        return encodings

    def _prompt_ids(self, prompts, room: int, call: str = "generate()") -> list[list[int]]:
        """Token ids of each prompt, cut from the left to `room` tokens (or refused, per the target)."""
        rows = [list(e.ids) for e in self.encode(prompts, call)]
        for i, ids in enumerate(rows):
            if len(ids) > room:
                if self.spec["overlong"] == "refuse":
                    if room < self.max_length:
                        why = f"with the new tokens asked for, {room} fit the model's {self.max_length}. Shorten it, "
                        why += "ask for fewer new tokens,"
                    else:
                        why = f"over the model's {self.max_length}; shorten it"
                    raise InputError(f"{call} prompt {i} is {len(ids)} tokens; {why} or use a truncating target")
                rows[i] = ids[-room:]  # keep the end: it is what the continuation follows
        return rows

    def _empty_past(self, batch: int) -> dict[str, np.ndarray]:
        return {n: np.zeros((batch, h, 0, d), dtype=np.float32) for n, (h, d) in self.past_shapes.items()}

    def feeds(self, encodings) -> dict:
        """Prompt-step inputs for a list of encodings: padded ids, the mask, positions and an empty cache."""
        return self._row_feeds([list(e.ids) for e in encodings])

    def _row_feeds(self, rows: list[list[int]]) -> dict:
        ids, mask = padded(rows, self.pad_id, right=self.right_padded)
        arrays = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids(mask)}
        return {**{n: arrays[n] for n in self.input_names if n in arrays}, **self._empty_past(len(ids))}

    def run(self, prompts, batch_size: int | None = None, bucketing: bool = True) -> np.ndarray:
        """Next-token logits [n, vocab] of each prompt (no generation). Prompts are grouped by length, so a short
        prompt is not padded to a long one. A prompt over the model's max_length keeps its end (or is refused,
        per the target), as in generate."""
        batch_size = check_batch_size(batch_size, "run()") or self.batch_size
        rows = self._prompt_ids(prompts, self.max_length, "run()")
        order = sorted(range(len(rows)), key=lambda i: len(rows[i])) if bucketing else list(range(len(rows)))
        results: list = [None] * len(rows)
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            logits = self.session.run([self.output_names[0]], self._row_feeds([rows[i] for i in chunk]))[0]
            logits = last_logits(logits, [len(rows[i]) for i in chunk], self.right_padded)
            for row, index in enumerate(chunk):
                results[index] = logits[row]
        return np.stack(results)

    def settings(
        self,
        max_new_tokens=None,
        min_new_tokens=0,
        do_sample=None,
        temperature=None,
        top_k=None,
        top_p=None,
        repetition_penalty=None,
        eos=None,
        stop=None,
    ) -> Sampling:
        """Resolve a call's settings against the checkpoint's defaults; a bad value is an InputError naming it."""
        pick = {
            "do_sample": do_sample,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "repetition_penalty": repetition_penalty,
        }
        values = {k: self.defaults.get(k) if v is None else v for k, v in pick.items()}
        values["max_new_tokens"] = 32 if max_new_tokens is None else max_new_tokens
        values["min_new_tokens"] = 0 if min_new_tokens is None else min_new_tokens
        problems = setting_problems(values, self.max_length)
        stop = self._stop_strings(stop, problems)
        eos_ids = self._eos_ids(eos, problems)
        if not problems and temperature is not None:
            if temperature == 0:
                values["do_sample"] = False  # temperature 0 is greedy
            elif do_sample is None:
                values["do_sample"] = True  # asking for a temperature is asking to sample
        if not problems and values["do_sample"] and not values["temperature"]:
            problems.append(f"temperature={values['temperature']!r} must be > 0 when sampling (0 is greedy)")
        if problems:
            raise InputError("generate(): " + "; ".join(problems))
        return Sampling(
            max_new_tokens=int(values["max_new_tokens"]),
            min_new_tokens=int(values["min_new_tokens"]),
            do_sample=bool(values["do_sample"]),
            temperature=float(values["temperature"] or 1.0),
            top_k=int(values["top_k"] or 0),
            top_p=float(1.0 if values["top_p"] is None else values["top_p"]),
            repetition_penalty=float(1.0 if values["repetition_penalty"] is None else values["repetition_penalty"]),
            eos=eos_ids,
            stop=stop,
        )

    @staticmethod
    def _stop_strings(stop, problems: list[str]) -> tuple[str, ...]:
        if stop is None:
            return ()
        strings = (stop,) if isinstance(stop, str) else stop
        if isinstance(strings, list | tuple | set | frozenset) and all(isinstance(s, str) and s for s in strings):
            return tuple(strings)
        problems.append(f"stop={stop!r} must be a non-empty string or a list of them")
        return ()

    def _eos_ids(self, eos, problems: list[str]) -> frozenset[int]:
        if eos is None or eos is True:
            return self.eos
        if eos is False:
            return frozenset()
        ids = [eos] if is_int(eos) else list(eos) if isinstance(eos, list | tuple | set | frozenset) else None
        vocab = self.tokenizer.get_vocab_size()
        if ids is None or not all(is_int(t) and 0 <= t < vocab for t in ids):
            problems.append(
                f"eos={eos!r} must be None, True, False, a token id or a list of token ids (0 to {vocab - 1})"
            )
            return frozenset()
        return frozenset(int(t) for t in ids)

    def stream(
        self,
        prompts=None,
        batch_size: int | None = None,
        seed: int | None = None,
        *,
        messages=None,
        tools=None,
        **settings,
    ) -> Iterator[Token]:
        """Generate for each prompt, yielding a Token event per prompt per step as soon as it is chosen. Bad
        arguments raise InputError here, before the first token.

        Settings (each None takes the checkpoint's generation_config.json default, as transformers does):
        max_new_tokens (32), min_new_tokens, do_sample, temperature (> 0 samples, 0 is greedy), top_k, top_p,
        repetition_penalty, eos (an id or ids; False to ignore the end-of-sequence token), stop (strings that
        end a prompt's text, cut off before them); any other name is an InputError. `seed` (an int from 0 to
        2**64 - 1) makes sampling repeatable: each prompt draws from its own generator, seeded by `seed` and its
        index, so its continuation does not depend on `batch_size` or on the prompts batched with it. Prompts run
        in batches of `batch_size`, padded; with more prompts than that (and batches of more than one), the
        batches are formed shortest prompts first, so that each pads as little as it can, and each event names
        its prompt by `index`.

        `messages`, in place of prompts, is a list of conversations (each a list of {"role", "content"} dicts),
        rendered with the checkpoint's chat template, ready for the assistant's reply; `tools` (a list of tool
        dicts in OpenAI's shape, as transformers' apply_chat_template(tools=...) takes them) go to that template.
        """
        prompts = chat_prompts(self.spec, prompts, messages, "stream()", tools)
        return self._events(prompts, batch_size, seed, settings, "stream()")[1]

    def _events(self, prompts, batch_size, seed, settings: dict, call: str, texts: bool = True):
        """Check a call's arguments now; returns the prompts' token ids and the iterator of their events."""
        batch_size = check_batch_size(batch_size, call) or self.batch_size
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise InputError(
                f"{call} got an unknown setting {unknown[0]!r}; it takes batch_size, seed and "
                f"{', '.join(SETTINGS)}. Fix the spelling or remove it"
            )
        if seed is not None and not (is_int(seed) and 0 <= seed < 2**64):
            raise InputError(f"{call}: seed={seed!r} must be an int from 0 to 2**64 - 1 (or None for no seed)")
        sampling = self.settings(**settings)
        rows = self._prompt_ids(prompts, self.max_length - sampling.max_new_tokens, call)
        # One generator a prompt, from (seed, its index): its draws do not depend on the batch it lands in.
        rngs = [np.random.default_rng(None if seed is None else [seed, i]) for i in range(len(rows))]
        # Batches of one pad nothing, and then prompts keep their order (the CLI streams them one after another).
        by_length = 1 < batch_size < len(rows)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i])) if by_length else range(len(rows))
        chunks = [order[start : start + batch_size] for start in range(0, len(rows), batch_size)]
        return rows, (
            event
            for chunk in chunks
            for event in self._stream_batch([rows[i] for i in chunk], chunk, sampling, [rngs[i] for i in chunk], texts)
        )

    def teacher_forced_logits(self, prompts: list[list[int]], continuations: list[list[int]]) -> list[np.ndarray]:
        """Next-token logits along given continuations (token ids), one batch, padded: for each row an array
        [len(continuation), V] whose row i predicts continuation[i] after the prompt and continuation[:i]. What
        perplexity and teacher-forced agreement are measured on."""
        longest = max(len(c) for c in continuations)
        forced = np.array([list(c) + [self.pad_id] * (longest - len(c)) for c in continuations], dtype=np.int64)
        state = Decoding(self, prompts, max(map(len, prompts)) + longest)
        steps = [state.step().copy()]
        for i in range(longest - 1):
            steps.append(state.step(forced[:, i]).copy())
        stacked = np.stack(steps, axis=1)
        return [stacked[row, : len(c)] for row, c in enumerate(continuations)]

    def _stream_batch(self, rows: list[list[int]], indices, sampling: Sampling, rngs: list, texts: bool):
        """Events of one batch, each row's named by its prompt's index in `indices`. Without `texts` (and without
        stop strings) no text is decoded per step: each event's text is empty, and the caller decodes each row
        once at its end."""
        state = Decoding(self, rows, max(map(len, rows)) + sampling.max_new_tokens)
        incremental = texts or bool(sampling.stop)
        detokenizers = [Detokenizer(self.tokenizer, r, sampling.stop) for r in rows] if incremental else None
        context = [list(r) for r in rows]
        live = [True] * len(rows)
        logits = state.step()
        for step in range(sampling.max_new_tokens):
            chosen = choose_tokens(logits, context, step, sampling, rngs)
            for row, token in enumerate(chosen.tolist()):
                if not live[row]:
                    continue
                context[row].append(token)
                event = token_event(indices[row], token, detokenizers[row] if incremental else None, sampling, step + 1)
                if event.finish_reason:
                    live[row] = False
                yield event
            if not any(live):
                return
            # Rows that have ended keep a place in the batch, fed padding, as transformers does.
            logits = state.step(chosen if all(live) else np.where(live, chosen, self.pad_id))

    def generate(
        self,
        prompts=None,
        batch_size: int | None = None,
        seed: int | None = None,
        *,
        messages=None,
        tools=None,
        **settings,
    ) -> list:
        """Generate for each prompt (or conversation of `messages`); returns one Completion per prompt, in order.
        Takes the settings (and `tools`) of `stream`."""
        prompts = chat_prompts(self.spec, prompts, messages, "generate()", tools)
        rows, events = self._events(prompts, batch_size, seed, settings, "generate()", texts=False)
        pieces: dict[int, list[str]] = {}
        tokens: dict[int, list[int]] = {}
        reasons: dict[int, str] = {}
        for event in events:
            pieces.setdefault(event.index, []).append(event.text)
            tokens.setdefault(event.index, []).append(event.token_id)
            if event.finish_reason:
                reasons[event.index] = event.finish_reason
        if not settings.get("stop"):  # no text was decoded per step: decode each row once, after its prompt's end
            tails = [rows[i][-CONTEXT_TOKENS:] for i in sorted(tokens)]
            befores = self.tokenizer.decode_batch(tails, skip_special_tokens=True)
            afters = self.tokenizer.decode_batch(
                [tail + tokens[i] for tail, i in zip(tails, sorted(tokens), strict=True)], skip_special_tokens=True
            )
            pieces = {i: [a[len(b) :]] for i, b, a in zip(sorted(tokens), befores, afters, strict=True)}
        return [Completion("".join(pieces[i]), tuple(tokens[i]), reasons[i]) for i in sorted(pieces)]


# What a call's **settings may name: the parameters of Generator.settings.
SETTINGS = tuple(inspect.signature(Generator.settings).parameters)[1:]
