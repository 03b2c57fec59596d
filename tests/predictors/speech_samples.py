"""Speech for the transcribe tests, made offline with Debian's ``espeak-ng`` (``make system-deps`` installs it).

Clips are written as 16 kHz mono 16-bit WAV, the rate Whisper takes, so the served path (PyAV decoding the upload)
and the in-process reference (the standard library's ``wave``) read the very same samples. Other containers are
encoded from them with PyAV.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import wave
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from scipy.signal import resample_poly  # type: ignore[import-untyped]

RATE = 16_000


def espeak(text: str) -> np.ndarray:
    """``text`` spoken by espeak-ng, as int16 samples at 16 kHz (espeak speaks at 22.05 kHz)."""
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed: run `make system-deps` (Debian's espeak-ng package)")
    wav = subprocess.run(["espeak-ng", "--stdout", text], capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(wav)) as reader:
        rate = reader.getframerate()
        # espeak-ng writes its data size as 0x7ffff000 to stdout (not seekable): read what is there.
        samples = np.frombuffer(wav[44:], dtype="<i2").astype(np.float64)
    resampled: np.ndarray = resample_poly(samples, RATE, rate)
    clipped: np.ndarray = np.clip(np.round(resampled), -32768, 32767).astype(np.int16)
    return clipped


def wav_bytes(samples: np.ndarray, rate: int = RATE, channels: int = 1) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(samples.astype("<i2").tobytes())
    return out.getvalue()


def read_wav(data: bytes) -> np.ndarray:
    """A 16-bit WAV's samples as float32 in [-1, 1), independently of the code under test."""
    with wave.open(io.BytesIO(data)) as reader:
        assert reader.getframerate() == RATE
        assert reader.getnchannels() == 1
        frames = reader.readframes(reader.getnframes())
    return (np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0).astype(np.float32)


def long_speech(seconds: float) -> np.ndarray:
    """Sentences with pauses between them, repeated to ``seconds`` (long-form: more than one 30 s window)."""
    sentences = [espeak(text) for text in ("the meeting starts at nine", "please send the notes to everyone",
                                           "we will talk again tomorrow")]  # fmt: skip
    pause = np.zeros(RATE // 2, dtype=np.int16)
    pieces: list[np.ndarray] = []
    total = 0
    while total < seconds * RATE:
        for sentence in sentences:
            pieces += [sentence, pause]
            total += len(sentence) + len(pause)
    return np.concatenate(pieces)[: int(seconds * RATE)]


class _LiveSink:
    """A write-only file: a muxer cannot seek back to write the duration, as a browser's MediaRecorder cannot."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        return len(chunk)


def encoded(samples: np.ndarray, container: str, codec: str, rate: int = RATE, *, live: bool = False) -> bytes:
    """``samples`` (int16, 16 kHz mono) encoded with PyAV into ``container`` with ``codec``; ``live``: written as a
    stream (no duration in the header)."""
    import av

    out: Any = _LiveSink() if live else io.BytesIO()
    with av.open(out, mode="w", format=container) as writer:
        stream: Any = writer.add_stream(codec, rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        frame.time_base = Fraction(1, RATE)
        frame.pts = 0
        resampler = av.AudioResampler(format=stream.codec_context.format.name, layout="mono", rate=rate)
        for piece in resampler.resample(frame):
            for packet in stream.encode(piece):
                writer.mux(packet)
        for packet in stream.encode(None):
            writer.mux(packet)
    return bytes(out.data) if live else out.getvalue()


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def lying_webm(samples: np.ndarray, declared_seconds: float) -> bytes:
    """``samples`` as WebM/Opus whose header declares ``declared_seconds`` (its Segment Info's Duration, element
    0x4489, rewritten): a header that lies about its length."""
    import struct

    data = encoded(samples, "webm", "libopus", 48_000)
    at = data.find(b"\x44\x89\x88")  # Duration, an 8-byte float, in the timecode scale's milliseconds
    assert at > 0, "no 8-byte Duration in the header"
    return data[: at + 3] + struct.pack(">d", declared_seconds * 1000) + data[at + 11 :]
