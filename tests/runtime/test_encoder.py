"""The encoder runtime's question answering: a context longer than the model is read in overlapping windows and
answered as transformers' question-answering pipeline answers it."""

import random

import pytest
import transformers

from pipeline.errors import InputError
from pipeline.runtime import load
from tests.conftest import _publish, write_target
from tests.tiny import make_checkpoint

QUESTION = "Which word comes after the river?"
WORDS = (
    "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
    "romeo sierra tango uniform victor whiskey xray yankee zulu"
).split()


def _context(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + ("," if rng.random() < 0.1 else "") for _ in range(words))


@pytest.fixture(scope="module")
def qa(tmp_path_factory, texts_file, calibration_file):
    """A tiny random BERT question-answering checkpoint, its cpu-fp32 artifact built for a target that refuses
    overlong input, the loaded model, and transformers' pipeline on the checkpoint."""
    root = tmp_path_factory.mktemp("qa")
    folder = make_checkpoint(root / "tiny-bert-qa", "bert", "question-answering")
    target = write_target(root, "cpu-fp32-refuse", base="cpu-fp32", shapes__overlong="refuse")
    model = load(_publish(folder, texts_file, calibration_file, root, str(target)))
    pipe = transformers.pipeline("question-answering", model=str(folder), tokenizer=str(folder), device="cpu")
    return folder, model, pipe


def _transformers_answer(pipe, model, context: str, doc_stride: int, max_answer_length: int) -> dict:
    # The runtime cuts spans at token boundaries: transformers' align_to_words=False.
    return pipe(
        question=QUESTION,
        context=context,
        doc_stride=doc_stride,
        max_seq_len=model.max_length,
        max_answer_len=max_answer_length,
        align_to_words=False,
    )


def _window_ends(folder, context: str, doc_stride: int, max_length: int) -> list[int]:
    """The character where each window's piece of the context ends, as transformers' tokenizer cuts them."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    enc = tokenizer(
        QUESTION,
        context,
        truncation="only_second",
        max_length=max_length,
        stride=doc_stride,
        return_overflowing_tokens=True,
        return_offsets_mapping=True,
    )
    return [
        max(end for (_, end), s in zip(enc["offset_mapping"][w], enc.sequence_ids(w), strict=True) if s == 1)
        for w in range(len(enc["input_ids"]))
    ]


@pytest.mark.parametrize("doc_stride", [16, 48])
def test_answer_gives_transformers_pipeline_span_when_context_spans_several_windows(qa, doc_stride):
    folder, model, pipe = qa
    contexts = [_context(seed, 300) for seed in range(6)]
    got = model.answer([QUESTION] * len(contexts), contexts, max_answer_length=7, doc_stride=doc_stride)
    past_first, last_only = 0, 0
    for context, answer in zip(contexts, got, strict=True):
        ends = _window_ends(folder, context, doc_stride, model.max_length)
        assert len(ends) >= 3
        expected = _transformers_answer(pipe, model, context, doc_stride, 7)
        assert (answer["answer"], answer["start"], answer["end"]) == (
            expected["answer"],
            expected["start"],
            expected["end"],
        )
        assert answer["score"] == pytest.approx(expected["score"], rel=1e-4)
        assert answer["answer"] == context[answer["start"] : answer["end"]]
        past_first += answer["end"] > ends[0]
        last_only += answer["end"] > ends[-2]
    # Truncation to one window could find none of these; the last window alone holds at least one.
    assert past_first >= 3 and last_only >= 1


def test_answer_reads_a_long_context_when_the_target_refuses_overlong_input(qa):
    _, model, _ = qa
    context = _context(0, 300)
    with pytest.raises(InputError, match="refuses overlong input"):
        model.run([(QUESTION, context)])
    [answer] = model.answer([QUESTION], [context], doc_stride=32)
    assert answer["answer"] and answer["answer"] == context[answer["start"] : answer["end"]]


def test_answer_of_a_short_context_is_its_best_span_scored_as_transformers_scores_it(qa):
    _, model, pipe = qa
    context = "The cat sat on the mat by the door, and the dog slept in the garden all afternoon."
    [answer] = model.answer([QUESTION], [context], max_answer_length=5)
    [logits] = model.run([(QUESTION, context)])
    enc = model.tokenizer.encode(QUESTION, context)
    in_context = [i for i, s in enumerate(enc.sequence_ids) if s == 1]
    first, last = max(
        ((i, j) for i in in_context for j in in_context if i <= j < i + 5),
        key=lambda ij: logits[ij[0], 0] + logits[ij[1], 1],
    )
    assert (answer["start"], answer["end"]) == (enc.offsets[first][0], enc.offsets[last][1])
    expected = _transformers_answer(pipe, model, context, 64, 5)
    assert (answer["answer"], answer["start"], answer["end"]) == (
        expected["answer"],
        expected["start"],
        expected["end"],
    )
    assert answer["score"] == pytest.approx(expected["score"], rel=1e-4)
    # A context that fits gives the same answer whatever the stride.
    assert model.answer([QUESTION], [context], max_answer_length=5, doc_stride=1) == [answer]


@pytest.mark.parametrize("context", ["", "   ", "\x00"])
def test_a_context_without_tokens_answers_nothing_never_a_span_of_the_question(qa, context):
    _, model, _ = qa
    assert model.answer([QUESTION], [context]) == [{"answer": "", "start": 0, "end": 0, "score": 0.0}]


def test_answer_default_stride_fits_a_question_that_leaves_little_room(qa):
    _, model, _ = qa
    question = " ".join(["word"] * 100)  # leaves 25 of the model's 128 tokens, under the default stride of 64
    [answer] = model.answer([question], [_context(1, 200)])
    assert answer["answer"]


@pytest.mark.parametrize(
    ("doc_stride", "message"),
    [
        (0, r"^answer\(doc_stride=0\) must be a positive int"),
        (-3, r"^answer\(doc_stride=-3\) must be a positive int"),
        (2.5, r"^answer\(doc_stride=2.5\) must be a positive int"),
        (True, r"^answer\(doc_stride=True\) must be a positive int"),
        (
            118,
            r"^answer\(doc_stride=118\) is not under the 118 tokens question 0 leaves .* pass doc_stride=117 or less$",
        ),
    ],
)
def test_answer_raises_one_line_input_error_when_doc_stride_is_bad(qa, doc_stride, message):
    _, model, _ = qa
    with pytest.raises(InputError, match=message) as err:
        model.answer([QUESTION], [_context(0, 300)], doc_stride=doc_stride)
    assert "\n" not in str(err.value)


def test_answer_raises_one_line_input_error_when_the_question_fills_the_model(qa):
    _, model, _ = qa
    question = " ".join(["word"] * 125)
    with pytest.raises(InputError, match=r"^answer\(\) question 1 is 125 tokens, .*shorten the question$") as err:
        model.answer([QUESTION, question], ["a context", "another context"])
    assert "\n" not in str(err.value)
