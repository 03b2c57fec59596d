"""The GPU smoke run (issue 16): the first contact of the predictors with a real GPU, in one go.

    # here, with network: the files the GPU machine lacks, trimmed to fit a 64 MiB carry
    .venv/bin/python bench/gpu_smoke.py --prepare .cache/gpu-smoke
    # on the GPU machine (no network), from the repository root with .cache/gpu-smoke carried:
    python bench/gpu_smoke.py --install .cache/gpu-smoke && python bench/gpu_smoke.py
    # CI, on the CPU: the same steps on tiny models, in seconds
    .venv/bin/python bench/gpu_smoke.py --dry-run

Steps, each timed and reported on its own (one failing step does not hide the others; the exit status is 1
if any failed): the environment (CUDA, capability, native bf16, llama.cpp GPU offload); random test models
built with the test suite's builders (``tests/predictors/generation/tiny_llama.py``); generation with
``backend: auto`` and default engine args on the Hugging Face directory (transformers) and its GGUF
(llama.cpp): time to ready, GPU memory, the model card, tokens/s at concurrency 1 and 8; the same on vLLM
(the release the CUDA image pins: another, or none, fails the step), and on a machine with several GPUs vLLM
with tensor parallelism over two after a /dev/shm check (one GPU: said, not run); an embedding
model's device and throughput; speech to text's device, dtype and real-time factor on both Whisper backends (issue
30); and the out-of-memory path (a real allocator OOM under a capped memory
fraction on the GPU; ``torch.OutOfMemoryError`` injected through the engine's ``step_hook`` on the CPU).
Budget: under 12 minutes on one GPU, the llama.cpp CUDA build (``--install``) included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.generation import measure, prompt_of

from tests.predictors.generation.tiny_llama import LlamaShape, build_llama, write_gguf
from tests.predictors.harness import running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import GPUS_ENV, PredictorConfig

#: A ~150M-parameter Llama for the GPU: big enough that the GPU, not Python, sets the pace.
GPU_SHAPE = LlamaShape(hidden=1024, heads=16, kv_heads=4, layers=12, intermediate=2816, vocab_size=2000, context=4096)
#: The test model for the dry run.
DRY_SHAPE = LlamaShape()
LLAMA_CPP_VERSION = "0.3.36"
CARRY_LIMIT = 64 << 20
#: What the sdist needs to build (no tests, docs, examples, models or web UI): see prepare().
SDIST_DROP = ("/.git/", "/tests/", "/docs/", "/examples/", "/models/", "/benches/", "/media/", "/.github/",
              "/gguf-py/", "/scripts/", "/tools/server/public", "/tools/server/webui", "/tools/ui/",
              "/ggml/src/ggml-vulkan/", "/ggml/src/ggml-sycl/", "/ggml/src/ggml-cann/", "/ggml/src/ggml-opencl/",
              "/ggml/src/ggml-musa/", "/ggml/src/ggml-kompute/", "/ggml/src/ggml-hexagon/", "/ggml/src/ggml-metal/",
              "/ggml/src/ggml-webgpu/", "/ggml/src/ggml-openvino/")  # fmt: skip
#: Runtime packages of the predictors that the GPU machine (torch, transformers, sentence-transformers) lacks.
CARRIED_PACKAGES = ("kserve==0.21.0", "llguidance", "jsonschema", "openai", "gguf", "scikit-build-core")


class Report:
    """Lines of ``key: value`` per step, printed as they come and as JSON at the end."""

    def __init__(self) -> None:
        self.steps: dict[str, dict[str, Any]] = {}
        self.failed: list[str] = []

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[dict[str, Any]]:
        facts: dict[str, Any] = {}
        self.steps[name] = facts
        started = time.monotonic()
        print(f"== {name}", flush=True)
        try:
            yield facts
        except Exception as exc:  # reported, and the next step still runs
            facts["error"] = f"{type(exc).__name__}: {exc}"
            self.failed.append(name)
            traceback.print_exc()
        facts["seconds"] = round(time.monotonic() - started, 2)
        for key, value in facts.items():
            print(f"   {key}: {value}", flush=True)


def environment(dry_run: bool) -> dict[str, Any]:
    import torch
    import transformers

    from universal_predictors.devices import allocated_gpus, native_bf16

    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch.version.cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cuda available": torch.cuda.is_available(),
        "allocated gpus (env)": allocated_gpus(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        facts.update({
            "devices": torch.cuda.device_count(),
            "device 0": props.name,
            "capability": f"{props.major}.{props.minor}",
            "native bf16": native_bf16(),
            "bf16 incl. emulation": torch.cuda.is_bf16_supported(),
            "memory free/total GiB": f"{free / 2**30:.1f}/{total / 2**30:.1f}",
        })  # fmt: skip
    try:
        import llama_cpp

        facts["llama_cpp"] = llama_cpp.__version__
        facts["llama.cpp gpu offload"] = bool(llama_cpp.llama_supports_gpu_offload())
    except ImportError as exc:
        facts["llama_cpp"] = f"not installed ({exc})"
    nvcc = shutil.which("nvcc")
    if nvcc:
        facts["nvcc"] = (
            subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
        )
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("no usable GPU: run with --dry-run on a CPU machine")
    return facts


def gpu_memory_used_mib() -> int | None:
    """Memory in use on GPU 0 as the driver sees it (every process), or None without a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = subprocess.run([smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True)  # fmt: skip
    return int(out.stdout.strip() or 0) if out.returncode == 0 else None


def generation(
    source: Path,
    log_dir: Path,
    facts: dict[str, Any],
    *,
    gpu: bool,
    requests: int,
    tokens: int,
    backend: Backend = Backend.AUTO,
    engine_args: dict[str, str] | None = None,
    gpus: int = 1,
) -> None:
    """``backend`` (``auto``) with default args (or ``engine_args``) on ``source``: time to ready, memory, card,
    tokens/s at c=1 and c=8."""
    config = PredictorConfig(
        model_name="smoke", task=Task.GENERATE, backend=backend, source=str(source), engine_args=engine_args or {}
    )
    env = {GPUS_ENV: str(gpus)} if gpu else {}  # as the operator renders for a GPU pod: the start-up check runs
    before = gpu_memory_used_mib()
    started = time.monotonic()
    with running_predictor(config, log_dir, env=env, ready_within=600) as predictor:
        facts["time to ready s"] = round(time.monotonic() - started, 1)
        after = gpu_memory_used_mib()
        if before is not None and after is not None:
            facts["gpu memory MiB (predictor)"] = after - before
        import httpx

        [card] = httpx.get(f"{predictor.openai_url}/models", timeout=30).json()["data"]
        facts["card"] = {k: v for k, v in card.items() if k not in ("id", "object", "created", "owned_by", "task")}
        prompt = prompt_of(64, source if source.is_dir() else source.parent / "hf")
        asyncio.run(measure(predictor.openai_url, "smoke", prompt, 1, 2, 8))  # warm-up
        for concurrency in (1, 8):
            count = requests if concurrency > 1 else max(2, requests // 4)  # c=1 is the slow one: fewer requests
            result = asyncio.run(measure(predictor.openai_url, "smoke", prompt, concurrency, count, tokens))
            facts[f"tokens/s c={concurrency}"] = round(result.tokens_per_s, 1)
            facts[f"ttft p50 ms c={concurrency}"] = round(result.ttft_p50_ms, 1)


def pinned_vllm() -> str:
    """The vLLM release the CUDA image installs (requirements/image-predictor-cuda.txt)."""
    lock = Path(__file__).resolve().parents[1] / "requirements" / "image-predictor-cuda.txt"
    for line in lock.read_text().splitlines():
        if line.startswith("vllm=="):
            return line.split("==", 1)[1].split()[0]
    raise RuntimeError(f"{lock} pins no vllm")


def vllm_generation(source: Path, log_dir: Path, facts: dict[str, Any], *, gpu: bool, requests: int, tokens: int,
                    tensor_parallel: int = 1) -> None:  # fmt: skip
    """The generation step on vLLM (the release the CUDA image pins; another is measured, then reported as a
    failure), on ``tensor_parallel`` GPUs."""
    pinned = pinned_vllm()
    try:
        import vllm
    except ImportError as exc:
        raise RuntimeError(f"vllm is not installed here ({exc}): the CUDA image runs vllm {pinned}") from None
    facts["vllm"] = vllm.__version__
    args = {"tensor_parallel_size": str(tensor_parallel)} if tensor_parallel > 1 else {}
    generation(source, log_dir, facts, gpu=gpu, requests=requests, tokens=tokens, backend=Backend.VLLM,
               engine_args=args, gpus=tensor_parallel)  # fmt: skip
    if facts["card"].get("backend") != "vllm":
        raise RuntimeError(f"the predictor served with {facts['card'].get('backend')}, not vllm")
    if vllm.__version__ != pinned:
        raise RuntimeError(f"measured vllm {vllm.__version__}, but the CUDA image pins {pinned}: install that release")


#: NCCL's shared-memory transport between the GPUs of one pod: below this /dev/shm (a container's default is
#: 64 MiB) tensor parallelism fails or falls back; the operator mounts a memory emptyDir there in every GPU pod.
SHM_NEEDED = 1 << 30


def tensor_parallel(source: Path, log_dir: Path, facts: dict[str, Any], *, requests: int, tokens: int) -> None:
    """vLLM over two GPUs, after checking /dev/shm; not run (said, not failed) on a machine with one GPU."""
    import torch

    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    facts["devices"] = devices
    if devices < 2:
        facts["not run"] = f"{devices} GPU{'s' if devices != 1 else ''} here: tensor parallelism needs 2"
        return
    shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").is_dir() else 0
    facts["/dev/shm MiB"] = shm >> 20
    if shm < SHM_NEEDED:
        raise RuntimeError(f"/dev/shm is {shm >> 20} MiB: NCCL needs at least {SHM_NEEDED >> 20} MiB between GPUs")
    vllm_generation(source, log_dir, facts, gpu=True, requests=requests, tokens=tokens, tensor_parallel=2)


def build_bert(out: Path, *, gpu: bool) -> Path:
    """A random BERT encoder (MiniLM-sized on the GPU) with the test suite's tokenizer, saved plainly."""
    import torch
    from transformers import BertConfig, BertModel

    from tests.predictors.tiny_bert import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    hidden, layers = (384, 6) if gpu else (32, 2)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=max(2, hidden // 64), intermediate_size=4 * hidden,
                        max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    BertModel(config).eval().save_pretrained(out)  # type: ignore[no-untyped-call]  # transformers' eval
    return out


def embedding(source: Path, log_dir: Path, facts: dict[str, Any], *, texts: int) -> None:
    """The embedding predictor's device (its encoder, in this process) and throughput (over HTTP)."""
    import httpx

    from universal_predictors.encoders.embedding import EmbedEngineArgs, TransformersEncoder

    encoder = TransformersEncoder(str(source), EmbedEngineArgs())
    facts["device"] = str(next(encoder.model.parameters()).device)
    facts["dtype"] = str(next(encoder.model.parameters()).dtype)
    encoder.close()
    config = PredictorConfig(model_name="smoke-embed", task=Task.EMBED, backend=Backend.AUTO, source=str(source))
    batch = [f"the river in Paris is open from {i} to {i + 8}, said the guide" for i in range(32)]
    with running_predictor(config, log_dir, ready_within=300) as predictor, httpx.Client(timeout=120) as client:
        url = f"{predictor.openai_url}/embeddings"
        client.post(url, json={"model": "smoke-embed", "input": batch}).raise_for_status()  # warm-up
        started = time.perf_counter()
        for _ in range(max(1, texts // len(batch))):
            client.post(url, json={"model": "smoke-embed", "input": batch}).raise_for_status()
        facts["texts/s (batches of 32)"] = round(
            max(1, texts // len(batch)) * len(batch) / (time.perf_counter() - started), 1
        )


def transcription(work: Path, facts: dict[str, Any], *, gpu: bool) -> None:
    """Whisper on the device and dtype the predictor picks (``device: auto``: transformers in bf16 or fp16 on CUDA,
    faster-whisper in CTranslate2's float16), in this process, on 150 s of tones and noise (16-bit samples: the GPU
    machine has no espeak-ng, and the upload path's decoding is the CPU's): long-form decoding's device, dtype,
    real-time factor, and whether the first window's tokens match fp32 on the CPU (told, not required: half precision
    may pick another token on random weights). faster-whisper only where CTranslate2 is installed (its wheel, 43 MB,
    does not fit the carry beside llama.cpp's sdist)."""
    import numpy as np
    import torch

    from tests.predictors.tiny_whisper import build_tiny_whisper
    from universal_predictors.devices import detect_device, dtype_for
    from universal_predictors.speech.whisper import Job, WhisperEngine

    shape = "base" if gpu else "tiny"
    hf = build_tiny_whisper(work / "whisper" / "transformers", max_target_positions=448, shape=shape)
    rng = np.random.default_rng(0)
    seconds = 150
    t = np.arange(seconds * 16_000) / 16_000
    samples = 3000 * np.sin(2 * np.pi * (220 + 40 * np.sin(t / 3)) * t) + rng.normal(0, 300, t.size)
    samples = samples.astype(np.int16)
    device = detect_device("auto")
    engine = WhisperEngine(str(hf), device, dtype_for(device))
    facts["transformers device"] = str(next(engine.model.parameters()).device)
    facts["transformers dtype"] = str(next(engine.model.parameters()).dtype)
    engine.transcribe_batch([Job(samples[: 5 * 16_000], "transcribe", "en", None, 0.0)])  # warm-up
    started = time.perf_counter()
    found = engine.transcribe_batch([Job(samples, "transcribe", "en", None, 0.0)])[0]
    facts["transformers real time x (150 s, long-form)"] = round(seconds / (time.perf_counter() - started), 1)
    facts["transformers segments"] = len(found.segments)
    if device != "cpu":
        reference = WhisperEngine(str(hf), "cpu", torch.float32)
        first = reference.transcribe_batch([Job(samples[: 30 * 16_000], "transcribe", "en", None, 0.0)])[0]
        on_device = engine.transcribe_batch([Job(samples[: 30 * 16_000], "transcribe", "en", None, 0.0)])[0]
        facts["transformers first window as fp32 on the CPU"] = [s.tokens for s in on_device.segments] == [
            s.tokens for s in first.segments
        ]
    del engine
    try:
        import ctranslate2
    except ImportError:
        facts["faster-whisper"] = "not run: ctranslate2 is not installed"
        return
    from tests.predictors.tiny_whisper import build_tiny_ct2_whisper
    from universal_predictors.speech.whisper_ct2 import FasterWhisperEngine, default_compute_type

    ct2 = build_tiny_ct2_whisper(work / "whisper-ct2", shape=shape)
    ct2_device = "cuda" if ctranslate2.get_cuda_device_count() else "cpu"
    compute_type = default_compute_type(ct2_device)
    fw = FasterWhisperEngine(str(ct2), ct2_device, compute_type)
    facts["faster-whisper device, compute type"] = f"{ct2_device}, {compute_type}"
    fw.transcribe(Job(samples[: 5 * 16_000], "transcribe", "en", None, 0.0))  # warm-up
    started = time.perf_counter()
    found = fw.transcribe(Job(samples, "transcribe", "en", None, 0.0))
    facts["faster-whisper real time x (150 s)"] = round(seconds / (time.perf_counter() - started), 1)
    facts["faster-whisper segments"] = len(found.segments)
    fw.close()


def out_of_memory(source: Path, facts: dict[str, Any], *, gpu: bool) -> None:
    """The OOM path of the transformers engine: 503 with Retry-After for the sequences hit, then served again.

    On the GPU the error is the allocator's own: the process's memory fraction is capped just above what
    the weights use, and 8 long prompts are prefilled in one pass (budget and chunking switched off by engine
    args). On the CPU, ``torch.OutOfMemoryError`` is raised from the engine's forward step by its step hook."""
    import torch

    from universal_predictors.errors import Unavailable
    from universal_predictors.generation.engine import GenerationRequest, SamplingParams
    from universal_predictors.generation.engines.transformers import TransformersArgs, TransformersEngine

    config = PredictorConfig(
        model_name="smoke-oom", task=Task.GENERATE, backend=Backend.TRANSFORMERS, source=str(source)
    )
    args = TransformersArgs(max_batch_tokens=1_000_000, prefill_chunk=1_000_000, batch_wait_ms=100)
    engine = TransformersEngine(config, args)
    engine.load()
    prompt = engine.tokenize(prompt_of(engine.context_length // 2, source), add_special_tokens=True)

    async def one(i: int) -> str:
        request = GenerationRequest(f"oom-{i}", prompt, SamplingParams(max_tokens=4, temperature=0))
        try:
            async for _ in engine.generate(request):
                pass
        except Unavailable as exc:
            return f"{exc.status_code} {exc.code} Retry-After={exc.headers().get('Retry-After')}"
        return "200"

    async def batch(n: int) -> list[str]:
        return list(await asyncio.gather(*(one(i) for i in range(n))))

    try:
        if gpu:
            allocated = torch.cuda.memory_allocated(0)
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, (allocated + (64 << 20)) / total), 0)
        else:
            fired: list[str] = []

            def hook(stage: str, rows: int, columns: int) -> None:
                if stage == "prefill" and not fired:
                    fired.append(stage)
                    raise torch.OutOfMemoryError("CUDA out of memory (injected: dry run)")

            engine.step_hook = hook
        facts["under pressure"] = sorted(set(asyncio.run(batch(8))))
        if gpu:
            torch.cuda.set_per_process_memory_fraction(1.0, 0)
            facts["reserved MiB after empty_cache"] = torch.cuda.memory_reserved(0) >> 20
        facts["afterwards"] = sorted(set(asyncio.run(batch(2))))
    finally:
        engine.unload()
    if not any(result.startswith("503 out_of_memory") for result in facts["under pressure"]):
        raise AssertionError(f"no request got the out-of-memory 503: {facts['under pressure']}")
    if facts["afterwards"] != ["200"]:
        raise AssertionError(f"the engine did not serve again after the OOM: {facts['afterwards']}")


def run(dry_run: bool, work: Path) -> Report:
    report = Report()
    gpu = not dry_run
    with report.step("environment") as facts:
        facts.update(environment(dry_run))
    with report.step("build models") as facts:
        shape = GPU_SHAPE if gpu else DRY_SHAPE
        hf_dir = build_llama(work / "llama" / "hf", shape)
        gguf = write_gguf(hf_dir, work / "llama" / "model-f32.gguf")
        bert = build_bert(work / "bert", gpu=gpu)
        facts["llama"] = str(shape)
        facts["gguf MiB"] = gguf.stat().st_size >> 20
    requests, tokens = (32, 128) if gpu else (4, 8)
    with report.step("generate: transformers (auto, HF directory)") as facts:
        generation(hf_dir, work / "logs-hf", facts, gpu=gpu, requests=requests, tokens=tokens)
    with report.step("generate: llama.cpp (auto, GGUF)") as facts:
        generation(gguf, work / "logs-gguf", facts, gpu=gpu, requests=requests, tokens=tokens)
    with report.step("generate: vLLM (HF directory)") as facts:
        try:
            import vllm  # noqa: F401
        except ImportError:
            if gpu:
                raise
            facts["not run"] = "vllm is not installed here (on the CPU the vLLM tier's .venv-vllm tests it)"
        else:
            vllm_generation(hf_dir, work / "logs-vllm", facts, gpu=gpu, requests=requests, tokens=tokens)
    if gpu:
        with report.step("generate: vLLM tensor parallel (2 GPUs, /dev/shm)") as facts:
            tensor_parallel(hf_dir, work / "logs-vllm-tp", facts, requests=requests, tokens=tokens)
    with report.step("embed (auto)") as facts:
        embedding(bert, work / "logs-embed", facts, texts=2048 if gpu else 64)
    with report.step("transcribe (auto)") as facts:
        transcription(work, facts, gpu=gpu)
    with report.step("out of memory (transformers)") as facts:
        out_of_memory(hf_dir, facts, gpu=gpu)
    return report


# -- carrying what the GPU machine lacks ----------------------------------------------------------------


def trim_sdist(sdist: Path, out: Path) -> Path:
    """A copy of llama-cpp-python's sdist without what a CUDA build does not read (``SDIST_DROP``)."""
    with tarfile.open(sdist) as src, tarfile.open(out, "w:gz", compresslevel=9) as dst:
        for member in src.getmembers():
            if any(part in f"/{member.name}/" for part in SDIST_DROP):
                continue
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return out


def prepare(carry: Path) -> None:
    """Here, with network: the trimmed llama-cpp-python sdist and wheels (CPython 3.12) of CARRIED_PACKAGES
    and their dependencies, less what the GPU machine has; fails above the 64 MiB carry limit."""
    carry.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--dest", tmp, "--no-deps"]
        subprocess.run([*pip, "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_VERSION}"], check=True)
        [sdist] = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        trim_sdist(sdist, carry / sdist.name)
    wheels = carry / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "--dest", str(wheels), "--only-binary", ":all:",
                    "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "--platform",
                    "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64", *CARRIED_PACKAGES],
                   check=True)  # fmt: skip
    # What the GPU machine brings itself (torch and the NVIDIA libraries, transformers and its stack).
    for wheel in wheels.glob("*.whl"):
        if wheel.name.split("-")[0].lower().replace("_", "-") in (
            "torch", "triton", "transformers", "tokenizers", "safetensors", "huggingface-hub", "sympy", "networkx",
        ) or wheel.name.lower().startswith("nvidia"):  # fmt: skip
            wheel.unlink()
    size = sum(f.stat().st_size for f in carry.rglob("*") if f.is_file())
    print(f"carry {carry}: {size / 2**20:.1f} MiB (limit {CARRY_LIMIT >> 20} MiB)")
    if size > CARRY_LIMIT:
        raise SystemExit(f"{carry} is {size / 2**20:.1f} MiB: over the {CARRY_LIMIT >> 20} MiB carry limit")


def install(carry: Path) -> None:
    """On the GPU machine, offline: the carried wheels, then llama-cpp-python built from the sdist with CUDA."""
    pip = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(carry / "wheels")]
    subprocess.run([*pip, *(p.split("==")[0] for p in CARRIED_PACKAGES)], check=True)
    [sdist] = carry.glob("llama_cpp_python-*.tar.gz")
    env = {**os.environ, "CMAKE_ARGS": "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native -DLLAMA_CURL=OFF "
           # the trimmed sdist has no tests, examples or tools sources (llama-cpp-python adds mtmd itself)
           "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_APP=OFF "
           "-DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF",
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 4)}  # fmt: skip
    started = time.monotonic()
    subprocess.run([*pip, "--no-build-isolation", "--no-deps", str(sdist)], check=True, env=env)
    print(f"llama-cpp-python built with CUDA in {time.monotonic() - started:.0f} s")
    # The project's own packages, from this checkout (no dependencies: they are above or already there).
    subprocess.run([*pip, "--no-deps", "--no-build-isolation", "-e", str(Path(__file__).resolve().parents[1])],
                   check=False)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny models on the CPU (what CI runs)")
    parser.add_argument("--work", type=Path, default=None, help="where models and logs go (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report here")
    parser.add_argument("--prepare", type=Path, metavar="CARRY", help="fetch and trim what to carry, then exit")
    parser.add_argument("--install", type=Path, metavar="CARRY", help="install the carried files, then exit")
    args = parser.parse_args(argv)
    sys.argv = sys.argv[:1]  # kserve.model_server parses sys.argv when imported (the embed step imports it)
    if args.prepare:
        prepare(args.prepare)
        return 0
    if args.install:
        install(args.install)
        return 0
    with contextlib.ExitStack() as stack:
        work = args.work or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpu-smoke-")))
        report = run(args.dry_run, work)
    print(json.dumps(report.steps, indent=1, default=str))
    if args.json:
        args.json.write_text(json.dumps(report.steps, indent=1, default=str))
    if report.failed:
        print(f"failed steps: {', '.join(report.failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
