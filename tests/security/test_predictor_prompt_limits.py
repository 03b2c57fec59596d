"""Counts and sizes are checked before the work they bound, and the tokenizer runs off the event loop.
On two cores ``prompt: ["a"] x 200,000`` (976 KiB) got its 413 after 10 s of tokenizing, 300,000 messages
their 400 after 10.5 s of validation and templating, and a 15 MiB prompt after 20 s of the tokenizer, all
on the event loop: the model answered nobody meanwhile. Each is now refused on the raw JSON; the bound
below (``ANSWERED_WITHIN``) is five times under the old times on a loaded CI machine, not a benchmark."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.predictors.harness import PredictorProcess
from tests.security.predictor_fixtures import *  # noqa: F403  (the predictor fixtures)
from tests.security.predictor_fixtures import CHAT_MAX_BATCH_SIZE, CHAT_MAX_QUEUE, openai_error

ANSWERED_WITHIN = 2.0  # seconds


def timed_post(predictor: PredictorProcess, path: str, body: dict[str, Any]) -> tuple[httpx.Response, float]:
    with predictor.client() as client:
        started = time.monotonic()
        response = client.post(path, json=body)
        return response, time.monotonic() - started


def test_200000_prompts_are_a_413_before_any_is_tokenized(chat_predictor: PredictorProcess) -> None:
    body = {"model": "tiny-llama", "prompt": ["a"] * 200_000, "max_tokens": 1}
    response, took = timed_post(chat_predictor, "/openai/v1/completions", body)
    error = openai_error(response, 413)
    assert error["code"] == "too_many_sequences"
    assert f"at most {CHAT_MAX_BATCH_SIZE + CHAT_MAX_QUEUE} at once" in error["message"]
    assert took < ANSWERED_WITHIN


def test_more_messages_than_the_context_has_tokens_is_a_400_before_validation(
    chat_predictor: PredictorProcess,
) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "a"}] * 300_000, "max_tokens": 1}
    response, took = timed_post(chat_predictor, "/openai/v1/chat/completions", body)
    error = openai_error(response, 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert "300000 messages" in error["message"]
    assert took < ANSWERED_WITHIN


def test_a_15_mib_prompt_is_a_400_before_the_tokenizer(chat_predictor: PredictorProcess) -> None:
    body = {"model": "tiny-llama", "prompt": "ab " * (5 * 2**20), "max_tokens": 1}
    response, took = timed_post(chat_predictor, "/openai/v1/completions", body)
    error = openai_error(response, 400)
    assert error["code"] == "context_length_exceeded"
    assert f"the prompt is {15 * 2**20} characters" in error["message"]
    assert took < ANSWERED_WITHIN


def test_a_prompt_within_the_context_is_still_served(chat_predictor: PredictorProcess) -> None:
    response, _ = timed_post(chat_predictor, "/openai/v1/completions",
                             {"model": "tiny-llama", "prompt": ["ab"] * 2, "max_tokens": 1})  # fmt: skip
    assert response.status_code == 200, response.text
