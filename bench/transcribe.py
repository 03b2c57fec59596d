"""Speech to text: real-time factor (audio seconds per wall second) through the predictor's
``POST /openai/v1/audio/transcriptions``, on each backend, against each engine's own in-process transcribe.

The same WAV clips (espeak-ng speech: short voice notes and one long-form recording) go through:

- the anchors, in this process, one clip after another: faster-whisper's ``WhisperModel.transcribe`` on the
  CTranslate2 conversion, and transformers' ``WhisperForConditionalGeneration.generate`` (timestamps, long-form with
  an attention mask, as its documentation writes it) on the same weights;
- a real predictor process per backend (``python -m universal_predictors --task transcribe``), one clip per
  multipart request over loopback HTTP, at concurrency 1 and 4: the upload, PyAV's decoding, the limits and the
  batching included.

Decoding is greedy everywhere (``--beam-size 1``, transformers' default) so the engines do the same work.

No model hub is reachable here: the model is a tiny random-weight Whisper built offline
(``tests.predictors.tiny_whisper``) and converted with CTranslate2's converter, so the engines' own compute is
small and the ratios measure the serving overhead (HTTP, multipart, decoding, queueing) on a tiny model, not a
real Whisper's throughput. Goal (issue 30): at concurrency 1, >= 0.9x of the faster in-process engine; at
concurrency 4, ahead of both.

    python bench/transcribe.py
    python bench/transcribe.py --rounds 5 --beam-size 5
    python bench/transcribe.py --batch-windows   # faster-whisper: requests share CTranslate2 generate calls
    python bench/transcribe.py --shape base      # openai/whisper-base's shape (random weights)
    python bench/transcribe.py --memory 10 20 40 # long files: peak memory against faster-whisper's own

``--memory MINUTES...``: for Opus files of those lengths (espeak-ng speech), the peak RSS a transcription adds
(VmHWM reset just before it; each in a fresh process) for faster-whisper's own ``WhisperModel.transcribe(path)``
(the anchor: the library with a file, as its README writes it), the predictor's faster-whisper engine on the file
decoded whole (``decode_audio``, as for a file of 120 s or less) and streamed (``FasterWhisperEngine.read``, as for
a longer one); the same for transformers (its anchor: its own long-form ``generate`` with the processor's
untruncated features, as its documentation writes it): whether memory stays flat with duration (issue 30), and
what each costs in time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.predictors.harness import running_predictor  # noqa: E402
from tests.predictors.speech_samples import RATE, espeak, long_speech, read_wav, wav_bytes  # noqa: E402
from tests.predictors.tiny_whisper import SHAPES, build_tiny_ct2_whisper  # noqa: E402
from universal_predictors.catalog import Backend, Task  # noqa: E402
from universal_predictors.config import PredictorConfig  # noqa: E402

SENTENCES = [
    "hello world, this is a voice note about the meeting",
    "please call me back tomorrow morning",
    "the quick brown fox jumps over the lazy dog",
    "one two three four five six seven eight nine ten",
    "we will talk again next week about the budget",
    "the train leaves at half past six from platform two",
    "remember to buy milk and bread on the way home",
]


def clips() -> list[bytes]:
    return [wav_bytes(espeak(text)) for text in SENTENCES] + [wav_bytes(long_speech(45))]


def in_process_pass(transcribe: Callable[[np.ndarray], Any], audio: list[np.ndarray]) -> float:
    started = time.perf_counter()
    for samples in audio:
        transcribe(samples)
    return sum(len(a) for a in audio) / RATE / (time.perf_counter() - started)


def predictor_pass(client: httpx.Client, wavs: list[bytes], seconds: float, concurrency: int) -> float:
    def one(wav: bytes) -> None:
        client.post("/openai/v1/audio/transcriptions", files={"file": ("a.wav", wav)},
                    data={"language": "en"}).raise_for_status()  # fmt: skip

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, wavs))
    return seconds / (time.perf_counter() - started)


def faster_whisper_anchor(model_dir: Path, beam_size: int) -> Callable[[np.ndarray], Any]:
    from faster_whisper import WhisperModel

    model = WhisperModel(str(model_dir), device="cpu", compute_type="int8")

    def transcribe(samples: np.ndarray) -> Any:
        found, _ = model.transcribe(samples, language="en", beam_size=beam_size, temperature=0.0, vad_filter=False)
        return list(found)  # a generator: the decoding happens as it is read

    return transcribe


def transformers_anchor(model_dir: Path) -> Callable[[np.ndarray], Any]:
    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    processor = WhisperProcessor.from_pretrained(model_dir)
    model = WhisperForConditionalGeneration.from_pretrained(model_dir).eval()  # type: ignore[no-untyped-call]

    def transcribe(samples: np.ndarray) -> Any:
        kwargs: dict[str, Any] = {}
        if len(samples) > 30 * RATE:
            inputs = processor(samples, sampling_rate=RATE, return_tensors="pt", truncation=False, padding="longest",
                               return_attention_mask=True)  # fmt: skip
            kwargs["attention_mask"] = inputs.attention_mask
        else:
            inputs = processor(samples, sampling_rate=RATE, return_tensors="pt")
        with torch.inference_mode():
            return model.generate(inputs.input_features, return_timestamps=True, language="en", task="transcribe",
                                  **kwargs)  # fmt: skip

    return transcribe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved passes over the clips per method")
    parser.add_argument("--beam-size", type=int, default=1, help="faster-whisper's beams (transformers: greedy)")
    parser.add_argument("--batch-windows", action="store_true",
                        help="faster-whisper: requests of a batch share CTranslate2 generate calls")  # fmt: skip
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="the random model's shape (base: openai/whisper-base's)")  # fmt: skip
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="faster-whisper predictor: CTranslate2 threads per replica")  # fmt: skip
    parser.add_argument("--faster-whisper-only", action="store_true",
                        help="skip transformers' anchor and predictor (slow on the base shape)")  # fmt: skip
    parser.add_argument("--memory", type=float, nargs="+", metavar="MINUTES",
                        help="long files: peak memory of a transcription against faster-whisper's own")  # fmt: skip
    parser.add_argument("--measure-one", nargs=3, metavar=("WAY", "MODEL", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure_one:
        measure_one(*args.measure_one)
        return
    if args.memory:
        memory(args.memory, args.shape)
        return

    wavs = clips()
    audio = [read_wav(wav) for wav in wavs]
    seconds = sum(len(a) for a in audio) / RATE
    machine = f"{os.cpu_count()} cores, {platform.machine()}, CPU"
    print(f"transcribe bench: {len(wavs)} clips, {seconds:.1f} s of audio, {args.rounds} interleaved passes per "
          f"method (median), {machine}")  # fmt: skip
    dims = SHAPES[args.shape]
    print(f"model: a random-weight Whisper of shape {args.shape} (d_model {dims['d_model']}, {dims['layers']} "
          "layer(s) each side) built offline and its CTranslate2 conversion; no real Whisper is reachable here (no "
          "model hub): on tiny each ratio is mostly of serving overhead, on base the engines' compute weighs as a "
          "real model's does (a random model's transcripts are not speech, and their lengths differ from a real "
          "one's)")  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        ct2_dir = build_tiny_ct2_whisper(Path(scratch) / "model", shape=args.shape)
        hf_dir = ct2_dir.parent / "transformers"
        anchors = {"faster-whisper": faster_whisper_anchor(ct2_dir, args.beam_size)}
        if not args.faster_whisper_only:
            anchors["transformers"] = transformers_anchor(hf_dir)
        sources = {"faster-whisper": ct2_dir, "transformers": hf_dir}
        rates: dict[str, list[float]] = {}
        for name, transcribe in anchors.items():
            in_process_pass(transcribe, audio[:2])  # warm-up
            rates[f"anchor {name}"] = []
        backends = [Backend.FASTER_WHISPER] + ([] if args.faster_whisper_only else [Backend.TRANSFORMERS])
        for backend in backends:
            engine_args = {"max_wait_ms": "10", "max_audio_seconds": "120"}
            if backend is Backend.FASTER_WHISPER:
                engine_args["beam_size"] = str(args.beam_size)
                engine_args["batch_windows"] = str(args.batch_windows).lower()
                if args.cpu_threads is not None:
                    engine_args["cpu_threads"] = str(args.cpu_threads)
            config = PredictorConfig(model_name=f"bench-{backend.value}", task=Task.TRANSCRIBE, backend=backend,
                                     source=str(sources[backend.value]), engine_args=engine_args)  # fmt: skip
            with (
                running_predictor(config, Path(scratch) / "logs") as predictor,
                httpx.Client(base_url=predictor.url, timeout=600) as client,
            ):
                predictor_pass(client, wavs[:2], 1.0, 1)  # warm-up
                for label in ("c1", "c4"):
                    rates[f"{backend.value} {label}"] = []
                # Interleaved with the anchors, so load from anything else on the machine falls on all alike.
                for _ in range(args.rounds):
                    for name, transcribe in anchors.items():
                        rates[f"anchor {name}"].append(in_process_pass(transcribe, audio))
                    rates[f"{backend.value} c1"].append(predictor_pass(client, wavs, seconds, 1))
                    rates[f"{backend.value} c4"].append(predictor_pass(client, wavs, seconds, 4))
    median = {key: statistics.median(values) for key, values in rates.items()}
    fw, tf = median["anchor faster-whisper"], median.get("anchor transformers", 0.0)
    faster_name, faster = max((("faster-whisper", fw), ("transformers", tf)), key=lambda pair: pair[1])
    also_tf = f", transformers {tf:.1f}x real time" if tf else ""
    print(f"anchors in-process: faster-whisper {fw:.1f}x real time{also_tf}")
    for served in [backend.value for backend in backends]:
        c1, c4 = median[f"{served} c1"], median[f"{served} c4"]
        own = median[f"anchor {served}"]
        print(f"transcribe: predictor {served} {c1:.1f}x real time (concurrency 1) vs in-process {served} "
              f"{own:.1f}x: {c1 / own:.2f}x (its own engine)", flush=True)  # fmt: skip
        print(f"transcribe: predictor {served} {c1:.1f}x real time (concurrency 1) vs in-process {faster_name} "
              f"{faster:.1f}x: {c1 / faster:.2f}x (goal >= 0.9x)", flush=True)  # fmt: skip
        versus_tf = f", transformers {tf:.1f}x: {c4 / tf:.2f}x" if tf else ""
        print(f"transcribe: predictor {served} {c4:.1f}x real time (concurrency 4) vs in-process faster-whisper "
              f"{fw:.1f}x: {c4 / fw:.2f}x{versus_tf} (goal > 1x of both)", flush=True)  # fmt: skip


def memory(lengths: list[float], shape: str) -> None:
    """The ``--memory`` part (module docstring)."""
    import subprocess

    from tests.predictors.speech_samples import encoded

    backends = {
        "faster-whisper": ("faster-whisper's own", "decoded whole", "streamed"),
        "transformers": ("transformers' own", "transformers decoded whole", "transformers streamed"),
    }
    ways = tuple(way for backend in backends.values() for way in backend)
    print(
        f"transcribe memory: Opus files, a random-weight Whisper of shape {shape} (greedy, language given), peak "
        f"RSS a transcription adds (VmHWM reset before it), each in a fresh process; {os.cpu_count()} cores"
    )
    with tempfile.TemporaryDirectory() as scratch:
        model = build_tiny_ct2_whisper(Path(scratch) / "model", shape=shape)
        peaks: dict[str, list[float]] = {way: [] for way in ways}
        for minutes in lengths:
            path = Path(scratch) / f"{minutes:g}.ogg"
            path.write_bytes(encoded(long_speech(minutes * 60), "ogg", "libopus", 48_000))
            line = []
            for way in ways:
                run = subprocess.run([sys.executable, __file__, "--measure-one", way, str(model), str(path)],
                                     check=True, capture_output=True, text=True)  # fmt: skip
                peak, seconds, segments = (float(v) for v in run.stdout.split()[-3:])
                peaks[way].append(peak)
                line.append(f"{way} +{peak:.0f} MB in {seconds:.1f} s ({segments:.0f} segments)")
            print(f"transcribe memory {minutes:g} min ({path.stat().st_size / 2**20:.1f} MB file): " + "; ".join(line),
                  flush=True)  # fmt: skip
        for own, *served in backends.values():
            for way in (own, *served):
                growth = (peaks[way][-1] - peaks[way][0]) / max(lengths[-1] - lengths[0], 1e-9)
                ratio = peaks[way][-1] / peaks[own][-1]
                print(f"transcribe memory: {way}: +{growth:.2f} MB a minute of audio; at {lengths[-1]:g} min "
                      f"{ratio:.2f}x of {own} (goal: flat with duration)")  # fmt: skip


def measure_one(way: str, model: str, file: str) -> None:
    """One ``--memory`` measurement in this (fresh) process: prints peak MB added, seconds, segments."""
    import gc

    from universal_predictors.speech.audio import AudioLimits, decode_audio
    from universal_predictors.speech.whisper import Job
    from universal_predictors.speech.whisper_ct2 import DecodeOptions, FasterWhisperEngine

    def peak_mb() -> float:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024

    data = Path(file).read_bytes()
    limits = AudioLimits(max_audio_bytes=2**31, max_audio_seconds=4 * 3600, max_audio_channels=2)
    warm = decode_audio(wav_bytes(long_speech(3)), "file", limits).samples
    if way.startswith("transformers"):
        measure_transformers(way, str(Path(model).parent / "transformers"), data, limits, warm, peak_mb)
        return
    if way == "faster-whisper's own":
        from faster_whisper import WhisperModel

        library = WhisperModel(model, device="cpu", compute_type="int8")
        list(library.transcribe(warm.astype(np.float32) / 32768.0, language="en", beam_size=1)[0])
    else:
        engine = FasterWhisperEngine(model, "cpu", "int8", options=DecodeOptions(beam_size=1))  # as the anchor
        engine.transcribe(Job(warm, "transcribe", "en", None, 0.0))
    del warm
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM from here (Linux: proc(5), clear_refs)
    base, started = peak_mb(), time.perf_counter()
    if way == "faster-whisper's own":
        found, _ = library.transcribe(file, language="en", beam_size=1, temperature=0.0, vad_filter=False)
        segments = len(list(found))
    else:
        if way == "decoded whole":
            samples = decode_audio(data, "file", limits).samples
        else:
            samples, _ = engine.read(data, "file", limits, 120)
        segments = len(engine.transcribe(Job(samples, "transcribe", "en", None, 0.0)).segments)
    print(f"{peak_mb() - base:.1f} {time.perf_counter() - started:.2f} {segments}")


def measure_transformers(way: str, model: str, data: bytes, limits: Any, warm: Any,
                         peak_mb: Callable[[], float]) -> None:  # fmt: skip
    """:func:`measure_one` on transformers: its own long-form ``generate`` as its documentation writes it (the
    processor's untruncated features and attention mask; the file decoded by PyAV, as the predictor decodes it:
    transformers reads no file itself), or the predictor's engine on the file decoded whole or streamed."""
    import gc

    import torch
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from universal_predictors.speech.audio import as_float, decode_audio
    from universal_predictors.speech.whisper import Job, WhisperEngine

    if way == "transformers' own":
        processor = WhisperProcessor.from_pretrained(model)
        library: Any = WhisperForConditionalGeneration.from_pretrained(model)
        library.eval()

        def own(samples: Any) -> int:
            inputs = processor(as_float(samples), sampling_rate=RATE, return_tensors="pt", truncation=False,
                               padding="longest", return_attention_mask=True)  # fmt: skip
            with torch.inference_mode():
                out = library.generate(inputs.input_features, attention_mask=inputs.attention_mask, language="en",
                                       return_timestamps=True, return_segments=True)  # fmt: skip
            return len(out["segments"][0])

        own(warm)
    else:
        engine = WhisperEngine(model, "cpu", torch.float32)
        engine.transcribe_batch([Job(warm, "transcribe", "en", None, 0.0)])
    del warm
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    base, started = peak_mb(), time.perf_counter()
    if way == "transformers' own":
        segments = own(decode_audio(data, "file", limits).samples)
    else:
        if way == "transformers decoded whole":
            samples: Any = decode_audio(data, "file", limits).samples
        else:
            samples, _ = engine.read(data, "file", limits, 120)
        segments = len(engine.transcribe_batch([Job(samples, "transcribe", "en", None, 0.0)])[0].segments)
    print(f"{peak_mb() - base:.1f} {time.perf_counter() - started:.2f} {segments}")


if __name__ == "__main__":
    main()
