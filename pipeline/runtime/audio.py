"""Audio in: WAV files read as 16 kHz mono float32, split into 30 s windows, and turned into the log-mel features a
Whisper encoder takes (what transformers' WhisperFeatureExtractor computes, in numpy alone).

    samples (any rate) --resample--> 16 kHz --pad/cut to 30 s--> STFT (Hann 400, hop 160) --|.|^2--> mel (Slaney)
        --> log10(max(., 1e-10)) --> max(., peak - 8) --> (. + 4) / 4 --> (n_mels, 3000)
"""

from __future__ import annotations

import functools
import io
import math
import os
import wave
from pathlib import Path

import numpy as np

from pipeline.errors import InputError

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = SAMPLE_RATE * CHUNK_SECONDS  # 480000: one window of audio
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000: one window of features
MAX_WAV_BYTES = 512 * 2**20
MAX_SECONDS = 3600.0
RATES = (4000, 384000)  # the sample rates read_wav accepts, inclusive
_CONVERT_HINT = "convert it with e.g. `ffmpeg -i IN -ac 1 -ar 16000 -c:a pcm_s16le OUT.wav`"


def resample(audio: np.ndarray, rate: int, new_rate: int = SAMPLE_RATE, zero_crossings: int = 16) -> np.ndarray:
    """`audio` (1-D) at `rate` Hz resampled to `new_rate` Hz as float32, ceil(len * new_rate / rate) samples: a
    polyphase Kaiser-windowed sinc, its passband ending at 94.5% of the lower Nyquist frequency (stopband ~ -85 dB)."""
    audio = np.asarray(audio, dtype=np.float64)
    if audio.ndim != 1 or not (isinstance(rate, int) and isinstance(new_rate, int) and rate > 0 and new_rate > 0):
        raise InputError(
            f"resample takes 1-D samples and positive integer rates, got {audio.shape}, {rate}, {new_rate}"
        )
    if rate == new_rate:
        return audio.astype(np.float32)
    gcd = math.gcd(rate, new_rate)
    up, down = new_rate // gcd, rate // gcd
    table, half = _sinc_table(up, down, zero_crossings)
    n_out = -(-len(audio) * up // down)
    padded = np.pad(audio, (half, half))
    # Output n sits at input position n * down / up: its taps start at input floor(.) + 1 - half, i.e. window
    # floor(.) + 1 of the padded signal. Outputs n, n + up, n + 2 up, ... share one phase and step `down` inputs.
    taps = np.lib.stride_tricks.sliding_window_view(padded, 2 * half)
    out = np.empty(n_out, dtype=np.float64)
    for r in range(min(up, n_out)):
        base, phase = divmod(r * down, up)
        count = len(range(r, n_out, up))
        out[r::up] = taps[base + 1 : base + 1 + (count - 1) * down + 1 : down] @ table[phase]
    return out.astype(np.float32)


@functools.lru_cache(maxsize=16)
def _sinc_table(up: int, down: int, zero_crossings: int, beta: float = 8.6) -> tuple[np.ndarray, int]:
    """The filter of each of the `up` phases, (up, 2 * half) taps each summing to 1, and `half`."""
    cutoff = 0.945 * min(1.0, up / down) / 2  # cycles per input sample
    width = zero_crossings / (2 * cutoff)  # half the filter's length, in input samples
    half = math.ceil(width)
    # Tap i of phase p weighs input floor(t) + 1 + i - half, at distance p / up - (1 + i - half) from the output.
    distance = np.arange(up)[:, None] / up - (np.arange(2 * half)[None, :] + 1 - half)
    inside = np.abs(distance) < width
    window = np.where(inside, np.i0(beta * np.sqrt(np.clip(1 - (distance / width) ** 2, 0, None))) / np.i0(beta), 0)
    table = 2 * cutoff * np.sinc(2 * cutoff * distance) * window
    table /= table.sum(axis=1, keepdims=True)
    table.setflags(write=False)
    return table, half


def read_wav(
    source: str | os.PathLike | bytes | bytearray | memoryview,
    max_bytes: int = MAX_WAV_BYTES,
    max_seconds: float = MAX_SECONDS,
) -> np.ndarray:
    """A PCM WAV file (a path, or its bytes) as 16 kHz mono float32 in [-1, 1]: 8-, 16-, 24- or 32-bit integer
    samples, channels averaged, any rate from 4 kHz to 384 kHz resampled. An InputError for a file over `max_bytes`
    or `max_seconds`, or one that is no PCM WAV."""
    name, data = _read_bounded(source, max_bytes)
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            channels, width, rate = wav.getnchannels(), wav.getsampwidth(), wav.getframerate()
            if not RATES[0] <= rate <= RATES[1] or channels < 1:
                raise InputError(
                    f"{name}: {channels} channel(s) at {rate} Hz; read_wav takes 1 or more channels at "
                    f"{RATES[0]} to {RATES[1]} Hz: {_CONVERT_HINT}"
                )
            seconds = wav.getnframes() / rate
            if seconds > max_seconds:
                raise InputError(
                    f"{name} holds {seconds:.1f} s of audio, over the {max_seconds:.0f} s limit; split it (e.g. "
                    "`ffmpeg -i IN -f segment -segment_time 600 OUT%03d.wav`) or pass a larger max_seconds"
                )
            frames = wav.readframes(wav.getnframes())
    except (wave.Error, EOFError) as err:
        why = f" ({err})" if str(err) else " (it ends before its header does)" if isinstance(err, EOFError) else ""
        raise InputError(f"{name} is not a PCM WAV file the wave module can read{why}; {_CONVERT_HINT}") from None
    samples = _pcm_to_float(frames, width, channels, name)
    return resample(samples, rate, SAMPLE_RATE)


def _read_bounded(source, max_bytes: int) -> tuple[str, bytes]:
    """A name for messages and the file's bytes, refusing more than `max_bytes` without reading them all."""
    if isinstance(source, bytes | bytearray | memoryview):
        _check_size("the audio sent", len(source), max_bytes)
        return "the audio sent", bytes(source)
    name = str(Path(source))
    try:
        with open(source, "rb") as file:
            _check_size(name, os.fstat(file.fileno()).st_size, max_bytes)
            data = file.read(max_bytes + 1)
    except OSError as err:
        raise InputError(f"cannot read WAV file {name} ({err.strerror}); pass the path of a WAV file") from None
    _check_size(name, len(data), max_bytes)  # a file that grew after fstat
    return name, data


def _check_size(name: str, size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise InputError(
            f"{name} is {size} bytes, over the {max_bytes}-byte limit for one WAV; split it (e.g. `ffmpeg -i IN -f "
            "segment -segment_time 600 OUT%03d.wav`) or pass a larger max_bytes"
        )


def _pcm_to_float(frames: bytes, width: int, channels: int, name: str) -> np.ndarray:
    """Interleaved little-endian PCM as mono float64 in [-1, 1] (a partial last frame is dropped)."""
    frames = frames[: len(frames) // (width * channels) * width * channels]
    if width == 1:  # 8-bit WAV is unsigned
        samples = (np.frombuffer(frames, np.uint8).astype(np.float64) - 128) / 128
    elif width == 2:
        samples = np.frombuffer(frames, "<i2") / 32768.0
    elif width == 3:
        raw = np.frombuffer(frames, np.uint8).reshape(-1, 3).astype(np.int32)
        packed = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        samples = ((packed << 8) >> 8) / 8388608.0  # sign-extend the 24-bit value
    elif width == 4:
        samples = np.frombuffer(frames, "<i4") / 2147483648.0
    else:
        raise InputError(f"{name} has {8 * width}-bit samples; read_wav takes 8, 16, 24 or 32-bit PCM: {_CONVERT_HINT}")
    return samples.reshape(-1, channels).mean(axis=1)


def windows(audio: np.ndarray, seconds: float = CHUNK_SECONDS, rate: int = SAMPLE_RATE) -> list[np.ndarray]:
    """`audio` cut into consecutive windows of `seconds` (the last one shorter); one empty window for empty audio."""
    size = int(round(seconds * rate))
    if size < 1:
        raise InputError(f"windows of {seconds} s at {rate} Hz hold no sample; pass seconds >= {1 / rate}")
    audio = np.asarray(audio)
    return [audio[start : start + size] for start in range(0, max(len(audio), 1), size)]


@functools.lru_cache(maxsize=4)
def mel_filters(n_mels: int = 80, n_fft: int = N_FFT, rate: int = SAMPLE_RATE) -> np.ndarray:
    """The (n_fft // 2 + 1, n_mels) Slaney-scale, Slaney-normalized triangular filter bank from 0 Hz to rate / 2,
    as transformers' `mel_filter_bank(..., norm="slaney", mel_scale="slaney")` builds it."""
    fft_freqs = np.linspace(0, rate // 2, n_fft // 2 + 1)
    mels = np.linspace(_hertz_to_mel(0.0), _hertz_to_mel(rate / 2), n_mels + 2)
    edges = _mel_to_hertz(mels)
    diff = np.diff(edges)
    slopes = edges[None, :] - fft_freqs[:, None]
    down, up = -slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]
    bank = np.maximum(0.0, np.minimum(down, up)) * (2.0 / (edges[2:] - edges[:-2]))[None, :]
    bank.setflags(write=False)
    return bank


# The Slaney mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above (27 mels per factor 6.4).
def _hertz_to_mel(hertz):
    hertz = np.asarray(hertz, dtype=np.float64)
    return np.where(
        hertz >= 1000.0, 15.0 + np.log(np.maximum(hertz, 1e-300) / 1000.0) * (27.0 / np.log(6.4)), hertz * 3.0 / 200.0
    )


def _mel_to_hertz(mels):
    mels = np.asarray(mels, dtype=np.float64)
    return np.where(mels >= 15.0, 1000.0 * np.exp(np.log(6.4) / 27.0 * (mels - 15.0)), mels * 200.0 / 3.0)


def log_mel_features(audio: np.ndarray, n_mels: int = 80) -> np.ndarray:
    """Whisper's input features for 16 kHz mono `audio`, (n_mels, 3000) float32, or (batch, n_mels, 3000) for a
    (batch, samples) array: each row zero-padded or cut to 30 s, as WhisperFeatureExtractor(feature_size=n_mels)."""
    audio = np.asarray(audio)
    floating = np.issubdtype(audio.dtype, np.floating)
    if audio.ndim not in (1, 2) or not floating or not np.isfinite(audio).all():
        raise InputError(
            f"log_mel_features takes finite float samples shaped (samples,) or (batch, samples), got a "
            f"{audio.ndim}-D {audio.dtype} array{' with NaN or inf' if floating else ''}; pass read_wav's output"
        )
    if audio.ndim == 2:
        return np.stack([log_mel_features(row, n_mels) for row in audio])
    signal = np.zeros(N_SAMPLES, dtype=np.float64)
    signal[: min(len(audio), N_SAMPLES)] = audio[:N_SAMPLES]
    # A centered STFT: reflect-pad n_fft // 2 on each side; the last of the 3001 frames is dropped, as Whisper does.
    padded = np.pad(signal, N_FFT // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP_LENGTH][:N_FRAMES]
    spectrum = np.fft.rfft(frames * _hann(N_FFT), axis=-1)
    power = spectrum.real**2 + spectrum.imag**2
    log_spec = np.log10(np.maximum(power @ mel_filters(n_mels), 1e-10)).T
    log_spec = np.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).astype(np.float32)


@functools.lru_cache(maxsize=2)
def _hann(size: int) -> np.ndarray:
    """The periodic Hann window (torch.hann_window's default, and transformers' window_function(size, "hann"))."""
    return 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(size) / size)
