"""Audio in: WAV reading, resampling, 30 s windows, and Whisper's log-mel features against transformers'
WhisperFeatureExtractor (the reference the converted and exported Whisper models were trained on)."""

import ast
import io
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import InputError
from pipeline.runtime import audio
from pipeline.runtime.audio import N_SAMPLES, SAMPLE_RATE, log_mel_features, read_wav, resample, windows

SENTENCES = [
    "Please close the door when you leave the room.",
    "The children are playing in the garden behind the house.",
    "She opened the window and looked at the sea.",
    "We need to finish the report before the meeting on Friday.",
]
# Measured (transformers 4.57.6, torch 2.13 CPU): 3.7e-5 on speech (4.3e-5 with 128 bins), 1.5e-6 to 9.3e-6 on
# noise; the gap is its float32 torch STFT against this float64 one, largest in near-silent bins.
FEATURE_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    """About 12 s of English speech, 16 kHz."""
    pytest.importorskip("espeakng_loader", reason="synthesized speech needs espeakng-loader")
    from pipeline.build.inputs.speech import synthesize

    return np.concatenate([synthesize(sentence) for sentence in SENTENCES])


@pytest.fixture(scope="module")
def feature_extractor():
    transformers = pytest.importorskip("transformers")
    return transformers.WhisperFeatureExtractor(feature_size=80)


def _wav_bytes(samples: np.ndarray, rate: int, width: int = 2, channels: int = 1) -> bytes:
    """Integer PCM WAV bytes of float `samples` (frames, channels) in [-1, 1]."""
    scale = 2 ** (8 * width - 1) - 1
    ints = np.round(np.asarray(samples, dtype=np.float64).reshape(-1, channels) * scale).astype(np.int64)
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = (ints.astype("<i4").view(np.uint8).reshape(-1, 4)[:, :3]).tobytes()
    else:
        raw = ints.astype(f"<i{width}").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(channels)
        wav.setsampwidth(width)
        wav.setframerate(rate)
        wav.writeframes(raw)
    return buffer.getvalue()


def _tone(frequency: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    return amplitude * np.sin(2 * np.pi * frequency * np.arange(int(rate * seconds)) / rate)


@pytest.mark.parametrize("seconds", [3.0, 12.0, 30.0, 41.0])
def test_log_mel_features_matches_whisper_feature_extractor_when_speech(speech, feature_extractor, seconds):
    clip = np.resize(speech, int(seconds * SAMPLE_RATE)).astype(np.float32)  # repeated past its ~12 s
    expected = feature_extractor(clip, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    got = log_mel_features(clip)
    assert got.shape == expected.shape == (80, 3000) and got.dtype == np.float32
    assert np.abs(got - expected).max() < FEATURE_TOLERANCE


@pytest.mark.parametrize("seconds", [0.5, 17.0, 35.0])
def test_log_mel_features_matches_whisper_feature_extractor_when_noise(feature_extractor, seconds):
    noise = (np.random.default_rng(7).standard_normal(int(seconds * SAMPLE_RATE)) * 0.1).astype(np.float32)
    expected = feature_extractor(noise, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    assert np.abs(log_mel_features(noise) - expected).max() < FEATURE_TOLERANCE


def test_log_mel_features_matches_whisper_feature_extractor_when_128_mel_bins(speech):
    transformers = pytest.importorskip("transformers")
    extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    expected = extractor(speech, sampling_rate=SAMPLE_RATE, return_tensors="np").input_features[0]
    got = log_mel_features(speech, n_mels=128)
    assert got.shape == (128, 3000) and np.abs(got - expected).max() < FEATURE_TOLERANCE


@pytest.mark.parametrize("n_mels", [80, 128])
def test_mel_filters_equals_transformers_mel_filter_bank(n_mels):
    transformers = pytest.importorskip("transformers")
    expected = transformers.audio_utils.mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16000,
        norm="slaney",
        mel_scale="slaney",
    )
    np.testing.assert_allclose(audio.mel_filters(n_mels), expected, rtol=1e-12, atol=1e-15)


def test_log_mel_features_returns_one_row_per_clip_when_batch(speech):
    noise = np.random.default_rng(0).standard_normal(len(speech)).astype(np.float32) * 0.1
    batch = log_mel_features(np.stack([speech, noise]))
    assert batch.shape == (2, 80, 3000)
    np.testing.assert_array_equal(batch[0], log_mel_features(speech))
    np.testing.assert_array_equal(batch[1], log_mel_features(noise))


@pytest.mark.parametrize(
    "bad", [np.zeros(100, np.int16), np.zeros((1, 1, 100), np.float32), np.array([0.0, np.nan], np.float32)]
)
def test_log_mel_features_raises_input_error_when_not_finite_float_samples(bad):
    with pytest.raises(InputError, match="log_mel_features takes finite float samples") as err:
        log_mel_features(bad)
    assert "\n" not in str(err.value)


def test_windows_returns_30_s_chunks_with_a_shorter_last():
    samples = np.arange(2 * N_SAMPLES + 5, dtype=np.float32)
    chunks = windows(samples)
    assert [len(c) for c in chunks] == [N_SAMPLES, N_SAMPLES, 5]
    np.testing.assert_array_equal(np.concatenate(chunks), samples)
    assert [len(c) for c in windows(samples[:0])] == [0]
    assert [len(c) for c in windows(samples[:10], seconds=0.0005)] == [8, 2]


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_resample_keeps_a_tone_when_rate_differs(rate):
    got = resample(_tone(440.0, rate, 1.0), rate)
    assert got.dtype == np.float32 and len(got) == SAMPLE_RATE
    expected = _tone(440.0, SAMPLE_RATE, 1.0)
    assert np.abs(got - expected)[100:-100].max() < 1e-3  # the edges see the zero padding


def test_resample_removes_a_tone_above_the_new_nyquist_frequency():
    alias = resample(_tone(10000.0, 44100, 1.0), 44100)
    assert np.abs(alias[100:-100]).max() < 1e-3  # at 16 kHz, 10 kHz would alias to 6 kHz


@pytest.mark.parametrize(("samples", "rate"), [(np.zeros((2, 10)), 8000), (np.zeros(10), 0), (np.zeros(10), 8000.5)])
def test_resample_raises_input_error_when_not_1d_or_rate_not_a_positive_int(samples, rate):
    with pytest.raises(InputError, match="resample takes 1-D samples and positive integer rates"):
        resample(samples, rate)


def test_resample_returns_a_copy_when_rate_matches():
    samples = _tone(440.0, SAMPLE_RATE, 0.1)
    np.testing.assert_array_equal(resample(samples, SAMPLE_RATE), samples.astype(np.float32))


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_read_wav_returns_the_samples_when_pcm_of_any_width(width, tmp_path):
    samples = _tone(440.0, SAMPLE_RATE, 0.5)
    path = tmp_path / "tone.wav"
    path.write_bytes(_wav_bytes(samples, SAMPLE_RATE, width))
    got = read_wav(path)
    assert got.dtype == np.float32 and got.shape == samples.shape
    assert np.abs(got - samples).max() <= max(1.5 / 2 ** (8 * width - 1), 1e-7)  # 1e-7: float32 output


def test_read_wav_round_trips_speech_when_bytes(speech):
    from pipeline.build.inputs.speech import write_wav

    buffer = io.BytesIO()
    write_wav(buffer, speech)
    got = read_wav(buffer.getvalue())
    assert got.shape == speech.shape and np.abs(got - speech).max() <= 0.5 / 32768


def test_read_wav_mixes_stereo_down_and_resamples_when_44100_hz():
    left, right = _tone(440.0, 44100, 1.0, 0.6), _tone(440.0, 44100, 1.0, 0.2)
    got = read_wav(_wav_bytes(np.stack([left, right], axis=1), 44100, channels=2))
    assert len(got) == SAMPLE_RATE
    assert np.abs(got - _tone(440.0, SAMPLE_RATE, 1.0, 0.4))[100:-100].max() < 1e-3


def test_read_wav_raises_input_error_when_over_max_bytes(tmp_path):
    data = _wav_bytes(_tone(440.0, SAMPLE_RATE, 1.0), SAMPLE_RATE)
    path = tmp_path / "long.wav"
    path.write_bytes(data)
    for source in (path, data):
        with pytest.raises(InputError, match=r"over the 1000-byte limit for one WAV; split it") as err:
            read_wav(source, max_bytes=1000)
        assert "\n" not in str(err.value)


def test_read_wav_raises_input_error_when_over_max_seconds():
    with pytest.raises(InputError, match=r"holds 2\.0 s of audio, over the 1 s limit"):
        read_wav(_wav_bytes(_tone(440.0, 8000, 2.0), 8000), max_seconds=1)


def _float_wav() -> bytes:
    """A 32-bit IEEE float WAV (format tag 3), which the wave module does not read."""
    data = np.zeros(16, "<f4").tobytes()
    fmt = (3).to_bytes(2, "little") + (1).to_bytes(2, "little") + (16000).to_bytes(4, "little")
    fmt += (64000).to_bytes(4, "little") + (4).to_bytes(2, "little") + (32).to_bytes(2, "little")
    body = b"WAVE" + b"fmt " + len(fmt).to_bytes(4, "little") + fmt + b"data" + len(data).to_bytes(4, "little") + data
    return b"RIFF" + len(body).to_bytes(4, "little") + body


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a wav file at all", "is not a PCM WAV file"),
        (b"RIFF\x10\x00\x00\x00WAVE", "is not a PCM WAV file"),
        (_float_wav(), "is not a PCM WAV file"),
        (_wav_bytes(np.zeros(10), 1000), "1 channel\\(s\\) at 1000 Hz; read_wav takes"),
    ],
    ids=["garbage", "truncated", "float", "rate"],
)
def test_read_wav_raises_input_error_when_not_a_readable_pcm_wav(data, message):
    with pytest.raises(InputError, match=message) as err:
        read_wav(data)
    assert "\n" not in str(err.value) and "ffmpeg" in str(err.value)


def test_read_wav_raises_input_error_when_file_missing_or_a_folder(tmp_path):
    with pytest.raises(InputError, match=r"cannot read WAV file .*missing\.wav \(No such file or directory\)"):
        read_wav(tmp_path / "missing.wav")
    with pytest.raises(InputError, match=r"cannot read WAV file .* \(Is a directory\)"):
        read_wav(tmp_path)


def test_audio_imports_nothing_but_numpy_the_standard_library_and_pipeline_errors():
    tree = ast.parse(Path(audio.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    outside = {name for name in imported if name.split(".")[0] not in sys.stdlib_module_names}
    assert outside <= {"numpy", "pipeline.errors"}, outside
