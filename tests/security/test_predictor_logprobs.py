"""Logprob amplification: a 152-byte body of ``n=16, max_tokens=1000, top_logprobs=20`` made a response of
9 MiB (three at once: 26 MiB, 40 s of the model) and RSS that stayed up after. ``n x max_tokens x
top_logprobs`` is capped (``planning.MAX_LOGPROB_ENTRIES``), a 400 naming the product and the cap before
anything is generated, and the predictor's RSS returns near idle once the requests end."""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.predictors.harness import PredictorProcess, running_predictor
from tests.security.memory import rss_mb
from tests.security.predictor_fixtures import openai_error, tiny_llama_dir
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.generation.planning import MAX_LOGPROB_ENTRIES

__all__ = ["tiny_llama_dir"]

ATTACK = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "n": 16, "max_tokens": 1000,
          "logprobs": True, "top_logprobs": 20, "temperature": 1.0}  # fmt: skip
#: Within the cap: 4 choices of up to 800 tokens (the tiny model's context clips them to ~500) x 20.
WITHIN = {**ATTACK, "n": 4, "max_tokens": 800}
#: What RSS may stay above the warmed-up idle once requests end (KV cache and allocator high-water marks).
RSS_SLACK_MB = 80


@pytest.fixture(scope="module")
def wide_predictor(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(
        model_name="tiny-llama",
        task=Task.GENERATE,
        backend=Backend.TRANSFORMERS,
        source=str(tiny_llama_dir),
        engine_args={"max_batch_size": "16", "max_queue": "48"},
    )
    with running_predictor(config, tmp_path_factory.mktemp("security-logprobs")) as predictor:
        yield predictor


def post_all(predictor: PredictorProcess, path: str, bodies: list[dict[str, Any]]) -> list[int]:
    def post(body: dict[str, Any]) -> int:
        with predictor.client(timeout=600) as client:
            return client.post(path, json=body).status_code

    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


def test_rss_returns_near_idle_after_a_logprobs_attack(wide_predictor: PredictorProcess) -> None:
    """First in the file: the baseline is the warmed-up model before any attack."""
    pid = wide_predictor.process.pid
    warm = {**WITHIN, "logprobs": False, "top_logprobs": None}
    assert post_all(wide_predictor, "/openai/v1/chat/completions", [warm] * 4) == [200] * 4
    idle = rss_mb(pid)
    post_all(wide_predictor, "/openai/v1/chat/completions", [ATTACK] * 6)
    assert post_all(wide_predictor, "/openai/v1/chat/completions", [WITHIN] * 4) == [200] * 4
    deadline = time.monotonic() + 10
    while rss_mb(pid) > idle + RSS_SLACK_MB and time.monotonic() < deadline:
        time.sleep(0.2)  # the predictor trims its heap once idle: poll for it
    assert rss_mb(pid) <= idle + RSS_SLACK_MB, f"RSS {rss_mb(pid)} MB, idle {idle} MB"


def test_n_times_max_tokens_times_top_logprobs_over_the_cap_is_a_400_naming_both(
    wide_predictor: PredictorProcess,
) -> None:
    with wide_predictor.client() as client:
        response = client.post("/openai/v1/chat/completions", json=ATTACK)
        assert response.status_code == 400, f"{response.status_code}, {len(response.content)} bytes"
        chat = openai_error(response, 400)
        completion = openai_error(
            client.post(
                "/openai/v1/completions",
                json={"model": "tiny-llama", "prompt": "a", "n": 16, "max_tokens": 1000, "logprobs": 20},
            ),
            400,
        )
    assert chat["param"] == "top_logprobs"
    assert chat["code"] == "too_many_logprobs"
    assert "n x max_tokens x top_logprobs" in chat["message"]
    assert f"at most {MAX_LOGPROB_ENTRIES}" in chat["message"]
    assert completion["param"] == "logprobs"
