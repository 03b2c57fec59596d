"""The anomaly detector routes (list, get, delete) through the real Gateway to a real anomaly predictor,
under both prefixes, with the model named by ``?model=`` or left out when it is the only anomaly model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.harness import OneUpstream
from tests.predictors.harness import PredictorProcess, running_predictor
from universal_gateway.app import Gateway
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig

MODEL = "anomaly"
ROWS = [[0.1 * (i % 10), 0.2 * (i % 7)] for i in range(100)]


@pytest.fixture(scope="module")
def predictor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name=MODEL, task=Task.ANOMALY, source="/nonexistent/anomaly-source")
    with running_predictor(config, tmp_path_factory.mktemp("logs")) as running:
        yield running


@pytest.fixture
async def client(predictor: PredictorProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        Gateway(OneUpstream(predictor.url, MODEL, Task.ANOMALY)).serving() as url,
        httpx.AsyncClient(base_url=url, timeout=60) as client,
    ):
        yield client


async def fit(client: httpx.AsyncClient, detector: str) -> None:
    response = await client.post("/v1/anomaly/fit", json={"model": MODEL, "detector": detector, "data": ROWS})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("prefix", ["/v1", "/openai/v1"])
@pytest.mark.parametrize("query", ["", f"?model={MODEL}"])
async def test_a_fitted_detector_is_listed_read_and_deleted_through_the_gateway(
    client: httpx.AsyncClient, prefix: str, query: str, tmp_path: Path
) -> None:
    name = f"doors-{prefix.count('/')}-{len(query)}"
    await fit(client, name)

    listed = await client.get(f"{prefix}/anomaly/detectors{query}")
    assert listed.status_code == 200, listed.text
    assert name in [d["name"] for d in listed.json()["data"]]

    one = await client.get(f"{prefix}/anomaly/detectors/{name}{query}")
    assert one.status_code == 200, one.text
    assert one.json()["name"] == name
    assert one.json()["n_samples"] == len(ROWS)

    deleted = await client.delete(f"{prefix}/anomaly/detectors/{name}{query}")
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"object": "anomaly.detector.deleted", "name": name, "deleted": True}

    gone = await client.get(f"{prefix}/anomaly/detectors/{name}{query}")
    assert gone.status_code == 404
    assert gone.json()["error"]["param"] == "name"
    listed = await client.get(f"{prefix}/anomaly/detectors{query}")
    assert name not in [d["name"] for d in listed.json()["data"]]


async def test_a_detector_name_the_predictor_refuses_reaches_it_as_one_segment(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/anomaly/detectors/not%20valid")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "name"
    assert "'not valid' is not a valid detector name" in error["message"]


async def test_a_model_the_gateway_does_not_serve_is_a_404_naming_the_served_ones(client: httpx.AsyncClient) -> None:
    response = await client.delete("/v1/anomaly/detectors/doors?model=elsewhere")
    assert response.status_code == 404
    assert "available models: anomaly" in response.json()["error"]["message"]


async def test_a_post_only_route_answers_405_naming_its_method(client: httpx.AsyncClient) -> None:
    response = await client.get("/v1/anomaly/fit")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
