"""The transformers engine beyond the shared conformance suite: its bounded queue (``max_batch_size``
running + ``max_queue`` waiting sequences; more get 503 ``overloaded`` with ``Retry-After``)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def small_queue_predictor(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(
        model_name=MODEL,
        task=Task.GENERATE,
        backend=Backend.TRANSFORMERS,
        source=str(tiny_llama_dir),
        engine_args={"max_batch_size": "1", "max_queue": "1"},
    )
    with running_predictor(config, tmp_path_factory.mktemp("transformers-small-queue")) as predictor:
        yield predictor


def assert_overloaded(error: openai.APIStatusError) -> None:
    assert error.status_code == 503
    assert int(error.response.headers["Retry-After"]) >= 1
    assert error.body["code"] == "overloaded"  # type: ignore[index]


def test_the_models_card_reports_the_queue_bound(small_queue_predictor: PredictorProcess) -> None:
    [card] = httpx.get(f"{small_queue_predictor.openai_url}/models", timeout=30).json()["data"]
    assert card["backend"] == "transformers"
    assert (card["max_batch_size"], card["max_queue"]) == (1, 1)


def test_more_choices_than_running_plus_waiting_get_413_before_any_stream_starts(
    small_queue_predictor: PredictorProcess,
) -> None:
    client = openai.OpenAI(base_url=small_queue_predictor.openai_url, api_key="unused", max_retries=0, timeout=60)
    ok = client.completions.create(model=MODEL, prompt="The river", max_tokens=4, n=2, temperature=0)
    assert len(ok.choices) == 2  # one running + one waiting fit
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt="The river", max_tokens=4, n=3, stream=stream)
        # Larger than running + waiting on an idle engine too: a 413 naming the limit, not a 503 to retry.
        assert info.value.status_code == 413
        assert "Retry-After" not in info.value.response.headers
        assert info.value.body["code"] == "too_many_sequences"  # type: ignore[index]


def test_concurrent_long_requests_beyond_the_queue_get_503_and_the_admitted_ones_complete(
    small_queue_predictor: PredictorProcess,
) -> None:
    max_tokens = 300

    async def fire() -> list[str | openai.APIStatusError]:
        async with openai.AsyncOpenAI(
            base_url=small_queue_predictor.openai_url, api_key="unused", max_retries=0, timeout=120
        ) as aclient:

            async def one(i: int) -> str | openai.APIStatusError:
                try:
                    if i % 2:  # streamed: a refusal must be the HTTP status, not an error event after a 200
                        stream = await aclient.completions.create(
                            model=MODEL, prompt="Go on", max_tokens=max_tokens, temperature=0, stream=True
                        )
                        chunks = [c async for c in stream if c.choices]
                        assert chunks[-1].choices[0].finish_reason == "length"
                        return "".join(c.choices[0].text for c in chunks)
                    response = await aclient.completions.create(
                        model=MODEL, prompt="Go on", max_tokens=max_tokens, temperature=0
                    )
                    # Greedy on this prompt never meets EOS: every admitted request really is long.
                    assert response.usage is not None
                    assert response.usage.completion_tokens == max_tokens
                    return response.choices[0].text
                except openai.APIStatusError as error:
                    return error

            return list(await asyncio.gather(*(one(i) for i in range(6))))

    results = asyncio.run(fire())
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    served = [r for r in results if isinstance(r, str)]
    assert refused, "six concurrent long requests never overloaded a queue of 1 running + 1 waiting"
    for error in refused:
        assert_overloaded(error)
    assert served
    assert len(set(served)) == 1  # the same greedy prompt: every admitted request got the same full text
    # Once the queue drains, the predictor serves again.
    client = openai.OpenAI(base_url=small_queue_predictor.openai_url, api_key="unused", max_retries=0, timeout=60)
    assert client.completions.create(model=MODEL, prompt="Go on", max_tokens=2, temperature=0).choices
