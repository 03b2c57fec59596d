"""Uploaded audio to 16 kHz mono samples, with every limit checked before the step it protects.

PyAV (FFmpeg's demuxers and decoders, bundled in its wheels) reads WAV, FLAC, MP3, OGG (Vorbis, Opus), M4A/MP4
(AAC, ALAC) and WebM/Matroska; soundfile (libsndfile) would leave out M4A and WebM, which browsers' recorders and
phones send. The container is chosen from the file's first bytes, never from its name, and only these demuxers
are opened: FFmpeg's others include playlists (HLS, concat) that would open further files or URLs.

Order of checks: the size in bytes (``max_audio_bytes``); the container's header, read without decoding, for the
channels (``max_audio_channels``) and the duration it declares (``max_audio_seconds``); then decoding, which stops
as soon as the samples pass ``max_audio_seconds`` whatever the header said (a header that lies short, or none).
A header that lies long is taken at its word: over the limit is a 413 before any frame is decoded. Every client
mistake is an :class:`InvalidRequest` (400) naming the field, every limit a :class:`RequestTooLarge` (413) naming
the limit's engine argument and its value.

A file is either decoded whole (:func:`decode_audio`) or streamed: read through once for its length and ends with
every check (:func:`scan_audio`), then decoded again as its samples are asked for, front to back
(:class:`StreamedSamples`), which faster-whisper's engine does for long files (``tasks/transcribe.py``).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol, TypeVar

import numpy as np

from universal_predictors.errors import InvalidRequest, RequestTooLarge

#: The rate Whisper-family feature extractors take.
SAMPLE_RATE = 16_000
#: Sample rates a real recording has at most (FFmpeg would take more, and resample a lie at length).
MAX_SOURCE_RATE = 384_000
FORMATS = "WAV, FLAC, MP3, OGG/Opus, M4A or WebM"
#: Memory one second of audio holds while a request is decoded and transcribed, in bytes: the samples (16-bit, 32
#: KB; transformers' engine scales a copy to float32 for its extractor, 64 KB), their log-mel features (32 KB), and
#: room for the samples to grow where the header said less (up to half again), rounded up. Measured with float32
#: samples (64 KB a second, before they were decoded to 16-bit): decoding and extracting a 10 minute file raised peak
#: RSS by 96 MB (160 KB/s), 20 minutes by 116 MB, when the decoder's frames were joined at the end (decoding alone,
#: 20 minutes: 175 MB then, 94 MB since the samples go into one array).
BYTES_PER_AUDIO_SECOND = 192 * 1024
#: Seconds of samples room is made for first when a header declares no duration (then grown by half at a time).
GUESS_SECONDS = 60

Damaged = Callable[[str], InvalidRequest]


@dataclass(frozen=True)
class AudioLimits:
    """What one uploaded file may be."""

    max_audio_bytes: int
    max_audio_seconds: float
    max_audio_channels: int


@dataclass(frozen=True)
class Audio:
    """Decoded audio: 16-bit samples at :data:`SAMPLE_RATE`, mono (:func:`as_float` scales them to [-1, 1)); the
    container it came in."""

    samples: np.ndarray
    container: str

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def sniff_container(data: bytes) -> str | None:
    """FFmpeg's demuxer for ``data`` by its magic bytes, or None when it is none of :data:`FORMATS`."""
    head = data[:12]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "wav"
    if head[:4] == b"fLaC":
        return "flac"
    if head[:4] == b"OggS":
        return "ogg"
    if head[4:8] == b"ftyp":
        return "mov"  # FFmpeg's MP4/M4A demuxer (mov,mp4,m4a,3gp,3g2,mj2)
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "matroska"  # WebM is Matroska
    if head[:3] == b"ID3":
        return "mp3"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        # ADTS AAC has layer bits 00 where every MPEG audio layer (MP3's is 01) has others.
        return "aac" if head[1] & 0x06 == 0 else "mp3"
    return None


#: FFmpeg's probing options per demuxer. A WAV's header names its codec, channels and rate, yet opening one probes its
#: samples (``avformat_find_stream_info`` reads up to ``probesize``, 5 MB, and ``analyzeduration``, 5 s, by default):
#: 3.4 ms of a 3 s voice note's 4.3 ms decode, measured here (PyAV 18.1, FFmpeg 8.1), paid twice a request (the header's
#: check, then the decode). Probing nothing gives the same stream parameters and the same samples (tested); the other
#: demuxers keep FFmpeg's defaults (MP3's and ADTS's durations are estimated from what probing reads).
_PROBE: dict[str, dict[str, str]] = {"wav": {"probesize": "32", "analyzeduration": "0"}}


def _declared_seconds(container: object, stream: object) -> float | None:
    """The duration the header declares, if it declares one (``stream.duration`` in its time base, else the
    container's, in microseconds)."""
    duration = getattr(stream, "duration", None)
    time_base = getattr(stream, "time_base", None)
    if duration is not None and time_base is not None:
        return float(duration * Fraction(time_base))
    total = getattr(container, "duration", None)
    return total / 1_000_000 if total is not None else None


def wav_declared_seconds(data: bytes) -> tuple[float, int] | None:
    """What a WAV's header declares: (seconds, bytes of samples), from its ``fmt `` and ``data`` chunks; None when
    it does not say (a streaming writer's 0 or 0xFFFFFFFF size). FFmpeg clamps a ``data`` size past the end of the
    file to what is there; this reads the size as written, so a header that lies is seen as one."""
    position, byte_rate = 12, 0
    while position + 8 <= len(data):
        chunk, size = data[position : position + 4], int.from_bytes(data[position + 4 : position + 8], "little")
        if chunk == b"fmt " and position + 16 <= len(data):
            byte_rate = int.from_bytes(data[position + 16 : position + 20], "little")
        elif chunk == b"data":
            if size in (0, 0xFFFFFFFF) or byte_rate <= 0:
                return None
            return size / byte_rate, size
        position += 8 + size + (size & 1)
    return None


@contextlib.contextmanager
def _opened(data: bytes, field: str, limits: AudioLimits) -> Iterator[tuple[Any, Any, float | None, Damaged]]:
    """The container of ``data``, open, with everything its header can tell checked (module docstring): its audio
    stream, the duration it declares (None: it does not say), and the 400 for a file that turns out damaged."""
    import av

    if len(data) > limits.max_audio_bytes:
        raise RequestTooLarge(
            f"{field}: the file is {len(data)} bytes; the limit max_audio_bytes is {limits.max_audio_bytes}",
            param=field,
            code="file_too_large",
        )
    if not data:
        raise InvalidRequest(f"{field}: the file is empty", param=field, code="invalid_audio")
    kind = sniff_container(data)
    if kind is None:
        raise InvalidRequest(f"{field}: not an audio file this server reads; send {FORMATS}", param=field,
                             code="unsupported_audio_format")  # fmt: skip

    def damaged(why: str) -> InvalidRequest:
        return InvalidRequest(f"{field}: the {kind} file cannot be decoded ({why}); is it complete?", param=field,
                              code="invalid_audio")  # fmt: skip

    if kind == "wav" and (header := wav_declared_seconds(data)) is not None:
        seconds, size = header
        if seconds > limits.max_audio_seconds:
            raise _too_long(field, f"its header says {seconds:.1f} seconds", limits)
        if size > len(data):
            raise damaged(f"its header declares {size} bytes of samples and the file is {len(data)} bytes")
    try:
        container = av.open(io.BytesIO(data), mode="r", format=kind, options=_PROBE.get(kind))
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise damaged(_reason(exc)) from None
    with container:
        if not container.streams.audio:
            raise damaged("it holds no audio stream")
        stream = container.streams.audio[0]
        channels = stream.codec_context.channels
        if channels > limits.max_audio_channels:
            raise RequestTooLarge(f"{field}: the audio has {channels} channels; the limit max_audio_channels is "
                                  f"{limits.max_audio_channels}", param=field, code="too_many_channels")  # fmt: skip
        rate = stream.codec_context.sample_rate or 0
        if not 0 < rate <= MAX_SOURCE_RATE:
            raise damaged(f"a sample rate of {rate} Hz")
        declared = _declared_seconds(container, stream)
        if declared is not None and declared > limits.max_audio_seconds:
            raise _too_long(field, f"its header says {declared:.1f} seconds", limits)
        yield container, stream, declared, damaged


def declared_seconds(data: bytes, field: str, limits: AudioLimits) -> float | None:
    """The duration ``data``'s header declares (None: it does not say), after every check the header allows: what
    a request reserves memory for before it decodes."""
    with _opened(data, field, limits) as (_, _, declared, _):
        return declared


def _decoded(container: Any, stream: Any, damaged: Damaged, field: str, limits: AudioLimits) -> Iterator[np.ndarray]:
    """The open ``container``'s samples (16 kHz mono 16-bit) chunk by chunk, about a second at a time: decoding
    stops with a 413 as soon as they pass ``max_audio_seconds`` (module docstring); a 400 for a damaged file or one
    with no audio frames."""
    import av

    # 16-bit samples, as faster-whisper's own ``decode_audio`` (faster-whisper 1.2.1 audio.py: ``format="s16"``,
    # then ``/ 32768.0``) and openai-whisper's ``load_audio`` (``-f s16le``) read a file: the same samples its
    # engine gets from a path, and half the memory of float32 while the request waits and decodes (they are
    # scaled window by window where the features are computed).
    resampler = av.AudioResampler(format="s16", layout="mono", rate=SAMPLE_RATE)
    # The decoder's frames (20 ms of Opus, 26 ms of MP3) gathered into about a second before they are resampled, as
    # faster-whisper's decode gathers them (``_group_frames``): the same samples, with a Python call or two a second
    # instead of fifty (a 10 minute Opus file decoded in 1.5 s instead of 3.1, measured).
    fifo = av.AudioFifo()
    group = stream.codec_context.sample_rate
    most = int(limits.max_audio_seconds * SAMPLE_RATE)
    total = 0

    def resampled(frame: Any) -> Iterator[np.ndarray]:
        nonlocal total
        for out in resampler.resample(frame):
            chunk = out.to_ndarray().reshape(-1)
            total += len(chunk)
            if total > most and frame is not None:
                raise _too_long(field, f"it decodes to more than {limits.max_audio_seconds:g} seconds", limits)
            yield chunk

    try:
        for frame in container.decode(stream):
            frame.pts = None  # the fifo would check that each frame's time follows the last one's
            fifo.write(frame)
            if fifo.samples >= group:
                yield from resampled(fifo.read())
        if fifo.samples:
            yield from resampled(fifo.read())
        yield from resampled(None)
    except av.FFmpegError as exc:
        raise damaged(_reason(exc)) from None
    except ValueError as exc:  # a frame whose format, layout or rate differs from the first's (the fifo's)
        raise damaged(f"its audio changes format midway: {exc}") from None
    if not total:
        raise damaged("no audio frames in it")


def _chunks(data: bytes, field: str, limits: AudioLimits) -> Generator[np.ndarray, None, None]:
    """:func:`_decoded` of ``data``, opened here (and closed when the chunks are, or run out)."""
    with _opened(data, field, limits) as (container, stream, _, damaged):
        yield from _decoded(container, stream, damaged, field, limits)


def decode_audio(data: bytes, field: str, limits: AudioLimits) -> Audio:
    """``data`` (an uploaded file) as 16 kHz mono 16-bit samples, within ``limits`` (module docstring)."""
    found = read_audio(data, field, limits, int(limits.max_audio_seconds * SAMPLE_RATE), _Ignore)
    assert isinstance(found, Audio)  # decoding stops with a 413 past max_audio_seconds
    return found


@dataclass(frozen=True)
class Scan:
    """A file decoded once without keeping its samples: how many there are, and its first and last ``edge``."""

    length: int
    head: np.ndarray
    tail: np.ndarray

    @property
    def seconds(self) -> float:
        return self.length / SAMPLE_RATE


def scan_audio(data: bytes, field: str, limits: AudioLimits) -> Scan:
    """``data`` read through once (:func:`read_audio`) for its :class:`Scan` alone."""
    found = read_audio(data, field, limits, 0, _Ignore)
    assert not isinstance(found, Audio)  # every file has more than no samples
    return found[0]


class _Ignore:
    def add(self, chunk: np.ndarray) -> None:
        pass


class _Reader(Protocol):
    def add(self, chunk: np.ndarray) -> None: ...


_R = TypeVar("_R", bound=_Reader)


def read_audio(data: bytes, field: str, limits: AudioLimits, hold: int, reader: Callable[[], _R],
               shortest: int = 0) -> Audio | tuple[Scan, _R]:  # fmt: skip
    """``data`` decoded whole if it has at most ``hold`` samples; else read through once, holding about a second of
    it at a time from there, every chunk given to a ``reader()`` (made when the file passes ``hold``): its
    :class:`Scan` and that reader; but decoded whole again if it turns out to have at most ``shortest`` samples (a
    header that said less, yet a short file). Either way every check of the module docstring. Samples held are
    decoded into one array sized from the header's duration (grown by half where it says less, or nothing; never
    past ``hold``), not into a list of chunks joined at the end: a file's samples are held once, not twice, at the
    peak."""
    edge = SAMPLE_RATE
    with _opened(data, field, limits) as (container, stream, declared, damaged):
        expected = int((declared if declared is not None else GUESS_SECONDS) * SAMPLE_RATE) + SAMPLE_RATE
        samples: np.ndarray | None = np.empty(min(hold + 1, max(expected, SAMPLE_RATE)), np.int16)
        running: _R | None = None
        head = tail = np.zeros(0, np.int16)
        total = 0
        for chunk in _decoded(container, stream, damaged, field, limits):
            if samples is not None and total + len(chunk) > hold:  # past what is held: read through from here
                running = reader()
                running.add(samples[:total])
                head = np.concatenate([samples[: min(total, edge)], chunk[:edge]])[:edge]
                samples = None
            if samples is None:
                assert running is not None
                running.add(chunk)
            else:
                if total + len(chunk) > len(samples):
                    grown = np.empty(max(total + len(chunk), min(hold + 1, len(samples) * 3 // 2)), np.int16)
                    grown[:total] = samples[:total]
                    samples = grown
                samples[total : total + len(chunk)] = chunk
            total += len(chunk)
            tail = np.concatenate([tail, chunk])[-edge:] if len(chunk) < edge else chunk[-edge:]
        kind = container.format.name
    if samples is not None:
        # What the header over-declared is given back (a copy only where that is more than a tenth).
        return Audio(samples[:total] if total * 10 >= len(samples) * 9 else samples[:total].copy(), kind)
    assert running is not None  # (made when the samples stopped being held)
    if total <= shortest:
        return decode_audio(data, field, limits)
    return Scan(total, head, tail.copy()), running


class StreamedSamples:
    """A file's samples decoded again as they are asked for, front to back: ``samples[lo:hi]`` holds what was
    decoded from ``lo`` on and drops what is before it, so a reader that moves forward (faster-whisper's windows)
    holds about one window of samples whatever the file's length. Asking for samples before those held decodes the
    file again from its start. Decoding the same bytes gives the same samples (``scan`` counted them)."""

    dtype = np.dtype(np.int16)

    def __init__(self, data: bytes, field: str, limits: AudioLimits, scan: Scan) -> None:
        self.scan = scan
        self.data, self.field, self.limits = data, field, limits
        self._restart()

    def __len__(self) -> int:
        return self.scan.length

    def _restart(self) -> None:
        self._chunks = _chunks(self.data, self.field, self.limits)
        self._held = np.zeros(0, np.int16)
        self._start = 0  # the file's index of self._held[0]

    def __getitem__(self, key: slice) -> np.ndarray:
        lo, hi, step = key.indices(self.scan.length)
        if step != 1:
            raise ValueError("streamed samples are read in order, one slice at a time")
        if lo < self._start:
            self._chunks.close()
            self._restart()
        end = self._start + len(self._held)
        pieces = [self._held[lo - self._start :]] if lo < end else []
        while end < hi:
            chunk = next(self._chunks, None)
            if chunk is None:
                break
            if end + len(chunk) > lo:
                pieces.append(chunk[max(lo - end, 0) :])
            end += len(chunk)
        self._held = np.concatenate(pieces) if pieces else np.zeros(0, np.int16)
        self._start = end - len(self._held)
        return self._held[: max(hi - lo, 0)].copy()


class HeldSamples:
    """Samples ``start``.. of a file of ``length`` (as far as they came), sliced by the file's indices: what a pass
    reading a file through keeps of it."""

    def __init__(self, samples: Any, start: int, length: int) -> None:
        self.samples, self.start, self.length = samples, start, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice) -> Any:
        lo, hi = key.start - self.start, key.stop - self.start
        if lo < 0 or hi > len(self.samples):
            raise IndexError(f"samples {key.start}..{key.stop} are not held ({self.start}..)")
        return self.samples[lo:hi]


def as_float(samples: np.ndarray) -> np.ndarray:
    """``samples`` as float32 in [-1, 1): 16-bit ones scaled as faster-whisper's ``decode_audio`` scales them
    (``astype(np.float32) / 32768.0``); float ones as they are."""
    if samples.dtype == np.int16:
        return samples.astype(np.float32) / 32768.0
    return np.asarray(samples, dtype=np.float32)


def _reason(exc: Exception) -> str:
    """FFmpeg's words for a failure (``Invalid data found when processing input``), without its errno."""
    return str(getattr(exc, "strerror", None) or type(exc).__name__)


def _too_long(field: str, why: str, limits: AudioLimits) -> RequestTooLarge:
    return RequestTooLarge(f"{field}: the audio is too long ({why}); the limit max_audio_seconds is "
                           f"{limits.max_audio_seconds:g}", param=field, code="audio_too_long")  # fmt: skip
