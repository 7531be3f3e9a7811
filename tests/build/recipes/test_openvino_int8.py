"""NNCF int8 with MatMul kinds kept out of int8: the ranking by local quantization error, and the bisection that
keeps the fewest kinds with which a model passes, run with real NNCF and OpenVINO on the tiny BERT."""

import contextlib
import io

import numpy as np
import pytest

from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Manifest, candidate_model
from pipeline.build.recipes.openvino_int8 import (
    RANKING_FEEDS,
    _activation_quantizers,
    _kind,
    int8_with_kinds_kept,
    kept_wide,
    kind_ranking,
    matmul_kinds,
    nncf_int8,
)
from pipeline.build.search.candidates import CannotWin
from pipeline.build.stages import checkpoint, export
from tests.conftest import CALIBRATION_TEXTS, SMALL_TEXTS
from tests.tiny import make_checkpoint

ov = pytest.importorskip("openvino")


@pytest.fixture(scope="module")
def biased_bert(tmp_path_factory):
    """A tiny BERT whose linear layers have random biases: a random BERT's are zero, OpenVINO drops a zero bias,
    and NNCF's bias correction would have nothing to correct."""
    import torch
    import transformers

    folder = make_checkpoint(tmp_path_factory.mktemp("biased") / "tiny-bert")
    model = transformers.AutoModel.from_pretrained(folder)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias") and "LayerNorm" not in name:
                parameter.normal_(0, 0.05)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def plain(biased_bert, texts_file, calibration_file, tmp_path_factory):
    """The tiny BERT's plain export (with biases) as an OpenVINO model, and one feed per calibration text."""
    target = load_target("cpu-avx2")
    cache = tmp_path_factory.mktemp("nncf") / "cache"
    manifest = Manifest("tiny", str(biased_bert), str(cache), "", str(texts_file), str(calibration_file))
    for stage in (checkpoint.run, export.run):
        manifest = stage(manifest, target)
    onnx_path = manifest.stage("export").output("model.onnx")
    probe = candidate_model(manifest, target, onnx_path)
    feeds = [probe.feeds(probe.encode([text])) for text in CALIBRATION_TEXTS + SMALL_TEXTS]
    return ov.convert_model(str(onnx_path)), feeds


def _int8_kinds(model) -> set[str]:
    """The kinds of the MatMuls that an activation quantizer feeds."""
    return {_kind(name) for _, names in _activation_quantizers(model) for name in names}


def test_kinds_group_each_layers_matmuls_and_the_ranking_covers_the_quantized_ones(plain):
    model, feeds = plain
    kinds = matmul_kinds(model)
    assert all("layer.*" in kind for kind in kinds) and len(set(map(len, kinds.values()))) == 1
    quantized = kept_wide(nncf_int8(model, feeds), model, [])
    ranking = kind_ranking(quantized, feeds[:RANKING_FEEDS])
    assert set(ranking) == _int8_kinds(quantized) and set(ranking) <= set(kinds) and len(ranking) >= 4
    assert not _int8_kinds(model)  # quantizing works on a copy


def _bias(model, matmul: str) -> np.ndarray:
    """The constant of the Add after the MatMul named `matmul` in `model`."""
    op = next(o for o in model.get_ops() if o.get_friendly_name() == matmul)
    add = next(u.get_node() for u in op.output(0).get_target_inputs())
    return next(v.get_node().get_data() for v in add.input_values() if v.get_node().get_type_name() == "Constant")


def test_a_form_with_kinds_kept_is_what_nncf_ignoring_them_gives(plain):
    """Bypassing the kept MatMuls' quantizers in the one quantized model gives NNCF's own model with those
    MatMuls in its ignored scope: the same int8 MatMuls, and the same outputs."""
    import nncf

    model, feeds = plain
    quantized = nncf_int8(model, feeds)
    kinds, ranking = matmul_kinds(model), kind_ranking(kept_wide(quantized, model, []), feeds[:RANKING_FEEDS])
    kept = [name for kind in ranking[:2] for name in kinds[kind]]
    # NNCF corrected the kept MatMuls' biases for their quantization: the form must not keep those corrections.
    assert any(not np.array_equal(_bias(quantized, name), _bias(model, name)) for name in kept)
    ours = kept_wide(quantized, model, kept)
    with contextlib.redirect_stdout(io.StringIO()):
        theirs = nncf.quantize(
            model.clone(),
            nncf.Dataset(feeds),
            model_type=nncf.ModelType.TRANSFORMER,
            subset_size=len(feeds),
            ignored_scope=nncf.IgnoredScope(names=kept),
        )
    assert _int8_kinds(ours) == _int8_kinds(theirs) == set(ranking[2:])
    core = ov.Core()
    run_ours, run_theirs = (core.compile_model(m, "CPU", {"INFERENCE_PRECISION_HINT": "f32"}) for m in (ours, theirs))
    for feed in feeds[:8]:
        np.testing.assert_allclose(run_ours(feed)[0], run_theirs(feed)[0], atol=1e-4)
    assert not [
        op
        for op in ours.get_ops()
        if op.get_type_name() == "FakeQuantize" and op.input_value(0).get_node().get_type_name() == "Constant"
    ]


def test_a_kept_matmul_gets_its_exported_bias_back():
    """NNCF's bias correction changes a quantized MatMul's bias; a MatMul kept out of int8 gets the exported one.
    (The tiny BERT's biases are zero, and OpenVINO drops them, so this model is made here.)"""
    from openvino import opset13 as ops

    rng = np.random.default_rng(0)
    x = ops.parameter([1, 8], np.float32, name="x")
    matmul = ops.matmul(x, ops.constant(rng.normal(size=(8, 4)).astype(np.float32)), False, False, name="dense")
    add = ops.add(matmul, ops.constant(np.arange(4, dtype=np.float32)), name="bias")
    plain = ov.Model([add], [x])
    corrected = plain.clone()
    bias = {op.get_friendly_name(): op for op in corrected.get_ops()}["bias"]
    bias.input(1).replace_source_output(ops.constant(np.full(4, 9.0, dtype=np.float32)).output(0))
    feed = {"x": rng.normal(size=(1, 8)).astype(np.float32)}
    compiled = [ov.Core().compile_model(m, "CPU") for m in (plain, corrected, kept_wide(corrected, plain, ["dense"]))]
    want, changed, got = (c(feed)[0] for c in compiled)
    assert not np.allclose(changed, want) and np.allclose(got, want)
    assert np.allclose(ov.Core().compile_model(kept_wide(corrected, plain, []), "CPU")(feed)[0], changed)


def test_bisection_keeps_the_fewest_leading_kinds_that_pass(plain):
    model, feeds = plain
    ranking = kind_ranking(kept_wide(nncf_int8(model, feeds), model, []), feeds[:RANKING_FEEDS])
    needed = set(ranking[:2])
    kept_model, record = int8_with_kinds_kept(model, feeds, lambda m: not needed & _int8_kinds(m))
    assert record["kept_kinds"] == ranking[:2] and not needed & _int8_kinds(kept_model)
    assert _int8_kinds(kept_model) == set(ranking[2:])
    counts = [t["kept_kinds"] for t in record["tries"]]
    assert counts[:2] == [0, len(ranking)] and len(counts) <= 2 + len(ranking).bit_length()
    assert all(t["passed"] == (t["kept_kinds"] >= 2) for t in record["tries"])
    assert record["kept_nodes"] == 2 * len(next(iter(matmul_kinds(model).values())))


def test_no_fallback_when_full_int8_passes_and_every_kind_kept_when_nothing_does(plain):
    model, feeds = plain
    full, record = int8_with_kinds_kept(model, feeds, lambda m: True)
    assert record["kept_kinds"] == [] and record["tries"] == [{"kept_kinds": 0, "passed": True}] and _int8_kinds(full)
    kept, record = int8_with_kinds_kept(model, feeds, lambda m: False)
    assert not _int8_kinds(kept) and len(record["tries"]) == 2 and not any(t["passed"] for t in record["tries"])


def test_a_missed_try_that_cannot_win_stops_the_bisection(plain):
    model, feeds = plain
    ranking = kind_ranking(kept_wide(nncf_int8(model, feeds), model, []), feeds[:RANKING_FEEDS])
    needed = set(ranking[:-1])  # only every kind kept passes: the first middle misses
    judged, screened = [], []

    def passes(quantized) -> bool:
        judged.append(quantized)
        return not needed & _int8_kinds(quantized)

    def could_win(quantized) -> None:
        screened.append(_int8_kinds(quantized))
        if len(screened) > 1:
            raise CannotWin("its form is slower than fp32, which passed, at b1, b8", {})

    with pytest.raises(CannotWin):
        int8_with_kinds_kept(model, feeds, passes, could_win)
    assert len(judged) == 3  # all int8, every kind kept, then the middle, after which nothing could win
    assert screened == [set(ranking), set(ranking[len(ranking) // 2 :])]
