"""The vllm half of ``bench/generation.py``: our vllm backend vs vLLM's own OpenAI server
(``python -m vllm.entrypoints.openai.api_server``) on the same model, streamed completions, greedy.

    .venv-vllm/bin/python bench/generation.py --only vllm [--requests 16]

Both servers get the same vLLM engine arguments (``ENGINE_ARGS``; eager mode, since torch.compile on two
CPU cores takes minutes) and run one at a time against the same client. Rounds alternate between the two
and each side's best round counts, so a neighbour's load on a shared machine does not decide the ratio.
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

from bench.anchors import wait_for_openai_server

from tests.predictors.harness import OFFLINE_ENV, free_port, running_predictor, stop
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

ROUNDS = 2
ENGINE_ARGS = {"max_model_len": "1024", "enforce_eager": "true", "kv_cache_memory_bytes": "1G"}
#: vLLM's engine-core queues bind to the host's address unless told otherwise: keep them on loopback.
ENV = {**OFFLINE_ENV, "VLLM_HOST_IP": "127.0.0.1"}


def compare_vllm(
    model_dir: Path, args: argparse.Namespace, log_dir: Path, measure: Callable[..., Any], prompt_of: Callable[..., str]
) -> None:
    log_dir.mkdir(parents=True, exist_ok=True)
    prompt = prompt_of(args.prompt_tokens, model_dir)
    config = PredictorConfig(model_name="bench", task=Task.GENERATE, backend=Backend.VLLM, source=str(model_dir),
                             engine_args=ENGINE_ARGS)  # fmt: skip
    port = free_port()
    flags: list[str] = []
    for key, value in ENGINE_ARGS.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag] if value == "true" else [flag, value]
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), *flags]  # fmt: skip
    theirs_log = log_dir / "vllm_server.log"
    with running_predictor(config, log_dir, env=ENV, ready_within=600) as predictor, theirs_log.open("wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
        try:
            theirs_url = f"http://127.0.0.1:{port}/v1"
            wait_for_openai_server(theirs_url, server, theirs_log, "vLLM's server", within=600, interval=0.5)
            urls = {"ours": predictor.openai_url, "theirs": theirs_url}
            for url in urls.values():
                asyncio.run(measure(url, "bench", prompt, 1, 2, 8))  # warm-up
            for concurrency, requests in ((1, max(4, args.requests // 4)), (8, args.requests)):
                best: dict[str, Any] = {}
                for _ in range(ROUNDS):
                    for side, url in urls.items():
                        result = asyncio.run(measure(url, "bench", prompt, concurrency, requests, args.output_tokens))
                        if side not in best or result.tokens_per_s > best[side].tokens_per_s:
                            best[side] = result
                ours, theirs = best["ours"], best["theirs"]
                print(f"vllm c={concurrency} vs vLLM's OpenAI server (anchor, same model and engine args): "
                      f"{ours.tokens_per_s:.1f} vs {theirs.tokens_per_s:.1f} tok/s = "
                      f"{ours.tokens_per_s / theirs.tokens_per_s:.2f}x; p50 TTFT {ours.ttft_p50_ms:.1f} vs "
                      f"{theirs.ttft_p50_ms:.1f} ms ({requests} requests, best of {ROUNDS}; "
                      "goal >= 0.95x)")  # fmt: skip
        finally:
            stop(server)
