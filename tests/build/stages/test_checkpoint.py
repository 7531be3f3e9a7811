import json
import shutil

import pytest

from pipeline.build.inputs.digest import checkpoint_digest
from pipeline.build.inputs.targets import load_target
from pipeline.build.manifest import Manifest
from pipeline.build.stages import checkpoint
from pipeline.build.stages.checkpoint import default_checkpoint
from pipeline.errors import InputError
from tests.tiny import make_checkpoint, make_sentence_transformer


def _run(folder, task=None):
    manifest = Manifest(
        model_name="m",
        source=str(folder),
        cache_dir="",
        artifacts_dir="",
        validation_path="",
        calibration_path="",
        task_override=task,
    )
    return checkpoint.run(manifest, load_target("cpu-avx2")).checkpoint


def test_run_reads_sentence_transformers_pooling_of_minilm():
    info = _run(default_checkpoint())
    assert info.task == "feature-extraction" and info.model_type == "bert"
    assert info.pooling == {"mode": "mean", "normalize": True}
    assert info.max_length == 256  # sentence_bert_config.json, not the 512 positions


def test_run_detects_task_from_head(tmp_path):
    folder = make_checkpoint(tmp_path / "cls", "bert", "sequence-classification")
    info = _run(folder)
    assert info.task == "sequence-classification" and info.pooling is None


def test_run_defaults_to_mean_pooling_without_modules_json(tiny_bert):
    assert _run(tiny_bert).pooling == {"mode": "mean", "normalize": False}


def test_run_refuses_missing_folder(tmp_path):
    with pytest.raises(InputError, match="is not a folder"):
        _run(tmp_path / "nope")


def test_run_refuses_folder_without_config(tmp_path):
    with pytest.raises(InputError, match="no config.json: not a Hugging Face checkpoint"):
        _run(tmp_path)


def test_run_refuses_unsupported_architecture(tmp_path, tiny_bert):
    folder = tmp_path / "pegasus"
    shutil.copytree(tiny_bert, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "pegasus"}))
    with pytest.raises(
        InputError, match=r"'pegasus' is not supported \(an encoder-decoder text-to-text model.*\); supported: albert"
    ):
        _run(folder)


def test_run_picks_text_generation_for_a_causal_lm(tiny_gpt2):
    info = _run(tiny_gpt2)
    assert info.task == "text-generation" and info.model_type == "gpt2" and info.pooling is None
    assert info.max_length == 256  # config.json's n_positions


def test_run_refuses_a_task_of_the_other_family(tiny_gpt2, tiny_bert):
    with pytest.raises(
        InputError,
        match=r"task 'feature-extraction' is for encoder models, and gpt2 is of the "
        r"decoder family, whose tasks are: text-generation",
    ):
        _run(tiny_gpt2, task="feature-extraction")
    with pytest.raises(InputError, match=r"task 'text-generation' is for decoder models"):
        _run(tiny_bert, task="text-generation")


def test_run_refuses_missing_weights(tmp_path, tiny_bert):
    folder = tmp_path / "noweights"
    shutil.copytree(tiny_bert, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(InputError, match="has no weights"):
        _run(folder)


def test_run_refuses_unknown_task(tiny_bert):
    with pytest.raises(InputError, match="task 'summarization' is not supported"):
        _run(tiny_bert, task="summarization")


def test_run_refuses_unsupported_sentence_transformers_module(tmp_path, tiny_bert):
    folder = tmp_path / "lstm"
    shutil.copytree(tiny_bert, folder)
    (folder / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.LSTM", "path": "2"}]))
    with pytest.raises(
        InputError, match=r"\['sentence_transformers.models.LSTM'\]; supported: Transformer, Pooling, Dense"
    ):
        _run(folder)


@pytest.mark.parametrize(
    ("file", "content", "match"),
    [
        ("config.json", "[1, 2]", "holds list, not a JSON object"),
        ("config.json", None, "cannot read .*config.json"),  # a folder where the file should be
        ("tokenizer_config.json", '{"model_max_length": "big"}', "model_max_length is 'big', not a number"),
        ("config.json", {"max_position_embeddings": "512"}, r"max_position_embeddings \(or n_positions\) is '512'"),
    ],
)
def test_run_refuses_damaged_json_in_one_line_naming_the_file(tmp_path, tiny_bert, file, content, match):
    folder = tmp_path / "damaged"
    shutil.copytree(tiny_bert, folder)
    target = folder / file
    if content is None:
        target.unlink()
        target.mkdir()
    elif isinstance(content, dict):
        target.write_text(json.dumps({**json.loads(target.read_text()), **content}))
    else:
        target.write_text(content)
    with pytest.raises(InputError, match=match) as err:
        _run(folder)
    assert "\n" not in str(err.value)


def test_run_refuses_a_pooling_config_that_is_not_an_object(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    (folder / "1_Pooling" / "config.json").write_text("[]")
    with pytest.raises(InputError, match="1_Pooling/config.json holds list, not a JSON object"):
        _run(folder)


def _modules(folder):
    return json.loads((folder / "modules.json").read_text())


def _dense_config(folder, **changes):
    config_file = folder / "2_Dense" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))


def test_run_reads_dense_modules_in_order_with_sentence_transformers_5_names(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st", dense=((24, "GELU"), (16, "Identity")))
    assert _modules(folder)[2]["type"] == "sentence_transformers.base.modules.dense.Dense"
    info = _run(folder)
    assert info.task == "feature-extraction"
    assert info.pooling == {
        "mode": "mean",
        "normalize": True,
        "dense": [
            {"path": "2_Dense", "in_features": 32, "out_features": 24, "bias": True, "activation": "GELU"},
            {"path": "3_Dense", "in_features": 24, "out_features": 16, "bias": True, "activation": "Identity"},
        ],
    }


def test_run_reads_the_legacy_names_and_pooling_keys_of_a_dense_model(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st", normalize=False)
    legacy = ["Transformer", "Pooling", "Dense"]
    modules = [
        {**m, "type": f"sentence_transformers.models.{kind}"} for m, kind in zip(_modules(folder), legacy, strict=True)
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    info = _run(folder)
    assert info.pooling["mode"] == "cls" and info.pooling["normalize"] is False
    assert [d["activation"] for d in info.pooling["dense"]] == ["Tanh"]


def test_run_refuses_an_unsupported_dense_activation_in_one_line(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    _dense_config(folder, activation_function="torch.nn.modules.activation.Softplus")
    with pytest.raises(
        InputError,
        match=r"activation 'torch.nn.modules.activation.Softplus' is not supported; "
        r"supported: Identity, Tanh, ReLU, GELU, Sigmoid",
    ) as err:
        _run(folder)
    assert "\n" not in str(err.value)


def test_run_refuses_a_dense_that_does_not_fit_the_pooling(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    _dense_config(folder, in_features=48)
    with pytest.raises(InputError, match="in_features is 48, but the module before it gives 32 values"):
        _run(folder)


def test_run_refuses_a_dense_folder_without_weights(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    (folder / "2_Dense" / "model.safetensors").unlink()
    with pytest.raises(InputError, match=r"2_Dense has no weights \(none of model.safetensors, pytorch_model.bin\)"):
        _run(folder)


@pytest.mark.parametrize(
    "order", [(0, 2, 1, 3), (0, 1, 3, 2), (1, 0, 2, 3)], ids=["dense-before-pooling", "after-normalize", "no-lead"]
)
def test_run_refuses_sentence_transformers_modules_out_of_order(tmp_path, order):
    folder = make_sentence_transformer(tmp_path / "st")
    modules = _modules(folder)
    (folder / "modules.json").write_text(json.dumps([modules[i] for i in order]))
    with pytest.raises(InputError, match="supported: Transformer, Pooling, any number of Dense, then optionally"):
        _run(folder)


def test_run_refuses_a_module_path_that_leads_out_of_the_checkpoint(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    shutil.copytree(folder / "2_Dense", tmp_path / "outside")
    modules = _modules(folder)
    modules[2]["path"] = "../outside"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(InputError, match="modules.json: 'path' is '../outside', a path outside the checkpoint folder"):
        _run(folder)


def test_run_refuses_a_transformer_module_in_a_subfolder(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    modules = _modules(folder)
    modules[0]["path"] = "0_Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(InputError, match="the Transformer module is in '0_Transformer', not the checkpoint folder"):
        _run(folder)


def test_checkpoint_digest_changes_with_a_dense_weight(tmp_path):
    folder = make_sentence_transformer(tmp_path / "st")
    before = checkpoint_digest(folder)
    with open(folder / "2_Dense" / "model.safetensors", "ab") as handle:
        handle.write(b"\0")
    assert checkpoint_digest(folder) != before


def test_checkpoint_digest_changes_with_weights_not_readme(tmp_path, tiny_bert):
    folder = tmp_path / "copy"
    shutil.copytree(tiny_bert, folder)
    before = checkpoint_digest(folder)
    (folder / "README.md").write_text("docs do not change the model")
    assert checkpoint_digest(folder) == before
    with open(folder / "model.safetensors", "ab") as handle:
        handle.write(b"\0")
    assert checkpoint_digest(folder) != before


@pytest.mark.parametrize("where", ["config.json", "tokenizer_config.json"])
def test_run_refuses_remote_code_without_running_it(tmp_path, tiny_bert, where):
    folder = tmp_path / "remote"
    shutil.copytree(tiny_bert, folder)
    marker = tmp_path / "ran"
    (folder / "custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    data = json.loads((folder / where).read_text()) if (folder / where).exists() else {}
    (folder / where).write_text(json.dumps({**data, "auto_map": {"AutoTokenizer": ["custom.Tok", None]}}))
    with pytest.raises(InputError, match=rf"{where} has `auto_map` \(AutoTokenizer\).*never runs code"):
        _run(folder)
    assert not marker.exists()


def test_run_refuses_a_model_type_transformers_does_not_know(tmp_path, tiny_bert):
    folder = tmp_path / "custom"
    shutil.copytree(tiny_bert, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "my_own_bert"}))
    with pytest.raises(InputError, match=r"'my_own_bert' is not supported \(transformers has no such model type"):
        _run(folder)


@pytest.mark.parametrize(("head", "task"), [("fill-mask", "fill-mask"), ("question-answering", "question-answering")])
def test_run_detects_the_task_of_a_masked_lm_or_question_answering_head(tmp_path, head, task):
    folder = make_checkpoint(tmp_path / head, "bert", head)
    info = _run(folder)
    assert info.task == task and info.pooling is None


def test_run_takes_a_masked_lm_with_sentence_transformers_modules_for_an_embedding_model(tmp_path):
    folder = make_checkpoint(tmp_path / "st-mlm", "mpnet", "fill-mask")
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["MPNetForMaskedLM"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    info = _run(folder)
    assert info.task == "feature-extraction" and info.pooling == {"mode": "mean", "normalize": True}
    assert _run(folder, task="fill-mask").task == "fill-mask"  # a user may still ask for the head


def _copy(tiny_bert, folder):
    shutil.copytree(tiny_bert, folder)
    return folder


def test_run_refuses_a_symlink_to_a_file_outside_the_checkpoint(tmp_path, tiny_bert):
    folder = _copy(tiny_bert, tmp_path / "linked")
    secret = tmp_path / "secret.txt"
    secret.write_text("{{ 'the key is 1234' }}")
    (folder / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(InputError, match=r"'chat_template.jinja' is a symlink to .*secret.txt', outside"):
        _run(folder)


def test_run_refuses_a_symlinked_subfolder_that_leads_outside(tmp_path, tiny_bert):
    folder = _copy(tiny_bert, tmp_path / "linked")
    (tmp_path / "elsewhere").mkdir()
    (folder / "1_Pooling").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(InputError, match="'1_Pooling' is a symlink to"):
        _run(folder)


@pytest.mark.parametrize("value", ["/etc/hostname", "../secret.txt", "sub/../../secret.txt", "C:\\secret.txt"])
def test_run_refuses_a_json_path_outside_the_checkpoint(tmp_path, tiny_bert, value):
    folder = _copy(tiny_bert, tmp_path / "paths")
    (tmp_path / "secret.txt").write_text("[PAD]\nsecret\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "vocab_file": value}))
    with pytest.raises(InputError, match=r"tokenizer_config.json: 'vocab_file' is .*a path outside the checkpoint"):
        _run(folder)


def test_run_takes_relative_paths_inside_and_where_a_checkpoint_came_from(tmp_path, tiny_bert):
    folder = _copy(tiny_bert, tmp_path / "inside")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "vocab.txt").write_text("[PAD]\n")
    legacy = {"vocab_file": "vocab.txt", "special_tokens_map_file": "/root/.cache/special_tokens_map.json"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **legacy}))
    model_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**model_config, "_name_or_path": "/home/someone/models/x"}))
    assert _run(folder).model_type == "bert"


def test_run_takes_a_hub_cache_snapshot_whose_files_link_into_its_blobs(tmp_path, tiny_bert):
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for index, file in enumerate(sorted(p for p in tiny_bert.iterdir() if p.is_file())):
        shutil.copy(file, blobs / f"blob{index}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{index}")
    assert _run(snapshot).model_type == "bert"


@pytest.mark.parametrize("auto_map", [5, "x", ["a"]])
def test_run_refuses_an_auto_map_of_any_shape_in_one_line(tmp_path, tiny_bert, auto_map):
    folder = _copy(tiny_bert, tmp_path / "remote")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": auto_map}))
    with pytest.raises(InputError, match=r"config.json has `auto_map` .*never runs code") as err:
        _run(folder)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"n_positions": 120000}, r"gives transformer.wpe.weight the shape \(120000, "),
        ({"vocab_size": 10**12}, r"gives transformer.wte.weight the shape \(1000000000000, "),
    ],
)
def test_run_refuses_config_sizes_that_do_not_fit_the_weights_before_allocating(tmp_path, tiny_gpt2, change, match):
    import resource

    folder = _copy(tiny_gpt2, tmp_path / "sizes")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(InputError, match=match + r".*the config does not fit the weights") as err:
        _run(folder)
    assert "\n" not in str(err.value)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KB: under 1 GB more at peak


@pytest.mark.parametrize(
    "model_type, what",
    [
        ("wav2vec2", "a speech model: it needs a feature extractor"),
        ("align", "a two-tower image-text model of another family than CLIP and SigLIP"),
        ("pegasus", "an encoder-decoder text-to-text model"),
    ],
)
def test_run_refuses_speech_image_and_text_to_text_models_for_what_they_are(tmp_path, tiny_bert, model_type, what):
    folder = _copy(tiny_bert, tmp_path / model_type)
    (folder / "tokenizer.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": model_type, "architectures": None}))
    with pytest.raises(InputError, match=f"architecture '{model_type}' is not supported \\({what}") as err:
        _run(folder)
    assert "has no tokenizer" not in str(err.value)


def test_run_refuses_a_whisper_checkpoint_for_its_missing_feature_extractor_not_a_tokenizer(tmp_path, tiny_bert):
    folder = _copy(tiny_bert, tmp_path / "whisper")
    (folder / "tokenizer.json").unlink()
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "whisper", "architectures": None}))
    with pytest.raises(InputError, match="is a speech model and needs a feature extractor \\(preprocessor_config.json"):
        _run(folder)


def test_run_refuses_a_tokenizer_pattern_that_backtracks_without_bound(tmp_path, tiny_bert):
    folder = _copy(tiny_bert, tmp_path / "backtracking")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    split = {"type": "Split", "pattern": {"Regex": "(a+)+b"}, "behavior": "Isolated", "invert": False}
    tokenizer["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, tokenizer["pre_tokenizer"]]}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(InputError, match=r"tokenizer.json: the pre_tokenizer's Split pattern '\(a\+\)\+b'") as err:
        _run(folder)
    assert "\n" not in str(err.value)
