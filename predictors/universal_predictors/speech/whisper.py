"""Whisper-family speech to text on transformers: ``WhisperForConditionalGeneration.generate`` over batches.

Audio of concurrent requests is batched (:class:`~universal_predictors.batching.MicroBatcher` hands
:meth:`WhisperEngine.transcribe_batch` a batch), and each batch is split into groups that one ``generate`` call
can serve: the same task, language, prompt and temperature, and either all short (at most 30 s: one window,
features padded to 3000 frames as the feature extractor pads them) or all long. Long audio goes through
transformers' own sequential long-form decoding: 30 s windows, each starting at the last timestamp the previous
one predicted, with an attention mask telling each item's length, so an item decodes the same alone or batched.
Timestamps are always predicted; the segments and their times are ``generate``'s (``return_segments``).

A request that names no language has it detected once on its first 30 s (``detect_language``), then decodes as
if it had named it: the groups stay homogeneous, and the response can say which language it was.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import numpy as np

from universal_predictors.errors import InvalidRequest
from universal_predictors.speech.audio import (
    SAMPLE_RATE,
    Audio,
    AudioLimits,
    HeldSamples,
    StreamedSamples,
    as_float,
    read_audio,
)

#: One Whisper window: 30 s, 3000 mel frames.
WINDOW_SECONDS = 30
WINDOW_FRAMES = 3000
#: A file read through past what it was to be held (``read``: its header said it was shorter) is decoded whole
#: again if it lasts no longer than this (a streamed file is longer than a window or two).
SHORTEST_STREAMED_SECONDS = 2 * WINDOW_SECONDS

SpeechTask = Literal["transcribe", "translate"]


@dataclass(frozen=True)
class Job:
    """One request's audio and how to decode it."""

    #: 16 kHz mono: 16-bit as the predictor decodes them, or float32 in [-1, 1] (``audio.as_float``); or a file
    #: streamed as the engine reads it (``read``: faster-whisper's ``StreamedWaveform``, :class:`StreamedFeatures`).
    samples: Any
    task: SpeechTask
    language: str | None
    prompt_ids: tuple[int, ...] | None
    temperature: float
    #: Word timestamps asked for (cross-attention alignment: faster-whisper's, transformers' token timestamps).
    words: bool = False
    #: ``avg_logprob`` and ``no_speech_prob`` wanted (verbose_json): on transformers, generate keeps its scores.
    scored: bool = False
    #: Called on the engine thread with the text decoded so far, as each of its 30 s windows decodes (transformers)
    #: or each segment arrives (faster-whisper); streaming. Not part of what the job is.
    on_window: Callable[[str], None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Word:
    """One word and its time, in seconds from the start of the audio."""

    word: str
    start: float
    end: float
    #: The mean probability of its tokens (None where the engine was not asked to score them).
    probability: float | None


@dataclass(frozen=True)
class Segment:
    """A stretch of speech between two predicted timestamps, in seconds from the start of the audio."""

    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    #: The window's average token log probability and its no-speech probability (openai-whisper's; None where the
    #: job did not ask for them).
    avg_logprob: float | None = None
    no_speech_prob: float | None = None
    words: tuple[Word, ...] = ()

    @property
    def compression_ratio(self) -> float:
        """Text bytes over their zlib size (openai-whisper's repetition measure); 0 for no text."""
        data = self.text.encode()
        return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass(frozen=True)
class Transcript:
    """What one job decoded to. ``texts[i]``: the text of segments 0..i decoded together (a character's bytes
    may span two segments, so the whole is decoded as one, as transformers' pipeline does)."""

    language: str
    segments: list[Segment]
    seconds: float
    texts: list[str]

    @property
    def text(self) -> str:
        return self.texts[-1].strip() if self.texts else ""


def checked_language(language: str | None, task: SpeechTask, multilingual: bool,
                     languages: Sequence[str]) -> str | None:  # fmt: skip
    """``language`` as a checkpoint knows it; a 400 naming the ones it knows (English-only: no translation)."""
    if not multilingual:
        if task == "translate":
            raise InvalidRequest("This model is English-only: it cannot translate; use a multilingual "
                                 "Whisper checkpoint.", param="model", code="unsupported_task")  # fmt: skip
        if language not in (None, "en"):
            raise InvalidRequest(f"language: this model is English-only; {language!r} is not available",
                                 param="language", code="unsupported_language")  # fmt: skip
        return None
    if language is not None and language not in languages:
        raise InvalidRequest(f"language: {language!r} is not one of the model's languages "
                             f"({', '.join(languages)})", param="language", code="unsupported_language")  # fmt: skip
    return language


def long_form_features(samples: np.ndarray, extractor: Any, frames_per_step: int = WINDOW_FRAMES) -> Any:
    """The log-mel features ``extractor(samples, truncation=False, padding="longest")`` computes, equal to the bit,
    computed ``frames_per_step`` frames at a time.

    The extractor's own path holds the whole file's spectrogram at once (complex STFT, magnitudes, mel, log): decoding
    and extracting features raised a process's peak RSS by 377 MB for a 10 minute file and 714 MB for 20 minutes,
    about 2.2 GB for an hour. Each frame depends on its own 400 samples only, and the one file-wide step (clamping to
    8 below the largest value) comes after the log: so the log-mel is computed window by window into one
    preallocated tensor (32 KB per second), then clamped and scaled in place; measured the same way, 96 MB and
    116 MB. The reflection padding ``torch.stft(center=True)`` adds at the two ends is added once."""
    import torch

    n_fft, hop = extractor.n_fft, extractor.hop_length
    if getattr(extractor, "dither", 0.0):
        raise ValueError("a feature extractor with dither is not supported")
    padded = torch.nn.functional.pad(torch.from_numpy(samples)[None, None], (n_fft // 2, n_fft // 2), mode="reflect")
    padded = padded[0, 0]
    total = len(samples) // hop  # torch.stft's 1 + len // hop frames, less the last, as the extractor keeps them
    window = torch.hann_window(n_fft)
    mel = torch.from_numpy(extractor.mel_filters).to(torch.float32)
    out = torch.empty((extractor.feature_size, total), dtype=torch.float32)
    for start in range(0, total, frames_per_step):
        end = min(total, start + frames_per_step)
        stft = torch.stft(padded[start * hop : (end - 1) * hop + n_fft], n_fft, hop, window=window, center=False,
                          return_complex=True)  # fmt: skip
        out[:, start:end] = torch.clamp(mel.T @ (stft.abs() ** 2).contiguous(), min=1e-10).log10()
    torch.maximum(out, out.max() - 8.0, out=out)
    return out.add_(4.0).div_(4.0)[None]


class LogMelSteps:
    """:func:`long_form_features` of a file of ``length`` samples, one step (:data:`WINDOW_FRAMES` frames, from frame
    0; the last step what is left) at a time, from samples sliced by the file's indices (``samples[lo:hi]``): the
    same calls on the same values, so each step equals those frames of :func:`long_form_features` to the bit, before
    its file-wide clamp and scaling (:meth:`scaled`)."""

    def __init__(self, extractor: Any, length: int) -> None:
        import torch

        if getattr(extractor, "dither", 0.0):
            raise ValueError("a feature extractor with dither is not supported")
        self.n_fft, self.hop = int(extractor.n_fft), int(extractor.hop_length)
        self.half = self.n_fft // 2
        self.length = length
        self.frames = length // self.hop
        self.steps = -(-self.frames // WINDOW_FRAMES)
        self._window = torch.hann_window(self.n_fft)
        self._mel = torch.from_numpy(extractor.mel_filters).to(torch.float32)

    def bounds(self, step: int) -> tuple[int, int]:
        """The frames of ``step``."""
        return step * WINDOW_FRAMES, min(self.frames, (step + 1) * WINDOW_FRAMES)

    def reads_up_to(self, step: int) -> int:
        """The end of the samples a full ``step`` reads (the file's indices; the reflection at its start aside)."""
        return ((step + 1) * WINDOW_FRAMES - 1) * self.hop + self.n_fft - self.half

    def log_mel(self, samples: Any, step: int) -> Any:
        """The log10 mel of ``step``'s frames. The samples they read are the file's, reflected at its two ends as
        ``torch.stft(center=True)`` pads (the reflection of ``n_fft // 2`` samples)."""
        import torch

        first, last = self.bounds(step)
        lo, hi = first * self.hop - self.half, (last - 1) * self.hop + self.n_fft - self.half  # may pass the ends
        start, end = max(lo, 0), min(hi, self.length)
        got = as_float(np.asarray(samples[start:end]))  # (the reflected samples are among these: one slice)
        parts = [got]
        if lo < 0:  # index -i reads sample i
            parts.insert(0, got[1 - start : 1 - lo - start][::-1])
        if hi > self.length:  # index length + i reads sample length - 2 - i
            parts.append(got[2 * self.length - 1 - hi - start : self.length - 1 - start][::-1])
        piece = np.concatenate(parts) if len(parts) > 1 else got
        stft = torch.stft(torch.from_numpy(piece), self.n_fft, self.hop, window=self._window, center=False,
                          return_complex=True)  # fmt: skip
        return torch.clamp(self._mel.T @ (stft.abs() ** 2).contiguous(), min=1e-10).log10()

    @staticmethod
    def scaled(log_mel: Any, largest: float) -> Any:
        """Frames of :meth:`log_mel` clamped to 8 below the file's ``largest`` value and scaled, in place, as
        :func:`long_form_features` does the whole file's."""
        import torch

        torch.maximum(log_mel, torch.tensor(largest, dtype=torch.float32) - 8.0, out=log_mel)
        return log_mel.add_(4.0).div_(4.0)


class RunningLogMelMax:
    """The largest value of a file's :class:`LogMelSteps`, computed as the file is read through, front to back
    (``add``: a chunk of samples at a time; :func:`~universal_predictors.speech.audio.read_audio`'s reader): each step
    once its samples have come, holding about one step's samples; the steps that reach the file's end once its
    length is known (:meth:`finish`)."""

    #: A length no file reaches: no step computed before :meth:`finish` reads as far as the file's end.
    _UNKNOWN = 1 << 62

    def __init__(self, extractor: Any) -> None:
        self._extractor = extractor
        self._steps = LogMelSteps(extractor, self._UNKNOWN)
        self.largest = -math.inf
        self._chunks: list[np.ndarray] = []
        self._start = 0  # the file's index of the first sample held
        self._received = 0
        self._next = 0  # the first step not yet computed

    def add(self, chunk: np.ndarray) -> None:
        self._chunks.append(chunk)
        self._received += len(chunk)
        if self._steps.reads_up_to(self._next) > self._received:
            return
        held = HeldSamples(np.concatenate(self._chunks), self._start, self._UNKNOWN)
        while self._steps.reads_up_to(self._next) <= self._received:
            self.largest = max(self.largest, float(self._steps.log_mel(held, self._next).max()))
            self._next += 1
        keep = max(self._start, self._next * WINDOW_FRAMES * self._steps.hop - self._steps.half)
        self._chunks = [held.samples[keep - self._start :]]
        self._start = keep

    def finish(self, length: int) -> float:
        """The largest value, the file (``length`` samples) read."""
        steps = LogMelSteps(self._extractor, length)
        held = HeldSamples(np.concatenate(self._chunks), self._start, length)
        for step in range(self._next, steps.steps):
            self.largest = max(self.largest, float(steps.log_mel(held, step).max()))
        return float(self.largest)


class StreamedFeatures:
    """A streamed file's :func:`long_form_features`, computed a step at a time as windows are asked for
    (:meth:`frames`), from its samples decoded again front to back (:class:`StreamedSamples`): equal to the whole
    file's features at any frames (tested bit for bit), holding two steps (1.9 MB) instead of 32 KB a second. The
    file-wide clamp needs the largest value first: found as the file was read through (:class:`RunningLogMelMax`)."""

    def __init__(self, extractor: Any, source: StreamedSamples, largest: float) -> None:
        self._steps = LogMelSteps(extractor, len(source))
        self._source = source
        self._largest = largest
        self.mels = int(extractor.feature_size)
        self._held: dict[int, Any] = {}  # the latest steps computed (windows move forward; one may span two steps)

    def __len__(self) -> int:
        """The file's samples (what a job's length is counted in)."""
        return len(self._source)

    @property
    def frame_count(self) -> int:
        return self._steps.frames

    def frames(self, first: int, last: int) -> Any:
        """Frames ``first``..``last`` (as far as there are: a (mels, n) tensor, n <= last - first), clamped and
        scaled."""
        import torch

        last = min(last, self._steps.frames)
        if last <= first:
            return torch.zeros((self.mels, 0), dtype=torch.float32)
        pieces = []
        for step in range(first // WINDOW_FRAMES, (last - 1) // WINDOW_FRAMES + 1):
            if step not in self._held:
                if len(self._held) >= 2:
                    del self._held[min(self._held)]
                self._held[step] = LogMelSteps.scaled(self._steps.log_mel(self._source, step), self._largest)
            lo, hi = self._steps.bounds(step)
            pieces.append(self._held[step][:, max(first, lo) - lo : min(last, hi) - lo])
        return pieces[0].clone() if len(pieces) == 1 else torch.cat(pieces, dim=1)


class StreamedBatch:
    """What ``generate`` is given for a long-form batch holding a streamed file: its (batch, mels, frames) shape and
    device, with each item's frames computed as its windows are cut (``features[i:i + 1, :, seek:seek + n]``, and
    ``features[:, :, :n]`` for language detection) instead of held. Items are a streamed file
    (:class:`StreamedFeatures`) or features held whole ((1, mels, frames) tensors); an item is zeros past its end, as
    the padded batch would be. :func:`scored_whisper_class` drops a finished item from it as ``generate`` drops one
    from a tensor."""

    def __init__(self, items: Sequence[Any], mels: int, device: Any = None, dtype: Any = None) -> None:
        import torch

        self.items = list(items)
        self.mels = mels
        self.width = max(self._frames_of(item) for item in self.items)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.dtype = torch.float32 if dtype is None else dtype

    @staticmethod
    def _frames_of(item: Any) -> int:
        return int(item.frame_count if isinstance(item, StreamedFeatures) else item.shape[-1])

    @property
    def shape(self) -> Any:
        import torch

        return torch.Size((len(self.items), self.mels, self.width))

    def to(self, device: Any = None, dtype: Any = None) -> StreamedBatch:
        return StreamedBatch(self.items, self.mels, device or self.device, dtype or self.dtype)

    def without(self, index: int) -> StreamedBatch:
        return StreamedBatch(self.items[:index] + self.items[index + 1 :], self.mels, self.device, self.dtype)

    def __getitem__(self, key: Any) -> Any:
        import torch

        if not (isinstance(key, tuple) and len(key) == 3 and key[1] == slice(None)):
            raise TypeError(f"streamed features are cut by items and frames only, not {key!r}")
        rows, _, span = key
        first, last = int(span.start or 0), int(span.stop if span.stop is not None else self.width)
        out = []
        for item in self.items[rows]:
            part = (item.frames(first, last) if isinstance(item, StreamedFeatures)
                    else item[0, :, first:last])  # fmt: skip
            out.append(torch.nn.functional.pad(part, (0, max(0, min(last, self.width) - first) - part.shape[-1])))
        return torch.stack(out).to(self.device, self.dtype)


def scored_generate_kwargs(temperature: float) -> dict[str, Any]:
    """What makes ``generate`` score every window as its temperature fallback does, without ever falling back or
    skipping a window: a ``logprob_threshold`` no average is below (it keeps the scores, ``output_scores``) and a
    ``no_speech_threshold`` (it adds ``WhisperNoSpeechDetection``, the probability of ``<|nospeech|>`` on the raw
    logits after ``<|startoftranscript|>``); a window is skipped only when both are crossed, and -inf never is. The
    temperature is named even when greedy (0: the fallback check compares it)."""
    return {"logprob_threshold": -math.inf, "no_speech_threshold": 1.0, "temperature": temperature}


@cache
def scored_whisper_class() -> type[Any]:
    """``WhisperForConditionalGeneration`` keeping, per decoded window, what its fallback logic computes.

    transformers 5.x (``models/whisper/generation_whisper.py``) decodes each window in ``generate_with_fallback`` and
    decides on a fallback from the window's average log probability (``_retrieve_avg_logprobs``: the scores' log
    softmax at the chosen tokens, the end-of-text token included, over their count, as openai-whisper's
    ``avg_logprob``) and from ``WhisperNoSpeechDetection.no_speech_prob``; it keeps neither. This subclass reads both
    after each window, with those same functions, into the window's output (what each segment of
    ``return_segments`` holds as ``result``), and drops the window's per-step scores (a vocabulary's floats per
    token) once read. Without the scoring arguments (:func:`scored_generate_kwargs`) it decodes as its parent."""
    import torch
    from transformers import WhisperForConditionalGeneration
    from transformers.generation.logits_process import WhisperNoSpeechDetection

    parent: Any = WhisperForConditionalGeneration  # untyped in transformers

    class ScoredWhisper(parent):
        #: Called with (the item's index in the batch, its window's segments) as each window is cut into segments.
        on_segments: Callable[[int, list[dict[str, Any]]], None] | None = None

        @staticmethod
        def _maybe_reduce_batch(input_features: Any, seek: Any, max_frames: Any, cur_bsz: int,
                                batch_idx_map: list[int]) -> Any:  # fmt: skip
            """The parent's, for a :class:`StreamedBatch` too: the items that are done dropped from it."""
            if not isinstance(input_features, StreamedBatch):
                return parent._maybe_reduce_batch(input_features, seek, max_frames, cur_bsz, batch_idx_map)
            kept: list[int] = []
            for i in range(cur_bsz):
                if seek[batch_idx_map[i]] >= max_frames[batch_idx_map[i]]:
                    input_features = input_features.without(len(kept))
                else:
                    kept.append(batch_idx_map[i])
            return input_features, len(kept), kept

        def _retrieve_segment(self, **kwargs: Any) -> Any:
            segments, offset = super()._retrieve_segment(**kwargs)
            if self.on_segments is not None:
                self.on_segments(int(kwargs["prev_idx"]), segments)
            return segments, offset

        def generate_with_fallback(self, **kwargs: Any) -> Any:
            sequences, outputs, skip, condition, output_type = super().generate_with_fallback(**kwargs)
            for window in outputs:
                if isinstance(window, dict):  # token timestamps are taken from these already: not kept per window
                    for key in ("cross_attentions", "decoder_attentions", "encoder_attentions"):
                        window.pop(key, None)
            config = kwargs["generation_config"]
            if config.logprob_threshold is None or not outputs or not isinstance(outputs[0], dict):
                return sequences, outputs, skip, condition, output_type
            detector = [p for p in kwargs["logits_processor"] or () if isinstance(p, WhisperNoSpeechDetection)]
            no_speech = detector[0].no_speech_prob if detector else None
            start = kwargs["decoder_input_ids"].shape[-1]
            temperature = kwargs["temperatures"][-1] or 0.0
            for i, window in enumerate(outputs):
                scores = window.pop("scores", None)
                if scores is None:
                    continue
                tokens = _with_one_end(window["sequences"][start:], config.pad_token_id, config.eos_token_id)
                window["avg_logprob"] = float(self._retrieve_avg_logprobs(scores, tokens, temperature))
                # Each chosen token's log probability the same way (for words' probabilities), by position.
                logprobs = torch.log_softmax(torch.stack(scores[: len(tokens)]).float() * (temperature or 1.0), -1)
                window["token_logprobs"] = logprobs.gather(-1, tokens[:, None].to(logprobs.device))[:, 0].tolist()
                window["generated_from"] = start
                if no_speech is not None:
                    window["no_speech_prob"] = float(no_speech[i])
            return sequences, outputs, skip, condition, output_type

    return ScoredWhisper


def _with_one_end(tokens: Any, pad: int, eos: int) -> Any:
    """A window's generated tokens as ``generate_with_fallback`` scores them: trailing padding removed, the one
    end-of-text token kept (padding and end-of-text are one token in Whisper's generation configs)."""
    length = len(tokens)
    while length and int(tokens[length - 1]) == pad:
        length -= 1
    if pad == eos and length < len(tokens):
        length += 1
    return tokens[:length]


class WhisperEngine:
    """One Whisper-family checkpoint (model, feature extractor, tokenizer, generation config) on one device."""

    def __init__(self, source: str, device: str, dtype: Any) -> None:
        from transformers import WhisperProcessor

        self.processor = WhisperProcessor.from_pretrained(source, local_files_only=True)
        model: Any = scored_whisper_class().from_pretrained(source, local_files_only=True, dtype=dtype)
        self.model = model.to(device).eval()
        self.device = device
        self.dtype = dtype
        config = self.model.generation_config
        lang_to_id: dict[str, int] = dict(getattr(config, "lang_to_id", None) or {})
        self.multilingual = bool(getattr(config, "is_multilingual", False)) and bool(lang_to_id)
        #: Language codes (``en``) the checkpoint knows, and back from their token ids.
        self.languages = sorted(token.strip("<|>") for token in lang_to_id)
        self._language_of = {token_id: token.strip("<|>") for token, token_id in lang_to_id.items()}
        #: Whether generate can time tokens (``return_token_timestamps`` needs the heads that align them).
        self.word_timestamps = getattr(config, "alignment_heads", None) is not None
        #: The longest prompt: generate refuses a prompt over half the decoder's positions.
        self.max_prompt_tokens = self.model.config.max_target_positions // 2 - 1
        rate = self.processor.feature_extractor.sampling_rate
        if rate != SAMPLE_RATE:
            raise ValueError(f"the feature extractor takes {rate} Hz audio; this engine resamples to {SAMPLE_RATE} Hz")

    # -- on the request path (cheap, validating) ------------------------------------------------------------

    def check_language(self, language: str | None, task: SpeechTask) -> str | None:
        """``language`` as the checkpoint knows it; a 400 naming the ones it knows."""
        return checked_language(language, task, self.multilingual, self.languages)

    def prompt_ids(self, prompt: str | None) -> tuple[int, ...] | None:
        """The prompt as the decoder's previous-text tokens; a 400 over :attr:`max_prompt_tokens`."""
        if not prompt:
            return None
        ids = self.processor.tokenizer.get_prompt_ids(prompt)
        if len(ids) - 1 > self.max_prompt_tokens:  # the leading <|startofprev|> is not counted by generate
            raise InvalidRequest(f"prompt: {len(ids) - 1} tokens; this model takes at most {self.max_prompt_tokens}",
                                 param="prompt", code="prompt_too_long")  # fmt: skip
        return tuple(int(i) for i in ids)

    # -- on the engine thread ------------------------------------------------------------------------------

    def read(self, data: bytes, field: str, limits: AudioLimits, hold_seconds: float) -> tuple[Any, float]:
        """``data``'s samples for a job and its seconds: decoded whole if it lasts at most ``hold_seconds``, else
        streamed (:class:`StreamedFeatures`), the largest value of its features found as it is read through (on the
        request path, beside the engine, in the same pass that counts it and checks every limit)."""
        extractor = self.processor.feature_extractor
        found = read_audio(data, field, limits, int(hold_seconds * SAMPLE_RATE), lambda: RunningLogMelMax(extractor),
                           SHORTEST_STREAMED_SECONDS * SAMPLE_RATE)  # fmt: skip
        if isinstance(found, Audio):
            return found.samples, found.seconds
        scan, running = found
        source = StreamedSamples(data, field, limits, scan)
        return StreamedFeatures(extractor, source, running.finish(scan.length)), scan.seconds

    def features(self, samples: Any) -> tuple[Any, bool]:
        """Log-mel features of one job, and whether it is long-form (over one window)."""
        if isinstance(samples, StreamedFeatures):
            return samples, True
        extract = self.processor.feature_extractor
        samples = as_float(samples)  # (the decode's 16-bit samples: transformers' extractor takes float32)
        if len(samples) > WINDOW_SECONDS * SAMPLE_RATE:
            return long_form_features(samples, extract), True
        return extract(samples, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_features, False

    def transcribe_batch(self, jobs: Sequence[Job]) -> list[Transcript]:
        """Every job decoded, in order; one ``generate`` call per group of jobs that can share it."""
        import torch

        features = [self.features(job.samples) for job in jobs]
        languages = self._languages(jobs, [f for f, _ in features])
        groups: dict[tuple[Any, ...], list[int]] = {}
        for index, job in enumerate(jobs):
            key = (features[index][1], job.task, languages[index], job.prompt_ids, job.temperature, job.scored,
                   job.words)  # fmt: skip
            groups.setdefault(key, []).append(index)
        out: list[Transcript | None] = [None] * len(jobs)
        with torch.inference_mode():
            for (long_form, task, language, prompt_ids, temperature, scored, words), members in groups.items():
                batch = [features[i][0] for i in members]
                self.model.on_segments = self._window_texts([jobs[i].on_window for i in members])
                try:
                    segments = self._generate(batch, long_form, task, language, prompt_ids, temperature, scored,
                                              words)  # fmt: skip
                finally:
                    self.model.on_segments = None
                for index, found in zip(members, segments, strict=True):
                    seconds = len(jobs[index].samples) / SAMPLE_RATE
                    out[index] = Transcript(languages[index] or "en", found, seconds, self._running_texts(found))
        return [transcript for transcript in out if transcript is not None]

    def _languages(self, jobs: Sequence[Job], features: list[Any]) -> list[str | None]:
        """Each job's language: the one it names, else the one detected on its first window."""
        import torch

        languages: list[str | None] = [job.language for job in jobs]
        unknown = [i for i, job in enumerate(jobs) if job.language is None]
        if not self.multilingual or not unknown:
            return languages
        first = torch.cat([features[i].frames(0, WINDOW_FRAMES)[None] if isinstance(features[i], StreamedFeatures)
                           else features[i][:, :, :WINDOW_FRAMES] for i in unknown])  # fmt: skip
        if first.shape[-1] < WINDOW_FRAMES:
            first = torch.nn.functional.pad(first, (0, WINDOW_FRAMES - first.shape[-1]))
        with torch.inference_mode():
            found = self.model.detect_language(input_features=first.to(self.device, self.dtype))
        for i, token_id in zip(unknown, found.view(-1).tolist(), strict=True):
            languages[i] = self._language_of[int(token_id)]
        return languages

    def _generate(self, batch: list[Any], long_form: bool, task: SpeechTask, language: str | None,
                  prompt_ids: tuple[int, ...] | None, temperature: float,
                  scored: bool = False, words: bool = False) -> list[list[Segment]]:  # fmt: skip
        import torch

        input_features: Any
        if any(isinstance(f, StreamedFeatures) for f in batch):  # (long-form, every one: shorter files are held)
            input_features = StreamedBatch(batch, int(self.processor.feature_extractor.feature_size))
            frames = [StreamedBatch._frames_of(f) for f in batch]
            width = input_features.width
        else:
            frames = [f.shape[-1] for f in batch]
            width = max(frames)
            input_features = torch.cat([torch.nn.functional.pad(f, (0, width - f.shape[-1])) for f in batch])
        kwargs: dict[str, Any] = {"return_timestamps": True, "return_segments": True}
        if long_form:
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, length in enumerate(frames):
                mask[row, :length] = 1
            kwargs["attention_mask"] = mask.to(self.device)
        if self.multilingual:
            kwargs["task"] = task
            kwargs["language"] = language
        if prompt_ids is not None:
            kwargs["prompt_ids"] = torch.tensor(prompt_ids, device=self.device)
        if temperature > 0:
            kwargs["do_sample"] = True
            kwargs["temperature"] = temperature
        if scored:
            kwargs.update(scored_generate_kwargs(temperature))
        if not words:
            output = self.model.generate(input_features.to(self.device, self.dtype), **kwargs)
            return [self._segments(found) for found in output["segments"]]
        # Token timestamps: cross-attention alignment (the generation config's alignment_heads, dynamic time warping).
        # generate switches the model to eager attention for the attention weights, for good: switched back after.
        attention = self.model.config._attn_implementation
        try:
            output = self.model.generate(input_features.to(self.device, self.dtype), return_token_timestamps=True,
                                         **kwargs)  # fmt: skip
        finally:
            self.model.config._attn_implementation = attention
        return [self._segments(found, language or "en") for found in output["segments"]]

    def _words(self, segment: dict[str, Any], window: dict[str, Any], language: str) -> tuple[Word, ...]:
        """A segment's text tokens grouped into words as openai-whisper groups them (split before a space, the
        punctuation merged into its neighbour: transformers' ``_combine_tokens_into_words``, the grouping of its
        pipeline's word timestamps), each from its first token's time to the time of the token after its last (the
        next word's, or the closing timestamp): openai-whisper's ``add_word_timestamps``, on ``generate``'s token
        timestamps (each token's time is where the alignment reaches it)."""
        from transformers.models.whisper.tokenization_whisper import LANGUAGES, _combine_tokens_into_words

        tokens = [int(t) for t in segment["tokens"].tolist()]
        times = [float(t) for t in segment["token_timestamps"].tolist()]
        text_end = self.processor.tokenizer.eos_token_id  # Whisper's special and timestamp tokens all come after
        positions = [i for i, token in enumerate(tokens) if token < text_end]
        if not positions:
            return ()
        texts, _, indices = _combine_tokens_into_words(self.processor.tokenizer, [tokens[i] for i in positions],
                                                       LANGUAGES.get(language, "english"))  # fmt: skip
        logprobs = window.get("token_logprobs")
        first = segment["idxs"][0] - window.get("generated_from", 0)
        words = []
        for text, members in zip(texts, indices, strict=True):
            start, after = positions[members[0]], positions[members[-1]] + 1
            probability = None
            if logprobs is not None:
                probability = sum(math.exp(logprobs[first + positions[m]]) for m in members) / len(members)
            words.append(Word(text, round(times[start], 3), round(times[min(after, len(times) - 1)], 3), probability))
        return tuple(words)

    def _window_texts(self, callbacks: list[Callable[[str], None] | None]) -> Callable[[int, Any], None] | None:
        """What tells each job of a ``generate`` call its text so far as each of its windows is cut into segments (in
        ``generate``'s sequential long-form loop, before the next window decodes): the tokens of every segment so far
        decoded as one, as :meth:`_running_texts` decodes them."""
        if not any(callbacks):
            return None
        tokens: list[list[int]] = [[] for _ in callbacks]

        def tell(row: int, segments: list[dict[str, Any]]) -> None:
            callback = callbacks[row]
            if callback is None or not segments:
                return
            for segment in segments:
                tokens[row] += [int(t) for t in segment["tokens"].tolist()]
            callback(self.processor.tokenizer.decode(tokens[row], skip_special_tokens=True))

        return tell

    def _running_texts(self, segments: list[Segment]) -> list[str]:
        decode = self.processor.tokenizer.decode
        tokens: list[int] = []
        texts = []
        for segment in segments:
            tokens += segment.tokens
            texts.append(decode(tokens, skip_special_tokens=True))
        return texts

    def _segments(self, found: list[dict[str, Any]], words_in: str | None = None) -> list[Segment]:
        """``generate``'s segments as :class:`Segment` (with words, in language ``words_in``, when it is named)."""
        tokenizer = self.processor.tokenizer
        segments = []
        for number, segment in enumerate(found):
            tokens = [int(t) for t in segment["tokens"].tolist()]
            start, end = float(segment["start"]), float(segment["end"])
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            window = segment["result"] if isinstance(segment.get("result"), dict) else {}
            segments.append(Segment(number, int(start * 100), round(start, 2), round(end, 2), text, tokens,
                                    avg_logprob=window.get("avg_logprob"),
                                    no_speech_prob=window.get("no_speech_prob"),
                                    words=self._words(segment, window, words_in) if words_in else ()))  # fmt: skip
        return segments
