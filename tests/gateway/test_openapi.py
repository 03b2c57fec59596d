"""``/openapi.json`` describes what the predictors accept: their own request models' schemas (generated from
them; ``tests/test_catalog.py`` holds the committed copy current), with ``model`` required and listing the
served names. It used to describe what the fuzzer wanted (max_tokens capped at 64, 3 of 8 anomaly
algorithms, no ``tool``/``developer`` roles); the fuzzer now narrows its own copy (``test_fuzz.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, get_args

import httpx
import pytest

from tests.gateway.harness import OneUpstream
from universal_gateway.app import Gateway
from universal_gateway.backends import ModelState, ModelView
from universal_gateway.openapi import openapi_document
from universal_predictors.anomaly.algorithms import ALGORITHMS, AlgorithmName
from universal_predictors.catalog import CATALOG, ModelFrom, Task

VIEWS = [ModelView(name=f"{t.value}-model", task=t, backend="auto", state=ModelState.IDLE) for t in Task]
DOCUMENT = openapi_document(VIEWS)
COMPONENTS = DOCUMENT["components"]["schemas"]


def resolved(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = COMPONENTS[schema["$ref"].rsplit("/", 1)[-1]]
    return schema


def body(path: str, content: str = "application/json") -> dict[str, Any]:
    schema: dict[str, Any] = DOCUMENT["paths"][path]["post"]["requestBody"]["content"][content]["schema"]
    return schema


def test_every_catalog_route_is_described_once_every_task_is_served() -> None:
    described = {(method.upper(), path) for path, ops in DOCUMENT["paths"].items() for method in ops}
    expected = {(r.method, f"/v1/{r.path}") for _, r in CATALOG.routes()}
    assert described - {("GET", "/v1/models"), ("GET", "/v1/models/{name}")} == expected


def test_max_tokens_has_the_predictors_bounds_only() -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        max_tokens = body(path)["properties"]["max_tokens"]
        assert {"type": "integer", "minimum": 1} in max_tokens["anyOf"]
        assert "maximum" not in str(max_tokens)


def test_chat_messages_take_every_role_the_predictor_does() -> None:
    message = resolved(body("/v1/chat/completions")["properties"]["messages"]["items"])
    assert message["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]


def test_anomaly_fit_lists_every_algorithm() -> None:
    algorithm = body("/v1/anomaly/fit")["properties"]["algorithm"]
    assert sorted(algorithm["enum"]) == sorted(ALGORITHMS) == sorted(get_args(AlgorithmName))
    assert len(algorithm["enum"]) == 8


def test_model_is_required_and_lists_the_served_names_of_the_routes_task() -> None:
    for entry, route in CATALOG.routes():
        if route.method == "POST":
            json_body = ModelFrom.JSON in route.model_from
            schema = body(f"/v1/{route.path}", "application/json" if json_body else "multipart/form-data")
            assert schema["required"][0] == "model"
            assert schema["properties"]["model"]["enum"] == [f"{entry.name}-model"]


def test_ocr_takes_a_multipart_upload_and_json() -> None:
    content = DOCUMENT["paths"]["/v1/ocr"]["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", "multipart/form-data"}
    assert content["multipart/form-data"]["schema"]["required"] == ["model"]


def test_the_audio_routes_take_an_upload_only_with_the_file_and_the_request_models_fields() -> None:
    content = DOCUMENT["paths"]["/v1/audio/transcriptions"]["post"]["requestBody"]["content"]
    assert set(content) == {"multipart/form-data"}
    schema = content["multipart/form-data"]["schema"]
    assert schema["required"] == ["model", "file"]
    assert schema["properties"]["response_format"]["enum"] == ["json", "text", "srt", "verbose_json", "vtt"]
    assert "language" not in body("/v1/audio/translations", "multipart/form-data")["properties"]


def test_the_detector_routes_take_the_name_in_the_path_and_the_model_in_the_query() -> None:
    for method in ("get", "delete"):
        parameters = DOCUMENT["paths"]["/v1/anomaly/detectors/{name}"][method]["parameters"]
        assert [(p["name"], p["in"], p["required"]) for p in parameters] == [("name", "path", True),
                                                                            ("model", "query", False)]  # fmt: skip


def test_the_stored_responses_routes_are_described_beside_responses_when_the_gateway_keeps_them() -> None:
    stored = openapi_document([VIEWS[0]], stored_responses=True)["paths"]
    assert set(stored["/v1/responses/{response_id}"]) == {"get", "delete"}
    items = stored["/v1/responses/{response_id}/input_items"]["get"]
    assert [p["name"] for p in items["parameters"]] == ["response_id", "order", "limit", "after"]
    assert "/v1/responses/{response_id}" not in openapi_document([VIEWS[0]])["paths"]  # the store off: not there
    # The Messages API's errors are Anthropic's.
    messages = stored["/v1/messages"]["post"]["responses"]["default"]
    assert messages["content"]["application/json"]["schema"]["required"] == ["type", "error"]


def test_a_route_is_described_only_when_a_model_of_its_task_is_served() -> None:
    document = openapi_document([VIEWS[0]])
    assert sorted(document["paths"]) == ["/v1/chat/completions", "/v1/completions", "/v1/detokenize",
                                         "/v1/messages", "/v1/messages/count_tokens", "/v1/models",
                                         "/v1/models/{name}", "/v1/responses", "/v1/tokenize"]  # fmt: skip


@pytest.fixture
async def gateway() -> AsyncIterator[httpx.AsyncClient]:
    backends = OneUpstream("http://127.0.0.1:9", "minilm", Task.EMBED)
    async with Gateway(backends).serving() as url, httpx.AsyncClient(base_url=url) as client:
        yield client


async def test_the_gateway_serves_the_document_of_its_models(gateway: httpx.AsyncClient) -> None:
    response = await gateway.get("/openapi.json")
    assert response.status_code == 200
    served = response.json()
    assert served["openapi"] == "3.1.0"
    assert served == openapi_document(
        [ModelView(name="minilm", task=Task.EMBED, backend="test", state=ModelState.READY)]
    )
