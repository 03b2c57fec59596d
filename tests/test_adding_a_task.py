"""Adding a task is one catalog entry (plus its predictor module and ``make crd``): a catalog with one more
task gives the gateway that task's routes, the OpenAPI document its request schema, and the CRD its name in
the task enum and in the task/backend rule. The upstream here stands in for the new task's predictor (an
HTTP server that echoes what reached it): what is under test is everything in front of it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from enum import StrEnum
from typing import Any

import celpy
import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from pydantic import BaseModel, ConfigDict, Field

from tests.gateway.harness import OneUpstream
from universal_gateway.app import Gateway
from universal_gateway.backends import ModelState, ModelView
from universal_gateway.openapi import openapi_document
from universal_operator.crd import custom_resource_definition
from universal_predictors.catalog import CATALOG, Backend, Route, Task, TaskEntry
from universal_predictors.request_schemas import generate


class TranslateRequest(BaseModel):
    """The new task's request model, as its predictor module would define it."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    texts: list[str] = Field(min_length=1)
    target: str = Field(pattern=r"^[a-z]{2}$", description="The language to translate into.")


TRANSLATE = StrEnum("ExtraTask", {"TRANSLATE": "translate"}).TRANSLATE  # the Task member it would add
ENTRY = TaskEntry(
    name="translate",
    summary="machine translation",
    backends=(Backend.TRANSFORMERS,),
    extra="transformers",
    predictor="universal_predictors.tasks.translate:TranslatePredictor",
    routes=(
        Route(method="POST", path="translate", upstream="/v1/translate", operation="translate",
              summary="Translate texts", request=f"{__name__}:TranslateRequest"),
    ),
)  # fmt: skip
EXTENDED = CATALOG.with_task(ENTRY)
SERVED = "tiny-translator"


def spec_schema(crd: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def backend_rule_admits(schema: dict[str, Any], task: str, backend: str) -> bool:
    [rule] = [v for v in schema["x-kubernetes-validations"] if v.get("fieldPath") == ".backend"]
    env = celpy.Environment()
    verdict = env.program(env.compile(rule["rule"])).evaluate(
        {"self": celpy.json_to_cel({"task": task, "backend": backend})}
    )
    return bool(verdict)


# -- the CRD --------------------------------------------------------------------------------------------------


def test_the_crd_takes_the_new_task_in_its_enum_and_description() -> None:
    task = spec_schema(custom_resource_definition(EXTENDED))["properties"]["task"]
    assert task["enum"] == [*(t.value for t in Task), "translate"]
    assert task["description"].endswith("ocr, document, anomaly or translate.")
    assert "translate" not in spec_schema(custom_resource_definition())["properties"]["task"]["enum"]


@pytest.mark.parametrize(("backend", "admitted"), [("transformers", True), ("auto", True), ("pyod", False)])
def test_the_crds_backend_rule_admits_the_new_tasks_backends_only(backend: str, admitted: bool) -> None:
    assert backend_rule_admits(spec_schema(custom_resource_definition(EXTENDED)), "translate", backend) is admitted


def test_the_crds_backend_message_names_the_new_tasks_backends_and_the_old_tasks_keep_theirs() -> None:
    schema = spec_schema(custom_resource_definition(EXTENDED))
    [rule] = [v for v in schema["x-kubernetes-validations"] if v.get("fieldPath") == ".backend"]
    assert "rerank, classify, ner, document and translate take transformers" in rule["message"]
    assert backend_rule_admits(schema, "ocr", "tesseract")
    assert not backend_rule_admits(schema, "ocr", "transformers")


# -- the OpenAPI document -----------------------------------------------------------------------------------


def test_the_openapi_document_lists_the_new_route_with_its_request_models_schema() -> None:
    view = ModelView(name=SERVED, task=TRANSLATE, backend="transformers", state=ModelState.IDLE)
    document = openapi_document([view], EXTENDED, generate(EXTENDED))
    operation = document["paths"]["/v1/translate"]["post"]
    assert operation["operationId"] == "translate"
    body = operation["requestBody"]["content"]["application/json"]["schema"]
    assert body["properties"]["model"]["enum"] == [SERVED]
    assert body["properties"]["target"]["pattern"] == "^[a-z]{2}$"
    assert body["required"] == ["model", "texts", "target"]
    assert body["additionalProperties"] is False
    assert "/v1/translate" not in openapi_document([view])["paths"]


# -- the gateway's routing ------------------------------------------------------------------------------------


@pytest.fixture
async def upstream() -> AsyncIterator[str]:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"path": request.path, "body": await request.json()})

    app = web.Application()
    app.router.add_post("/v1/translate", echo)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.mark.parametrize("prefix", ["/v1", "/openai/v1"])
async def test_the_gateway_routes_the_new_tasks_route_to_its_model(upstream: str, prefix: str) -> None:
    body = {"model": SERVED, "texts": ["bonjour"], "target": "en"}
    gateway = Gateway(OneUpstream(upstream, SERVED, TRANSLATE), catalog=EXTENDED)
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url) as client:
        response = await client.post(f"{prefix}/translate", json=body)
        wrong_method = await client.get(f"{prefix}/translate")
    assert response.status_code == 200, response.text
    assert response.json() == {"path": "/v1/translate", "body": body}
    assert wrong_method.status_code == 405
    assert wrong_method.headers["allow"] == "POST"


async def test_the_gateway_refuses_a_model_of_another_task_on_the_new_route(upstream: str) -> None:
    gateway = Gateway(OneUpstream(upstream, "minilm", Task.EMBED), catalog=EXTENDED)
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/translate", json={"model": "minilm", "texts": ["x"], "target": "en"})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message == "The model 'minilm' does embed; /v1/translate needs a translate model."


async def test_the_projects_gateway_serves_no_such_route(upstream: str) -> None:
    async with Gateway(OneUpstream(upstream, SERVED, Task.EMBED)).serving() as url, httpx.AsyncClient() as client:
        response = await client.post(f"{url}/v1/translate", json={"model": SERVED})
    assert response.status_code == 404
