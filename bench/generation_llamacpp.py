"""The llamacpp half of ``bench/generation.py``: our llamacpp backend vs llama-cpp-python's own OpenAI
server (``python -m llama_cpp.server``, its defaults) on the same GGUF, streamed completions, greedy.

    .venv/bin/python bench/generation.py --only llamacpp

Needs llama-cpp-python's server extras (fastapi, sse-starlette, starlette-context, pydantic-settings).
Both servers get the same ``n_ctx`` and threads. Rounds alternate between the two and each side's best
round counts, so a neighbour's load on a shared machine does not decide the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from bench.anchors import wait_for_openai_server

from tests.predictors.generation.tiny_llama import write_gguf
from tests.predictors.harness import free_port, running_predictor, stop
from universal_predictors.config import Backend, PredictorConfig, Task

ROUNDS = 2


def compare_llamacpp(
    model_dir: Path, args: argparse.Namespace, log_dir: Path, measure: Callable[..., Any], prompt_of: Callable[..., str]
) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    gguf = write_gguf(model_dir, log_dir / "bench-f32.gguf")
    threads = max(1, (os.cpu_count() or 2) // 2)  # what both servers default to on a machine without cgroup quotas
    batch_threads = max(threads, os.cpu_count() or 1)
    n_ctx = 1024
    prompt = prompt_of(args.prompt_tokens, model_dir)
    config = PredictorConfig(model_name="bench", task=Task.GENERATE, backend=Backend.LLAMACPP, source=str(gguf),
                             engine_args={"n_ctx": str(n_ctx), "n_threads": str(threads)})  # fmt: skip
    port = free_port()
    theirs_log = log_dir / "llama_cpp_server.log"
    command = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "bench",
               "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(batch_threads),
               "--host", "127.0.0.1", "--port", str(port), "--verbose", "false",
               # Its default cuts a running stream short when another request arrives; serve each to the end.
               "--interrupt_requests", "false"]  # fmt: skip
    with running_predictor(config, log_dir) as predictor, theirs_log.open("wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            theirs_url = f"http://127.0.0.1:{port}/v1"
            wait_for_openai_server(theirs_url, server, theirs_log, "llama_cpp.server", within=300, interval=0.2)
            urls = {"ours": predictor.openai_url, "theirs": theirs_url}
            for url in urls.values():
                asyncio.run(measure(url, "bench", prompt, 1, 2, 8))  # warm-up
            # It streams no usage: check that a request runs to max_tokens, which the count then assumes.
            check = httpx.post(f"{theirs_url}/completions", timeout=300, json={"model": "bench", "prompt": prompt,
                               "max_tokens": args.output_tokens, "temperature": 0}).json()  # fmt: skip
            assert check["usage"]["completion_tokens"] == args.output_tokens, check["usage"]
            for concurrency, requests in ((1, max(4, args.requests // 4)), (8, args.requests)):
                best: dict[str, Any] = {}
                for _ in range(ROUNDS):
                    for side, url in urls.items():
                        result = asyncio.run(measure(url, "bench", prompt, concurrency, requests, args.output_tokens))
                        if side not in best or result.tokens_per_s > best[side].tokens_per_s:
                            best[side] = result
                ours, theirs = best["ours"], best["theirs"]
                goal = "goal >= 0.95x, <= +5 ms TTFT" if concurrency == 1 else "goal >= 0.95x"
                print(f"llamacpp c={concurrency} vs llama_cpp.server (anchor, same GGUF, {threads} threads): "
                      f"{ours.tokens_per_s:.1f} vs {theirs.tokens_per_s:.1f} tok/s = "
                      f"{ours.tokens_per_s / theirs.tokens_per_s:.2f}x; p50 TTFT {ours.ttft_p50_ms:.1f} vs "
                      f"{theirs.ttft_p50_ms:.1f} ms = {ours.ttft_p50_ms - theirs.ttft_p50_ms:+.1f} ms "
                      f"({requests} requests, best of {ROUNDS}; {goal})")  # fmt: skip
        finally:
            stop(server)
