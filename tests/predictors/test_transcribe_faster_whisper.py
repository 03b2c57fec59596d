"""``task: transcribe`` on faster-whisper: a tiny random Whisper converted with CTranslate2's own converter, served by
``universal-runtime serve`` (backend ``auto``, which must pick faster-whisper for it), called with the real ``openai``
SDK, against faster-whisper's own ``WhisperModel.transcribe`` run in-process on the same samples.

The model's words are gibberish, but the same gibberish in-process and served: tokens, texts, segment and word
timestamps are compared exactly. The audio path (PyAV, limits, budget) is the transformers backend's, tested in
``test_transcribe.py``; here only what the engine changes.
"""

from __future__ import annotations

import concurrent.futures
import io
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI

from tests.gateway.harness import GatewayProcess, running_gateway
from tests.predictors.speech_samples import espeak, read_wav, wav_bytes
from tests.predictors.tiny_whisper import build_tiny_ct2_whisper
from universal_predictors.catalog import Backend
from universal_predictors.config import PredictorConfig
from universal_predictors.speech.whisper_ct2 import is_ctranslate2_whisper

SERVED = "tiny-faster-whisper"
BEAM_SIZE = 5


@pytest.fixture(scope="module")
def ct2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_ct2_whisper(tmp_path_factory.mktemp("ct2-whisper"))


@cache
def _in_process(model_dir: str) -> Any:
    from faster_whisper import WhisperModel

    return WhisperModel(model_dir, device="cpu", compute_type="int8")


def reference(model_dir: Path, samples: np.ndarray, **options: Any) -> tuple[list[dict[str, Any]], str, Any]:
    """faster-whisper's own transcription, as its README writes it, with the options the server passes."""
    model = _in_process(str(model_dir))
    options = {"beam_size": BEAM_SIZE, "temperature": 0.0, "vad_filter": False, **options}
    found, info = model.transcribe(samples, **options)
    segments = []
    text = ""
    for s in found:
        text += s.text
        segments.append({
            "tokens": list(s.tokens), "start": round(s.start, 3), "end": round(s.end, 3), "text": s.text,
            "words": [(w.word.strip(), round(w.start, 3), round(w.end, 3)) for w in s.words or ()],
        })  # fmt: skip
    return segments, text.strip(), info


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, ct2_dir: Path) -> Iterator[GatewayProcess]:
    folder = tmp_path_factory.mktemp("manifests")
    (folder / "whisper.yaml").write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
        f"metadata: {{name: fwhisper}}\nspec:\n  task: transcribe\n  servedName: {SERVED}\n"
        f'  source: {{uri: "{ct2_dir}"}}\n'
        '  engineArgs: {max_audio_seconds: "200", max_wait_ms: "50", num_workers: "2"}\n'
    )
    with running_gateway([folder], tmp_path_factory.mktemp("gateway")) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=gateway.base_url, api_key="unused", timeout=300, max_retries=0)


def verbose(client: OpenAI, data: bytes, **fields: Any) -> dict[str, Any]:
    answer = client.audio.transcriptions.create(model=SERVED, file=("speech.wav", data), response_format="verbose_json",
                                                **fields)  # fmt: skip
    dumped: dict[str, Any] = answer.model_dump()
    return dumped


def served(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: s[k] for k in ("tokens", "start", "end", "text")} for s in answer["segments"]]


def without_words(segments: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k != "words"} for s in segments]


# -- the backend auto picks ------------------------------------------------------------------------------------------


def test_auto_picks_faster_whisper_for_a_ctranslate2_directory_only(ct2_dir: Path) -> None:
    from universal_predictors.tasks.transcribe import speech_backend

    transformers_dir = ct2_dir.parent / "transformers"
    assert is_ctranslate2_whisper(str(ct2_dir))
    assert not is_ctranslate2_whisper(str(transformers_dir))  # a transformers config.json, no model.bin
    assert speech_backend(Backend.AUTO, str(ct2_dir)) is Backend.FASTER_WHISPER
    assert speech_backend(Backend.AUTO, str(transformers_dir)) is Backend.TRANSFORMERS
    assert speech_backend(Backend.TRANSFORMERS, str(ct2_dir)) is Backend.TRANSFORMERS


def test_a_model_bin_of_another_architecture_is_not_taken_for_whisper(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.bin").write_bytes(b"\x06\x00\x00\x00\x0c\x00TransformerS\x00")
    assert not is_ctranslate2_whisper(str(tmp_path))


def test_engine_args_of_the_other_backend_stop_the_start(ct2_dir: Path) -> None:
    from universal_predictors.base import StartupError
    from universal_predictors.tasks.transcribe import TranscribePredictor

    config = PredictorConfig(model_name="w", task="transcribe", source=str(ct2_dir), engine_args={"dtype": "float16"})
    with pytest.raises(StartupError, match="'dtype' is not read by the faster-whisper backend"):
        TranscribePredictor(config)
    config = PredictorConfig(model_name="w", task="transcribe", source=str(ct2_dir), engine_args={"device": "cuda"})
    with pytest.raises(StartupError, match="CTranslate2 sees no CUDA device"):
        TranscribePredictor(config)
    transformers_dir = str(ct2_dir.parent / "transformers")
    config = PredictorConfig(model_name="w", task="transcribe", source=transformers_dir, engine_args={"beam_size": "2"})
    with pytest.raises(StartupError, match="'beam_size' is not read by the transformers backend"):
        TranscribePredictor(config)
    chosen = TranscribePredictor(PredictorConfig(model_name="w", task="transcribe", source=str(ct2_dir)))
    assert (chosen.backend, chosen.device, chosen.compute_type) == (Backend.FASTER_WHISPER, "cpu", "int8")


# -- equal to faster-whisper in-process --------------------------------------------------------------------------


def test_a_short_clip_decodes_to_faster_whispers_segments_and_timestamps(client: OpenAI, ct2_dir: Path,
                                                                         short_wav: bytes) -> None:  # fmt: skip
    segments, text, _ = reference(ct2_dir, read_wav(short_wav), language="en")
    answer = verbose(client, short_wav, language="en")
    assert segments, "the tiny model predicts at least one segment"
    assert served(answer) == without_words(segments)
    assert answer["text"] == text
    assert answer["language"] == "english"
    assert answer["words"] is None  # not asked for
    assert all(s["avg_logprob"] is not None and s["no_speech_prob"] is not None for s in answer["segments"])


def test_a_long_recording_decodes_window_by_window_as_faster_whisper_does(client: OpenAI, ct2_dir: Path,
                                                                          long_wav: bytes) -> None:  # fmt: skip
    segments, text, _ = reference(ct2_dir, read_wav(long_wav), language="en")
    answer = verbose(client, long_wav, language="en")
    assert max(s["end"] for s in segments) > 30, "more than one window"
    assert served(answer) == without_words(segments)
    assert answer["text"] == text


def test_word_timestamps_are_faster_whispers_in_verbose_json(client: OpenAI, ct2_dir: Path,
                                                             short_wav: bytes) -> None:  # fmt: skip
    segments, text, _ = reference(ct2_dir, read_wav(short_wav), language="en", word_timestamps=True)
    answer = verbose(client, short_wav, language="en", timestamp_granularities=["word", "segment"])
    expected_words = [word for s in segments for word in s["words"]]
    assert expected_words, "the tiny model's words are aligned"
    assert [(w["word"], w["start"], w["end"]) for w in answer["words"]] == expected_words
    assert served(answer) == without_words(segments)
    assert answer["text"] == text


def test_a_prompt_and_detected_language_are_as_in_process(client: OpenAI, ct2_dir: Path, short_wav: bytes) -> None:
    segments, text, info = reference(ct2_dir, read_wav(short_wav), initial_prompt="meeting notes")
    answer = verbose(client, short_wav, prompt="meeting notes")
    assert served(answer) == without_words(segments)
    assert answer["text"] == text
    assert info.language == "en"
    assert answer["language"] == "english"


def test_concurrent_requests_each_get_their_own_transcript(client: OpenAI, ct2_dir: Path, short_wav: bytes) -> None:
    clips = [wav_bytes(espeak(text)) for text in ("one two three", "call me back tomorrow", "the lazy dog")]
    clips.append(short_wav)
    expected = [reference(ct2_dir, read_wav(clip), language="en")[1] for clip in clips]
    with concurrent.futures.ThreadPoolExecutor(len(clips)) as pool:
        answers = list(pool.map(lambda clip: client.audio.transcriptions.create(
            model=SERVED, file=("a.wav", clip), language="en").text, clips))  # fmt: skip
    assert answers == expected


# -- through the SDK: formats and streaming --------------------------------------------------------------------------


def test_json_text_and_a_stream_say_the_same_transcript(client: OpenAI, short_wav: bytes, long_wav: bytes) -> None:
    for clip in (short_wav, long_wav):
        unary = client.audio.transcriptions.create(model=SERVED, file=("a.wav", clip), language="en")
        text = client.audio.transcriptions.create(model=SERVED, file=("a.wav", clip), language="en",
                                                  response_format="text")  # fmt: skip
        assert str(text).strip() == unary.text
        *deltas, done = list(client.audio.transcriptions.create(model=SERVED, file=("a.wav", clip), language="en",
                                                                stream=True))  # fmt: skip
        assert {event.type for event in deltas} == {"transcript.text.delta"}
        assert done.type == "transcript.text.done"
        assert done.text == unary.text
        assert "".join(getattr(event, "delta", "") for event in deltas) == unary.text
        if clip == long_wav:
            assert len(deltas) > 1


def test_a_long_recordings_text_is_told_as_each_window_decodes(ct2_dir: Path, long_wav: bytes) -> None:
    """What streaming sends: the text so far after each segment, told before the next window decodes (the order of
    events, counted by wrapping faster-whisper's window decoding, ``WhisperModel.generate_with_fallback``)."""
    from universal_predictors.speech.whisper import Job
    from universal_predictors.speech.whisper_ct2 import DecodeOptions, FasterWhisperEngine

    engine = FasterWhisperEngine(str(ct2_dir), "cpu", "int8", options=DecodeOptions(beam_size=BEAM_SIZE))
    events: list[str] = []
    told: list[str] = []
    decode_window = engine.model.generate_with_fallback

    def counted(*args: Any, **kwargs: Any) -> Any:
        events.append("window decoded")
        return decode_window(*args, **kwargs)

    def on_window(text: str) -> None:
        events.append("text told")
        told.append(text)

    engine.model.generate_with_fallback = counted  # type: ignore[method-assign]
    samples = read_wav(long_wav)
    try:
        [transcript] = engine.transcribe_batch([Job(samples, "transcribe", "en", None, 0.0, on_window=on_window)])
        engine.model.generate_with_fallback = decode_window  # type: ignore[method-assign]
        quiet = engine.transcribe(Job(samples, "transcribe", "en", None, 0.0))
    finally:
        engine.close()
    decoded = [i for i, event in enumerate(events) if event == "window decoded"]
    assert len(decoded) >= 3, "two and a half windows"
    assert told == transcript.texts, "one call per segment, the text of the segments so far"
    assert len(told) > 1, "more than one delta"
    # Fails where the text is told only once the whole recording is decoded.
    assert events.index("text told") < decoded[-1], "the first segment is told before the last window decodes"
    assert events[-1] == "text told"
    assert quiet == transcript


def test_the_gateway_reports_the_backend_auto_chose(gateway: GatewayProcess, client: OpenAI,
                                                    short_wav: bytes) -> None:  # fmt: skip
    client.audio.transcriptions.create(model=SERVED, file=("a.wav", short_wav))
    card = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]
    [model] = [m for m in card if m["id"] == SERVED]
    assert model["task"] == "transcribe"
    assert model["backend"] == "faster-whisper"  # what auto chose, as the running predictor reports it


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK marks audio.translations deprecated
def test_an_english_only_checkpoint_refuses_translation_and_other_languages(client: OpenAI, short_wav: bytes) -> None:
    import openai

    # CTranslate2 calls a checkpoint multilingual by its vocabulary's size (Whisper's 51865 and up): the tiny one is
    # English-only to it, as to faster-whisper.
    with pytest.raises(openai.BadRequestError) as translation:
        client.audio.translations.create(model=SERVED, file=("a.wav", short_wav))
    assert translation.value.code == "unsupported_task"
    with pytest.raises(openai.BadRequestError) as german:
        client.audio.transcriptions.create(model=SERVED, file=("a.wav", short_wav), language="de")
    assert german.value.code == "unsupported_language"


def test_a_gpu_given_where_ctranslate2_has_none_stops_the_start_naming_why(ct2_dir: Path) -> None:
    from universal_predictors.base import StartupError
    from universal_predictors.config import GPUS_ENV
    from universal_predictors.devices import gpu_unusable_reason
    from universal_predictors.speech.whisper_ct2 import ctranslate2_cuda_devices
    from universal_predictors.tasks.transcribe import TranscribePredictor

    if ctranslate2_cuda_devices() > 0:
        # On a GPU machine the refusal cannot happen; CI has no GPU, so it always runs there, and inside a tier a
        # skip fails (tests/tiers.py).
        pytest.skip("CTranslate2 sees a GPU here: the refusal this test reads cannot happen")
    reason = gpu_unusable_reason(Backend.FASTER_WHISPER, 1)
    assert reason is not None
    assert f"{GPUS_ENV}=1" in reason
    assert "\n" not in reason
    config = PredictorConfig(model_name="w", task="transcribe", source=str(ct2_dir))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(GPUS_ENV, "1")
        with pytest.raises(StartupError, match=GPUS_ENV):
            TranscribePredictor(config)


# -- requests sharing CTranslate2 generate calls (batch_windows) ------------------------------------------------------


class _CountedWhisper:
    """The real CTranslate2 Whisper, its ``generate`` calls' batch sizes written down."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.batches: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def generate(self, features: Any, prompts: list[list[int]], **options: Any) -> Any:
        self.batches.append(len(prompts))
        return self.model.generate(features, prompts, **options)


@pytest.mark.parametrize("beam_size", [1, BEAM_SIZE])
def test_a_batchs_jobs_share_generate_calls_each_decoded_as_alone(ct2_dir: Path, short_wav: bytes, long_wav: bytes,
                                                                  beam_size: int) -> None:  # fmt: skip
    from universal_predictors.speech.whisper import Job
    from universal_predictors.speech.whisper_ct2 import DecodeOptions, FasterWhisperEngine

    short, long = read_wav(short_wav), read_wav(long_wav)
    other = read_wav(wav_bytes(espeak("call me back tomorrow")))
    told: list[str] = []
    alone = FasterWhisperEngine(str(ct2_dir), "cpu", "int8", options=DecodeOptions(beam_size))
    together = FasterWhisperEngine(str(ct2_dir), "cpu", "int8", options=DecodeOptions(beam_size, batch_windows=True))
    counted = _CountedWhisper(together.model.model)
    together.model.model = counted
    prompt_ids = alone.prompt_ids("meeting notes")
    jobs = [
        Job(short, "transcribe", "en", None, 0.0),
        Job(long, "transcribe", "en", None, 0.0, on_window=told.append),
        Job(other, "transcribe", None, prompt_ids, 0.0),  # language detected, a prompt
        Job(short, "transcribe", "en", None, 0.0, words=True),
    ]
    try:
        expected = [alone.transcribe(job) for job in jobs]
        told.clear()  # the solo pass told its segments too
        found = together.transcribe_batch(jobs)
    finally:
        alone.close()
        together.close()
    assert found == expected  # tokens, texts, timestamps, words, scores: all as decoded alone
    assert told == found[1].texts  # streaming still told segment by segment
    windows = sum(len({s.seek for s in transcript.segments}) for transcript in expected)
    assert max(counted.batches) >= 2, "windows of different jobs went through one generate call"
    assert len(counted.batches) < windows, "fewer generate calls than windows decoded"


@pytest.fixture(scope="module")
def batched_client(tmp_path_factory: pytest.TempPathFactory, ct2_dir: Path) -> Iterator[OpenAI]:
    folder = tmp_path_factory.mktemp("batched-manifests")
    (folder / "whisper.yaml").write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
        f"metadata: {{name: fwhisper-batched}}\nspec:\n  task: transcribe\n  servedName: {SERVED}\n"
        f'  source: {{uri: "{ct2_dir}"}}\n'
        '  engineArgs: {max_audio_seconds: "200", max_wait_ms: "500", batch_windows: "true"}\n'
    )
    with running_gateway([folder], tmp_path_factory.mktemp("batched-gateway")) as running:
        yield OpenAI(base_url=running.base_url, api_key="unused", timeout=300, max_retries=0)


def test_concurrent_requests_sharing_generate_calls_get_their_own_transcripts(batched_client: OpenAI, ct2_dir: Path,
                                                                              short_wav: bytes,
                                                                              long_wav: bytes) -> None:  # fmt: skip
    clips = [wav_bytes(espeak(text)) for text in ("one two three", "call me back tomorrow")] + [short_wav, long_wav]
    expected = [reference(ct2_dir, read_wav(clip), language="en")[1] for clip in clips]
    with concurrent.futures.ThreadPoolExecutor(len(clips)) as pool:
        answers = list(pool.map(lambda clip: batched_client.audio.transcriptions.create(
            model=SERVED, file=("a.wav", clip), language="en").text, clips))  # fmt: skip
    assert answers == expected
    *deltas, done = list(batched_client.audio.transcriptions.create(model=SERVED, file=("a.wav", long_wav),
                                                                    language="en", stream=True))  # fmt: skip
    assert len(deltas) > 1
    assert "".join(getattr(event, "delta", "") for event in deltas) == done.text == expected[-1]


# -- features window by window ---------------------------------------------------------------------------------------


FILES = [
    ("wav", "pcm_s16le", 16_000),
    ("mp3", "libmp3lame", 44_100),
    ("ogg", "libopus", 48_000),
    ("ipod", "aac", 22_050),
]


@pytest.mark.parametrize(("container", "codec", "rate"), FILES)
def test_the_predictors_samples_are_the_ones_faster_whisper_reads_from_a_file(
    container: str, codec: str, rate: int
) -> None:
    # So a transcript through the predictor equals ``WhisperModel.transcribe(path)`` on the same upload, lossy
    # codecs included (faster-whisper 1.2.1 audio.py decodes to 16-bit, then scales).
    import io

    from faster_whisper.audio import decode_audio as faster_whispers_decode

    from tests.predictors.speech_samples import encoded
    from universal_predictors.speech.audio import AudioLimits, as_float, decode_audio

    data = encoded(espeak("testing one two three"), container, codec, rate)
    ours = decode_audio(data, "file", AudioLimits(max_audio_bytes=2**22, max_audio_seconds=60, max_audio_channels=2))
    assert np.array_equal(as_float(ours.samples), faster_whispers_decode(io.BytesIO(data)))


@pytest.mark.parametrize("chunk_length", [None, 30])
def test_features_computed_window_by_window_equal_faster_whispers_own_bit_for_bit(chunk_length: int | None) -> None:
    from faster_whisper.feature_extractor import FeatureExtractor

    from universal_predictors.speech.whisper_ct2 import FEATURE_STEP_FRAMES, windowed_feature_extractor

    library = FeatureExtractor(feature_size=80)
    windowed = windowed_feature_extractor(FeatureExtractor(feature_size=80))
    step = FEATURE_STEP_FRAMES * library.hop_length
    # Shorter than the reflection, around its edges, one window, around a step's edges, several steps and a remainder.
    lengths = [1, 41, 199, 200, 201, 240, 241, 401, 16_000, step - 1, step, step + 1, step + 161, 2 * step + 7,
               5 * step + 12_345]  # fmt: skip
    rng = np.random.default_rng(7)
    for length in lengths:
        samples = (rng.standard_normal(length) * 0.3).astype(np.float32)
        expected = library(samples, chunk_length=chunk_length)
        got = windowed(samples, chunk_length=chunk_length)
        assert got.shape == expected.shape, length
        assert np.array_equal(got, expected), f"{length} samples: differs by up to {np.abs(got - expected).max()}"
        # The predictor's decode gives 16-bit samples, scaled piece by piece: the features of the samples scaled
        # whole, as faster-whisper's ``decode_audio`` scales them.
        pcm = (rng.standard_normal(length) * 8000).clip(-32768, 32767).astype(np.int16)
        expected = library(pcm.astype(np.float32) / 32768.0, chunk_length=chunk_length)
        assert np.array_equal(windowed(pcm, chunk_length=chunk_length), expected), f"{length} 16-bit samples"
    assert (windowed.n_samples, windowed.nb_max_frames) == (library.n_samples, library.nb_max_frames)


def test_features_of_a_longer_file_take_only_their_own_size_more_memory() -> None:
    """What computing the features holds beyond the features themselves stays the same as the file grows (the
    library's own holds about 30 times the features' size more: 341 MB for 6 minutes, measured)."""
    import tracemalloc

    from faster_whisper.feature_extractor import FeatureExtractor

    from universal_predictors.speech.whisper_ct2 import windowed_feature_extractor

    def beyond_features(extractor: Any, minutes: float) -> int:
        samples = np.zeros(int(minutes * 60 * 16_000), np.float32)
        samples[::7] = 0.25
        tracemalloc.start()
        try:
            features = extractor(samples)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        return peak - features.nbytes

    windowed = windowed_feature_extractor(FeatureExtractor(feature_size=80))
    two, six = beyond_features(windowed, 2), beyond_features(windowed, 6)
    assert abs(six - two) < 2 * 2**20, (two, six)  # flat: the same steps' temporaries, not the file's length
    library = beyond_features(FeatureExtractor(feature_size=80), 6)
    assert library > 4 * six, (library, six)


# -- files longer than STREAMED_FROM_SECONDS: streamed, window by window ----------------------------------------------


def test_a_file_past_the_streaming_length_is_transcribed_as_faster_whisper_does_the_whole_file(
    client: OpenAI, ct2_dir: Path, longer_speech: np.ndarray
) -> None:
    """Streamed (read through, then decoded again window by window with its features): the same segments, words and
    detected language as faster-whisper in-process on the whole decoded file."""
    from tests.predictors.speech_samples import encoded

    wav = wav_bytes(longer_speech)
    segments, text, _ = reference(ct2_dir, read_wav(wav), language="en", word_timestamps=True)
    answer = verbose(client, wav, language="en", timestamp_granularities=["word", "segment"])
    assert max(s["end"] for s in segments) > 120, "past the streaming length"
    assert served(answer) == without_words(segments)
    assert answer["text"] == text
    assert [(w["word"].strip(), w["start"], w["end"]) for w in answer["words"]] == [
        w for s in segments for w in s["words"]
    ]
    # Without a language (its detection slices the features from the start, unbounded) and a header that declares
    # no duration (the file is read through first to know it): Opus written as a browser streams it.
    live = encoded(longer_speech, "webm", "libopus", 48_000, live=True)
    from faster_whisper.audio import decode_audio as faster_whispers_decode

    samples = faster_whispers_decode(io.BytesIO(live))
    segments, text, info = reference(ct2_dir, samples)
    answer = client.audio.transcriptions.create(model=SERVED, file=("note.webm", live),
                                                response_format="verbose_json").model_dump()  # fmt: skip
    assert served(answer) == without_words(segments)
    assert answer["duration"] == pytest.approx(info.duration, abs=1e-3)


def test_a_header_that_lies_short_is_streamed_and_transcribed_as_the_whole_file(
    client: OpenAI, ct2_dir: Path, longer_speech: np.ndarray
) -> None:
    """A WebM declaring 10 s that decodes to 157 s: streamed past half again what it declared (its request reserved
    10 s), and transcribed as faster-whisper does the whole file."""
    from tests.predictors.speech_samples import lying_webm
    from universal_predictors.speech.audio import AudioLimits, decode_audio
    from universal_predictors.speech.whisper_ct2 import FasterWhisperEngine, StreamedWaveform
    from universal_predictors.tasks.transcribe import GROWTH

    limits = AudioLimits(max_audio_bytes=2**26, max_audio_seconds=3600, max_audio_channels=2)
    lie = lying_webm(longer_speech, 10)
    samples = decode_audio(lie, "file", limits).samples
    engine = FasterWhisperEngine(str(ct2_dir), "cpu", "int8")
    try:
        streamed, seconds = engine.read(lie, "file", limits, 10 * GROWTH + 1)
    finally:
        engine.close()
    assert isinstance(streamed, StreamedWaveform)
    assert seconds == len(samples) / 16_000
    segments, text, _ = reference(ct2_dir, samples.astype(np.float32) / 32768.0, language="en")
    answer = verbose(client, lie, language="en")
    assert served(answer) == without_words(segments)
    assert answer["text"] == text


@pytest.mark.parametrize(("container", "codec", "rate"), [("wav", "pcm_s16le", 16_000), ("ogg", "libopus", 48_000)])
def test_streamed_samples_and_features_equal_the_whole_files_bit_for_bit(
    container: str, codec: str, rate: int, longer_speech: np.ndarray
) -> None:
    from faster_whisper.feature_extractor import FeatureExtractor

    from tests.predictors.speech_samples import encoded
    from universal_predictors.speech.audio import AudioLimits, StreamedSamples, as_float, decode_audio, scan_audio
    from universal_predictors.speech.whisper_ct2 import streamed_waveform, windowed_feature_extractor

    limits = AudioLimits(max_audio_bytes=2**26, max_audio_seconds=3600, max_audio_channels=2)
    data = encoded(longer_speech, container, codec, rate)
    whole = decode_audio(data, "file", limits).samples
    scan = scan_audio(data, "file", limits)
    streamed = StreamedSamples(data, "file", limits, scan)
    assert len(streamed) == len(whole)
    # Forward (overlapping, past the end), then back to the start (decoded again from there).
    for lo, hi in [(0, 1000), (500, 70_000), (69_000, 480_000), (len(whole) - 100, len(whole) + 50), (10, 20)]:
        assert np.array_equal(streamed[lo:hi], whole[lo:hi]), (lo, hi)
    expected = FeatureExtractor(feature_size=80)(as_float(whole))
    windowed = windowed_feature_extractor(FeatureExtractor(feature_size=80))
    features = windowed(streamed_waveform(StreamedSamples(data, "file", limits, scan)))
    frames = expected.shape[1]
    assert features.shape == expected.shape
    # faster-whisper's windows: any seek, the last ones shorter than a window.
    for seek in [0, 1, 2500, 2999, 3000, 4321, frames - 3000, frames - 2999, frames - 100, frames - 3, frames - 1]:
        assert np.array_equal(features[:, seek : seek + 3000], expected[:, seek : seek + 3000]), seek
    detected = features[..., 1234:]  # language detection's slice: still streamed
    assert detected.shape == (80, frames - 1234)
    assert np.array_equal(detected[..., :3000], expected[:, 1234:4234])


def test_a_streamed_file_holds_the_same_memory_whatever_its_length() -> None:
    """Scanning, then every window of features as faster-whisper asks for them: the peak does not grow with the
    file (decoding a file whole holds 64 KB a second of it: samples and features)."""
    import tracemalloc

    from faster_whisper.feature_extractor import FeatureExtractor

    from tests.predictors.speech_samples import encoded
    from universal_predictors.speech.audio import AudioLimits, StreamedSamples, scan_audio
    from universal_predictors.speech.whisper_ct2 import streamed_waveform, windowed_feature_extractor

    limits = AudioLimits(max_audio_bytes=2**28, max_audio_seconds=3600, max_audio_channels=2)
    windowed = windowed_feature_extractor(FeatureExtractor(feature_size=80))
    rng = np.random.default_rng(5)

    def peak(minutes: int) -> int:
        data = encoded((rng.standard_normal(minutes * 60 * 16_000) * 3000).astype(np.int16), "ogg", "libopus",
                       48_000)  # fmt: skip
        tracemalloc.start()
        try:
            scan = scan_audio(data, "file", limits)
            features = windowed(streamed_waveform(StreamedSamples(data, "file", limits, scan)))
            for seek in range(0, features.shape[1], 2_800):
                features[:, seek : seek + 3000]
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    short, long = peak(3), peak(12)
    assert long - short < 2 * 2**20, (short, long)  # 9 more minutes decoded whole: 35 MB more


def test_the_largest_feature_found_while_reading_is_the_one_a_pass_over_the_file_finds(
    longer_speech: np.ndarray,
) -> None:
    from faster_whisper.feature_extractor import FeatureExtractor

    from tests.predictors.speech_samples import encoded
    from universal_predictors.speech.audio import Audio, AudioLimits, StreamedSamples, decode_audio, read_audio
    from universal_predictors.speech.whisper_ct2 import RunningLargest, largest_log_mel, windowed_feature_extractor

    limits = AudioLimits(max_audio_bytes=2**26, max_audio_seconds=3600, max_audio_channels=2)
    extractor = windowed_feature_extractor(FeatureExtractor(feature_size=80))
    # Loud at the very end (the last step, computed once the length is known) and in the middle, quiet elsewhere.
    for loud_at in (len(longer_speech) - 300, len(longer_speech) // 2, 100):
        samples = (longer_speech // 8).astype(np.int16)
        samples[loud_at : loud_at + 200] = 30_000
        data = encoded(samples, "ogg", "libopus", 48_000)
        found = read_audio(data, "file", limits, 16_000 * 60, lambda: RunningLargest(extractor))
        assert not isinstance(found, Audio)
        scan, running = found
        expected = largest_log_mel(extractor, StreamedSamples(data, "file", limits, scan))
        assert running.finish(scan.length, scan.head, scan.tail) == expected, loud_at
    # A file within what is held is decoded whole, as decode_audio decodes it.
    short = encoded(longer_speech[: 16_000 * 20], "webm", "libopus", 48_000, live=True)
    whole = read_audio(short, "file", limits, 16_000 * 60, lambda: RunningLargest(extractor))
    assert isinstance(whole, Audio)
    assert np.array_equal(whole.samples, decode_audio(short, "file", limits).samples)
