import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Manifest
from pipeline.build.passes.lm_head import last_token_logits
from pipeline.build.stages import checkpoint, export
from pipeline.errors import ExportError, InputError
from tests.tiny import make_checkpoint, make_sentence_transformer


def _export(folder, cache):
    target = load_target("cpu-avx2")
    manifest = Manifest(
        model_name="m",
        source=str(folder),
        cache_dir=str(cache),
        artifacts_dir="",
        validation_path="",
        calibration_path="",
    )
    return export.run(checkpoint.run(manifest, target), target)


def test_onnx_from_checkpoint_matches_pytorch_on_dynamic_shapes(tiny_bert, tmp_path):
    manifest = _export(tiny_bert, tmp_path)
    record = manifest.stage("export")
    session = ort.InferenceSession(str(record.output("model.onnx")), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask", "token_type_ids"]
    model = export.load_torch_model(manifest.checkpoint)
    for batch, length in ((1, 3), (3, 17)):
        ids = torch.randint(1000, 2000, (batch, length))
        mask = torch.ones_like(ids)
        mask[0, length // 2 :] = 0
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
        with torch.inference_mode():
            hidden = model(**feeds).last_hidden_state
        m = mask.unsqueeze(-1).float()
        expected = ((hidden * m).sum(1) / m.sum(1)).numpy()
        got = session.run(None, {k: v.numpy() for k, v in feeds.items()})[0]
        np.testing.assert_allclose(got, expected, atol=1e-4)


def test_onnx_from_checkpoint_is_cached_by_content(tiny_bert, tmp_path):
    first = _export(tiny_bert, tmp_path).stage("export")
    second = _export(tiny_bert, tmp_path).stage("export")
    assert not first.reused and second.reused and first.key == second.key


def test_onnx_from_checkpoint_rebuilds_truncated_cache_entry(tiny_bert, tmp_path):
    first = _export(tiny_bert, tmp_path).stage("export")
    path = first.output("model.onnx")
    path.write_bytes(path.read_bytes()[:1000])
    again = _export(tiny_bert, tmp_path).stage("export")
    assert not again.reused
    ort.InferenceSession(str(again.output("model.onnx")), providers=["CPUExecutionProvider"])


def test_onnx_from_checkpoint_refuses_nan_weights(tmp_path):
    folder = make_checkpoint(tmp_path / "nan", "bert")
    model = export.load_torch_model(
        checkpoint.run(Manifest("m", str(folder), "", "", "", ""), load_target("cpu-avx2")).checkpoint
    )
    with torch.no_grad():
        model.embeddings.word_embeddings.weight.fill_(float("nan"))
    model.save_pretrained(folder)
    with pytest.raises(ExportError, match="outputs NaN or inf"):
        _export(folder, tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("model.onnx"))


def test_a_model_that_fails_on_the_probe_input_is_a_one_line_export_error(tmp_path):
    import transformers

    from pipeline.build.stages.checkpoint import default_checkpoint
    from tests.tiny import TOKENIZER_FILES

    # Nystromformer's landmarks need sequences of `segment_means_seq_len` tokens: its own forward fails on the probe.
    folder = tmp_path / "nystromformer"
    settings = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    config = transformers.AutoConfig.for_model("nystromformer", num_landmarks=4, segment_means_seq_len=128, **settings)
    transformers.AutoModel.from_config(config).eval().save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copyfile(default_checkpoint() / name, folder / name)
    with pytest.raises(ExportError, match=r"\(nystromformer\) did not export and run on a probe input") as err:
        _export(folder, tmp_path / "cache")
    assert "\n" not in str(err.value) and "RuntimeError" in str(err.value)
    assert not list((tmp_path / "cache").rglob("model.onnx"))


def test_onnx_from_checkpoint_refuses_corrupt_weights(tmp_path, tiny_bert):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_bert, folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="model.safetensors is not a safetensors file .*save the checkpoint again"):
        _export(folder, tmp_path / "cache")


def _st_encode(folder, texts):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu", local_files_only=True).encode(texts, convert_to_numpy=True)


def _graph_embeddings(record, folder, texts):
    from transformers import AutoTokenizer

    session = ort.InferenceSession(str(record.output("model.onnx")), providers=["CPUExecutionProvider"])
    enc = AutoTokenizer.from_pretrained(folder)(texts, padding=True, return_tensors="np")
    return session.run(None, {i.name: enc[i.name] for i in session.get_inputs()})[0]


def test_onnx_from_checkpoint_loads_a_dense_saved_as_bin_only(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    dense = folder / "2_Dense"
    torch.save(load_file(dense / "model.safetensors"), dense / "pytorch_model.bin")
    (dense / "model.safetensors").unlink()
    texts = ["a short one", "and a longer second text, so that the batch pads"]
    got = _graph_embeddings(_export(folder, tmp_path / "cache").stage("export"), folder, texts)
    assert got.shape == (2, 16)
    np.testing.assert_allclose(got, _st_encode(folder, texts), atol=1e-5)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_onnx_from_checkpoint_refuses_a_dense_bin_that_would_run_code(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    dense = folder / "2_Dense"
    marker = tmp_path / "ran"
    torch.save({"linear.weight": _RunsCode(marker)}, dense / "pytorch_model.bin")
    (dense / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"could not load the Dense weights in .*2_Dense \(UnpicklingError"):
        _export(folder, tmp_path / "cache")
    assert not marker.exists()


def test_onnx_from_checkpoint_refuses_dense_weights_of_the_wrong_shape(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    weights = folder / "2_Dense" / "model.safetensors"
    save_file({"linear.weight": torch.zeros(16, 32)}, weights)  # no bias, which the config asks for
    with pytest.raises(InputError, match=r"Dense weights in .*2_Dense are \{'linear.weight': \(16, 32\)\}"):
        _export(folder, tmp_path / "cache")


def test_export_rebuilds_when_a_dense_weight_changes(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    texts = ["the same text twice"]
    first = _export(folder, tmp_path / "cache").stage("export")
    before = _graph_embeddings(first, folder, texts)
    weights = folder / "2_Dense" / "model.safetensors"
    save_file({k: -v for k, v in load_file(weights).items()}, weights)
    second = _export(folder, tmp_path / "cache").stage("export")
    assert not second.reused and second.key != first.key
    after = _graph_embeddings(second, folder, texts)
    np.testing.assert_allclose(after, _st_encode(folder, texts), atol=1e-5)
    assert np.abs(after - before).max() > 1e-3


def test_onnx_from_causal_lm_has_kv_cache_io_and_last_token_logits(tiny_gpt2, tmp_path):
    record = _export(tiny_gpt2, tmp_path).stage("export")
    assert record.metrics["last_token_logits"] and record.metrics["probe_max_abs_diff"] < 1e-4
    session = ort.InferenceSession(str(record.output("model.onnx")), providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in session.get_inputs()}
    assert inputs["input_ids"] == ["batch_size", "sequence_length"]
    assert inputs["past_key_values.0.key"] == ["batch_size", 4, "past_sequence_length", 16]
    assert [o.name for o in session.get_outputs()] == ["logits"] + [
        f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value")
    ]
    spec = record.metrics["spec"]
    assert spec["past"] == [f"past_key_values.{i}.{kv}" for i in range(2) for kv in ("key", "value")]
    assert spec["eos_token_ids"] == [0] and spec["defaults"]["do_sample"] is False
    # One graph serves the prompt and each new token: the cache it returns, fed back, gives PyTorch's logits.
    model = export.load_torch_model(
        checkpoint.run(Manifest("m", str(tiny_gpt2), "", "", "", ""), load_target("cpu-avx2")).checkpoint
    )
    ids = np.array([[5, 17, 99, 300, 42, 7]], dtype=np.int64)
    empty = {n: np.zeros((1, 4, 0, 16), np.float32) for n in spec["past"]}

    def step(tokens, start):
        feeds = {
            "input_ids": tokens,
            "attention_mask": np.ones((1, start + tokens.shape[1]), np.int64),
            "position_ids": np.arange(start, start + tokens.shape[1])[None],
            **past,
        }
        logits, *present = session.run(None, feeds)
        assert logits.shape == (1, 1, 512)  # the last position only
        return logits[0, -1], dict(zip(spec["past"], present, strict=True))

    past = empty
    first, past = step(ids[:, :4], 0)
    second, past = step(ids[:, 4:5], 4)
    third, past = step(ids[:, 5:6], 5)
    assert past["past_key_values.1.value"].shape == (1, 4, 6, 16)
    with torch.inference_mode():
        full = model(torch.from_numpy(ids)).logits[0].numpy()
    for got, position in ((first, 3), (second, 4), (third, 5)):
        np.testing.assert_allclose(got, full[position], atol=1e-4)


def test_a_decoder_export_loads_its_pytorch_model_only_after_optimum_wrote_the_graph(tiny_gpt2, tmp_path, monkeypatch):
    # Two copies of a model's weights at once (this stage's and optimum's) was most of a 1B export's peak memory.
    written_first = []
    load = export.load_torch_model

    def loading(checkpoint):
        written_first.append(any(tmp_path.rglob("optimum/model.onnx")))
        return load(checkpoint)

    monkeypatch.setattr(export, "load_torch_model", loading)
    _export(tiny_gpt2, tmp_path)
    assert written_first == [True]


def test_last_token_logits_leaves_other_graphs_alone():
    import onnx

    graph = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Relu", ["x"], ["logits"])],
            "g",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 3])],
            [onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [1, 2, 3])],
        )
    )
    assert last_token_logits(graph) is False and len(graph.graph.node) == 1


def test_onnx_from_causal_lm_refuses_generation_settings_it_cannot_follow(tiny_gpt2, tmp_path):
    folder = tmp_path / "beams"
    shutil.copytree(tiny_gpt2, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "num_beams": 4, "no_repeat_ngram_size": 3}))
    with pytest.raises(ExportError, match=r"sets no_repeat_ngram_size, num_beams, which the runtime's generate\(\)"):
        _export(folder, tmp_path / "cache")


@pytest.mark.parametrize("model_type", ["roberta", "deberta-v2"])
def test_onnx_from_checkpoint_feeds_only_the_inputs_the_graph_reads(tmp_path, model_type):
    # Both borrow BERT's tokenizer, which makes token_type_ids: RoBERTa has one segment type (a pair's ones would
    # index past it), and tracing DeBERTa-v2 (no segment embedding) drops the input from the graph.
    folder = make_checkpoint(tmp_path / model_type, model_type)
    record = _export(folder, tmp_path / "cache").stage("export")
    session = ort.InferenceSession(str(record.output("model.onnx")), providers=["CPUExecutionProvider"])
    inputs = [i.name for i in session.get_inputs()]
    assert inputs == record.metrics["spec"]["inputs"] == ["input_ids", "attention_mask"]


def test_graph_inputs_follow_the_graph_and_refuse_one_no_tokenizer_makes(tmp_path):
    import onnx

    from pipeline.build.inputs.architectures.encoders import graph_inputs

    def session(names):
        ints = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.INT64, [1, 2]) for n in names]
        graph = onnx.helper.make_graph(
            [onnx.helper.make_node("Add", names[:2], ["y"])],
            "g",
            ints,
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [1, 2])],
        )
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
        path = tmp_path / f"{len(names)}.onnx"
        onnx.save(model, str(path))
        return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    offered = ["input_ids", "attention_mask", "token_type_ids"]
    assert graph_inputs(session(["input_ids", "attention_mask"]), offered) == ["input_ids", "attention_mask"]
    with pytest.raises(ValueError, match=r"takes \['position_ids'\], which the tokenizer does not make"):
        graph_inputs(session(["input_ids", "position_ids"]), offered)


def test_onnx_from_causal_lm_keeps_weights_in_a_data_file_when_over_the_limit(tmp_path, monkeypatch):
    from pipeline.build import onnx_files
    from pipeline.build.stages import optimize
    from tests.tiny import make_decoder

    monkeypatch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)
    manifest = _export(make_decoder(tmp_path / "tiny-llama", "llama"), tmp_path / "cache")
    record = manifest.stage("export")
    graph = record.output("model.onnx")
    assert onnx_files.graph_files(graph) == [graph, graph.parent / "model.onnx.data"]
    assert "model.onnx.data" in record.outputs  # the cache records it (and checks its sha256 on reuse)
    assert record.metrics["attention"]["op"] == "GroupQueryAttention"
    assert record.metrics["probe_max_abs_diff"] <= 1e-3  # probed on the pair, against PyTorch
    optimized = optimize.run(manifest, load_target("cpu-fp32")).stage("optimize").output("model.onnx")
    assert onnx_files.graph_files(optimized) == [optimized, optimized.parent / "model.onnx.data"]
