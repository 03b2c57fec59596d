"""The llamacpp half of ``bench/generation.py``: our llamacpp backend against llama.cpp's own ``llama-server``
(the anchor: built from the vendored llama.cpp of the installed llama-cpp-python, ``bench/llama_server.py``)
and llama-cpp-python's ``python -m llama_cpp.server``, on the same GGUF, streamed greedy completions.

    .venv/bin/python bench/generation.py --only llamacpp [--sizes small,large]

Two random Llamas (the bench's ~30M and a ~160M one), concurrency 1 and 8. Every server gets the same
slots (8), context per slot and attention kernel (flash attention off, our default), and its own default
threads, as a user gets them (llama-server and ours: the physical cores; llama_cpp.server: half the CPUs).
llama_cpp.server has no slots: it serves one request at a time. Rounds alternate between the servers and
each side's best round counts, so a neighbour's load on a shared machine hits them alike.
Goal: >= 0.9x llama-server's tokens/s at c=1 and c=8, and p50 TTFT at c=8 within 1.5x of llama-server's.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from bench.anchors import wait_for_openai_server
from bench.llama_server import build_llama_server

from tests.predictors.generation.tiny_llama import LlamaShape, build_llama, write_gguf
from tests.predictors.harness import free_port, running_predictor, stop
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

ROUNDS = 2
SLOTS = 8
CONTEXT_PER_SLOT = 1024
SIZES = {
    "small": LlamaShape(hidden=512, heads=8, kv_heads=8, layers=8, intermediate=1408, vocab_size=2000, context=1024),
    "large": LlamaShape(hidden=1024, heads=16, kv_heads=16, layers=12, intermediate=2816, vocab_size=2000,
                        context=1024),
}  # fmt: skip


@contextmanager
def _server(command: list[str], url: str, log: Path, name: str) -> Iterator[str]:
    with log.open("wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            wait_for_openai_server(url, process, log, name, within=300, interval=0.2)
            yield url
        finally:
            stop(process)


def compare_llamacpp(
    model_dir: Path, args: argparse.Namespace, log_dir: Path, measure: Callable[..., Any], prompt_of: Callable[..., str]
) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    llama_server = build_llama_server()
    prompt = prompt_of(args.prompt_tokens, model_dir)  # the same tokenizer for every size
    # --threads N gives ours and llama-server N decode threads; by default each runs with its own default.
    forced = getattr(args, "threads", None)
    threads = {"n_threads": str(forced)} if forced else {}
    native_threads = ["-t", str(forced)] if forced else []
    print_header()
    for size in (getattr(args, "sizes", None) or "small,large").split(","):
        shape = SIZES[size]
        hf_dir = model_dir if size == "small" else build_llama(log_dir / f"llama-{size}", shape)
        gguf = write_gguf(hf_dir, log_dir / f"bench-{size}-f32.gguf")
        params = gguf.stat().st_size / 4 / 1e6
        config = PredictorConfig(
            model_name="bench", task=Task.GENERATE, backend=Backend.LLAMACPP, source=str(gguf),
            engine_args={"n_ctx": str(CONTEXT_PER_SLOT), "n_parallel": str(SLOTS), **threads},
        )  # fmt: skip
        native_port, python_port = free_port(), free_port()
        native = [str(llama_server), "-m", str(gguf), "--alias", "bench", "--host", "127.0.0.1",
                  "--port", str(native_port), "-np", str(SLOTS), "-c", str(SLOTS * CONTEXT_PER_SLOT),
                  "-fa", "off", "--no-webui", *native_threads,
                  # The test tokenizer's template is not one its chat parser knows; completions need none.
                  "--no-jinja", "--chat-template", "chatml"]  # fmt: skip
        python = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "bench",
                  "--n_ctx", str(CONTEXT_PER_SLOT), "--host", "127.0.0.1", "--port", str(python_port),
                  "--verbose", "false",
                  # Its default cuts a running stream short when another request arrives; serve each to the end.
                  "--interrupt_requests", "false"]  # fmt: skip
        with (
            running_predictor(config, log_dir / size) as predictor,
            _server(native, f"http://127.0.0.1:{native_port}/v1", log_dir / f"llama-server-{size}.log",
                    "llama-server") as native_url,
            _server(python, f"http://127.0.0.1:{python_port}/v1", log_dir / f"llama_cpp_server-{size}.log",
                    "llama_cpp.server") as python_url,
        ):  # fmt: skip
            urls = {"ours": predictor.openai_url, "llama-server": native_url, "llama_cpp.server": python_url}
            for url in urls.values():
                asyncio.run(measure(url, "bench", prompt, 1, 2, 8))  # warm-up
                # Some stream no usage: check that a request runs to max_tokens, which the count then assumes.
                check = httpx.post(f"{url}/completions", timeout=300, json={"model": "bench", "prompt": prompt,
                                   "max_tokens": args.output_tokens, "temperature": 0}).json()  # fmt: skip
                assert check["usage"]["completion_tokens"] == args.output_tokens, (url, check["usage"])
            for concurrency, requests in ((1, max(4, args.requests // 4)), (SLOTS, args.requests)):
                best: dict[str, Any] = {}
                for _ in range(ROUNDS):
                    for side, url in urls.items():
                        result = asyncio.run(measure(url, "bench", prompt, concurrency, requests, args.output_tokens))
                        if side not in best or result.tokens_per_s > best[side].tokens_per_s:
                            best[side] = result
                ours, anchor, python_server = best["ours"], best["llama-server"], best["llama_cpp.server"]
                print(f"| ~{params:.0f}M f32 | {concurrency} | {ours.tokens_per_s:.1f} | {anchor.tokens_per_s:.1f} | "
                      f"{ours.tokens_per_s / anchor.tokens_per_s:.2f}x | {ours.ttft_p50_ms:.0f} / "
                      f"{anchor.ttft_p50_ms:.0f} ms = {ours.ttft_p50_ms / anchor.ttft_p50_ms:.2f}x | "
                      f"{python_server.tokens_per_s:.1f} | {ours.tokens_per_s / python_server.tokens_per_s:.2f}x |",
                      flush=True)  # fmt: skip


def print_header() -> None:
    print(f"llamacpp vs llama-server (anchor) and llama_cpp.server; {SLOTS} slots of {CONTEXT_PER_SLOT} tokens, "
          f"each server's default threads, best of {ROUNDS} alternating rounds; "
          "goal >= 0.9x tok/s, TTFT at c=8 <= 1.5x")  # fmt: skip
    print(
        "| model | concurrency | ours tok/s | llama-server tok/s | ratio | p50 TTFT ours / llama-server | "
        "llama_cpp.server tok/s | ours / llama_cpp.server |"
    )
    print("|---|---|---|---|---|---|---|---|")
