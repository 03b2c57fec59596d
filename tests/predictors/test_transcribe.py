"""``task: transcribe``: a tiny random Whisper served by ``universal-runtime serve``, called with the real ``openai``
SDK, against transformers' own ``generate`` run in-process on the same samples.

Speech comes from espeak-ng (:mod:`tests.predictors.speech_samples`); the model is built offline
(:mod:`tests.predictors.tiny_whisper`). Its words are gibberish, but the same gibberish in-process and served:
tokens and timestamps are compared exactly, for one short clip, a long-form recording (two and a half windows) and
concurrent requests batched together.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI

from tests.gateway.harness import GatewayProcess, running_gateway
from tests.predictors.speech_samples import RATE, encoded, espeak, long_speech, read_wav, wav_bytes
from tests.predictors.tiny_whisper import build_tiny_whisper
from universal_predictors.config import AUDIO_SECONDS_HEADER
from universal_predictors.errors import InvalidRequest, RequestTooLarge
from universal_predictors.http import FormPart
from universal_predictors.speech.audio import AudioLimits, decode_audio
from universal_predictors.speech.captions import srt, vtt
from universal_predictors.speech.whisper import Job, Segment, WhisperEngine, long_form_features

SERVED = "tiny-whisper"
MAX_SECONDS = 200
#: Room for the concurrency test's audio at once (192 KB a second: 75 s + 45 s + the short clips), and for a file
#: streamed (over 120 s: what 120 s reserves, 23 MB).
DECODE_BUDGET_MB = 24


@dataclass(frozen=True)
class Reference:
    """What transformers' ``generate`` decodes in-process: each segment's (tokens, start, end), and the text."""

    segments: list[tuple[list[int], float, float]]
    text: str


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_whisper(tmp_path_factory.mktemp("whisper") / "tiny-whisper")


@cache
def _in_process(model_dir: str, attention: str | None = None) -> tuple[Any, Any]:
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(model_dir, attn_implementation=attention)
    return WhisperProcessor.from_pretrained(model_dir), model


def reference_words(model_dir: Path, samples: np.ndarray) -> list[tuple[str, float, float]]:
    """transformers' token timestamps in-process (``return_token_timestamps``: its cross-attention alignment, which
    runs in eager attention: a model of its own), grouped into words with its own grouping
    (``_combine_tokens_into_words``); a word lasts from its first token's time to the next token's, as
    openai-whisper times words."""
    import torch
    from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words

    processor, model = _in_process(str(model_dir), "eager")
    kwargs: dict[str, Any] = {}
    if len(samples) > 30 * RATE:
        inputs = processor(samples, sampling_rate=RATE, return_tensors="pt", truncation=False, padding="longest",
                           return_attention_mask=True)  # fmt: skip
        kwargs["attention_mask"] = inputs.attention_mask
    else:
        inputs = processor(samples, sampling_rate=RATE, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(inputs.input_features, return_timestamps=True, return_segments=True, language="en",
                             task="transcribe", return_token_timestamps=True, **kwargs)  # fmt: skip
    words = []
    for segment in out["segments"][0]:
        tokens, times = segment["tokens"].tolist(), segment["token_timestamps"].tolist()
        assert len(tokens) == len(times)
        text = [i for i, token in enumerate(tokens) if token < processor.tokenizer.eos_token_id]
        if not text:
            continue
        found, _, indices = _combine_tokens_into_words(processor.tokenizer, [tokens[i] for i in text], "english")
        for word, members in zip(found, indices, strict=True):
            end = min(text[members[-1]] + 1, len(times) - 1)
            words.append((word.strip(), round(times[text[members[0]]], 3), round(times[end], 3)))
    return words


def reference(model_dir: Path, samples: np.ndarray, *, language: str = "en", task: str = "transcribe",
              prompt: str | None = None) -> Reference:  # fmt: skip
    """transformers' own Whisper decoding, as its documentation writes it (long-form: untruncated features, an
    attention mask)."""
    import torch

    processor, model = _in_process(str(model_dir))
    kwargs: dict[str, Any] = {}
    if prompt is not None:
        kwargs["prompt_ids"] = torch.tensor(processor.get_prompt_ids(prompt))
    if len(samples) > 30 * RATE:
        inputs = processor(samples, sampling_rate=RATE, return_tensors="pt", truncation=False, padding="longest",
                           return_attention_mask=True)  # fmt: skip
        kwargs["attention_mask"] = inputs.attention_mask
    else:
        inputs = processor(samples, sampling_rate=RATE, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(inputs.input_features, return_timestamps=True, return_segments=True, language=language,
                             task=task, **kwargs)  # fmt: skip
    segments = [
        ([int(t) for t in s["tokens"].tolist()], round(float(s["start"]), 2), round(float(s["end"]), 2))
        for s in out["segments"][0]
    ]
    text = processor.batch_decode(out["sequences"], skip_special_tokens=True)[0].strip()
    return Reference(segments, text)


def reference_scores(model_dir: Path, samples: np.ndarray) -> list[tuple[float, float]]:
    """Each segment's window's ``(avg_logprob, no_speech_prob)`` as openai-whisper defines them, derived here from
    what transformers' ``generate`` exposes in-process: the window's scores (``output_scores``; the log softmax at
    each chosen token, the end-of-text token included, averaged) and, for ``<|nospeech|>``, one forward pass of the
    window's features with the window's first decoder tokens (its probability after ``<|startoftranscript|>``). The
    windows' positions are those ``generate`` reports to ``monitor_progress``."""
    import torch

    processor, model = _in_process(str(model_dir))
    seeks: list[int] = []
    kwargs: dict[str, Any] = {"monitor_progress": lambda progress: seeks.append(int(progress[0, 0]))}
    if len(samples) > 30 * RATE:
        inputs = processor(samples, sampling_rate=RATE, return_tensors="pt", truncation=False, padding="longest",
                           return_attention_mask=True)  # fmt: skip
        kwargs["attention_mask"] = inputs.attention_mask
    else:
        inputs = processor(samples, sampling_rate=RATE, return_tensors="pt")
    features = inputs.input_features
    with torch.inference_mode():
        out = model.generate(features, return_timestamps=True, return_segments=True, language="en", task="transcribe",
                             return_dict_in_generate=True, output_scores=True, **kwargs)  # fmt: skip
        windows: list[dict[str, Any]] = []
        for segment in out["segments"][0]:
            if not any(segment["result"] is seen for seen in windows):
                windows.append(segment["result"])
        assert len(windows) == len(seeks)
        tokenizer = processor.tokenizer
        prefix = tokenizer.convert_tokens_to_ids(["<|startoftranscript|>", "<|en|>", "<|transcribe|>"])
        no_speech = tokenizer.convert_tokens_to_ids("<|nospeech|>")
        eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        scored: dict[int, tuple[float, float]] = {}
        for window, seek in zip(windows, seeks, strict=True):
            assert window["sequences"][: len(prefix)].tolist() == prefix
            generated = window["sequences"][len(prefix) :].tolist()
            while len(generated) > 1 and generated[-1] == eos and generated[-2] == eos:
                generated.pop()  # padding after the one end-of-text token
            logprobs = torch.log_softmax(torch.stack(window["scores"][: len(generated)]).float(), dim=-1)
            avg = float(logprobs[torch.arange(len(generated)), generated].mean())
            frames = features[:, :, seek : seek + 3000]
            frames = torch.nn.functional.pad(frames, (0, 3000 - frames.shape[-1]))
            logits = model(input_features=frames, decoder_input_ids=torch.tensor([prefix])).logits
            scored[id(window)] = (avg, float(logits[0, 0].float().softmax(-1)[no_speech]))
    return [scored[id(segment["result"])] for segment in out["segments"][0]]


@contextlib.contextmanager
def _serving(tmp_path_factory: pytest.TempPathFactory, whisper_dir: Path, budget_mb: int) -> Iterator[GatewayProcess]:
    folder = tmp_path_factory.mktemp("manifests")
    (folder / "whisper.yaml").write_text(
        "apiVersion: serving.universal-runtime.dev/v1alpha1\nkind: UniversalModel\n"
        f"metadata: {{name: whisper}}\nspec:\n  task: transcribe\n  servedName: {SERVED}\n"
        f'  source: {{uri: "{whisper_dir}"}}\n'
        f'  engineArgs: {{max_audio_seconds: "{MAX_SECONDS}", max_wait_ms: "50", '
        f'decode_budget_mb: "{budget_mb}"}}\n'
    )
    with running_gateway([folder], tmp_path_factory.mktemp("gateway")) as running:
        yield running


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, whisper_dir: Path) -> Iterator[GatewayProcess]:
    with _serving(tmp_path_factory, whisper_dir, DECODE_BUDGET_MB) as running:
        yield running


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> OpenAI:
    return OpenAI(base_url=gateway.base_url, api_key="unused", timeout=300, max_retries=0)


def verbose(client: OpenAI, data: bytes, name: str = "speech.wav", **fields: Any) -> dict[str, Any]:
    answer = client.audio.transcriptions.create(model=SERVED, file=(name, data), response_format="verbose_json",
                                                **fields)  # fmt: skip
    dumped: dict[str, Any] = answer.model_dump()
    return dumped


def served_segments(answer: dict[str, Any]) -> list[tuple[list[int], float, float]]:
    return [(s["tokens"], s["start"], s["end"]) for s in answer["segments"]]


# -- equal to transformers in-process --------------------------------------------------------------------------------


def test_a_short_clip_decodes_to_generates_tokens_and_timestamps(client: OpenAI, whisper_dir: Path,
                                                                 short_wav: bytes) -> None:  # fmt: skip
    expected = reference(whisper_dir, read_wav(short_wav))
    answer = verbose(client, short_wav, language="en")
    assert expected.segments, "the tiny model predicts at least one timestamped segment"
    assert served_segments(answer) == expected.segments
    assert answer["text"] == expected.text
    assert answer["language"] == "english"
    assert answer["task"] == "transcribe"
    assert answer["duration"] == pytest.approx(len(read_wav(short_wav)) / RATE, abs=1e-3)
    assert [s["id"] for s in answer["segments"]] == list(range(len(expected.segments)))


def test_a_long_recording_is_decoded_window_by_window_as_generate_does(client: OpenAI, whisper_dir: Path,
                                                                       long_wav: bytes) -> None:  # fmt: skip
    expected = reference(whisper_dir, read_wav(long_wav))
    answer = verbose(client, long_wav, language="en")
    assert served_segments(answer) == expected.segments
    assert answer["text"] == expected.text
    assert max(end for _, _, end in expected.segments) > 30, "the recording is decoded past its first window"


@pytest.mark.parametrize("clip", ["short_wav", "long_wav"])
def test_avg_logprob_and_no_speech_prob_are_each_windows_as_generate_scores_it(
    client: OpenAI, whisper_dir: Path, clip: str, request: pytest.FixtureRequest
) -> None:
    data: bytes = request.getfixturevalue(clip)
    expected = reference_scores(whisper_dir, read_wav(data))
    answer = verbose(client, data, language="en")
    served = [(s["avg_logprob"], s["no_speech_prob"]) for s in answer["segments"]]
    assert len(served) == len(expected)
    assert served == [(pytest.approx(avg, abs=1e-5), pytest.approx(p, rel=1e-4)) for avg, p in expected]
    assert all(avg < 0 and 0 < p < 1 for avg, p in served)
    if clip == "long_wav":
        assert len(set(expected)) > 1, "each window has its own scores"


@pytest.mark.parametrize("clip", ["short_wav", "long_wav"])
def test_word_timestamps_are_transformers_token_timestamps_grouped_into_words(
    client: OpenAI, whisper_dir: Path, clip: str, request: pytest.FixtureRequest
) -> None:
    data: bytes = request.getfixturevalue(clip)
    expected = reference_words(whisper_dir, read_wav(data))
    answer = verbose(client, data, language="en", timestamp_granularities=["word", "segment"])
    assert expected, "the tiny model's tokens are aligned"
    assert [(w["word"], w["start"], w["end"]) for w in answer["words"]] == expected
    # Words change nothing of the segments: still generate's, as without them.
    assert served_segments(answer) == reference(whisper_dir, read_wav(data)).segments
    if clip == "long_wav":
        assert max(w["end"] for w in answer["words"]) > 30, "words are timed past the first window"


def test_a_checkpoint_without_alignment_heads_refuses_word_timestamps_by_name(tmp_path: Path) -> None:
    import torch

    from universal_predictors.tasks.transcribe import form_body

    engine = WhisperEngine(str(build_tiny_whisper(tmp_path / "no-heads", alignment_heads=False)), "cpu", torch.float32)
    assert engine.word_timestamps is False
    parts = [FormPart("file", b"RIFF", filename="a.wav"), FormPart("response_format", b"verbose_json"),
             FormPart("timestamp_granularities[]", b"word")]  # fmt: skip
    with pytest.raises(InvalidRequest, match="generation config names no alignment_heads") as raised:
        form_body(parts, "transcribe", word_timestamps=engine.word_timestamps)
    assert raised.value.param == "timestamp_granularities[]"


def test_concurrent_requests_batched_together_each_get_their_own_transcript(
    client: OpenAI, whisper_dir: Path, short_wav: bytes, long_wav: bytes
) -> None:
    clips = [
        short_wav,
        wav_bytes(espeak("call me back tomorrow")),
        long_wav,
        wav_bytes(espeak("one two three four five")),
        wav_bytes(long_speech(45)),
    ]
    expected = [reference(whisper_dir, read_wav(clip)).segments for clip in clips]
    with concurrent.futures.ThreadPoolExecutor(len(clips)) as pool:
        answers = list(pool.map(lambda clip: verbose(client, clip, language="en"), clips))
    assert [served_segments(answer) for answer in answers] == expected


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK marks audio.translations deprecated
def test_translation_decodes_with_the_translate_task(client: OpenAI, whisper_dir: Path, short_wav: bytes) -> None:
    answer = client.audio.translations.create(model=SERVED, file=("note.wav", short_wav),
                                              response_format="verbose_json").model_dump()  # fmt: skip
    # The language the model detects on the clip is what the translation starts from.
    detected = answer["language"]
    codes = {"english": "en", "german": "de", "french": "fr", "spanish": "es"}
    expected = reference(whisper_dir, read_wav(short_wav), language=codes[detected], task="translate")
    assert answer["task"] == "translate"
    assert served_segments(answer) == expected.segments


def test_a_mixed_batch_decodes_each_job_as_it_decodes_alone(whisper_dir: Path, short_wav: bytes,
                                                            long_wav: bytes) -> None:  # fmt: skip
    """Short and long audio, two languages, both tasks, a prompt and a detected language in one batch: the engine
    splits it into the generate calls that can be shared, and each job comes out as it does alone."""
    import torch

    engine = WhisperEngine(str(whisper_dir), "cpu", torch.float32)
    short, long = read_wav(short_wav), read_wav(long_wav)
    prompt = engine.prompt_ids("the meeting notes")
    jobs = [
        Job(short, "transcribe", "en", None, 0.0),
        Job(long, "transcribe", "en", None, 0.0),
        Job(short[: 3 * RATE // 2], "transcribe", "en", None, 0.0),
        Job(short, "transcribe", "de", None, 0.0),
        Job(short, "translate", "fr", None, 0.0),
        Job(short, "transcribe", "en", prompt, 0.0),
        Job(long[: 45 * RATE], "transcribe", None, None, 0.0),
        Job(long, "transcribe", "en", None, 0.0, scored=True),
        Job(short, "transcribe", "en", None, 0.0, scored=True),
    ]
    together = engine.transcribe_batch(jobs)
    alone = [engine.transcribe_batch([job])[0] for job in jobs]
    assert together == alone
    assert [(s.tokens, s.start, s.end) for s in together[5].segments] == reference(
        whisper_dir, short, prompt="the meeting notes"
    ).segments
    assert [(s.tokens, s.start, s.end) for s in together[4].segments] == reference(
        whisper_dir, short, language="fr", task="translate"
    ).segments
    assert together[6].language in engine.languages
    # Scoring a window changes nothing of what it decodes to.
    assert [(s.tokens, s.start, s.end) for s in together[7].segments] == [
        (s.tokens, s.start, s.end) for s in together[1].segments
    ]
    assert {s.avg_logprob for s in together[0].segments} == {None}
    assert None not in {s.no_speech_prob for s in together[8].segments}


def test_a_long_recordings_text_is_told_as_each_window_decodes(whisper_dir: Path, long_wav: bytes) -> None:
    """What streaming sends: the text so far after each 30 s window, told before the next window decodes (the
    order of events, counted by wrapping the engine's window decoding, ``generate_with_fallback``)."""
    import torch

    engine = WhisperEngine(str(whisper_dir), "cpu", torch.float32)
    events: list[str] = []
    told: list[str] = []
    decode_window = engine.model.generate_with_fallback

    def counted(**kwargs: Any) -> Any:
        events.append("window decoded")
        return decode_window(**kwargs)

    def on_window(text: str) -> None:
        events.append("text told")
        told.append(text)

    engine.model.generate_with_fallback = counted
    samples = read_wav(long_wav)
    [transcript] = engine.transcribe_batch([Job(samples, "transcribe", "en", None, 0.0, on_window=on_window)])
    assert len(told) >= 3, "two and a half windows"
    assert events == ["window decoded", "text told"] * len(told)
    assert set(told) <= set(transcript.texts)  # each the text of the segments so far
    assert told[-1] == transcript.texts[-1]
    quiet = engine.transcribe_batch([Job(samples, "transcribe", "en", None, 0.0)])[0]
    assert quiet == transcript
    assert [(s.tokens, s.start, s.end) for s in transcript.segments] == reference(whisper_dir, samples).segments


# -- every response format through the SDK ---------------------------------------------------------------------------


def test_every_response_format_says_the_same_transcript(client: OpenAI, short_wav: bytes) -> None:
    full = verbose(client, short_wav, language="en")
    segments = [Segment(s["id"], s["seek"], s["start"], s["end"], s["text"], s["tokens"]) for s in full["segments"]]
    create = client.audio.transcriptions.create
    as_json = create(model=SERVED, file=("a.wav", short_wav), language="en")
    as_text = create(model=SERVED, file=("a.wav", short_wav), language="en", response_format="text")
    as_srt = create(model=SERVED, file=("a.wav", short_wav), language="en", response_format="srt")
    as_vtt = create(model=SERVED, file=("a.wav", short_wav), language="en", response_format="vtt")
    assert as_json.text == full["text"]
    assert as_json.model_dump()["usage"] == {"type": "duration", "seconds": 3}
    assert as_text == full["text"] + "\n"
    assert as_srt == srt(segments)
    assert as_srt.startswith(f"1\n00:00:{segments[0].start:06.3f}".replace(".", ",") + " --> ")
    assert as_vtt == vtt(segments)
    assert as_vtt.startswith("WEBVTT\n\n00:00:")


def test_sampling_and_segment_granularity_are_taken(client: OpenAI, short_wav: bytes) -> None:
    sampled = verbose(client, short_wav, language="en", temperature=0.7, timestamp_granularities=["segment"])
    assert {segment["temperature"] for segment in sampled["segments"]} == {0.7}
    assert sampled["text"] == sampled["text"].strip()


def test_a_stream_sends_deltas_that_add_up_to_the_done_text(client: OpenAI, short_wav: bytes, long_wav: bytes) -> None:
    for clip in (short_wav, long_wav):
        unary = client.audio.transcriptions.create(model=SERVED, file=("a.wav", clip), language="en")
        events = list(client.audio.transcriptions.create(model=SERVED, file=("a.wav", clip), language="en",
                                                         stream=True))  # fmt: skip
        *deltas, done = events
        assert {event.type for event in deltas} == {"transcript.text.delta"}
        assert done.type == "transcript.text.done"
        assert done.text == unary.text
        assert "".join(getattr(event, "delta", "") for event in deltas) == unary.text
        if clip == long_wav:
            assert len(deltas) > 1


def test_the_gateway_lists_the_model_with_its_task(gateway: GatewayProcess, client: OpenAI,
                                                  short_wav: bytes) -> None:  # fmt: skip
    client.audio.transcriptions.create(model=SERVED, file=("a.wav", short_wav))  # wakes the predictor
    card = httpx.get(f"{gateway.url}/v1/models", timeout=10).json()["data"]
    [model] = [m for m in card if m["id"] == SERVED]
    assert model["task"] == "transcribe"


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")  # the SDK marks audio.translations deprecated
def test_the_usage_ledger_counts_the_answers_audio_seconds(gateway: GatewayProcess, client: OpenAI,
                                                           short_wav: bytes, long_wav: bytes) -> None:  # fmt: skip
    def totals() -> dict[str, int]:
        rows = httpx.get(f"{gateway.url}/v1/usage", timeout=30).json()["data"]
        mine = [row for row in rows if row["model"] == SERVED]
        return {name: sum(row[name] for row in mine) for name in ("audio_seconds", "requests")}

    before = totals()
    translated = client.audio.translations.create(model=SERVED, file=("b.wav", short_wav),
                                                  response_format="verbose_json")  # fmt: skip
    answers = [
        client.audio.transcriptions.create(model=SERVED, file=("a.wav", short_wav), language="en").model_dump(),
        verbose(client, long_wav, language="en"),
        translated.model_dump(),
    ]
    billed = [answer["usage"]["seconds"] for answer in answers]
    assert billed == [3, 75, 3]
    # Answers without a usage of their own (text, captions, an event stream) are billed the same seconds.
    for fields in ({"response_format": "text"}, {"response_format": "srt"}, {"response_format": "vtt"},
                   {"stream": "true"}):  # fmt: skip
        answer = post(gateway, short_wav, **fields, language="en")
        assert answer.status_code == 200, answer.text
        assert answer.text.strip()
        assert AUDIO_SECONDS_HEADER.lower() not in {name.lower() for name in answer.headers}  # the gateway's own
        billed.append(3)
    deadline = time.monotonic() + 30  # the gateway writes the ledger after each answer is out
    while totals()["requests"] - before["requests"] < len(billed) and time.monotonic() < deadline:
        time.sleep(0.1)
    after = totals()
    assert after["requests"] - before["requests"] == len(billed)
    assert after["audio_seconds"] - before["audio_seconds"] == sum(billed)
    csv_text = httpx.get(f"{gateway.url}/v1/usage?format=csv", timeout=30).text
    assert "audio_seconds" in csv_text.splitlines()[0].split(",")
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=30).text
    counter = "universal_gateway_usage_audio_seconds_total{"
    counted = [line for line in metrics.splitlines() if line.startswith(counter) and f'model="{SERVED}"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in counted) == after["audio_seconds"]


# -- hostile and wrong files: 400/413 in OpenAI's shape --------------------------------------------------------------


def post(gateway: GatewayProcess, data: bytes, name: str = "speech.wav", **fields: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/audio/transcriptions", files={"file": (name, data)},
                      data={"model": SERVED, **fields}, timeout=120)  # fmt: skip


def error_of(response: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = response.json()["error"]
    return error


def test_the_extension_is_not_trusted_the_bytes_are(client: OpenAI, short_wav: bytes) -> None:
    samples = np.frombuffer(short_wav[44:], dtype="<i2")
    flac = encoded(samples, "flac", "flac")
    as_wav = verbose(client, short_wav, language="en")
    as_flac_named_mp3 = verbose(client, flac, name="speech.mp3", language="en")
    assert served_segments(as_flac_named_mp3) == served_segments(as_wav)  # FLAC is lossless: the same samples


def test_a_text_file_named_wav_is_a_400_naming_the_formats(gateway: GatewayProcess) -> None:
    response = post(gateway, b"these are not the samples you are looking for\n" * 20)
    assert response.status_code == 400
    assert error_of(response)["param"] == "file"
    assert error_of(response)["code"] == "unsupported_audio_format"
    assert "WAV, FLAC, MP3, OGG/Opus, M4A or WebM" in error_of(response)["message"]


@pytest.mark.parametrize("keep", [20, 44, 2000])
def test_a_truncated_wav_is_a_400(gateway: GatewayProcess, short_wav: bytes, keep: int) -> None:
    response = post(gateway, short_wav[:keep])
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == "file"
    assert error_of(response)["code"] == "invalid_audio"


def test_truncated_compressed_files_are_a_400(gateway: GatewayProcess, short_wav: bytes) -> None:
    samples = np.frombuffer(short_wav[44:], dtype="<i2")
    for container, codec in (("ipod", "aac"), ("ogg", "libopus"), ("flac", "flac")):
        data = encoded(samples, container, codec, 48_000 if codec == "libopus" else RATE)
        response = post(gateway, data[:60])
        assert response.status_code == 400, (container, response.text)
        assert error_of(response)["param"] == "file"


def test_a_wav_header_claiming_hours_is_a_413_before_decoding(gateway: GatewayProcess, short_wav: bytes) -> None:
    lying = short_wav[:40] + struct.pack("<I", 0xFFFFFF00) + short_wav[44:]
    response = post(gateway, lying)
    assert response.status_code == 413, response.text
    assert error_of(response)["code"] == "audio_too_long"
    assert f"the limit max_audio_seconds is {MAX_SECONDS}" in error_of(response)["message"]


def test_audio_over_the_duration_limit_is_a_413(gateway: GatewayProcess) -> None:
    response = post(gateway, wav_bytes(np.zeros((MAX_SECONDS + 5) * RATE, dtype=np.int16)))
    assert response.status_code == 413
    assert "max_audio_seconds" in error_of(response)["message"]


def test_audio_over_the_memory_budget_is_a_413_naming_it(tmp_path_factory: pytest.TempPathFactory,
                                                          whisper_dir: Path) -> None:  # fmt: skip
    """A budget below what one file reserves: 192 KB a second of what it declares (100 s: 19 MB), or for a file
    streamed (over 120 s), what 120 s reserves (23 MB) however long it is."""
    with _serving(tmp_path_factory, whisper_dir, 16) as small:
        for seconds in (100, 150):
            response = post(small, wav_bytes(np.zeros(seconds * RATE, dtype=np.int16)))
            assert response.status_code == 413, response.text
            assert error_of(response)["code"] == "decode_budget_exceeded"
            assert "decode budget (16 MiB, the engine argument decode_budget_mb)" in error_of(response)["message"]


def test_a_form_without_a_file_or_with_a_bad_field_is_a_400(gateway: GatewayProcess, short_wav: bytes) -> None:
    no_file = httpx.post(f"{gateway.url}/v1/audio/transcriptions", files={"note": (None, "x")},
                         data={"model": SERVED}, timeout=30)  # fmt: skip
    bad_format = post(gateway, short_wav, response_format="docx")
    bad_language = post(gateway, short_wav, language="xx")
    words = post(gateway, short_wav, response_format="json", **{"timestamp_granularities[]": "word"})
    assert (no_file.status_code, error_of(no_file)["param"]) == (400, "file")
    assert (bad_format.status_code, error_of(bad_format)["param"]) == (400, "response_format")
    assert (bad_language.status_code, error_of(bad_language)["param"]) == (400, "language")
    assert "de, en, es, fr" in error_of(bad_language)["message"]
    assert (words.status_code, error_of(words)["param"]) == (400, "timestamp_granularities[]")


def test_the_gateway_routes_the_upload_by_its_model_field(gateway: GatewayProcess, short_wav: bytes) -> None:
    response = httpx.post(f"{gateway.url}/v1/audio/transcriptions", files={"file": ("a.wav", short_wav)},
                          data={"model": "no-such-model"}, timeout=30)  # fmt: skip
    assert response.status_code == 404
    assert error_of(response)["param"] == "model"


# -- decoding, in-process ---------------------------------------------------------------------------------------------

LIMITS = AudioLimits(max_audio_bytes=2**20, max_audio_seconds=10, max_audio_channels=2)


@pytest.mark.parametrize(
    ("container", "codec", "rate"),
    [("wav", "pcm_s16le", RATE), ("flac", "flac", RATE), ("mp3", "libmp3lame", RATE), ("ogg", "libopus", 48_000),
     ("ipod", "aac", RATE), ("webm", "libopus", 48_000)],
)  # fmt: skip
def test_every_container_decodes_to_16khz_mono_of_its_length(container: str, codec: str, rate: int) -> None:
    samples = espeak("testing one two")
    audio = decode_audio(encoded(samples, container, codec, rate), "file", LIMITS)
    # Lossy codecs add a priming delay or pad the last frame: tens of milliseconds, never a different clip.
    assert abs(audio.seconds - len(samples) / RATE) < 0.1
    assert audio.samples.dtype == np.int16  # as faster-whisper's and openai-whisper's own decoders read a file
    assert audio.samples.ndim == 1


@pytest.mark.parametrize(
    "codec", ["pcm_s16le", "pcm_u8", "pcm_s24le", "pcm_f32le", "pcm_mulaw", "pcm_alaw", "adpcm_ima_wav", "libmp3lame"]
)
@pytest.mark.parametrize("rate", [8_000, 44_100])
def test_a_wav_opened_without_probing_decodes_as_a_probed_one(codec: str, rate: int) -> None:
    # The predictor opens a WAV without FFmpeg's stream probing (its header names codec, channels and rate); every
    # codec a WAV commonly holds must still decode to the samples a probed open gives.
    data = encoded(espeak("testing one two"), "wav", codec, rate)
    assert np.array_equal(decode_audio(data, "file", LIMITS).samples, _decoded_by_pyav(data))


def test_a_stereo_wav_opened_without_probing_decodes_as_a_probed_one() -> None:
    data = wav_bytes(np.repeat(espeak("testing one two"), 2), RATE, channels=2)
    assert np.array_equal(decode_audio(data, "file", LIMITS).samples, _decoded_by_pyav(data))


def test_the_limits_are_checked_before_decoding_and_name_themselves() -> None:
    samples = espeak("testing one two")
    stereo = np.repeat(samples, 3)  # three interleaved channels
    with pytest.raises(RequestTooLarge, match="the limit max_audio_channels is 2"):
        decode_audio(wav_bytes(stereo, channels=3), "file", LIMITS)
    with pytest.raises(RequestTooLarge, match="the limit max_audio_bytes is 1048576"):
        decode_audio(wav_bytes(np.zeros(2**20, dtype=np.int16)), "file", LIMITS)
    long_flac = encoded(np.zeros(12 * RATE, dtype=np.int16), "flac", "flac")
    with pytest.raises(RequestTooLarge, match=r"its header says 12.0 seconds\); the limit max_audio_seconds is 10"):
        decode_audio(long_flac, "file", LIMITS)
    with pytest.raises(InvalidRequest, match="the file is empty"):
        decode_audio(b"", "file", LIMITS)


def test_a_recording_without_a_declared_length_stops_decoding_at_the_limit() -> None:
    # A WebM written live (as browsers record) has no duration in its header: decoding counts and stops.
    live = encoded(np.zeros(12 * RATE, dtype=np.int16), "webm", "libopus", 48_000, live=True)
    with pytest.raises(RequestTooLarge, match=r"decodes to more than 10 seconds\); the limit max_audio_seconds is 10"):
        decode_audio(live, "file", LIMITS)
    short = decode_audio(encoded(espeak("hello"), "webm", "libopus", 48_000, live=True), "file", LIMITS)
    assert 0.3 < short.seconds < 2


def _decoded_by_pyav(data: bytes) -> np.ndarray:
    """The file as 16 kHz mono 16-bit samples by PyAV's own loop with FFmpeg's default probing, joined at the end
    (the test's reference)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        resampler = av.AudioResampler(format="s16", layout="mono", rate=RATE)
        stream = container.streams.audio[0]
        chunks = [
            out.to_ndarray().reshape(-1) for frame in container.decode(stream) for out in resampler.resample(frame)
        ]
        chunks += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    return np.concatenate(chunks)


def test_a_recording_longer_than_the_first_guess_decodes_whole_and_equal() -> None:
    # No declared length: room for the first 60 s, grown as the samples come (150 s: twice).
    tone = (np.sin(np.arange(150 * RATE) * 0.05) * 8000).astype(np.int16)
    live = encoded(tone, "webm", "libopus", 48_000, live=True)
    limits = AudioLimits(max_audio_bytes=2**24, max_audio_seconds=300, max_audio_channels=2)
    audio = decode_audio(live, "file", limits)
    assert np.array_equal(audio.samples, _decoded_by_pyav(live))
    assert abs(audio.seconds - 150) < 0.1


def test_a_file_s_samples_are_held_once_while_it_decodes() -> None:
    """Decoded into one array sized from the header, not frames joined at the end (which held them twice)."""
    import tracemalloc

    data = wav_bytes((np.sin(np.arange(120 * RATE) * 0.05) * 8000).astype(np.int16))
    limits = AudioLimits(max_audio_bytes=2**24, max_audio_seconds=300, max_audio_channels=2)
    # A second of it decoded first: what the first decode of the process sets up once (PyAV's codecs, about 1.2 MB
    # measured) is not the file's, and run alone this test would count it (in the tier, a test before it did).
    decode_audio(wav_bytes(np.zeros(RATE, dtype=np.int16)), "file", limits)
    tracemalloc.start()
    try:
        audio = decode_audio(data, "file", limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert np.array_equal(audio.samples, _decoded_by_pyav(data))
    assert peak < 1.3 * audio.samples.nbytes, (peak, audio.samples.nbytes)


@pytest.mark.parametrize("frames_per_step", [3000, 1000])
def test_long_form_features_equal_the_extractors_to_the_bit(whisper_dir: Path, frames_per_step: int) -> None:
    import torch
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(whisper_dir)
    samples = (np.random.default_rng(0).standard_normal(65 * RATE + 77) * 0.1).astype(np.float32)
    expected = extractor(samples, sampling_rate=RATE, return_tensors="pt", truncation=False, padding="longest")
    assert torch.equal(long_form_features(samples, extractor, frames_per_step), expected.input_features)


# -- files longer than STREAMED_FROM_SECONDS: streamed, window by window ----------------------------------------------


def test_a_file_past_the_streaming_length_is_transcribed_as_generate_does_the_whole_file(
    client: OpenAI, whisper_dir: Path, longer_speech: np.ndarray
) -> None:
    """Streamed (read through, then decoded again window by window as generate cuts its windows): the same segments,
    text and words as transformers in-process on the whole file's features."""
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    wav = wav_bytes(longer_speech)
    samples = read_wav(wav)
    expected = reference(whisper_dir, samples)
    answer = verbose(client, wav, language="en", timestamp_granularities=["word", "segment"])
    assert max(end for _, _, end in expected.segments) > 120, "past the streaming length"
    assert served_segments(answer) == expected.segments
    assert answer["text"] == expected.text
    assert [(w["word"], w["start"], w["end"]) for w in answer["words"]] == reference_words(whisper_dir, samples)
    # Without a language (detected on the first window) and a header that declares no duration (the file is read
    # through first to know it): Opus written as a browser streams it.
    live = encoded(longer_speech, "webm", "libopus", 48_000, live=True)
    decoded = decode_audio(live, "file", AudioLimits(max_audio_bytes=2**26, max_audio_seconds=3600,
                                                     max_audio_channels=2)).samples  # fmt: skip
    answer = verbose(client, live, name="note.webm")
    language = {name: code for code, name in LANGUAGES.items()}[answer["language"]]
    assert served_segments(answer) == reference(whisper_dir, decoded.astype(np.float32) / 32768.0,
                                                language=language).segments  # fmt: skip


@pytest.mark.parametrize(("container", "codec", "rate"), [("wav", "pcm_s16le", 16_000), ("ogg", "libopus", 48_000)])
def test_streamed_features_equal_the_whole_files_bit_for_bit(whisper_dir: Path, container: str, codec: str,
                                                             rate: int, longer_speech: np.ndarray) -> None:  # fmt: skip
    """The largest value found while the file is read through, and every window generate may cut (any seek, the
    last ones short, going back), equal the whole file's long-form features."""
    import torch
    from transformers import WhisperFeatureExtractor

    from universal_predictors.speech.audio import Audio, StreamedSamples, as_float, read_audio
    from universal_predictors.speech.whisper import RunningLogMelMax, StreamedFeatures

    extractor = WhisperFeatureExtractor.from_pretrained(whisper_dir)
    limits = AudioLimits(max_audio_bytes=2**26, max_audio_seconds=3600, max_audio_channels=2)
    data = encoded(longer_speech, container, codec, rate)
    expected = long_form_features(as_float(decode_audio(data, "file", limits).samples), extractor)[0]
    found = read_audio(data, "file", limits, 60 * RATE, lambda: RunningLogMelMax(extractor))
    assert not isinstance(found, Audio)
    scan, running = found
    largest = running.finish(scan.length)
    assert float(expected.max()) == float((torch.tensor(largest) + 4.0) / 4.0)  # the scaling of the largest
    features = StreamedFeatures(extractor, StreamedSamples(data, "file", limits, scan), largest)
    frames = expected.shape[1]
    assert features.frame_count == frames
    for seek in [0, 1, 2500, 2999, 3000, 4321, frames - 3000, frames - 2999, frames - 100, frames - 1, 10]:
        assert torch.equal(features.frames(seek, seek + 3000), expected[:, seek : seek + 3000]), seek


def test_the_largest_feature_found_while_reading_is_the_whole_files(whisper_dir: Path,
                                                                    longer_speech: np.ndarray) -> None:  # fmt: skip
    import torch
    from transformers import WhisperFeatureExtractor

    from universal_predictors.speech.audio import Audio, as_float, read_audio
    from universal_predictors.speech.whisper import RunningLogMelMax

    extractor = WhisperFeatureExtractor.from_pretrained(whisper_dir)
    limits = AudioLimits(max_audio_bytes=2**26, max_audio_seconds=3600, max_audio_channels=2)
    # Loud at the very end (the last step, computed once the length is known), in the middle and at the start.
    for loud_at in (len(longer_speech) - 300, len(longer_speech) // 2, 100):
        samples = (longer_speech // 8).astype(np.int16)
        samples[loud_at : loud_at + 200] = 30_000
        data = encoded(samples, "ogg", "libopus", 48_000)
        expected = long_form_features(as_float(decode_audio(data, "file", limits).samples), extractor)
        found = read_audio(data, "file", limits, 60 * RATE, lambda: RunningLogMelMax(extractor))
        assert not isinstance(found, Audio)
        largest = found[1].finish(found[0].length)
        assert float(expected.max()) == float((torch.tensor(largest) + 4.0) / 4.0), loud_at


def test_a_batch_with_a_streamed_file_decodes_each_job_as_it_decodes_alone(
    whisper_dir: Path, long_wav: bytes, longer_speech: np.ndarray
) -> None:
    """A streamed file beside one held whole in one long-form generate call (the shorter one finishes first and
    leaves the batch), timed by words or not: each as it decodes alone, and the streamed one as its whole file."""
    import torch

    engine = WhisperEngine(str(whisper_dir), "cpu", torch.float32)
    limits = AudioLimits(max_audio_bytes=2**26, max_audio_seconds=3600, max_audio_channels=2)
    data = wav_bytes(longer_speech)
    streamed, seconds = engine.read(data, "file", limits, 120)
    assert type(streamed).__name__ == "StreamedFeatures"
    assert seconds == pytest.approx(len(longer_speech) / RATE)
    whole, held = read_wav(data), read_wav(long_wav)
    for options in ({}, {"words": True}):
        jobs = [Job(streamed, "transcribe", "en", None, 0.0, **options),
                Job(held, "transcribe", "en", None, 0.0, **options)]  # fmt: skip
        together = engine.transcribe_batch(jobs)
        assert together == [engine.transcribe_batch([job])[0] for job in jobs]
        assert together[0].segments == engine.transcribe_batch([Job(whole, "transcribe", "en", None, 0.0,
                                                                    **options)])[0].segments  # fmt: skip
    # Scored (a batch's scores differ from one item's in their last bits, streamed or not: compared alone).
    scored = [engine.transcribe_batch([Job(samples, "transcribe", "en", None, 0.0, scored=True, words=True)])[0]
              for samples in (streamed, whole)]  # fmt: skip
    assert scored[0] == scored[1]
    detected = engine.transcribe_batch([Job(streamed, "transcribe", None, None, 0.0)])[0]
    assert detected == engine.transcribe_batch([Job(whole, "transcribe", None, None, 0.0)])[0]


def test_a_header_that_lies_short_is_streamed_past_what_its_request_reserved(
    client: OpenAI, whisper_dir: Path, longer_speech: np.ndarray
) -> None:
    """A WebM declaring 10 s that decodes to 157 s: its request reserved 10 s (1.9 MB of the decode budget), and
    holds no more: held whole up to half again what it declared, read through and streamed from there. Transcribed as
    the whole file, as transformers does it in-process."""
    import tracemalloc

    import torch

    from tests.predictors.speech_samples import lying_webm
    from universal_predictors.speech.audio import declared_seconds
    from universal_predictors.speech.whisper import StreamedFeatures
    from universal_predictors.tasks.transcribe import GROWTH

    limits = AudioLimits(max_audio_bytes=2**26, max_audio_seconds=3600, max_audio_channels=2)
    lie = lying_webm(longer_speech, 10)
    assert declared_seconds(lie, "file", limits) == 10
    decoded = decode_audio(lie, "file", limits)
    assert decoded.seconds > 150
    engine = WhisperEngine(str(whisper_dir), "cpu", torch.float32)

    def read(data: bytes) -> tuple[Any, float, int]:
        tracemalloc.start()
        try:
            streamed, seconds = engine.read(data, "file", limits, 10 * GROWTH + 1)
            return streamed, seconds, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    streamed, seconds, peak = read(lie)
    assert isinstance(streamed, StreamedFeatures)
    assert seconds == decoded.seconds
    # What reading it holds does not grow with the file (one 30 s step's work: decoded whole, 157 s of samples are
    # 5 MB, 10 more minutes 19 MB more).
    _, _, longer_peak = read(lying_webm(np.tile(longer_speech, 5), 10))
    assert abs(longer_peak - peak) < 2**20, (peak, longer_peak)
    answer = verbose(client, lie, name="note.webm", language="en")
    assert served_segments(answer) == reference(whisper_dir, decoded.samples.astype(np.float32) / 32768.0).segments
    # A file that decodes to a little more than its header says (within half again) is held whole, as before.
    near = lying_webm(longer_speech[: 40 * RATE], 30)
    held, _ = engine.read(near, "file", limits, 30 * GROWTH + 1)
    assert np.array_equal(held, decode_audio(near, "file", limits).samples)


def test_streamed_features_hold_two_steps_whatever_the_files_length(whisper_dir: Path) -> None:
    """Every window of a 12 minute file as generate cuts them, forward: no more than two steps of features
    (3000 frames each) held at once, and samples as tracemalloc sees them no more than for a 3 minute file."""
    import tracemalloc

    from transformers import WhisperFeatureExtractor

    from universal_predictors.speech.audio import StreamedSamples, scan_audio
    from universal_predictors.speech.whisper import StreamedFeatures

    extractor = WhisperFeatureExtractor.from_pretrained(whisper_dir)
    limits = AudioLimits(max_audio_bytes=2**28, max_audio_seconds=3600, max_audio_channels=2)
    rng = np.random.default_rng(5)

    def peak(minutes: int) -> int:
        data = encoded((rng.standard_normal(minutes * 60 * RATE) * 3000).astype(np.int16), "ogg", "libopus",
                       48_000)  # fmt: skip
        tracemalloc.start()
        try:
            features = StreamedFeatures(extractor, StreamedSamples(data, "file", limits,
                                                                   scan_audio(data, "file", limits)), 1.0)  # fmt: skip
            for seek in range(0, features.frame_count, 2_800):
                features.frames(seek, seek + 3000)
                assert len(features._held) <= 2
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    short, long = peak(3), peak(12)
    assert long - short < 2 * 2**20, (short, long)


def test_captions_are_numbered_cues_with_their_clock_times() -> None:
    segments = [Segment(0, 0, 0.0, 2.5, " Hello.", [1]), Segment(1, 250, 2.5, 3661.25, " Bye.", [2])]
    assert srt(segments) == "1\n00:00:00,000 --> 00:00:02,500\nHello.\n\n2\n00:00:02,500 --> 01:01:01,250\nBye.\n\n"
    assert vtt(segments) == "WEBVTT\n\n00:00:00.000 --> 00:00:02.500\nHello.\n\n00:00:02.500 --> 01:01:01.250\nBye.\n\n"
