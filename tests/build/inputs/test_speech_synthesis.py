"""Synthesized English speech (espeak-ng through ctypes): audible, as long as speech takes, and deterministic."""

import io

import numpy as np
import pytest

pytest.importorskip("espeakng_loader", reason="speech synthesis needs the espeakng-loader wheel")

from pipeline.build.inputs.speech import synthesize, write_wav  # noqa: E402
from pipeline.runtime.audio import SAMPLE_RATE, read_wav  # noqa: E402

SENTENCE = "The children are playing in the garden behind the house."


@pytest.fixture(scope="module")
def spoken() -> np.ndarray:
    return synthesize(SENTENCE)


def test_synthesize_returns_audible_16_khz_float32(spoken):
    assert spoken.dtype == np.float32 and spoken.ndim == 1
    assert np.abs(spoken).max() <= 1.0 and np.sqrt(np.mean(spoken**2)) > 0.02
    # Speech fills most of the clip: fewer than half of its 20 ms frames are near-silent.
    frames = spoken[: len(spoken) // 320 * 320].reshape(-1, 320)
    assert np.mean(np.sqrt(np.mean(frames**2, axis=1)) < 1e-3) < 0.5


def test_synthesize_takes_speaking_time_when_a_sentence(spoken):
    seconds = len(spoken) / SAMPLE_RATE
    words = len(SENTENCE.split())
    assert 0.15 * words < seconds < 0.8 * words  # 160 words a minute is 0.375 s a word
    assert len(synthesize("Hello.")) < len(spoken) / 3


def test_synthesize_returns_the_same_samples_when_called_twice(spoken):
    np.testing.assert_array_equal(synthesize(SENTENCE), spoken)
    np.testing.assert_array_equal(synthesize(SENTENCE), spoken)


def test_synthesize_is_slower_when_fewer_words_per_minute(spoken):
    assert len(synthesize(SENTENCE, words_per_minute=110)) > 1.2 * len(spoken)


@pytest.mark.parametrize("text", ["", "   ", "a\0b"])
def test_synthesize_raises_value_error_when_text_is_empty_or_has_nul(text):
    with pytest.raises(ValueError, match="synthesize takes 1 to"):
        synthesize(text)


@pytest.mark.parametrize("words_per_minute", [79, 451, 160.0])
def test_synthesize_raises_value_error_when_words_per_minute_out_of_range(words_per_minute):
    with pytest.raises(ValueError, match="espeak-ng speaks 80 to 450 words per minute"):
        synthesize("Hello.", words_per_minute=words_per_minute)


def test_synthesize_raises_value_error_when_voice_unknown():
    with pytest.raises(ValueError, match="espeak-ng has no voice 'xx-nowhere'"):
        synthesize("Hello.", voice="xx-nowhere")


def test_write_wav_round_trips_through_read_wav(spoken, tmp_path):
    path = write_wav(tmp_path / "speech.wav", spoken)
    got = read_wav(path)
    assert got.shape == spoken.shape and np.abs(got - spoken).max() <= 0.5 / 32768
    buffer = io.BytesIO()
    write_wav(buffer, spoken)
    assert buffer.getvalue() == path.read_bytes()
