"""Text-to-text end to end: tiny random T5, BART, Marian and M2M100 checkpoints through check, build (search,
gate), publish, load and `pipeline generate`, against transformers' greedy generate. Real parts: the exporter, ONNX
Runtime, transformers as the reference."""

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from pipeline.build.table import build
from pipeline.cli import main
from pipeline.errors import InputError
from pipeline.runtime import load
from tests.conftest import needs_triton, tampered_copy, triton_answers
from tests.tiny_text2text import FAMILIES, make_text2text

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Please bring three apples from the market, and some bread for the children.",
    "Hello there.",
]


def _transformers_ids(folder, texts: list[str], new_tokens: int, **settings) -> list[list[int]]:
    """transformers' new tokens of each text (greedy, or as `settings` say), one at a time, after the decoder's
    start token."""
    import torch
    import transformers

    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    eos = model.generation_config.eos_token_id
    rows = []
    for text in texts:
        source = tokenizer([text], return_tensors="pt", return_token_type_ids=False)
        with torch.inference_mode():
            ids = model.generate(**source, do_sample=False, max_length=1 + new_tokens, **({"num_beams": 1} | settings))
        ids = ids[0].tolist()[1:]
        rows.append(ids[: ids.index(eos)] if eos in ids else ids)
    return rows


def _build(folder, tmp_path, target="cpu-avx2"):
    return build(folder, target, artifacts_dir=tmp_path / "artifacts", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_tiny_model_builds_at_fp32_and_generates_token_for_token_as_transformers(model_type, tmp_path):
    folder = make_text2text(tmp_path / f"tiny-{model_type}", model_type)
    manifest = _build(folder, tmp_path)
    rows = {r["name"]: r for r in manifest.stage("search").metrics["candidates"]}
    assert rows["ort-fp32-text2text"]["status"] == "passed"
    assert rows["ort-fp32-text2text"]["greedy_prefix_agreement"] == 1.0
    for quantized in ("ort-int8-weights-text2text", "ort-int8-text2text"):  # built and judged for every family
        assert rows[quantized]["status"] in ("passed", "missed")
        assert 0.0 <= rows[quantized]["teacher_top1_agreement"] <= 1.0
    model = load(manifest.published.path)
    assert model.task == "text2text-generation"
    expected = _transformers_ids(folder, TEXTS, 10)
    assert model.generate_ids(TEXTS, max_new_tokens=10) == expected  # batched: padded sources
    assert [model.generate_ids([t], max_new_tokens=10)[0] for t in TEXTS] == expected
    assert len({tuple(r) for r in expected}) > 1 or model_type == "marian"  # the output depends on the input
    texts = model.generate(TEXTS, max_new_tokens=10)
    assert texts == [model.tokenizer.decode(r, skip_special_tokens=True).strip() for r in expected]


@pytest.fixture(scope="module")
def bart_build(tmp_path_factory):
    folder = make_text2text(tmp_path_factory.mktemp("bart") / "tiny-bart", "bart")
    return folder, _build(folder, tmp_path_factory.mktemp("bart-build"))


@pytest.fixture(scope="module")
def t5_build(tmp_path_factory):
    folder = make_text2text(tmp_path_factory.mktemp("t5") / "tiny-t5", "t5")
    return folder, _build(folder, tmp_path_factory.mktemp("t5-build"))


BEAM_SETTINGS = [
    {"num_beams": 4},
    {"num_beams": 3, "length_penalty": 2.0, "early_stopping": True},
    {"num_beams": 2, "length_penalty": -1.0, "early_stopping": "never", "no_repeat_ngram_size": 2},
    {"num_beams": 5, "min_length": 6},
]


@pytest.mark.parametrize("settings", BEAM_SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("family", ["bart", "t5"])
def test_beam_search_writes_transformers_tokens(family, settings, request):
    folder, manifest = request.getfixturevalue(f"{family}_build")
    model = load(manifest.published.path)
    model.spec = {**model.spec, **{k: v for k, v in settings.items() if k != "num_beams"}}
    expected = _transformers_ids(folder, TEXTS, 12, **settings)
    assert model.generate_ids(TEXTS, max_new_tokens=12, num_beams=settings["num_beams"]) == expected
    if family == "bart":  # here the beams find other outputs than greedy decoding: the search is exercised
        assert model.generate_ids(TEXTS, max_new_tokens=12) != expected


def test_the_artifact_holds_two_verified_graphs_and_refuses_a_tampered_decoder(bart_build, tmp_path):
    from pipeline.errors import ArtifactError

    folder = bart_build[1].published.path
    published = json.loads(open(f"{folder}/manifest.json").read())
    assert {"encoder.onnx", "decoder.onnx", "tokenizer.json"} <= set(published["files"])
    with pytest.raises(ArtifactError, match="decoder.onnx"):
        load(tampered_copy(folder, tmp_path, "decoder.onnx"))


def test_a_quantized_candidate_is_built_judged_and_timed_for_each_graph(bart_build):
    rows = {r["name"]: r for r in bart_build[1].stage("search").metrics["candidates"]}
    for name in ("ort-int8-weights-text2text", "ort-int8-text2text"):
        row = rows[name]
        assert row["status"] in ("passed", "missed") and 0.0 <= row["teacher_top1_agreement"] <= 1.0
        assert 0.0 <= row["greedy_prefix_agreement"] <= 1.0


def test_a_quantized_build_publishes_int8_decoder_weights_that_run_as_measured(tmp_path):
    import onnx

    from tests.conftest import write_target

    folder = make_text2text(tmp_path / "tiny-t5", "t5")
    loose = {"greedy_match": 0.0, "greedy_prefix_agreement": 0.0, "teacher_top1_agreement": 0.5}
    candidate = {"name": "int8-weights", "family": "text2text", "engine": "onnxruntime", "precision": "int8"}
    candidate |= {"quantize": "weight_only", "bits": 8, "blocks": "zero_point", "block_size": 16, "accuracy": loose}
    target = write_target(tmp_path, "t2t-int8", "cpu-avx2", candidates=[candidate])
    manifest = _build(folder, tmp_path, target=str(target))
    artifact = Path(manifest.published.path)
    decoder = {n.op_type for n in onnx.load(str(artifact / "decoder.onnx")).graph.node}
    assert "MatMulNBits" in decoder  # the decoder's weights in int8 blocks; the encoder stays fp32
    assert "MatMulNBits" not in {n.op_type for n in onnx.load(str(artifact / "encoder.onnx")).graph.node}
    [row] = manifest.stage("search").metrics["candidates"]
    model = load(artifact)
    expected = _transformers_ids(folder, TEXTS, 10)
    got = model.generate_ids(TEXTS, max_new_tokens=10)
    agreement = np.mean([g[:1] == e[:1] for g, e in zip(got, expected, strict=True)])
    assert row["status"] == "passed" and row["teacher_top1_agreement"] >= 0.5 and agreement >= 1 / 3


def test_pipeline_generate_writes_each_output_and_bad_input_gets_one_line(bart_build):
    folder = bart_build[1].published.path
    model = load(folder)
    result = CliRunner().invoke(main, ["generate", str(folder), TEXTS[0], "--max-new-tokens", "6"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == model.generate(TEXTS[0], max_new_tokens=6)
    beams = CliRunner().invoke(main, ["generate", str(folder), TEXTS[0], "--max-new-tokens", "6", "--num-beams", "3"])
    assert beams.exit_code == 0 and beams.output.strip() == model.generate(TEXTS[0], max_new_tokens=6, num_beams=3)
    sampled = CliRunner().invoke(main, ["generate", str(folder), TEXTS[0], "--temperature", "0.7"])
    assert sampled.exit_code != 0 and "--temperature apply to text-generation artifacts only" in sampled.output
    with pytest.raises(InputError, match="num_beams=0 must be an int from 1 to 16"):
        model.generate(TEXTS, num_beams=0)
    with pytest.raises(InputError, match="over the model's 128"):
        model.generate(["word " * 300])
    with pytest.raises(InputError, match="max_new_tokens"):
        model.generate(TEXTS, max_new_tokens=0)
    with pytest.raises(InputError, match="takes a list of strings"):
        model.generate_ids(b"bytes")
    assert model.generate(TEXTS[:1], max_new_tokens=3) == [model.generate(TEXTS[0], max_new_tokens=3)]


def test_pipeline_check_names_the_family_and_its_candidates(bart_build):
    from pipeline.ops.check import check

    result = CliRunner().invoke(main, ["check", str(bart_build[0]), "--target", "cpu-avx2"])
    assert result.exit_code == 0 and "text2text" in result.output, result.output
    report = check(str(bart_build[0]), "cpu-avx2")
    assert (report["family"], report["task"]) == ("text2text", "text2text-generation")
    assert [c["name"] for c in report["candidates"]] == [
        "ort-fp32-text2text",
        "ort-int8-weights-text2text",
        "ort-int8-text2text",
    ]


def test_a_target_without_text2text_candidates_refuses_before_exporting(bart_build, tmp_path):
    from pipeline.errors import TargetError

    with pytest.raises(TargetError, match="lists no \\[\\[candidates\\]\\] for text2text models"):
        _build(bart_build[0], tmp_path, target="cpu-fp32")


def test_the_gate_compares_tokens_not_texts():
    from pipeline.build.text2text.gate import text2text_stats

    reference = {"tokens": [[5, 6, 7], []], "top1": [np.array([5, 6, 7]), np.array([], dtype=np.int64)]}
    same = text2text_stats(reference, reference)
    assert same == {"greedy_match": 1.0, "greedy_prefix_agreement": 1.0, "teacher_top1_agreement": 1.0}
    changed = {"tokens": [[5, 9, 7], []], "top1": [np.array([5, 9, 7]), np.array([], dtype=np.int64)]}
    stats = text2text_stats(reference, changed)
    assert stats["greedy_match"] == 0.5 and stats["greedy_prefix_agreement"] == pytest.approx((1 / 3 + 1) / 2)
    assert stats["teacher_top1_agreement"] == pytest.approx(2 / 3)


@pytest.mark.slow  # a live Ray Serve deployment
def test_ray_serve_answers_each_text_and_a_bad_request_alone(bart_build):
    pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")
    from tests.conftest import served_answers

    folder = bart_build[1].published.path
    bodies = [json.dumps({"texts": TEXTS}).encode(), json.dumps({"texts": ["word " * 300]}).encode(), b"{"]
    answers = served_answers(folder, bodies, "application/json")
    assert answers[0] == (200, {"outputs": load(folder).generate(TEXTS)})
    assert answers[1][0] == 400 and "over the model's 128" in answers[1][1]["error"]
    assert answers[2][0] == 400


@pytest.mark.slow  # a live tritonserver
@needs_triton
def test_triton_answers_each_text_as_the_runtime_and_an_overlong_one_alone(bart_build, tmp_path):
    folder = bart_build[1].published.path
    rows = [TEXTS[0].encode(), ("word " * 300).encode(), TEXTS[1].encode()]
    kind, answers = triton_answers(folder, tmp_path, rows)
    assert kind == "TEXT"
    assert [answers[0][0].decode(), answers[2][0].decode()] == load(folder).generate([TEXTS[0], TEXTS[1]])
    assert answers[1].status() == "400" and "over the model's" in answers[1].message()
