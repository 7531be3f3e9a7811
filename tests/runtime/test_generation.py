"""The decoder runtime: greedy generation equal to transformers', streaming, batching, sampling, stop conditions."""

import json
import time

import numpy as np
import pytest
import torch
import transformers

from pipeline.errors import InputError
from pipeline.runtime import load
from pipeline.runtime.generation import Generator, Token, position_ids
from pipeline.runtime.sampling import Detokenizer, Sampling, choose_tokens
from tests.conftest import SMALL_TEXTS


@pytest.fixture(scope="module")
def model(published_gpt2) -> Generator:
    return load(published_gpt2)


@pytest.fixture(scope="module")
def hf(tiny_gpt2):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_gpt2).eval()
    return model, transformers.AutoTokenizer.from_pretrained(tiny_gpt2)


def _hf_greedy(hf, prompt: str, n: int, **kwargs) -> tuple[int, ...]:
    model, tokenizer = hf
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**ids, do_sample=False, max_new_tokens=n, pad_token_id=tokenizer.eos_token_id, **kwargs)
    return tuple(out[0, ids["input_ids"].shape[1] :].tolist())


class _Counting:
    """Counts the ONNX Runtime steps a generator runs; everything else goes to the real session."""

    def __init__(self, session):
        self.session, self.steps = session, 0

    def run_with_iobinding(self, binding, *args):
        self.steps += 1
        return self.session.run_with_iobinding(binding, *args)

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_position_ids_count_real_tokens_like_transformers():
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids(mask).tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_generate_greedy_equals_transformers_for_32_tokens_on_every_prompt(model, hf):
    completions = model.generate(SMALL_TEXTS, max_new_tokens=32, batch_size=8)
    for prompt, completion in zip(SMALL_TEXTS, completions, strict=True):
        assert completion.token_ids == _hf_greedy(hf, prompt, 32), prompt
        assert completion.finish_reason in ("length", "eos")


def test_published_manifest_records_greedy_match_and_the_report_the_build_speed(published_gpt2):
    manifest = json.loads((published_gpt2 / "manifest.json").read_text())
    validation = manifest["validation"]
    assert validation["greedy_match"] == 1.0 and validation["new_tokens"] == 32
    assert manifest["target_spec"]["precision"] == "int8"
    assert "speed" not in validation  # a build host's timing is not a property of the artifact
    report = json.loads((published_gpt2 / "report.json").read_text())
    speed = report["build_speed"]["generation"]
    assert speed["measured_at"] and report["build_speed"]["host"]["cores"] >= 1
    for batch in ("batch_1", "batch_8"):
        row = speed["batches"][batch]
        assert set(row) == {"pytorch-generate", "artifact"}
        low, high = row["artifact"]["decode_range_tokens_per_s"]
        assert row["artifact"]["ttft_ms"] > 0 and 0 < low <= row["artifact"]["decode_tokens_per_s"] <= high
    assert report["stages"]["quantize"]["metrics"]["quantized_nodes"] > 0


def test_stream_yields_each_token_as_its_step_runs(model):
    counting = _Counting(model.session)
    model.session = counting
    try:
        events = model.stream(
            ["The cat sat", "A much longer prompt about the weather in spring"], max_new_tokens=6, eos=False
        )
        first = next(events)
        assert counting.steps == 1 and isinstance(first, Token) and first.index == 0
        rest = list(events)
    finally:
        model.session = counting.session
    assert counting.steps == 6
    assert [e.index for e in [first, *rest]] == [0, 1] * 6
    assert [e.finish_reason for e in [first, *rest]][-2:] == ["length", "length"]
    assert all(e.finish_reason is None for e in [first, *rest][:-2])


def test_stream_text_joins_to_generate_text_and_decoded_ids(model):
    prompts = ["Preheat the oven", "Stock markets fell"]
    streamed = {0: "", 1: ""}
    for event in model.stream(prompts, max_new_tokens=20, eos=False):
        streamed[event.index] += event.text
    completions = model.generate(prompts, max_new_tokens=20, eos=False)
    assert [streamed[0], streamed[1]] == [c.text for c in completions]
    for completion in completions:
        assert completion.text == model.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
        assert len(completion.token_ids) == 20


def test_batched_left_padded_generation_equals_one_prompt_at_a_time(tiny_gpt2, texts_file, tmp_path):
    from pipeline.build.table import build

    manifest = build(
        tiny_gpt2,
        "cpu-fp32",
        artifacts_dir=tmp_path / "a",
        cache_dir=tmp_path / "c",
        validation=texts_file,
        calibration=texts_file,
    )
    fp32 = load(manifest.published.path)
    together = fp32.generate(SMALL_TEXTS, max_new_tokens=16, batch_size=len(SMALL_TEXTS))
    alone = [fp32.generate([p], max_new_tokens=16)[0] for p in SMALL_TEXTS]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    by_length = fp32.generate(SMALL_TEXTS, max_new_tokens=16, batch_size=3)  # batches of similar lengths
    assert [c.token_ids for c in by_length] == [c.token_ids for c in alone]
    np.testing.assert_allclose(fp32.run(SMALL_TEXTS, batch_size=12), fp32.run(SMALL_TEXTS, batch_size=1), atol=1e-5)
    # Sampled with a seed, each prompt draws from its own generator: its sample does not depend on its batch.
    sampled = {
        size: fp32.generate(SMALL_TEXTS, max_new_tokens=16, batch_size=size, temperature=1.5, seed=7)
        for size in (1, 3, 12)
    }
    assert [c.token_ids for c in sampled[1]] == [c.token_ids for c in sampled[3]] == [c.token_ids for c in sampled[12]]


def test_more_prompts_than_a_batch_are_batched_shortest_first_and_events_name_their_prompt(model):
    prompts = ["a much longer prompt than the others, by several words", "short", "a middling prompt", "hi there"]
    lengths = [len(model.tokenizer.encode(p).ids) for p in prompts]
    events = list(model.stream(prompts, max_new_tokens=3, batch_size=2, eos=False))
    first_batch = {e.index for e in events[:6]}  # two rows, three steps
    assert first_batch == set(sorted(range(4), key=lambda i: lengths[i])[:2])
    assert sorted({e.index for e in events}) == [0, 1, 2, 3] and len(events) == 12
    texts = [c.text for c in model.generate(prompts, max_new_tokens=3, batch_size=2, eos=False)]
    assert texts == ["".join(e.text for e in events if e.index == i) for i in range(4)]
    one_at_a_time = list(model.stream(prompts, max_new_tokens=3, batch_size=1, eos=False))
    assert [e.index for e in one_at_a_time] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # nothing to pad: kept in order


def test_eos_ends_a_row_with_the_eos_token_kept(model):
    greedy = model.generate(["The train to Berlin"], max_new_tokens=12, eos=False)[0].token_ids
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    ended = model.generate(["The train to Berlin"], max_new_tokens=12, eos=stop_at)[0]
    assert ended.token_ids == greedy[: first + 1] and ended.finish_reason == "eos"
    forced = model.generate(["The train to Berlin"], max_new_tokens=12, eos=stop_at, min_new_tokens=12)[0]
    assert len(forced.token_ids) == 12 and forced.finish_reason == "length"
    assert stop_at not in forced.token_ids


def test_stop_string_ends_a_row_and_is_cut_off(model):
    full = model.generate(["Please close the door"], max_new_tokens=24, eos=False)[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    at = full.text.index(stop)
    stopped = model.generate(["Please close the door"], max_new_tokens=24, eos=False, stop=[stop])[0]
    assert stopped.text == full.text[:at] and stopped.finish_reason == "stop"
    assert len(stopped.token_ids) < len(full.token_ids)
    pieces = [e.text for e in model.stream(["Please close the door"], max_new_tokens=24, eos=False, stop=stop)]
    assert "".join(pieces) == full.text[:at]


def test_sampling_repeats_with_a_seed_and_top_k_1_is_greedy(model):
    prompts = ["How do I reset", "Photosynthesis"]
    a = model.generate(prompts, max_new_tokens=10, temperature=1.5, seed=7, eos=False)
    b = model.generate(prompts, max_new_tokens=10, temperature=1.5, seed=7, eos=False)
    c = model.generate(prompts, max_new_tokens=10, temperature=1.5, seed=8, eos=False)
    assert [x.token_ids for x in a] == [x.token_ids for x in b] != [x.token_ids for x in c]
    greedy = model.generate(prompts, max_new_tokens=10, eos=False)
    top1 = model.generate(prompts, max_new_tokens=10, temperature=1.5, top_k=1, seed=3, eos=False)
    assert [x.token_ids for x in top1] == [x.token_ids for x in greedy]


def _settings(**changes) -> Sampling:
    base = dict(
        max_new_tokens=4,
        min_new_tokens=0,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        repetition_penalty=1.0,
        eos=frozenset(),
        stop=(),
    )
    return Sampling(**{**base, **changes})


def test_choose_tokens_filters_like_transformers_warpers():
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 50)).astype(np.float32) * 3
    context = [[1, 2, 3], [4, 4], [10]]
    for settings in (_settings(top_k=5), _settings(top_p=0.6), _settings(temperature=0.5, top_k=8, top_p=0.8)):
        scores = torch.from_numpy(logits.copy())
        scores = TemperatureLogitsWarper(settings.temperature)(None, scores)
        if settings.top_k:
            scores = TopKLogitsWarper(settings.top_k)(None, scores)
        if settings.top_p < 1:
            scores = TopPLogitsWarper(settings.top_p)(None, scores)
        allowed = [set(np.flatnonzero(np.isfinite(row))) for row in scores.numpy()]
        drawn = [set() for _ in range(3)]
        for _ in range(400):
            for row, token in enumerate(choose_tokens(logits, context, 0, settings, rng)):
                drawn[row].add(int(token))
        assert all(d <= a for d, a in zip(drawn, allowed, strict=True)), settings
        assert all(len(d) > 1 for d, a in zip(drawn, allowed, strict=True) if len(a) > 2)
    seen = torch.tensor([[1, 2, 3, 3], [4, 4, 4, 4], [10, 10, 10, 10]])  # the contexts, repeats padding the rows
    penalized = RepetitionPenaltyLogitsProcessor(1.3)(seen, torch.from_numpy(logits.copy())).numpy()
    greedy = choose_tokens(logits, context, 0, _settings(do_sample=False, repetition_penalty=1.3), rng)
    assert greedy.tolist() == penalized.argmax(-1).tolist()


def test_min_new_tokens_blocks_eos_in_choose_tokens():
    logits = np.zeros((1, 5), dtype=np.float32)
    logits[0, 2] = 5.0
    settings = _settings(do_sample=False, min_new_tokens=2, eos=frozenset({2}))
    assert choose_tokens(logits, [[0]], 0, settings, None).tolist() != [2]
    assert choose_tokens(logits, [[0]], 2, settings, None).tolist() == [2]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0 must be an int from 1"),
        ({"max_new_tokens": 10_000}, "max_new_tokens=10000 must be an int from 1 to 255"),
        ({"temperature": -1.0}, "temperature=-1.0 must be a finite number >= 0"),
        ({"top_p": 1.5}, r"top_p=1.5 must be a number in \(0, 1\]"),
        ({"top_k": -2}, "top_k=-2 must be an int >= 0"),
        ({"stop": [""]}, "must be a non-empty string"),
        ({"min_new_tokens": -1}, "min_new_tokens=-1 must be an int >= 0"),
    ],
)
def test_generate_refuses_bad_settings_naming_them(model, kwargs, message):
    with pytest.raises(InputError, match=message):
        model.generate(["hello"], **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": float("nan")}, "temperature=nan must be a finite number >= 0"),
        ({"temperature": float("inf")}, "temperature=inf must be a finite number >= 0"),
        ({"temperature": "0.7"}, "temperature='0.7' must be a finite number >= 0"),
        ({"top_p": "0.9"}, r"top_p='0.9' must be a number in \(0, 1\]"),
        ({"top_p": float("nan")}, r"top_p=nan must be a number in \(0, 1\]"),
        ({"top_k": 2.5}, "top_k=2.5 must be an int >= 0"),
        ({"top_k": True}, "top_k=True must be an int >= 0"),
        ({"repetition_penalty": 0}, "repetition_penalty=0 must be a finite number > 0"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty=nan must be a finite number > 0"),
        ({"eos": "x"}, "eos='x' must be None, True, False, a token id or a list of token ids"),
        ({"eos": [0, "x"]}, r"eos=\[0, 'x'\] must be None, True, False, a token id or a list of token ids"),
        ({"eos": -1}, "eos=-1 must be None, True, False, a token id or a list of token ids"),
        ({"max_new_tokens": True}, "max_new_tokens=True must be an int from 1"),
        ({"max_new_tokens": 4.0}, "max_new_tokens=4.0 must be an int from 1"),
        ({"min_new_tokens": True}, "min_new_tokens=True must be an int >= 0"),
        ({"do_sample": "yes"}, "do_sample='yes' must be True, False or None"),
        ({"stop": 5}, "stop=5 must be a non-empty string or a list of them"),
    ],
)
def test_generate_raises_input_error_naming_the_setting_when_it_is_loose(model, kwargs, message):
    with pytest.raises(InputError, match=message) as caught:
        model.generate(["hello"], max_new_tokens=kwargs.pop("max_new_tokens", 2), **kwargs)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("seed", ["abc", -1, 1.5, True, 2**64])
def test_generate_and_stream_raise_one_line_input_error_naming_the_range_when_seed_is_bad(model, seed):
    for call in (model.generate, model.stream):
        with pytest.raises(InputError, match=r"seed=.* must be an int from 0 to 2\*\*64 - 1") as caught:
            call(["hello"], max_new_tokens=2, seed=seed)
        assert "\n" not in str(caught.value)


def test_generate_and_stream_raise_input_error_naming_the_known_settings_when_a_keyword_is_unknown(model):
    for call in (model.generate, model.stream):
        with pytest.raises(
            InputError,
            match=r"unknown setting 'temprature'; it takes batch_size, seed and "
            r"max_new_tokens, .*temperature, .*stop",
        ):
            call(["hello"], max_new_tokens=2, temprature=0.5)


def test_choose_tokens_picks_the_best_token_when_temperature_or_penalty_is_tiny():
    rng = np.random.default_rng(0)
    logits = np.array([[1.0, 5.0, 2.0, 0.5]], dtype=np.float32)
    with np.errstate(invalid="raise"):  # no inf - inf = NaN on the way
        for temperature in (1e-40, 1e-300, 5e-324):
            assert choose_tokens(logits, [[0]], 0, _settings(temperature=temperature), rng).tolist() == [1]
        # The penalty divides the seen tokens' positive scores by 1e-300: 3e300 beats 2e300, both finite.
        seen = np.array([[0.0, 3.0, 2.0, -1.0]], dtype=np.float32)
        for do_sample in (True, False):
            settings = _settings(do_sample=do_sample, repetition_penalty=1e-300)
            assert choose_tokens(seen, [[1, 2]], 0, settings, rng).tolist() == [1]


def test_generate_with_a_tiny_temperature_is_greedy(model):
    greedy = model.generate(["The train to Berlin"], max_new_tokens=8, eos=False)[0]
    cold = model.generate(["The train to Berlin"], max_new_tokens=8, eos=False, temperature=1e-40, seed=0)[0]
    assert cold.token_ids == greedy.token_ids


def _first_stop(text: str, stops: list[str]) -> str:
    """The text before the stop string that ends first in `text` (the longer of two ending together)."""
    ends = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
    if not ends:
        return text
    end, minus = min(ends)
    return text[: end + minus]


def test_stop_matcher_cuts_where_a_full_search_of_the_text_does():
    from pipeline.runtime.sampling import _StopMatcher

    rng = np.random.default_rng(0)
    for _ in range(300):
        text = "".join(rng.choice(list("ab"), size=int(rng.integers(1, 30))))
        stops = ["".join(rng.choice(list("ab"), size=int(rng.integers(1, 5)))) for _ in range(int(rng.integers(1, 3)))]
        matcher, seen = _StopMatcher(tuple(stops)), ""
        while seen != text:
            piece = text[len(seen) : len(seen) + int(rng.integers(1, 4))]
            begin = matcher.feed(piece)
            if begin is not None:
                assert (seen + piece)[: len(seen) + begin] == _first_stop(text, stops), (text, stops)
                break
            seen += piece
            tail = max((k for s in stops for k in range(len(s)) if seen.endswith(s[:k])), default=0)
            assert matcher.held() == tail, (seen, stops)
        else:
            assert _first_stop(text, stops) == text


def test_a_long_stop_string_is_checked_in_time_linear_in_its_length(tiny_gpt2):
    from pipeline.runtime.text import open_tokenizer

    tokenizer = open_tokenizer(tiny_gpt2 / "tokenizer.json")
    tokens = tokenizer.encode("a" * 200).ids[:8]
    started = time.perf_counter()
    # A rescan of the text's tail for each prefix of the string took over a minute for these 8 tokens.
    detokenizer = Detokenizer(tokenizer, [], ("a" * 1_000_000,))
    emitted = ""
    for token in tokens:
        emitted += detokenizer.add(token)[0]
        assert time.perf_counter() - started < 20  # it takes under a second
    text, stopped = detokenizer.flush()
    assert emitted == "" and not stopped  # all held back: the text could be the start of the stop string
    assert text == tokenizer.decode(tokens) and set(text) == {"a"}


def test_settings_accepts_numpy_numbers_and_token_id_lists(model):
    sampling = model.settings(temperature=np.float32(0.5), top_p=np.float64(0.9), top_k=np.int64(3), eos=[0, 1])
    assert (sampling.do_sample, sampling.temperature, sampling.top_k, sampling.eos) == (True, 0.5, 3, {0, 1})
    assert model.settings(temperature=0, repetition_penalty=1.2).do_sample is False
    assert model.settings(eos=np.int64(5), stop="x").eos == {5}


@pytest.mark.parametrize("batch_size", [-1, 0, 1.5, True, "8"])
def test_generate_raises_input_error_when_batch_size_is_not_a_positive_int(model, batch_size):
    with pytest.raises(InputError, match=r"generate\(\): batch_size=.* must be a positive int"):
        model.generate(["hello", "world"], max_new_tokens=2, batch_size=batch_size)
    with pytest.raises(InputError, match=r"stream\(\): batch_size=.* must be a positive int"):
        model.stream(["hello", "world"], max_new_tokens=2, batch_size=batch_size)  # before the first token


@pytest.mark.parametrize("batch_size", [-1, 0, 1.5, True, "8"])
def test_run_raises_input_error_when_batch_size_is_not_a_positive_int(model, batch_size):
    with pytest.raises(InputError, match=r"run\(\): batch_size=.* must be a positive int"):
        model.run(["hello", "world"], batch_size=batch_size)


def test_generate_refuses_bad_prompts(model):
    with pytest.raises(InputError, match=r"single str; wrap it: model\.generate\(\[text\]\)"):
        model.generate("hello")
    with pytest.raises(InputError, match="prompt 1 is empty after tokenization"):
        model.generate(["fine", ""])
    with pytest.raises(InputError, match="input 0 is int"):
        model.generate([3])


def test_overlong_prompt_keeps_its_end_or_is_refused(model):
    long_prompt = " ".join(SMALL_TEXTS * 8)
    ids = model.tokenizer.encode(long_prompt).ids
    assert len(ids) > model.max_length
    assert model._prompt_ids([long_prompt], model.max_length - 8) == [ids[-(model.max_length - 8) :]]
    assert len(model.generate([long_prompt], max_new_tokens=8, eos=False)[0].token_ids) == 8
    strict = Generator.__new__(Generator)
    strict.__dict__.update(model.__dict__, spec={**model.spec, "overlong": "refuse"})
    with pytest.raises(InputError, match=r"prompt 0 is \d+ tokens; with the new tokens asked for, 248 fit"):
        strict.generate([long_prompt], max_new_tokens=8)


def test_run_keeps_the_prompt_end_when_prompt_is_overlong(model, published_gpt2):
    manifest = json.loads((published_gpt2 / "manifest.json").read_text())
    max_length = manifest["model"]["max_length"]
    long_prompt = " ".join(SMALL_TEXTS * 8)
    ids = model.tokenizer.encode(long_prompt).ids
    assert len(ids) > max_length == model.max_length
    logits = model.run([long_prompt])
    assert logits.shape == (1, 512) and np.isfinite(logits).all()
    end = model.session.run([model.output_names[0]], model._row_feeds([ids[-max_length:]]))[0][:, -1]
    np.testing.assert_allclose(logits, end, atol=1e-5)
    batched = model.run([long_prompt, "ok"], batch_size=2)  # padded together; dynamic int8 moves logits a little
    assert batched.shape == (2, 512)
    np.testing.assert_allclose(batched[0], logits[0], atol=2e-2)


def test_run_raises_input_error_when_prompt_is_overlong_and_target_refuses(model):
    strict = Generator.__new__(Generator)
    strict.__dict__.update(model.__dict__, spec={**model.spec, "overlong": "refuse"})
    with pytest.raises(InputError, match=r"run\(\) prompt 1 is \d+ tokens; over the model's 256; shorten it"):
        strict.run(["ok", " ".join(SMALL_TEXTS * 8)])


def test_detokenizer_flush_emits_the_replacement_character_when_a_row_ends_mid_character(model):
    tokenizer = model.tokenizer
    ids = tokenizer.encode("naïve 日本語").ids
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "the byte-level BPE splits no character across tokens here"
    for cut in cuts:
        row = Detokenizer(tokenizer, tokenizer.encode("Once upon a time").ids, ())
        text = "".join(row.add(token)[0] for token in ids[:cut])
        rest, stopped = row.flush()
        assert text + rest == tokenizer.decode(ids[:cut]) and rest.endswith("\ufffd") and not stopped


def test_generate_text_equals_decoded_token_ids_when_a_row_ends_mid_character(model):
    prompts = ["Zürich is expensive, but the café was lovely.", "日本語のテキスト", "naïve café"]
    cut = 0
    for seed in range(6):
        for completion in model.generate(prompts, max_new_tokens=3 + seed, temperature=1.5, seed=seed, eos=False):
            decoded = model.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
            assert completion.text == decoded
            cut += decoded.endswith("\ufffd")
    assert cut, "no row ended inside a character; pick other prompts or seeds"


def test_run_scores_the_next_token(model, hf):
    logits = model.run(SMALL_TEXTS[:3])
    assert logits.shape == (3, 512)
    for prompt, row in zip(SMALL_TEXTS[:3], logits, strict=True):
        assert int(row.argmax()) == _hf_greedy(hf, prompt, 1)[0]


@pytest.fixture(scope="module")
def fp32_model(tiny_gpt2, texts_file, tmp_path_factory) -> Generator:
    from pipeline.build.table import build

    root = tmp_path_factory.mktemp("gpt2-fp32")
    manifest = build(
        tiny_gpt2,
        "cpu-fp32",
        validation=texts_file,
        calibration=texts_file,
        artifacts_dir=root / "a",
        cache_dir=root / "c",
    )
    return load(manifest.published.path)


def test_teacher_forced_logits_equal_transformers_along_each_continuation_batched_with_left_padding(fp32_model, hf):
    from pipeline.build.accuracy.metrics import split_at_middle

    model, (hf, _) = fp32_model, hf
    pairs = split_at_middle([e.ids for e in model.encode(SMALL_TEXTS)], model.max_length)
    prompts, continuations = [p for p, _ in pairs], [c for _, c in pairs]
    assert len({len(p) for p in prompts}) > 1  # rows of several lengths share the batch
    got = model.teacher_forced_logits(prompts, continuations)
    with torch.inference_mode():
        for prompt, continuation, logits in zip(prompts, continuations, got, strict=True):
            expected = hf(input_ids=torch.tensor([prompt + continuation])).logits[0, len(prompt) - 1 : -1].numpy()
            assert logits.shape == expected.shape
            np.testing.assert_allclose(logits, expected, atol=2e-3)


def test_published_decoder_records_teacher_forced_agreement_and_perplexity_ratio(published_gpt2):
    validation = json.loads((published_gpt2 / "manifest.json").read_text())["validation"]
    assert 0.5 < validation["teacher_top1_agreement"] <= 1.0
    assert 0.9 < validation["perplexity_ratio"] < 1.1
    # Every greedy continuation matched (greedy_match 1.0), so each was reproduced whole.
    assert validation["greedy_match"] == 1.0 and validation["greedy_prefix_agreement"] == 1.0
    from pipeline.build.accuracy.metrics import greedy_stats

    assert greedy_stats([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])["greedy_prefix_agreement"] == 0.75
