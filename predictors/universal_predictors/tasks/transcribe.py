"""``task: transcribe``: OpenAI's ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` over Whisper.

Requests are ``multipart/form-data`` as the OpenAI SDK sends them: the audio in the ``file`` part, and the
fields ``model``, ``language``, ``prompt``, ``temperature``, ``response_format`` (``json``, ``text``, ``srt``,
``vtt``, ``verbose_json``), ``timestamp_granularities[]`` and, for transcriptions, ``stream``. The file is decoded
on a worker thread within the limits of :class:`TranscribeEngineArgs` (:mod:`universal_predictors.speech.audio`);
the decoding runs on the engine thread, audio of concurrent requests batched
(:mod:`universal_predictors.speech.whisper` on transformers, :mod:`universal_predictors.speech.whisper_ct2` on
faster-whisper; ``auto`` picks faster-whisper for a directory CTranslate2's converter wrote, transformers otherwise).

``stream=true`` answers with server-sent events, ``transcript.text.delta`` events and one ``transcript.text.done``
with the whole text. On transformers a delta goes out as each 30 s window decodes (``Job.on_window``, told from
within ``generate``'s sequential long-form loop); on faster-whisper as each segment arrives from ``transcribe``'s
lazy generator (a window's segments once it decodes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from universal_predictors.base import StartupError, UniversalPredictor
from universal_predictors.batching import BatchPolicy, MicroBatcher
from universal_predictors.catalog import Backend, Route, Task
from universal_predictors.config import AUDIO_SECONDS_HEADER, PredictorConfig
from universal_predictors.decode_budget import DecodeBudget
from universal_predictors.devices import allocated_gpus, detect_device, dtype_for, gpu_unusable_reason
from universal_predictors.errors import InvalidRequest
from universal_predictors.http import FormPart, is_multipart_form, parse_form, validation_error
from universal_predictors.speech.audio import (
    BYTES_PER_AUDIO_SECOND,
    AudioLimits,
    declared_seconds,
)
from universal_predictors.speech.captions import srt, vtt
from universal_predictors.speech.whisper import Job, SpeechTask, Transcript, WhisperEngine
from universal_predictors.speech.whisper_ct2 import FasterWhisperEngine, is_ctranslate2_whisper

ResponseFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]


#: A request's decoding (``_progress``): the audio's seconds, its text so far per window, then its transcript.
_Progress = AsyncGenerator[float | str | Transcript, None]


#: Files longer than this are streamed (:meth:`TranscribePredictor._samples`), on either backend: their samples and
#: features are computed window by window, so a request holds about what a file of this length decoded whole holds,
#: however long its file. Shorter files are decoded once, whole (streaming decodes a file twice and
#: computes its features twice: a cost that is small beside a long file's transcription).
STREAMED_FROM_SECONDS = 120
#: What a streamed file reserves of the decode budget: what a file of :data:`STREAMED_FROM_SECONDS` reserves.
STREAMED_BYTES = STREAMED_FROM_SECONDS * BYTES_PER_AUDIO_SECOND
#: How far past its declared duration a file is held whole (the room :data:`BYTES_PER_AUDIO_SECOND` makes for it).
GROWTH = 1.5


class TranscribeEngineArgs(BaseModel):
    """Engine arguments of the transcribe predictor (``--engine-arg key=value``)."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(default=8, ge=1, le=256, description="Requests' audio per generate call at most.")
    max_wait_ms: float = Field(default=10.0, ge=0, le=1000, description="How long a batch waits for company.")
    max_audio_bytes: int = Field(default=25 * 2**20, ge=1024, description="Bytes of one uploaded file.")
    max_audio_seconds: float = Field(default=3600.0, gt=0, le=86400, description="Duration of one file.")
    max_audio_channels: int = Field(default=8, ge=1, le=64, description="Channels of one file (mixed to mono).")
    decode_budget_mb: int = Field(
        default=2048, ge=16, le=1024 * 1024,
        description="Memory the audio of concurrent requests may hold (samples and features), in MiB.",
    )  # fmt: skip
    decode_wait_s: float = Field(default=30.0, gt=0, le=3600, description="Longest a request waits for its share.")
    device: str = "auto"
    dtype: str = Field(
        default="auto", description="transformers: the torch dtype (auto: fp32 on CPU, bf16/fp16 on GPU)."
    )
    compute_type: str = Field(
        default="auto", description="faster-whisper: CTranslate2's compute type (auto: int8 on CPU, float16 on GPU)."
    )
    beam_size: int = Field(default=5, ge=1, le=16, description="faster-whisper: beams per window (1: greedy).")
    num_workers: int = Field(
        default=2, ge=1, le=16, description="faster-whisper: model replicas decoding requests side by side."
    )
    cpu_threads: int = Field(default=0, ge=0, le=256, description="faster-whisper: threads per replica (0: its own).")
    batch_windows: bool = Field(
        default=False,
        description="faster-whisper: a batch's requests share CTranslate2 generate calls, window by window.",
    )

    #: Arguments only one backend reads: given to the other, the predictor refuses to start.
    FASTER_WHISPER_ONLY: ClassVar[tuple[str, ...]] = (
        "compute_type",
        "beam_size",
        "num_workers",
        "cpu_threads",
        "batch_windows",
    )
    TRANSFORMERS_ONLY: ClassVar[tuple[str, ...]] = ("dtype",)

    def limits(self) -> AudioLimits:
        return AudioLimits(self.max_audio_bytes, self.max_audio_seconds, self.max_audio_channels)

    @property
    def max_body_bytes(self) -> int:
        """The form around the file: the file's limit and 1 MiB for the other fields and the part headers."""
        return self.max_audio_bytes + 2**20


class TranslationRequest(BaseModel):
    """``POST /v1/audio/translations``' form fields (the audio is the ``file`` part): speech to English text."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = Field(default=None, description="Text the decoder takes as what came before.")
    response_format: ResponseFormat = "json"
    temperature: float = Field(default=0.0, ge=0, le=1, description="0 decodes greedily; above, it samples.")


class TranscriptionRequest(TranslationRequest):
    """``POST /v1/audio/transcriptions``' form fields (the audio is the ``file`` part)."""

    language: str | None = Field(default=None, pattern=r"^[a-z]{2,3}$", description="ISO-639-1 code; else detected.")
    stream: bool = False
    timestamp_granularities: list[Literal["segment", "word"]] | None = Field(
        default=None, description="verbose_json only: segment times always; word times when asked."
    )


class SpeechBody(BaseModel):
    """What a route's method takes: the validated fields, the file's bytes, and which route it came in."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)

    task: SpeechTask
    fields: TranscriptionRequest
    audio: bytes


#: Form fields sent with ``[]`` by the OpenAI SDK (arrays), read as lists.
_LIST_FIELDS = {"timestamp_granularities[]": "timestamp_granularities", "include[]": "include"}


def form_body(
    parts: list[FormPart], task: SpeechTask, *, word_timestamps: bool = False
) -> tuple[str | None, SpeechBody]:
    """The model and body of an upload; a 400 names a missing or doubled file, or a field that is wrong
    (``word_timestamps``: whether the backend has them)."""
    options: dict[str, Any] = {}
    files = [part for part in parts if part.name == "file"]
    for part in parts:
        if part.name == "file":
            if not part.is_file:
                raise InvalidRequest("file: send the audio as a file part (a filename in its Content-Disposition)",
                                     param="file")  # fmt: skip
            continue
        if part.is_file:
            raise InvalidRequest(f"{part.name}: only the field 'file' takes a file", param=part.name)
        if part.name in _LIST_FIELDS:
            options.setdefault(_LIST_FIELDS[part.name], []).append(part.text())
        elif part.name in options:
            raise InvalidRequest(f"{part.name}: the form field is given more than once", param=part.name)
        else:
            options[part.name] = part.text()
    if not files:
        raise InvalidRequest("file: the form has no 'file' part with the audio", param="file")
    if len(files) > 1:
        raise InvalidRequest("file: send one audio file per request", param="file")
    if "include" in options:
        raise InvalidRequest("include[]: logprobs are not available on this backend", param="include[]")
    model = TranscriptionRequest if task == "transcribe" else TranslationRequest
    try:
        checked = model.model_validate(options)
    except ValidationError as exc:
        raise validation_error(exc) from None
    fields = TranscriptionRequest.model_validate(checked.model_dump())
    if fields.timestamp_granularities and fields.response_format != "verbose_json":
        raise InvalidRequest("timestamp_granularities[]: only response_format verbose_json has timestamps",
                             param="timestamp_granularities[]")  # fmt: skip
    if fields.timestamp_granularities and "word" in fields.timestamp_granularities and not word_timestamps:
        raise InvalidRequest("timestamp_granularities[]: word timestamps are not available for this model (its "
                             "generation config names no alignment_heads, the cross-attention heads that align "
                             "words); ask for segment",
                             param="timestamp_granularities[]")  # fmt: skip
    return fields.model, SpeechBody(task=task, fields=fields, audio=files[0].data)


def speech_backend(backend: Backend, source: str) -> Backend:
    """The engine ``auto`` means here: faster-whisper for a directory CTranslate2's converter wrote, else
    transformers; an explicit backend passes through."""
    if backend is not Backend.AUTO:
        return backend
    return Backend.FASTER_WHISPER if is_ctranslate2_whisper(source) else Backend.TRANSFORMERS


def language_name(code: str) -> str:
    """``en`` as ``english``, the way OpenAI's verbose responses name languages (Whisper's own table)."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    return str(LANGUAGES.get(code, code))


class TranscribePredictor(UniversalPredictor):
    """One Whisper-family model; the audio of concurrent requests shares ``generate`` calls."""

    task = Task.TRANSCRIBE
    EngineArgs = TranscribeEngineArgs

    whisper: WhisperEngine | FasterWhisperEngine

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__(config)
        self.backend = speech_backend(config.backend, config.source)
        # Before loading, as every task does: GPUs given that the engine cannot use stop the start, named.
        unusable = gpu_unusable_reason(self.backend, allocated_gpus())
        if unusable is not None:
            raise StartupError(unusable)
        given = set(config.engine_args_for(self.backend))
        other = TranscribeEngineArgs.TRANSFORMERS_ONLY if self.backend is Backend.FASTER_WHISPER else \
            TranscribeEngineArgs.FASTER_WHISPER_ONLY  # fmt: skip
        wrong = sorted(given & set(other))
        if wrong:
            raise StartupError(f"engine arg {wrong[0]!r} is not read by the {self.backend.value} backend of task "
                               f"transcribe (the other backend's)")  # fmt: skip
        if self.backend is Backend.FASTER_WHISPER:
            self.device, self.compute_type = self._ctranslate2_device(self.engine_args)

    @staticmethod
    def _ctranslate2_device(args: TranscribeEngineArgs) -> tuple[str, str]:
        """CTranslate2's device and compute type; a GPU asked for and absent stops the start, as every task's."""
        from universal_predictors.speech.whisper_ct2 import ctranslate2_cuda_devices, default_compute_type

        cuda = ctranslate2_cuda_devices()
        device = args.device if args.device != "auto" else ("cuda" if cuda else "cpu")
        if device.startswith("cuda") and cuda == 0:
            raise StartupError(f"engine arg device={args.device!r}: CTranslate2 sees no CUDA device (no GPU, or a "
                               "build without CUDA); use device=cpu or give the model a GPU")  # fmt: skip
        if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
            raise StartupError(f"engine arg device={args.device!r}: faster-whisper runs on cpu or cuda[:N]")
        return device, args.compute_type if args.compute_type != "auto" else default_compute_type(device)

    def load(self) -> bool:
        args: TranscribeEngineArgs = self.engine_args
        if self.backend is Backend.FASTER_WHISPER:
            from universal_predictors.speech.whisper_ct2 import DecodeOptions

            device, _, index = self.device.partition(":")
            self.whisper = FasterWhisperEngine(
                self.config.source, device, self.compute_type, device_index=int(index or 0),
                cpu_threads=args.cpu_threads, num_workers=args.num_workers,
                options=DecodeOptions(args.beam_size, batch_windows=args.batch_windows),
            )  # fmt: skip
        else:
            device = detect_device(args.device)
            self.whisper = WhisperEngine(self.config.source, device, dtype_for(device, args.dtype))
        self.limits = args.limits()
        #: Requests between their arrival and their job's submission (reading the header, decoding the audio).
        self.decoding = 0
        largest = int(args.max_audio_seconds * BYTES_PER_AUDIO_SECOND)
        self.decode_budget = DecodeBudget(args.decode_budget_mb * 2**20, args.decode_wait_s, largest_bytes=largest)
        self.batcher: MicroBatcher[Job, Transcript] = MicroBatcher(
            self.whisper.transcribe_batch,
            model_name=self.name,
            policy=BatchPolicy(max_batch_size=args.max_batch_size, max_wait_ms=args.max_wait_ms),
            # Similar lengths together: a long-form batch decodes for as long as its longest item.
            cost=lambda job: len(job.samples),
            # A batch waits for company only while other requests' audio is being decoded: a lone request (the
            # batch in hand, none queued, none decoding) starts at once instead of after max_wait_ms.
            expected=lambda: self.decoding + self.batcher.queued + 1,
        )
        return True

    @property
    def word_timestamps(self) -> bool:
        """faster-whisper's ``word_timestamps``; on transformers, a checkpoint whose generation config names the
        heads that align (``alignment_heads``: openai/whisper-* have them, a fine-tune may not)."""
        return isinstance(self.whisper, FasterWhisperEngine) or self.whisper.word_timestamps

    def unload(self) -> None:
        if hasattr(self, "whisper"):
            if isinstance(self.whisper, FasterWhisperEngine):
                self.whisper.close()
            del self.whisper
            self.decode_budget.close()

    def describe(self) -> dict[str, Any]:
        if not hasattr(self, "whisper"):
            return {}
        args: TranscribeEngineArgs = self.engine_args
        described: dict[str, Any] = {
            "languages": self.whisper.languages,
            "multilingual": self.whisper.multilingual,
            "limits": {
                "max_audio_bytes": args.max_audio_bytes,
                "max_audio_seconds": args.max_audio_seconds,
                "max_audio_channels": args.max_audio_channels,
                "decode_budget_mb": args.decode_budget_mb,
            },
            "word_timestamps": self.word_timestamps,
        }
        if isinstance(self.whisper, FasterWhisperEngine):
            described["compute_type"] = self.whisper.compute_type
            described["device"] = self.whisper.device
        return described

    # A client that leaves stops its request: decoding, its audio queued for a batch.
    stop_on_disconnect = True

    async def read_request(self, route: Route, request: Request) -> tuple[str | None, SpeechBody]:
        if not is_multipart_form(request):
            raise InvalidRequest(
                f"{route.upstream} takes a multipart/form-data upload (the audio in the field 'file'), as the OpenAI "
                "SDK sends it", code="unsupported_media_type",
            )  # fmt: skip
        task: SpeechTask = "translate" if route.handler == "translations" else "transcribe"
        parts = await parse_form(request, self.engine_args.max_body_bytes)
        return form_body(parts, task, word_timestamps=self.word_timestamps)

    async def transcriptions(self, body: SpeechBody, request: Request | None = None) -> Response:
        return await self._answer(body)

    async def translations(self, body: SpeechBody, request: Request | None = None) -> Response:
        return await self._answer(body)

    async def _answer(self, body: SpeechBody) -> Response:
        fields = body.fields
        language = self.whisper.check_language(fields.language, body.task)
        prompt_ids = self.whisper.prompt_ids(fields.prompt)
        progress = self._progress(body, language, prompt_ids)
        # The audio's seconds once decoded (a file the limits refuse is a 400/413 before any answer starts).
        seconds = await anext(progress)
        assert isinstance(seconds, float)
        if fields.stream:
            # The first window's text (or the transcript) before answering.
            first = await anext(progress)
            assert not isinstance(first, float)
            headers = {"Cache-Control": "no-cache", AUDIO_SECONDS_HEADER: str(math.ceil(seconds))}
            return StreamingResponse(_events(first, progress), media_type="text/event-stream", headers=headers)
        async for item in progress:
            if isinstance(item, Transcript):
                words = "word" in (fields.timestamp_granularities or ())
                response = self._response(item, body.task, fields.response_format, fields.temperature, words)
                response.headers[AUDIO_SECONDS_HEADER] = str(math.ceil(item.seconds))  # what usage bills
                return response
        raise AssertionError("the decoding ended without a transcript")

    async def _progress(self, body: SpeechBody, language: str | None,
                        prompt_ids: tuple[int, ...] | None) -> _Progress:  # fmt: skip
        """The request decoded: the audio's seconds once decoded; for a stream, its text so far as each window
        decodes; then its transcript."""
        fields = body.fields
        loop = asyncio.get_running_loop()
        windows: asyncio.Queue[str] = asyncio.Queue()

        def on_window(text: str) -> None:  # on the engine thread
            loop.call_soon_threadsafe(windows.put_nowait, text)

        with self._arriving() as arrived:
            async with self._samples(body.audio) as (samples, seconds):
                yield seconds
                words = "word" in (fields.timestamp_granularities or ())
                job = Job(samples, body.task, language, prompt_ids, fields.temperature, words=words,
                          scored=fields.response_format == "verbose_json",
                          on_window=on_window if fields.stream else None)  # fmt: skip
                del samples
                arrived()
                pending = asyncio.ensure_future(self.batcher.submit(job))
                try:
                    while not pending.done():
                        window = asyncio.ensure_future(windows.get())
                        await asyncio.wait({pending, window}, return_when=asyncio.FIRST_COMPLETED)
                        if window.done():
                            yield window.result()
                        else:
                            window.cancel()
                    while not windows.empty():  # told before the batch's answer was
                        yield windows.get_nowait()
                    yield pending.result()
                finally:
                    pending.cancel()  # a client that left: a job still queued is skipped

    @contextlib.asynccontextmanager
    async def _samples(self, audio: bytes) -> AsyncIterator[tuple[Any, float]]:
        """``audio``'s samples and seconds, with the decode budget's share they hold reserved until the transcript is
        done. A file longer than :data:`STREAMED_FROM_SECONDS` is streamed: read through once for its length, every
        limit and its features' largest value, then decoded again window by window as its features are computed
        (``FasterWhisperEngine.read``, ``WhisperEngine.read``), holding what a file of that length
        decoded whole would; any other file is decoded whole, its reservation being what its header declares, made
        before anything is decoded, unless it decodes to more than that and half again (a header that lies short):
        then it is read through and streamed from there, so it holds no more than it reserved."""
        declared = await self.decode_budget.run(declared_seconds, audio, "file", self.limits)
        seconds = min(self.limits.max_audio_seconds, declared if declared is not None else math.inf)
        if seconds > STREAMED_FROM_SECONDS:
            # Read through once: decoded whole if it turns out short (a header that did not say how long), else
            # streamed; either holds no more than a file of STREAMED_FROM_SECONDS.
            reserved, hold = STREAMED_BYTES, float(STREAMED_FROM_SECONDS)
        else:
            # Held whole as far as its reservation makes room (what the header declares and half again); a file that
            # decodes past that (a header that lies short) is read through and streamed from there instead.
            reserved, hold = int(seconds * BYTES_PER_AUDIO_SECOND), seconds * GROWTH + 1
        async with self.decode_budget.reserve(reserved, "file", "audio files"):
            yield await self.decode_budget.run(self.whisper.read, audio, "file", self.limits, hold)

    @contextlib.contextmanager
    def _arriving(self) -> Iterator[Callable[[], None]]:
        """Counts a request in :attr:`decoding` until the callable it yields is called (its job about to be
        submitted) or it ends; the batcher is told either way."""
        self.decoding += 1
        counted = True

        def arrived() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.decoding -= 1
                self.batcher.notify()

        try:
            yield arrived
        finally:
            arrived()

    def _response(self, transcript: Transcript, task: SpeechTask, response_format: ResponseFormat,
                  temperature: float, words: bool = False) -> Response:  # fmt: skip
        usage = {"type": "duration", "seconds": math.ceil(transcript.seconds)}
        if response_format == "text":
            return PlainTextResponse(transcript.text + "\n")
        if response_format == "srt":
            return PlainTextResponse(srt(transcript.segments))
        if response_format == "vtt":
            return PlainTextResponse(vtt(transcript.segments), media_type="text/vtt")
        if response_format == "json":
            return _json({"text": transcript.text, "usage": usage})
        segments = [
            {
                "id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text, "tokens": s.tokens,
                "temperature": temperature, "avg_logprob": s.avg_logprob,
                "compression_ratio": round(s.compression_ratio, 4), "no_speech_prob": s.no_speech_prob,
            }
            for s in transcript.segments
        ]  # fmt: skip
        payload: dict[str, Any] = {
            "task": task, "language": language_name(transcript.language), "duration": round(transcript.seconds, 3),
            "text": transcript.text, "segments": segments,
        }  # fmt: skip
        if words:
            # OpenAI's TranscriptionWord: the word without the space the tokenizer puts before it.
            payload["words"] = [
                {"word": w.word.strip(), "start": w.start, "end": w.end} for s in transcript.segments for w in s.words
            ]
        payload["usage"] = usage
        return _json(payload)


def _json(payload: dict[str, Any]) -> Response:
    return Response(json.dumps(payload, ensure_ascii=False), media_type="application/json")


def _grown(running: str, sent: str) -> str | None:
    """The text told so far (``running``) past what was sent, once it only grew. Held back: trailing spaces (the
    done text is stripped) and a trailing U+FFFD (a character whose other bytes the next segment may bring)."""
    running = running.strip().rstrip("\ufffd")
    return running if running.startswith(sent) and len(running) > len(sent) else None


async def _events(first: str | Transcript, rest: _Progress) -> AsyncIterator[bytes]:
    """The decoding as OpenAI's transcription events: a delta per window as it decodes, deltas that add up to the
    text, then the text."""
    sent = ""
    item: float | str | Transcript = first
    try:
        while not isinstance(item, Transcript):
            grown = _grown(item, sent) if isinstance(item, str) else None  # (the seconds came before ``first``)
            if grown is not None:
                yield _event({"type": "transcript.text.delta", "delta": grown[len(sent) :]})
                sent = grown
            item = await anext(rest)
    finally:
        await rest.aclose()
    transcript = item
    for running in transcript.texts:  # what the windows did not tell, per segment
        grown = _grown(running, sent)
        if grown is not None:
            yield _event({"type": "transcript.text.delta", "delta": grown[len(sent) :]})
            sent = grown
    if transcript.text.startswith(sent) and len(transcript.text) > len(sent):
        yield _event({"type": "transcript.text.delta", "delta": transcript.text[len(sent) :]})
    yield _event({"type": "transcript.text.done", "text": transcript.text})


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()
