import shutil

import numpy as np
import onnxruntime as ort
import pytest
import torch

from pipeline import checkpoint, export
from pipeline.errors import ExportError, InputError
from pipeline.manifest import Manifest
from pipeline.targets import load_target

from .conftest import make_checkpoint


def _export(folder, cache):
    target = load_target("cpu-avx2")
    manifest = Manifest(
        model_name="m", source=str(folder), cache_dir=str(cache), artifacts_dir="", validation_path="",
        calibration_path="",
    )  # fmt: skip
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
    model = export.load_torch_model(checkpoint.run(
        Manifest("m", str(folder), "", "", "", ""), load_target("cpu-avx2")
    ).checkpoint)  # fmt: skip
    with torch.no_grad():
        model.embeddings.word_embeddings.weight.fill_(float("nan"))
    model.save_pretrained(folder)
    with pytest.raises(ExportError, match="outputs NaN or inf"):
        _export(folder, tmp_path / "cache")
    assert not list((tmp_path / "cache").rglob("model.onnx"))


def test_onnx_from_checkpoint_refuses_corrupt_weights(tmp_path, tiny_bert):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_bert, folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InputError, match="could not load the weights"):
        _export(folder, tmp_path / "cache")
