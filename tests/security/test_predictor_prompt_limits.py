"""Counts and sizes are checked before the work they bound, and the tokenizer runs off the event loop.
On two cores ``prompt: ["a"] x 200,000`` (976 KiB) got its 413 after 10 s of tokenizing, 300,000 messages
their 400 after 10.5 s of validation and templating, and a 15 MiB prompt after 20 s of the tokenizer, all
on the event loop: the model answered nobody meanwhile. Each is now refused on the raw JSON (measured on two
cores: 0.04 s, 0.63 s and 0.25 s). The tests check the answers, never a time (the house rule: timings live in
bench/); the messages and the 15 MiB prompt's answers differ from the old path's, the 200,000 prompts' does not."""

from __future__ import annotations

from typing import Any

import httpx

from tests.predictors.harness import PredictorProcess
from tests.security.predictor_fixtures import *  # noqa: F403  (the predictor fixtures)
from tests.security.predictor_fixtures import CHAT_MAX_BATCH_SIZE, CHAT_MAX_QUEUE, openai_error


def post(predictor: PredictorProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    with predictor.client() as client:
        return client.post(path, json=body)


def test_200000_prompts_are_a_413_before_any_is_tokenized(chat_predictor: PredictorProcess) -> None:
    body = {"model": "tiny-llama", "prompt": ["a"] * 200_000, "max_tokens": 1}
    response = post(chat_predictor, "/openai/v1/completions", body)
    error = openai_error(response, 413)
    assert error["code"] == "too_many_sequences"
    assert f"at most {CHAT_MAX_BATCH_SIZE + CHAT_MAX_QUEUE} at once" in error["message"]


def test_more_messages_than_the_context_has_tokens_is_a_400_before_validation(
    chat_predictor: PredictorProcess,
) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "a"}] * 300_000, "max_tokens": 1}
    response = post(chat_predictor, "/openai/v1/chat/completions", body)
    error = openai_error(response, 400)
    assert error["code"] == "context_length_exceeded"
    assert error["param"] == "messages"
    assert "300000 messages" in error["message"]


def test_a_15_mib_prompt_is_a_400_before_the_tokenizer(chat_predictor: PredictorProcess) -> None:
    body = {"model": "tiny-llama", "prompt": "ab " * (5 * 2**20), "max_tokens": 1}
    response = post(chat_predictor, "/openai/v1/completions", body)
    error = openai_error(response, 400)
    assert error["code"] == "context_length_exceeded"
    assert f"the prompt is {15 * 2**20} characters" in error["message"]


def test_a_prompt_within_the_context_is_still_served(chat_predictor: PredictorProcess) -> None:
    response = post(
        chat_predictor, "/openai/v1/completions", {"model": "tiny-llama", "prompt": ["ab"] * 2, "max_tokens": 1}
    )
    assert response.status_code == 200, response.text
