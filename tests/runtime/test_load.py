import json
import os
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import pytest

from pipeline.errors import ArtifactError, InputError
from pipeline.runtime import HostMismatchWarning, cpu_flags, load, verify_artifact
from tests.conftest import REPO, SMALL_TEXTS, _publish, edit_manifest, write_target
from tests.tiny import make_decoder


@pytest.mark.parametrize("kind", ["encoder", "decoder"])
def test_runtime_imports_no_heavy_packages(kind, request):
    published = request.getfixturevalue("published" if kind == "encoder" else "published_gpt2")
    use = "m.run(['hello there'])" if kind == "encoder" else "list(m.stream(['hello there'], max_new_tokens=4))"
    code = (
        "import sys; from pipeline.runtime import load; "
        f"m = load({str(published)!r}); {use}; "
        "heavy = ('torch', 'transformers', 'onnx', 'optimum', 'sentence_transformers'); "
        "print(sorted(k for k in heavy if k in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_load_runs_equal_to_one_by_one_when_bucketed(published):
    model = load(published)
    texts = ["short", "a much longer sentence that needs many more tokens than the others do", "mid length text"]
    together = model.run(texts, batch_size=3)
    alone = np.stack([model.run([t], batch_size=1)[0] for t in texts])
    np.testing.assert_allclose(together, alone, atol=2e-2)
    reordered = model.run(texts[::-1], batch_size=3)[::-1]
    np.testing.assert_allclose(reordered, together, atol=1e-6)  # each caller's row comes back in its place


def test_load_refuses_changed_model_byte(artifact_copy):
    model_file = artifact_copy / "model.onnx"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model\.onnx does not match its sha256"):
        load(artifact_copy)


def test_load_refuses_deleted_tokenizer(artifact_copy):
    (artifact_copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match=r"tokenizer\.json is missing"):
        load(artifact_copy)


@pytest.mark.parametrize("content", ['{"garbage": 1}', "not json", ""])
def test_load_raises_one_line_artifact_error_naming_the_file_when_tokenizer_is_corrupt(artifact_copy, content):
    from pipeline.runtime.artifact import sha256_file

    tokenizer = artifact_copy / "tokenizer.json"
    tokenizer.write_text(content)
    edit_manifest(artifact_copy, lambda m: m["files"].update({"tokenizer.json": sha256_file(tokenizer)}))
    verify_artifact(artifact_copy)  # the hashes hold: what fails is reading the tokenizer
    with pytest.raises(ArtifactError, match=r"tokenizer\.json is not a tokenizer the tokenizers library can read") as e:
        load(artifact_copy)
    assert "\n" not in str(e.value)


def test_load_refuses_edited_manifest(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m["validation"].update(cosine_min=1.0), reseal=False)
    with pytest.raises(ArtifactError, match=r"manifest\.json was edited after publishing"):
        load(artifact_copy)


def test_load_refuses_manifest_from_another_version(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m.update(version="v7"))
    with pytest.raises(
        ArtifactError, match=r"belongs to tiny-bert/v7/cpu-avx2-dynamic, but sits in tiny-bert/v1/cpu-avx2-dynamic"
    ):
        load(artifact_copy)


def test_load_refuses_symlink_pointing_outside(artifact_copy, tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_bytes((artifact_copy / "tokenizer.json").read_bytes())
    (artifact_copy / "tokenizer.json").unlink()
    os.symlink(outside, artifact_copy / "tokenizer.json")
    with pytest.raises(ArtifactError, match=r"tokenizer\.json is a symlink"):
        load(artifact_copy)


def test_load_refuses_unlisted_file(artifact_copy):
    (artifact_copy / "extra.onnx").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=r"'extra\.onnx' is not listed in the manifest"):
        load(artifact_copy)


@pytest.mark.parametrize("name", ["../model.onnx", "/etc/passwd", "a\nb", ".hidden", "x\x00y", ""])
def test_load_refuses_a_listed_name_that_is_not_a_plain_file_name_in_one_line(artifact_copy, name):
    edit_manifest(artifact_copy, lambda m: m["files"].update({name: "0" * 64}))
    with pytest.raises(ArtifactError, match="which is not a plain file name") as err:
        load(artifact_copy)
    assert "\n" not in str(err.value) and "\x00" not in str(err.value)


def test_load_of_a_model_or_version_folder_names_the_artifacts_inside(published):
    for folder, names in (
        (published.parent.parent, f"{published.parent.name}/{published.name}"),
        (published.parent, published.name),
    ):
        with pytest.raises(ArtifactError, match=f"It holds artifacts: pass one of them \\(.*{names}") as err:
            load(folder)
        assert "\n" not in str(err.value)
    with pytest.raises(ArtifactError, match="Pass the folder that holds manifest.json"):
        load(published / "manifest.json")


def test_load_refuses_missing_folder(tmp_path):
    with pytest.raises(ArtifactError, match="no artifact at"):
        load(tmp_path / "nothing")


def test_load_warns_or_refuses_when_host_lacks_flags(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m["target_spec"].update(required_cpu_flags=["avx2", "no_such_flag"]))
    with pytest.warns(HostMismatchWarning, match="lacks CPU flags no_such_flag"):
        load(artifact_copy)
    with pytest.raises(ArtifactError, match="lacks CPU flags no_such_flag"):
        load(artifact_copy, strict=True)


@pytest.mark.skipif("avx512f" in (cpu_flags() or ()), reason="this host has AVX-512")
def test_load_warns_for_avx512_artifact_on_avx2_host(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m["target_spec"].update(required_cpu_flags=["avx512f", "avx512bw"]))
    with pytest.warns(HostMismatchWarning, match="avx512bw, avx512f"):
        load(artifact_copy)


def test_load_warns_when_int8_kernels_differ_from_build_host(artifact_copy):
    flags = sorted(cpu_flags() or ())
    changed = [f for f in flags if f != "avx512_vnni"] if "avx512_vnni" in flags else flags + ["avx512_vnni"]
    edit_manifest(artifact_copy, lambda m: m["host"].update(cpu_flags=changed))
    with pytest.warns(HostMismatchWarning, match="differ in avx512_vnni"):
        load(artifact_copy)


def test_load_no_warning_when_host_has_flags(published):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(published)


@pytest.mark.parametrize(
    "texts, message",
    [
        ("one string", "got a single str"),
        ([], "empty list"),
        (["fine", 3], "input 1 is int"),
        (None, "got NoneType"),
    ],
)
def test_model_run_refuses_bad_input(published, texts, message):
    with pytest.raises(InputError, match=message):
        load(published).run(texts)


def test_model_run_truncates_overlong_input(published):
    model = load(published)
    out = model.run(["word " * 5000])
    assert out.shape == (1, 32) and np.isfinite(out).all()


def test_model_run_refuses_overlong_when_target_says(artifact_copy):
    edit_manifest(artifact_copy, lambda m: m["model"].update(overlong="refuse"))
    with pytest.raises(InputError, match=r"input 0 is \d+ tokens, over the model's 128"):
        load(artifact_copy).run(["word " * 500])


def test_verify_artifact_returns_manifest(published):
    manifest = verify_artifact(published)
    assert manifest["target"] == "cpu-avx2-dynamic" and manifest["version"] == "v1"


def test_model_batches_buckets_by_length(published):
    model = load(published)
    lengths = [40, 5, 6, 100, 7, 41, 30]
    assert model.batches(lengths, 32) == [[1, 2, 4], [6, 0, 5], [3]]
    assert model.batches(lengths, 2) == [[1, 2], [4], [6, 0], [5], [3]]
    assert model.batches(lengths, 4, bucketing=False) == [[0, 1, 2, 3], [4, 5, 6]]


def test_a_batch_size_above_the_sessions_largest_runs_in_batches_that_fit(published):
    model = load(published)
    texts = [f"sentence number {i} of the batch" for i in range(5)]
    expected = model.run(texts, batch_size=64)
    fed, run = [], model.session.run
    model.streams = None  # the tune stage may have chosen streams (timed on this host); every batch goes through one
    model.session = type("Limited", (), {})()  # the real session, with the largest batch a TensorRT profile gives
    model.session.max_batch = 2
    model.session.run = lambda names, feeds: fed.append(len(next(iter(feeds.values())))) or run(names, feeds)
    np.testing.assert_allclose(model.run(texts, batch_size=64), expected, atol=2e-3)  # int8: ranges per batch
    assert fed and max(fed) == 2 and sum(fed) == 5


def test_model_run_same_rows_with_and_without_bucketing(published):
    model = load(published)
    texts = ["tiny", "a sentence of middling length here", "word " * 60, "short one"]
    np.testing.assert_allclose(model.run(texts), model.run(texts, bucketing=False), atol=2e-2)


def test_ort_gpu_providers_carry_the_targets_profiles_and_caches(tmp_path):
    from pipeline.build.inputs.targets import load_target
    from pipeline.runtime.backends.onnxruntime import ort_gpu_providers

    shape = {"min": [1, 1], "opt": [8, 128], "max": [32, 256]}
    manifest = {
        "target_spec": load_target("a100").to_dict(),
        "engine": {"profiles": {"input_ids": shape, "attention_mask": shape}},
    }
    every = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    (trt, options), cuda, cpu = ort_gpu_providers(manifest, tmp_path, every)
    assert (trt, cuda, cpu) == tuple(every)
    assert options["trt_profile_min_shapes"] == "input_ids:1x1,attention_mask:1x1"
    assert options["trt_profile_max_shapes"] == "input_ids:32x256,attention_mask:32x256"
    assert options["trt_engine_cache_path"] == str(tmp_path / "onnxruntime") and options["trt_engine_cache_enable"]
    assert options["trt_max_workspace_size"] == 4096 << 20 and options["trt_builder_optimization_level"] == 3
    assert ort_gpu_providers(manifest, tmp_path, ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    decoder = {**manifest, "engine": {"profiles": None}}
    assert ort_gpu_providers(decoder, tmp_path, every) == ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_load_refuses_a_symlinked_manifest(artifact_copy, tmp_path):
    real = tmp_path / "elsewhere.json"
    (artifact_copy / "manifest.json").rename(real)
    (artifact_copy / "manifest.json").symlink_to(real)
    with pytest.raises(ArtifactError, match="manifest.json is a symlink"):
        load(artifact_copy)


def test_load_refuses_a_manifest_of_another_model(artifact_copy, tmp_path):
    other = tmp_path / "other-model" / artifact_copy.parent.name / artifact_copy.name
    shutil.copytree(artifact_copy, other)
    with pytest.raises(ArtifactError, match=r"belongs to tiny-bert/v1/cpu-avx2-dynamic, but sits in other-model/"):
        load(other)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"path": None}, "load(path=None): path must be a str or a pathlib.Path"),
        ({"path": 5}, "load(path=5): path must be a str"),
        ({"intra_op_threads": "abc"}, "load(intra_op_threads='abc') must be an int >= 0"),
        ({"intra_op_threads": -1}, "load(intra_op_threads=-1) must be an int >= 0"),
        ({"backend": "tvm"}, "load(backend='tvm') must be one of auto, onnxruntime, openvino, tensorrt"),
        ({"strict": "yes"}, "load(strict='yes'): strict must be True or False"),
    ],
)
def test_load_refuses_bad_arguments_naming_them(published, kwargs, message):
    with pytest.raises(InputError, match=re.escape(message)):
        load(**{"path": published, **kwargs})


@pytest.mark.parametrize("texts, index", [(["fine", b"bytes"], 1), (["ok", "bad \ud800"], 1)])
def test_model_run_names_the_bad_input(published, texts, index):
    model = load(published)
    with pytest.raises(InputError, match=f"input {index} "):
        model.run(texts)
    with pytest.raises(InputError, match="got a single bytes"):
        model.run(b"bytes")


# A decoder whose weights sit in a data file beside its graph: what every decoder from about 0.5B parameters is.
EXTERNAL_TARGETS = ("cpu-fp32", "cpu-int8-weights")


@pytest.fixture(scope="module")
def external(tmp_path_factory, texts_file, calibration_file):
    """A tiny Llama built for each of EXTERNAL_TARGETS with every graph forced past the single-file limit: the
    checkpoint, and each target's artifact."""
    from pipeline.build import onnx_files

    checkpoint = make_decoder(tmp_path_factory.mktemp("ckpt") / "tiny-llama", "llama")
    root = tmp_path_factory.mktemp("external")
    # The int8 gate is not what these tests check: on eight calibration texts a random model's teacher-forced
    # agreement lands near 0.9, so its threshold is eased.
    eased = write_target(root, "int8-weights-eased", base="cpu-int8-weights", accuracy__teacher_top1_agreement=0.5)
    files = {"cpu-fp32": "cpu-fp32", "cpu-int8-weights": str(eased)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(onnx_files, "SINGLE_FILE_LIMIT", 1)
        built = {t: _publish(checkpoint, texts_file, calibration_file, root, files[t]) for t in EXTERNAL_TARGETS}
    return checkpoint, built


def _copy_artifact(published, tmp_path):
    copy = tmp_path / "tiny-llama" / published.parent.name / published.name
    shutil.copytree(published, copy)
    for file in copy.iterdir():
        file.chmod(0o644)
    return copy


@pytest.mark.parametrize("target", EXTERNAL_TARGETS)
def test_load_runs_a_decoder_whose_weights_are_in_a_data_file(external, target):
    import hashlib

    import torch
    import transformers

    checkpoint, artifacts = external
    folder = artifacts[target]
    files = json.loads((folder / "manifest.json").read_text())["files"]
    assert files["model.onnx.data"] == hashlib.sha256((folder / "model.onnx.data").read_bytes()).hexdigest()
    completions = load(folder).generate(SMALL_TEXTS[:4], max_new_tokens=12)
    if target == "cpu-fp32":  # int8 weights may flip a near-tie of random weights; its gate passed at build
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
        for prompt, completion in zip(SMALL_TEXTS[:4], completions, strict=True):
            ids = tokenizer(prompt, return_tensors="pt")
            with torch.inference_mode():
                out = model.generate(**ids, do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.eos_token_id)
            assert completion.token_ids == tuple(out[0, ids["input_ids"].shape[1] :].tolist()), prompt
    else:
        assert all(len(c.token_ids) > 0 for c in completions)


def test_load_refuses_a_changed_byte_of_the_data_file(external, tmp_path):
    copy = _copy_artifact(external[1]["cpu-fp32"], tmp_path)
    data = bytearray((copy / "model.onnx.data").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "model.onnx.data").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data does not match its sha256"):
        load(copy)


@pytest.mark.parametrize("change", ["rename", "remove"])
def test_load_refuses_a_renamed_or_missing_data_file_in_one_line(external, tmp_path, change):
    copy = _copy_artifact(external[1]["cpu-fp32"], tmp_path)
    if change == "rename":
        (copy / "model.onnx.data").rename(copy / "weights.data")
    else:
        (copy / "model.onnx.data").unlink()
    with pytest.raises(ArtifactError, match=r"model\.onnx\.data, the weights of model\.onnx, is missing") as caught:
        load(copy)
    assert "\n" not in str(caught.value)


def test_load_refuses_a_graph_whose_data_file_the_manifest_dropped(external, tmp_path):
    copy = _copy_artifact(external[1]["cpu-fp32"], tmp_path)
    (copy / "model.onnx.data").unlink()
    edit_manifest(copy, lambda m: m["files"].pop("model.onnx.data"))  # resealed: the digest is no signature
    with pytest.raises(ArtifactError, match=r"model\.onnx cannot be opened: .*model\.onnx\.data") as caught:
        load(copy)
    assert "\n" not in str(caught.value)


def test_load_refuses_a_manifest_nested_too_deeply_in_one_line(artifact_copy):
    (artifact_copy / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ArtifactError, match="nests too deeply to be a manifest") as err:
        load(artifact_copy)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("field, value", [("validation", [1, 2]), ("candidates", {"a": 1}), ("created_at", 5)])
def test_load_refuses_an_optional_field_of_the_wrong_kind(artifact_copy, field, value):
    edit_manifest(artifact_copy, lambda m: m.update({field: value}))
    with pytest.raises(ArtifactError, match=f"field '{field}' is a {type(value).__name__}, not a .* or null; rebuild"):
        verify_artifact(artifact_copy)


def test_load_caps_inter_op_threads_at_this_hosts_cores(artifact_copy):
    from pipeline.runtime.host import usable_cores
    from pipeline.runtime.load import session_settings

    edit_manifest(artifact_copy, lambda m: m["session"].update(inter_op_threads=10**6))
    manifest = verify_artifact(artifact_copy)
    assert session_settings(manifest, None)["inter_op_threads"] == usable_cores()
    assert load(artifact_copy).run(["still answers"]).shape[0] == 1
