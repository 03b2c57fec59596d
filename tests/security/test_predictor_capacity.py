"""A request larger than the model's whole capacity is a 413 naming the limit, not a 503 with Retry-After
that no amount of retrying can satisfy. Busy-now stays a 503 (tests/predictors/generation/test_admission.py)."""

from __future__ import annotations

import asyncio

import pytest

from tests.predictors.harness import PredictorProcess
from tests.security.predictor_fixtures import *  # noqa: F403  (the predictor fixtures)
from tests.security.predictor_fixtures import CHAT_MAX_BATCH_SIZE, CHAT_MAX_QUEUE, openai_error
from universal_predictors.batching import BatchPolicy, MicroBatcher
from universal_predictors.errors import RequestTooLarge

CAPACITY = CHAT_MAX_BATCH_SIZE + CHAT_MAX_QUEUE
QUEUE = 8


def test_more_chat_choices_than_the_engine_ever_admits_is_a_413_naming_the_limit(
    chat_predictor: PredictorProcess,
) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "n": CAPACITY + 1}  # fmt: skip
    with chat_predictor.client() as client:
        response = client.post("/openai/v1/chat/completions", json=body)
    error = openai_error(response, 413)
    assert "Retry-After" not in response.headers
    assert error["code"] == "too_many_sequences"
    assert error["param"] == "n"
    assert f"at most {CAPACITY} at once" in error["message"]
    assert "max_batch_size + max_queue" in error["message"]


def test_more_completion_prompts_than_the_engine_ever_admits_is_a_413(chat_predictor: PredictorProcess) -> None:
    body = {"model": "tiny-llama", "prompt": ["a"] * (CAPACITY + 1), "max_tokens": 1}
    with chat_predictor.client() as client:
        response = client.post("/openai/v1/completions", json=body)
    assert openai_error(response, 413)["code"] == "too_many_sequences"


def test_a_request_within_capacity_is_still_served(chat_predictor: PredictorProcess) -> None:
    body = {"model": "tiny-llama", "prompt": ["a"] * CAPACITY, "max_tokens": 1}
    with chat_predictor.client() as client:
        response = client.post("/openai/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == CAPACITY


def test_more_items_than_the_batch_queue_holds_is_a_413_not_a_503() -> None:
    """Encoder tasks queue a request's items (texts, pairs, pages) in one micro-batcher; a request of more
    items than the queue holds (rerank with engine arg max_documents above it) could never be admitted."""

    async def submit(count: int) -> list[int]:
        batcher: MicroBatcher[int, int] = MicroBatcher(list, model_name="t", policy=BatchPolicy(max_queue=QUEUE))
        try:
            return await batcher.submit_many(list(range(count)))
        finally:
            await batcher.close()

    assert asyncio.run(submit(QUEUE)) == list(range(QUEUE))
    with pytest.raises(RequestTooLarge) as raised:
        asyncio.run(submit(QUEUE + 1))
    assert raised.value.status_code == 413
    assert raised.value.code == "too_many_items"
    assert f"at most {QUEUE} at once" in raised.value.message
