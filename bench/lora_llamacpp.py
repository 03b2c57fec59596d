"""What LoRA adapters cost the llama.cpp engine: 8 concurrent greedy sequences on the base alone (the anchor),
all on one adapter, and spread over 4 adapters (2 each), in process on a random ~30M Llama (``bench/generation``'s
small shape) with rank-16 GGUF LoRAs on q, v, o and down. One adapter adds its LoRA matmuls to one decode a step;
4 adapters split each step into 4 decodes, with a switch of the context's adapter (and llama.cpp's graph
re-planning) before each.

    .venv/bin/python bench/lora_llamacpp.py [--size small|large] [--tokens 64] [--rounds 3]

Prints one line per case: tokens/s (best round), decodes per step, and the ratio to the base.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from bench.generation_llamacpp import SIZES
from bench.llama_server import vendored_llama_cpp

from tests.predictors.generation.tiny_llama import build_llama, write_gguf
from tests.predictors.generation.tiny_lora import build_lora, lora_to_gguf
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.generation.adapters import AdapterRef
from universal_predictors.generation.engine import GenerationRequest, SamplingParams
from universal_predictors.generation.engines.llamacpp import LlamaCppArgs, LlamaCppEngine

SEQUENCES = 8
ADAPTERS = ("a", "b", "c", "d")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, help="decode threads (default: the engine's); 1 on a shared machine")
    parser.add_argument("--size", choices=sorted(SIZES), default="small", help="bench/generation_llamacpp's shapes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf = build_llama(root / "hf", SIZES[args.size])
        base = write_gguf(hf, root / "base.gguf")
        peft = {name: build_lora(hf, root / "peft" / name, seed=i + 1, rank=16) for i, name in enumerate(ADAPTERS)}
        lora_to_gguf(hf, {peft[name]: root / f"{name}.gguf" for name in ADAPTERS}, vendored_llama_cpp())
        config = PredictorConfig(model_name="bench", task=Task.GENERATE, backend=Backend.LLAMACPP, source=str(base))
        engine = LlamaCppEngine(config, LlamaCppArgs(n_parallel=SEQUENCES, n_ctx=512, n_threads=args.threads))
        engine.load()
        try:
            cases: dict[str, list[str | None]] = {
                "base alone": [None] * SEQUENCES,
                "one adapter": ["a"] * SEQUENCES,
                "4 adapters": [ADAPTERS[i % 4] for i in range(SEQUENCES)],
            }
            results = measure(engine, root, cases, args)
        finally:
            engine.unload()
    anchor = results["base alone"][0]
    for name, (rate, per_step) in results.items():
        print(f"lora_llamacpp {args.size} {name:12s} c={SEQUENCES} {rate:8.1f} tok/s  {per_step:.1f} decodes/step  "
              f"{rate / anchor:.2f}x base")  # fmt: skip


def measure(
    engine: LlamaCppEngine, root: Path, cases: dict[str, list[str | None]], args: argparse.Namespace
) -> dict[str, tuple[float, float]]:
    """Each case's (best tokens/s, decodes per step), its sequences run together; rounds alternate between the
    cases, so a neighbour's load on a shared machine hits them alike."""
    prompts = [engine.tokenize(f"Request {i}: the harbour at dawn", add_special_tokens=True) for i in range(SEQUENCES)]
    params = SamplingParams(args.tokens, 0.0, ignore_eos=True)

    async def one(i: int, name: str | None) -> int:
        ref = AdapterRef(name, root / f"{name}.gguf") if name else None
        n = 0
        async for chunk in engine.generate(GenerationRequest(str(i), prompts[i], params, adapter=ref)):
            n += len(chunk.token_ids)
        return n

    async def together(names: list[str | None]) -> int:
        return sum(await asyncio.gather(*(one(i, name) for i, name in enumerate(names))))

    results = {name: (0.0, 0.0) for name in cases}
    for round_ in range(args.rounds + 1):  # the first round warms up (adapters loaded, caches touched)
        for case, names in cases.items():
            calls: list[int] = []
            engine.step_hook = lambda adapter, tokens, calls=calls: calls.append(tokens)
            started = time.perf_counter()
            tokens = asyncio.run(together(names))
            rate = tokens / (time.perf_counter() - started)
            engine.step_hook = None
            if round_ and rate > results[case][0]:
                results[case] = (rate, len(calls) / args.tokens)
    return results


if __name__ == "__main__":
    main()
