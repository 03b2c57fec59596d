"""Whisper-family speech to text on CTranslate2, through faster-whisper's ``WhisperModel.transcribe``.

The audio path is the transformers backend's (:mod:`universal_predictors.speech.audio`: PyAV, the limits, the decode
budget); only the model differs. Each job is one ``WhisperModel.transcribe`` call on the decoded samples, with the
library's own sequential decoding (30 s windows, conditioning on the previous window's text, timestamps always),
so a served transcript is what faster-whisper gives in-process for the same samples and options.

Across requests: faster-whisper's ``BatchedInferencePipeline`` batches the voice-activity chunks of one file under
one tokenizer and one set of options; it takes no second file, and what it returns differs from
``WhisperModel.transcribe`` (no temperature fallback, no previous-text prompt, chunks cut by its VAD). So by default
the jobs of a batch run side by side: ``num_workers`` CTranslate2 replicas (its ``inter_threads``), one Python
thread each (CTranslate2 releases the GIL while it computes). With ``batch_windows`` they share CTranslate2
``generate`` calls, window by window, each still in faster-whisper's own loop (:class:`WindowBatcher`).
"""

from __future__ import annotations

import concurrent.futures
import copy
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from universal_predictors.speech.audio import (
    SAMPLE_RATE,
    Audio,
    AudioLimits,
    HeldSamples,
    StreamedSamples,
    as_float,
    read_audio,
)
from universal_predictors.speech.whisper import (
    SHORTEST_STREAMED_SECONDS,
    Job,
    Segment,
    SpeechTask,
    Transcript,
    Word,
    checked_language,
)

#: faster-whisper's decoding budget per window (``WhisperModel.max_length``): every Whisper has 448 positions.
MAX_LENGTH = 448
#: The spec name CTranslate2's converters write at the head of a Whisper's ``model.bin``.
_CT2_WHISPER_SPEC = b"WhisperSpec"


def is_ctranslate2_whisper(source: str) -> bool:
    """Whether ``source`` is a directory as CTranslate2's converter writes a Whisper: ``model.bin`` whose header
    names ``WhisperSpec`` (a uint32 format version, a uint16 length, the spec's name), beside a ``config.json``
    that is CTranslate2's (``alignment_heads``, ``lang_ids``), not a transformers config (``model_type``)."""
    folder = Path(source)
    weights, config = folder / "model.bin", folder / "config.json"
    if not (weights.is_file() and config.is_file()):
        return False
    with weights.open("rb") as handle:
        head = handle.read(6 + 64)
    length = int.from_bytes(head[4:6], "little") if len(head) >= 6 else 0
    if head[6 : 6 + length].rstrip(b"\0") != _CT2_WHISPER_SPEC:
        return False
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "model_type" not in data


def ctranslate2_cuda_devices() -> int:
    """CUDA devices CTranslate2 can use (0 on a CPU build or a machine without one)."""
    import ctranslate2

    return int(ctranslate2.get_cuda_device_count())


def default_compute_type(device: str) -> str:
    """int8 on CPUs (CTranslate2's quantised kernels), float16 on GPUs."""
    return "float16" if device.startswith("cuda") else "int8"


@dataclass(frozen=True)
class DecodeOptions:
    """faster-whisper's options that are the server's, not the request's."""

    beam_size: int = 5
    #: Jobs of one batch share CTranslate2 ``generate`` calls (:class:`WindowBatcher`); False: side by side on the
    #: replicas, one job per call.
    batch_windows: bool = False


class FasterWhisperEngine:
    """One CTranslate2 Whisper directory on one device; the same request-path checks as the transformers engine."""

    def __init__(self, source: str, device: str, compute_type: str, *, device_index: int = 0, cpu_threads: int = 0,
                 num_workers: int = 1, options: DecodeOptions | None = None) -> None:  # fmt: skip
        from faster_whisper import WhisperModel

        self.model = WhisperModel(source, device=device, device_index=device_index, compute_type=compute_type,
                                  cpu_threads=cpu_threads, num_workers=num_workers, local_files_only=True)  # fmt: skip
        self.device = device
        self.compute_type = compute_type
        self.options = options or DecodeOptions()
        # faster-whisper computes a whole file's log-mel at once (about 825 KB a second of audio at its peak: 3 GB
        # for an hour); the same features, computed window by window, hold 32 KB a second.
        self.model.feature_extractor = windowed_feature_extractor(self.model.feature_extractor)
        self.multilingual = bool(self.model.model.is_multilingual)
        tokenizer = self.model.hf_tokenizer
        #: The codes faster-whisper knows whose language token this checkpoint's vocabulary has.
        self.languages = sorted(
            code for code in self.model.supported_languages if tokenizer.token_to_id(f"<|{code}|>") is not None
        )
        #: The longest prompt: faster-whisper keeps the last ``max_length // 2 - 1`` tokens of a longer one.
        self.max_prompt_tokens = MAX_LENGTH // 2 - 1
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="ct2-whisper")

    # -- on the request path (cheap, validating) ------------------------------------------------------------

    def check_language(self, language: str | None, task: SpeechTask) -> str | None:
        return checked_language(language, task, self.multilingual, self.languages)

    def prompt_ids(self, prompt: str | None) -> tuple[int, ...] | None:
        """The prompt's tokens as faster-whisper encodes an ``initial_prompt`` (a space, the stripped text)."""
        if not prompt:
            return None
        from universal_predictors.errors import InvalidRequest

        ids = self.model.hf_tokenizer.encode(" " + prompt.strip(), add_special_tokens=False).ids
        if len(ids) > self.max_prompt_tokens:
            raise InvalidRequest(f"prompt: {len(ids)} tokens; this model takes at most {self.max_prompt_tokens}",
                                 param="prompt", code="prompt_too_long")  # fmt: skip
        return tuple(int(i) for i in ids)

    def read(self, data: bytes, field: str, limits: AudioLimits, hold_seconds: float) -> tuple[Any, float]:
        """``data``'s samples for :meth:`transcribe` and its seconds: decoded whole if it lasts at most
        ``hold_seconds``, else streamed (:class:`StreamedWaveform`), the largest value of its features found as it
        is read through (on the request path, beside the engine, in the same pass that counts it)."""
        found = read_audio(data, field, limits, int(hold_seconds * SAMPLE_RATE),
                           lambda: RunningLargest(self.model.feature_extractor),
                           SHORTEST_STREAMED_SECONDS * SAMPLE_RATE)  # fmt: skip
        if isinstance(found, Audio):
            return found.samples, found.seconds
        scan, running = found
        largest = running.finish(scan.length, scan.head, scan.tail)
        return streamed_waveform(StreamedSamples(data, field, limits, scan), largest), scan.seconds

    # -- on the engine thread ------------------------------------------------------------------------------

    def transcribe_batch(self, jobs: Sequence[Job]) -> list[Transcript]:
        """Every job decoded, in order: up to ``num_workers`` at once, or (``batch_windows``) all at once, their
        windows decoded together by a :class:`WindowBatcher`."""
        if not self.options.batch_windows or len(jobs) < 2:
            return list(self._pool.map(self.transcribe, jobs))
        batcher = WindowBatcher(self.model.model, len(jobs), self.model.hf_tokenizer.token_to_id(_SOT))
        # A shallow copy whose ``model`` is the batcher: faster-whisper's own decoding loop, run once per job on its
        # own thread, reaches CTranslate2 only through ``self.model`` (faster-whisper 1.2.1, transcribe.py:
        # ``WhisperModel.encode``, ``generate_with_fallback``, ``detect_language``, ``find_alignment``).
        model = copy.copy(self.model)
        model.model = batcher

        def run(job: Job) -> Transcript:
            try:
                return self.transcribe(job, model)
            finally:
                batcher.leave()

        with concurrent.futures.ThreadPoolExecutor(len(jobs), thread_name_prefix="ct2-batch") as pool:
            return list(pool.map(run, jobs))

    def transcribe(self, job: Job, model: Any = None) -> Transcript:
        found, info = (model or self.model).transcribe(job.samples, **self.transcribe_kwargs(job))
        segments: list[Segment] = []
        texts: list[str] = []
        running = ""
        for number, s in enumerate(found):
            # Times to the millisecond (sums of 20 ms steps carry float noise: 51.120000000000005).
            words = tuple(Word(w.word, _ms(w.start), _ms(w.end), float(w.probability)) for w in s.words or ())
            segments.append(Segment(number, s.seek, _ms(s.start), _ms(s.end), s.text, list(s.tokens),
                                    avg_logprob=float(s.avg_logprob), no_speech_prob=float(s.no_speech_prob),
                                    words=words))  # fmt: skip
            running += s.text
            texts.append(running)
            if job.on_window is not None:
                # faster-whisper 1.x transcribe.py: ``transcribe`` returns ``generate_segments``' generator, which
                # yields a window's segments once that window decodes, before the next one starts; so each segment
                # is told here before the rest of the audio is decoded.
                job.on_window(running)
        return Transcript(info.language, segments, info.duration, texts)

    def transcribe_kwargs(self, job: Job) -> dict[str, Any]:
        """``WhisperModel.transcribe``'s arguments for ``job`` (the benchmark and the tests call it with these)."""
        return {
            "language": job.language,
            "task": job.task,
            "beam_size": self.options.beam_size,
            "temperature": job.temperature,
            "initial_prompt": list(job.prompt_ids) if job.prompt_ids else None,
            "word_timestamps": job.words,
            "vad_filter": False,
        }

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_SOT = "<|startoftranscript|>"

#: Frames of log-mel computed at a time by :func:`windowed_feature_extractor` (one Whisper window: 30 s).
FEATURE_STEP_FRAMES = 3000


def windowed_feature_extractor(extractor: Any) -> Any:
    """faster-whisper's ``FeatureExtractor`` (``extractor``'s settings) computing its features window by window.

    faster-whisper 1.2.1 ``transcribe.py`` ``WhisperModel.transcribe`` calls ``self.feature_extractor(audio,
    chunk_length=...)`` once on the whole file, and ``feature_extractor.py`` ``FeatureExtractor.__call__`` holds the
    file's frames (float32), their complex spectrum (complex128, then a complex64 copy), the power and the mel at
    once: measured here, peak RSS +495 MB for 10 minutes of audio and +990 MB for 20 (825 KB a second). Each frame
    depends only on its own ``n_fft`` samples of the padded signal, and the one file-wide step (clamping to 8 below
    the largest value) comes after the log; so each window's frames are cut from the padding's pieces (the zeros it
    adds at the end, the reflection at both ends), transformed with the same NumPy calls and layouts, and written into
    one preallocated array, clamped and scaled in place at the end. The result equals the library's
    (``tests/predictors/test_transcribe_faster_whisper.py`` compares them bit for bit on several lengths)."""
    from faster_whisper.feature_extractor import FeatureExtractor

    class WindowedFeatureExtractor(FeatureExtractor):
        def __call__(self, waveform: Any, padding: int = 160, chunk_length: int | None = None) -> Any:
            if isinstance(waveform, StreamedWaveform):
                return StreamedLogMel(self, waveform.source, padding, chunk_length, largest=waveform.largest)
            return windowed_log_mel(self, waveform, padding, chunk_length)

    windowed = WindowedFeatureExtractor.__new__(WindowedFeatureExtractor)
    windowed.__dict__.update(extractor.__dict__)
    return windowed


def _set_chunk_length(extractor: Any, chunk_length: int | None) -> None:
    if chunk_length is not None:  # as the library's call does: its window's size follows the last one asked for
        extractor.n_samples = chunk_length * extractor.sampling_rate
        extractor.nb_max_frames = extractor.n_samples // extractor.hop_length


def frame_count(extractor: Any, length: int, padding: int) -> int:
    """The frames of the library's features of ``length`` samples (it drops the last one: ``stft[..., :-1]``)."""
    padded = length + (padding or 0) + 2 * (extractor.n_fft // 2)
    return int(1 + (padded - extractor.n_fft) // extractor.hop_length - 1)


class _Framing:
    """How the library frames a waveform of ``length`` samples: the zeros it adds at the end (``padding``), the
    reflection ``torch.stft(center=True)`` adds at both ends, the Hann window, the number of frames (the library
    drops the last one: ``stft[..., :-1]``), and the steps :func:`windowed_log_mel` computes them in."""

    def __init__(self, extractor: Any, length: int, padding: int, first: Any, last: Any) -> None:
        """``first`` and ``last``: the waveform's first and last ``n_fft // 2 + 1`` samples (or all of them); the
        waveform is longer than one step (:func:`frame_count`)."""
        self.extractor = extractor
        self.n_fft, self.hop = extractor.n_fft, extractor.hop_length
        self.half = self.n_fft // 2
        self.tail = np.zeros(padding or 0, np.float32)
        self.signal = length + (padding or 0)  # the waveform and the zeros the library adds at its end
        self.frames = frame_count(extractor, length, padding)
        # The padded signal is: head (reflection of samples 1..half), the waveform, the zeros, end (reflection of the
        # ``half`` values before the last one).
        half = self.half
        self.head = np.pad(_take(first, self.tail, 0, half + 1), (half, 0), mode="reflect")[:half]
        # ``last`` holds the waveform's last samples: the signal's last ``half + 1`` of it and of the zeros.
        offset = length - len(last)
        self.end = np.pad(_take(last, self.tail, self.signal - half - 1 - offset, self.signal - offset), (0, half),
                          mode="reflect")[-half:]  # fmt: skip
        self.window = np.hanning(self.n_fft + 1)[:-1].astype("float32")

    def steps(self) -> list[tuple[int, int]]:
        """The frames computed at a time: :data:`FEATURE_STEP_FRAMES`, the last step taking what is left with it
        (between one and two steps' frames): a step of a few frames would go through BLAS's matrix-vector path,
        which sums in another order than the library's one product."""
        frames = self.frames
        starts = list(range(0, max(frames - FEATURE_STEP_FRAMES, 0) + 1, FEATURE_STEP_FRAMES)) if frames else []
        return [(first, starts[n + 1] if n + 1 < len(starts) else frames) for n, first in enumerate(starts)]

    def log_mel(self, waveform: Any, first: int, last: int) -> Any:
        """The log10 mel of frames ``first``..``last`` (before the file-wide clamp and scaling), with the library's
        NumPy calls and layouts; ``waveform[lo:hi]`` gives the samples they read."""
        lo, hi = first * self.hop, (last - 1) * self.hop + self.n_fft  # the padded signal's samples these frames read
        piece = _padded(waveform, self.tail, self.head, self.end, self.half, self.signal, lo, hi)[None]
        strided = np.lib.stride_tricks.as_strided(
            piece, (1, last - first, self.n_fft), (piece.strides[0], self.hop * piece.strides[1], piece.strides[1])
        )
        spectrum = np.fft.rfft(strided * self.window, n=self.n_fft, axis=-1).transpose((0, 2, 1)).squeeze(0)
        power = np.abs(spectrum.astype("complex64")) ** 2
        return np.log10(np.clip(self.extractor.mel_filters @ power, a_min=1e-10, a_max=None))


def windowed_log_mel(extractor: Any, waveform: Any, padding: int = 160, chunk_length: int | None = None) -> Any:
    """``FeatureExtractor.__call__``'s log-mel of ``waveform`` (faster-whisper 1.2.1 feature_extractor.py), computed
    :data:`FEATURE_STEP_FRAMES` frames at a time (:func:`windowed_feature_extractor`)."""
    _set_chunk_length(extractor, chunk_length)
    # (The library's ``waveform.dtype is not np.float32`` is always true: it copies even float32 samples.) 16-bit
    # samples (the predictor's decode) stay 16-bit: each piece is scaled as it is cut (:func:`_take`).
    waveform = np.asarray(waveform)
    if waveform.dtype != np.int16:
        waveform = waveform.astype(np.float32, copy=False)
    if frame_count(extractor, len(waveform), padding) <= FEATURE_STEP_FRAMES:
        # One window's worth or less (and audio shorter than the reflection, where NumPy's reflection repeats): the
        # library's own path, which holds no more than one step does here and is quicker on a short clip.
        return _library_call(extractor, as_float(waveform), padding)
    framing = _Framing(extractor, len(waveform), padding, waveform, waveform)
    out = np.empty((extractor.mel_filters.shape[0], framing.frames), np.float32)
    for first, last in framing.steps():
        out[:, first:last] = framing.log_mel(waveform, first, last)
    np.maximum(out, out.max() - 8.0, out=out)
    out += 4.0
    out /= 4.0
    return out


class StreamedWaveform(np.ndarray):
    """What faster-whisper's ``transcribe`` is given for a file streamed from its bytes (:func:`streamed_waveform`):
    an array of the file's length that holds no samples (its ``transcribe`` reads ``audio.shape`` and passes it to
    the feature extractor, which computes the features from ``source``: :class:`StreamedLogMel`)."""

    source: StreamedSamples
    #: The largest log10 mel of the file, where it was computed beforehand (:func:`largest_log_mel`).
    largest: float | None


def streamed_waveform(source: StreamedSamples, largest: float | None = None) -> StreamedWaveform:
    """``source`` as the array faster-whisper takes (one 16-bit zero seen at every index: two bytes)."""
    empty = np.lib.stride_tricks.as_strided(np.zeros(1, np.int16), shape=(len(source),), strides=(0,),
                                            writeable=False)  # fmt: skip
    waveform = empty.view(StreamedWaveform)
    waveform.source = source
    waveform.largest = largest
    return waveform


class RunningLargest:
    """:func:`largest_log_mel` of a file given chunk by chunk, front to back, as it is read through: each step of
    frames computed once its samples have come, holding about two steps' samples. Frames that read only the file's
    own samples have the same values whatever the file's length, so they are computed before the length is known;
    the last step (the zeros and reflection at the end) once it is (:meth:`finish`)."""

    #: A length no file reaches: the provisional framing's end, which no frame computed before :meth:`finish` reads.
    _UNKNOWN = 1 << 62

    def __init__(self, extractor: Any, padding: int = 160) -> None:
        self._extractor, self._padding = extractor, padding
        self._hop, self._half, self._n_fft = extractor.hop_length, extractor.n_fft // 2, extractor.n_fft
        self.largest = -np.inf
        self._chunks: list[Any] = []
        self._start = 0  # the file's index of the first sample held
        self._received = 0
        self._next = 0  # the first frame not yet computed
        self._framing: _Framing | None = None

    def add(self, chunk: Any) -> None:
        self._chunks.append(chunk)
        self._received += len(chunk)
        step = FEATURE_STEP_FRAMES
        # The signal's samples frames first..last read end at (last - 1) * hop + n_fft - half.
        if (self._next + step - 1) * self._hop + self._n_fft - self._half > self._received:
            return
        held = np.concatenate(self._chunks)
        if self._framing is None:
            self._framing = _Framing(self._extractor, self._UNKNOWN, self._padding, held, held)
        window = HeldSamples(held, self._start, self._UNKNOWN)
        while (self._next + step - 1) * self._hop + self._n_fft - self._half <= self._received:
            self.largest = max(self.largest, float(self._framing.log_mel(window, self._next, self._next + step).max()))
            self._next += step
        # Kept: from a step before the next frame (the last step may reach back that far: _Framing.steps).
        keep = max(self._start, (self._next - step) * self._hop - self._half)
        self._chunks = [held[keep - self._start :]]
        self._start = keep

    def finish(self, length: int, head: Any, tail: Any) -> float:
        """The largest value, the file (``length`` samples; ``head`` and ``tail``, its first and last ones) read."""
        edge = self._half + 1
        framing = _Framing(self._extractor, length, self._padding, head[:edge], tail[-edge:])
        if self._next < framing.frames:
            first = max(0, min(self._next, framing.frames - FEATURE_STEP_FRAMES))
            held = HeldSamples(np.concatenate(self._chunks), self._start, length)
            self.largest = max(self.largest, float(framing.log_mel(held, first, framing.frames).max()))
        return float(self.largest)


def largest_log_mel(extractor: Any, source: StreamedSamples, padding: int = 160) -> float:
    """The largest value of ``source``'s log10 mel (before the library's clamp and scaling), computed step by step:
    what :class:`StreamedLogMel` needs before its first window."""
    edge = extractor.n_fft // 2 + 1
    framing = _Framing(extractor, len(source), padding, source.scan.head[:edge], source.scan.tail[-edge:])
    return max(float(framing.log_mel(source, first, last).max()) for first, last in framing.steps())


class StreamedLogMel:
    """The log-mel features of a streamed file, computed window by window as faster-whisper slices them
    (``features[:, seek:seek + 3000]``, ``features[..., seek:]`` for language detection), each equal to the
    library's features of the whole file at those frames (tested bit for bit). The file-wide step (clamping to 8
    below the largest value) needs the largest value first: found as the file was read through (``largest``:
    :class:`RunningLargest`), else by a pass over it here; then windows are computed as they are asked for. So a
    file's features cost about twice the library's to compute and hold one window (960 KB) at a time instead of 32 KB
    a second."""

    ndim = 2

    def __init__(self, extractor: Any, source: StreamedSamples, padding: int, chunk_length: int | None,
                 start: int = 0, stop: int | None = None, largest: float | None = None) -> None:  # fmt: skip
        _set_chunk_length(extractor, chunk_length)
        self._extractor, self._source = extractor, source
        edge = extractor.n_fft // 2 + 1
        self._framing = _Framing(extractor, len(source), padding, source.scan.head[:edge], source.scan.tail[-edge:])
        self._start = start
        self._stop = self._framing.frames if stop is None else stop
        self.shape = (int(extractor.mel_filters.shape[0]), self._stop - self._start)
        self._largest = largest_log_mel(extractor, source, padding) if largest is None else largest

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key: Any) -> Any:
        rows, frames = key if isinstance(key, tuple) else (slice(None), key)
        if rows not in (Ellipsis, slice(None)) or not isinstance(frames, slice) or frames.step not in (None, 1):
            raise TypeError(f"streamed features are sliced by frames only, not {key!r}")
        first, last, _ = frames.indices(self.shape[1])
        first, last = self._start + first, self._start + max(last, first)
        if frames.stop is None:  # an open slice (language detection's ``features[..., seek:]``): still streamed
            return StreamedLogMel(self._extractor, self._source, len(self._framing.tail), None, first, self._stop,
                                  self._largest)  # fmt: skip
        return self._frames(first, last)

    def _frames(self, first: int, last: int) -> Any:
        """Frames ``first``..``last``, clamped and scaled as the library does the whole file's."""
        # At least one step's frames in one product (see _Framing.steps), taken from there.
        total = self._framing.frames
        lo = max(0, min(first, total - FEATURE_STEP_FRAMES))
        hi = min(total, max(last, lo + FEATURE_STEP_FRAMES))
        out = self._framing.log_mel(self._source, lo, hi)[:, first - lo : last - lo]
        out = np.ascontiguousarray(out)
        np.maximum(out, self._largest - 8.0, out=out)
        out += 4.0
        out /= 4.0
        return out


def _library_call(extractor: Any, waveform: Any, padding: int) -> Any:
    """The library's own ``__call__`` on ``waveform`` (for a clip of one window or less)."""
    from faster_whisper.feature_extractor import FeatureExtractor

    return FeatureExtractor.__call__(extractor, waveform, padding)


def _take(waveform: Any, tail: Any, lo: int, hi: int) -> Any:
    """Samples ``lo``..``hi`` of the waveform (as float32) followed by the zeros ``tail``."""
    import numpy as np

    n = len(waveform)
    parts = [as_float(waveform[max(lo, 0) : min(hi, n)]), tail[max(lo - n, 0) : max(hi - n, 0)]]
    return np.concatenate([p for p in parts if len(p)]) if any(len(p) for p in parts) else np.zeros(0, np.float32)


def _padded(waveform: Any, tail: Any, head: Any, end: Any, half: int, signal: int, lo: int, hi: int) -> Any:
    """Samples ``lo``..``hi`` of the padded signal (head, waveform and zeros, end), as one contiguous array."""
    import numpy as np

    parts = []
    if lo < half:
        parts.append(head[lo : min(hi, half)])
    middle = _take(waveform, tail, max(lo - half, 0), min(hi - half, signal))
    if len(middle) and hi > half and lo < half + signal:
        parts.append(middle)
    if hi > half + signal:
        parts.append(end[max(lo - half - signal, 0) : hi - half - signal])
    return np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0], dtype=np.float32)


class _Window:
    """One job's 30 s window of log-mel features, as :meth:`WindowBatcher.encode` hands it to faster-whisper in
    place of its encoder output: encoded by the batched ``generate`` (CTranslate2's ``Whisper.generate`` takes features
    as well as encoder outputs), or here on demand for what needs the encoder output itself."""

    def __init__(self, model: Any, features: Any, to_cpu: bool) -> None:
        self._model, self.features, self._to_cpu = model, features, to_cpu
        self._encoded: Any = None

    def encoded(self) -> Any:
        if self._encoded is None:
            self._encoded = self._model.encode(self.features, to_cpu=self._to_cpu)
        return self._encoded


@dataclass
class _Call:
    window: _Window
    prompt: list[int]
    options: dict[str, Any]
    result: Any = None
    error: BaseException | None = None
    answered: bool = False


class WindowBatcher:
    """Stands in for the CTranslate2 Whisper (``WhisperModel.model``) while the jobs of one batch decode, one thread
    each, each in faster-whisper's own loop: every job's ``generate`` waits until each job still decoding is waiting
    in ``generate`` too, then the waiting windows go through one CTranslate2 ``generate`` call per group of equal
    options and equal ``<|startoftranscript|>`` position (CTranslate2 4.x refuses a batch whose prompts put it at
    different positions: "requires the <|startoftranscript|> token to be at the same position in all batches", so a
    window conditioned on more previous text than another goes in a call of its own).

    Batched: the decoding of each window (greedy, beam search, sampling; the temperature fallback re-decodes a window
    in a later step). Not batched, per job on its thread: language detection and word alignment, which need the
    encoder output: the window is encoded again for them (``_Window.encoded``)."""

    def __init__(self, model: Any, jobs: int, sot: int | None) -> None:
        self._model = model
        self._live = jobs
        self._sot = sot
        self._waiting: list[_Call] = []
        self._lock = threading.Condition()

    def __getattr__(self, name: str) -> Any:  # is_multilingual, n_mels, device...: the model's own
        return getattr(self._model, name)

    def encode(self, features: Any, to_cpu: bool = False) -> _Window:
        return _Window(self._model, features, to_cpu)

    def detect_language(self, features: Any, *args: Any, **kwargs: Any) -> Any:
        return self._model.detect_language(_encoder_output(features), *args, **kwargs)

    def align(self, features: Any, *args: Any, **kwargs: Any) -> Any:
        return self._model.align(_encoder_output(features), *args, **kwargs)

    def generate(self, features: Any, prompts: list[list[int]], **options: Any) -> Any:
        if not isinstance(features, _Window) or len(prompts) != 1:
            return self._model.generate(_encoder_output(features), prompts, **options)
        call = _Call(features, list(prompts[0]), options)
        with self._lock:
            self._waiting.append(call)
            self._decode_if_all_wait()
            while not call.answered:
                self._lock.wait()
        if call.error is not None:
            raise call.error
        return [call.result]

    def leave(self) -> None:
        """One job done (or failed): the others no longer wait for it."""
        with self._lock:
            self._live -= 1
            self._decode_if_all_wait()

    def _decode_if_all_wait(self) -> None:
        if not self._waiting or len(self._waiting) < self._live:
            return
        calls, self._waiting = self._waiting, []
        groups: dict[tuple[int, str], list[_Call]] = {}
        for call in calls:
            sot = call.prompt.index(self._sot) if self._sot in call.prompt else len(call.prompt)
            groups.setdefault((sot, repr(sorted(call.options.items()))), []).append(call)
        import numpy as np
        from ctranslate2 import StorageView

        for group in groups.values():
            try:
                features = np.concatenate([np.asarray(call.window.features) for call in group])
                found = self._model.generate(StorageView.from_array(features), [c.prompt for c in group],
                                             **group[0].options)  # fmt: skip
                for call, result in zip(group, found, strict=True):
                    call.result = result
            except Exception as error:  # every job of the group fails with it
                for call in group:
                    call.error = error
            for call in group:
                call.answered = True
        self._lock.notify_all()


def _encoder_output(features: Any) -> Any:
    return features.encoded() if isinstance(features, _Window) else features


def _ms(seconds: float) -> float:
    return round(float(seconds), 3)
