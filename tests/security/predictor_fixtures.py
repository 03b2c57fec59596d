"""Predictor processes the predictor security tests share (module-scoped: each test file starts its own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.predictors.conftest import embed_predictor, minilm_path
from tests.predictors.generation.conftest import tiny_llama_dir
from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig

__all__ = ["anomaly_predictor", "chat_predictor", "embed_predictor", "minilm_path", "openai_error", "tiny_llama_dir"]

#: The chat predictor's capacity: 2 running sequences + 2 waiting.
CHAT_MAX_BATCH_SIZE, CHAT_MAX_QUEUE = 2, 2


@pytest.fixture(scope="module")
def anomaly_predictor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name="sensors", task=Task.ANOMALY, source="/nonexistent/anomaly-source",
                             engine_args={"default_detector": "only"})  # fmt: skip
    with running_predictor(config, tmp_path_factory.mktemp("security-anomaly")) as predictor:
        yield predictor


@pytest.fixture(scope="module")
def chat_predictor(
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PredictorProcess]:
    config = PredictorConfig(
        model_name="tiny-llama",
        task=Task.GENERATE,
        backend=Backend.TRANSFORMERS,
        source=str(tiny_llama_dir),
        engine_args={"max_batch_size": str(CHAT_MAX_BATCH_SIZE), "max_queue": str(CHAT_MAX_QUEUE)},
    )
    with running_predictor(config, tmp_path_factory.mktemp("security-chat")) as predictor:
        yield predictor


def openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of ``response``, which must have ``status``."""
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    return error
