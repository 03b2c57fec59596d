"""HEAD on a real predictor: answered as GET without its body (RFC 9110 section 9.3.2), behind the same token
check as GET. Before, every route answered HEAD with a 405."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.predictors.harness import PredictorProcess, running_predictor
from universal_predictors.catalog import Task
from universal_predictors.config import UPSTREAM_TOKEN_ENV, UPSTREAM_TOKEN_HEADER, PredictorConfig

TOKEN = "head-test-token"


@pytest.fixture(scope="module")
def predictor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name="sensors", task=Task.ANOMALY, source="/nonexistent/anomaly-source")
    with running_predictor(config, tmp_path_factory.mktemp("head"), env={UPSTREAM_TOKEN_ENV: TOKEN}) as running:
        yield running


@pytest.mark.parametrize("path", ["/openai/v1/models", "/v1/anomaly/detectors", "/v2/health/ready"])
def test_head_is_get_without_the_body(predictor: PredictorProcess, path: str) -> None:
    headers = {UPSTREAM_TOKEN_HEADER: TOKEN}
    with httpx.Client(base_url=predictor.url, headers=headers, timeout=30) as http:
        got = http.get(path)
        head = http.head(path)
    assert got.status_code == 200, got.text
    assert head.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    assert head.headers["content-length"] == str(len(got.content))


def test_head_needs_the_token_as_get_does(predictor: PredictorProcess) -> None:
    with httpx.Client(base_url=predictor.url, timeout=30) as http:
        head = http.head("/openai/v1/models")
        got = http.get("/openai/v1/models")
    assert got.status_code == 401
    assert head.status_code == 401
    assert head.content == b""
