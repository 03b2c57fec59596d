"""Text generation throughput and time to first token, one line per comparison (nothing asserted).

    .venv/bin/python bench/generation.py [--requests 16] [--prompt-tokens 64] [--output-tokens 64]

Model: a random-weight Llama of about 30M parameters built on the spot (hidden 512, 8 layers, 8 heads
of 64, the test tokenizer), big enough that compute dominates. Greedy, fixed prompt and output lengths
(the model's EOS logit is zeroed, so every request produces exactly ``--output-tokens``), streamed
through the real OpenAI client so TTFT is measured as a client sees it.

Comparisons:
- transformers at concurrency 8 vs the same backend at concurrency 1 (batching; goal >= 3x aggregate
  tokens/s; KServe's huggingfaceserver transformers backend serves one request at a time, i.e. 1x);
- llamacpp vs llama.cpp's own ``llama-server`` (built from the same vendored llama.cpp) and llama-cpp-python's
  server on the same GGUFs, two model sizes, c=1 and c=8 (goal >= 0.9x llama-server's tokens/s, TTFT at c=8
  within 1.5x): ``bench/generation_llamacpp.py``;
- vllm vs vLLM's own OpenAI server (goal >= 0.95x): slot ``compare_vllm`` below.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.predictors.generation.tiny_llama import LlamaShape, build_llama
from tests.predictors.harness import running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

BENCH_SHAPE = LlamaShape(hidden=512, heads=8, kv_heads=8, layers=8, intermediate=1408, vocab_size=2000, context=1024)


@dataclass
class Result:
    tokens_per_s: float
    ttft_p50_ms: float
    requests: int


async def measure(
    base_url: str, model: str, prompt: str, concurrency: int, requests: int, output_tokens: int
) -> Result:
    """``requests`` streamed completions, ``concurrency`` at a time; aggregate output tokens/s, p50 TTFT."""
    ttfts: list[float] = []
    tokens = 0
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(requests):
            queue.put_nowait(i)

        async def worker() -> None:
            nonlocal tokens
            while not queue.empty():
                queue.get_nowait()
                started = time.perf_counter()
                first, counted = None, False
                stream = await client.completions.create(
                    model=model,
                    prompt=prompt,
                    max_tokens=output_tokens,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in stream:
                    if first is None and chunk.choices and chunk.choices[0].text:
                        first = time.perf_counter() - started
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
                        counted = True
                if not counted:  # a server without stream usage (llama_cpp.server; checked to run to max_tokens)
                    tokens += output_tokens
                ttfts.append(first if first is not None else time.perf_counter() - started)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return Result(tokens / elapsed, statistics.median(ttfts) * 1000, requests)


def prompt_of(tokens: int, model_dir: Path) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = ["the", "river", "in", "Paris", "is", "open", "from", "8", "to", "12", "said", "the", "guide"]
    text = ""
    i = 0
    while len(tokenizer(text + " " + words[i % len(words)])["input_ids"]) <= tokens:
        text += " " + words[i % len(words)]
        i += 1
    return text


def compare_transformers(model_dir: Path, args: argparse.Namespace, log_dir: Path) -> None:
    config = PredictorConfig(
        model_name="bench", task=Task.GENERATE, backend=Backend.TRANSFORMERS, source=str(model_dir)
    )
    prompt = prompt_of(args.prompt_tokens, model_dir)
    with running_predictor(config, log_dir) as predictor:
        url = predictor.openai_url
        asyncio.run(measure(url, "bench", prompt, 1, 2, 8))  # warm-up
        one = asyncio.run(measure(url, "bench", prompt, 1, max(4, args.requests // 4), args.output_tokens))
        eight = asyncio.run(measure(url, "bench", prompt, 8, args.requests, args.output_tokens))
    print(
        f"transformers c=1: {one.tokens_per_s:.1f} tok/s, p50 TTFT {one.ttft_p50_ms:.1f} ms ({one.requests} requests)"
    )
    print(
        f"transformers c=8: {eight.tokens_per_s:.1f} tok/s, p50 TTFT {eight.ttft_p50_ms:.1f} ms "
        f"({eight.requests} requests)"
    )
    print(
        f"transformers c=8 vs c=1 (anchor: the same backend at c=1; huggingfaceserver = 1x): "
        f"{eight.tokens_per_s / one.tokens_per_s:.2f}x aggregate tokens/s (goal >= 3x)"
    )


def compare_llamacpp(model_dir: Path, args: argparse.Namespace, log_dir: Path) -> None:
    """Our llamacpp backend vs ``llama-server`` and ``python -m llama_cpp.server`` (c=1 and c=8, two sizes)."""
    from bench.generation_llamacpp import compare_llamacpp as run

    run(model_dir, args, log_dir, measure, prompt_of)


def compare_vllm(model_dir: Path, args: argparse.Namespace, log_dir: Path) -> None:
    """Our vllm backend vs ``python -m vllm.entrypoints.openai.api_server`` on the same model (c=1 and c=8),
    same engine args, alternating best-of rounds (run it from ``.venv-vllm``)."""
    from bench.generation_vllm import compare_vllm as run

    run(model_dir, args, log_dir, measure, prompt_of)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--only", choices=["transformers", "llamacpp", "vllm"], default=None)
    parser.add_argument("--sizes", default="small,large", help="llamacpp: model sizes to run (small ~30M, large ~160M)")
    parser.add_argument("--threads", type=int, default=None, help="llamacpp: decode threads for ours and llama-server")
    args = parser.parse_args()
    print(
        f"# generation bench {datetime.now(UTC):%Y-%m-%d %H:%M} UTC on {platform.machine()} "
        f"{platform.processor() or ''}, prompt {args.prompt_tokens} / output {args.output_tokens} tokens, greedy"
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_llama(Path(tmp) / "bench-llama", BENCH_SHAPE)
        params = (model_dir / "model.safetensors").stat().st_size / 4 / 1e6  # fp32 weights
        print(f"# model: random Llama, {params:.0f}M parameters, {BENCH_SHAPE}")
        for name, fn in (
            ("transformers", compare_transformers),
            ("llamacpp", compare_llamacpp),
            ("vllm", compare_vllm),
        ):
            if args.only in (None, name):
                fn(model_dir, args, Path(tmp) / f"logs-{name}")


if __name__ == "__main__":
    main()
