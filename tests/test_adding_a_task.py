"""Adding a task is one catalog entry (plus its predictor module and ``make crd``): a catalog with one more
task gives the gateway that task's routes, the OpenAPI document its request schema, the CRD its name in
the task enum and in the task/backend rule, and the predictor its routes, bound to the methods the entry
names (universal_predictors.binding). The new task's predictor here is a real UniversalPredictor subclass
with one method and no route code, served by uvicorn as a predictor process serves it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from enum import StrEnum
from typing import Any

import celpy
import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from tests.gateway.harness import OneUpstream
from tests.predictors.harness import free_port
from universal_gateway.app import Gateway
from universal_gateway.backends import ModelState, ModelView
from universal_gateway.openapi import openapi_document
from universal_operator.crd import custom_resource_definition
from universal_predictors.base import UniversalPredictor
from universal_predictors.catalog import CATALOG, Backend, Route, Task, TaskEntry
from universal_predictors.config import PredictorConfig
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
              summary="Translate texts", request=f"{__name__}:TranslateRequest", handler="translate"),
    ),
)  # fmt: skip
EXTENDED = CATALOG.with_task(ENTRY)
SERVED = "tiny-translator"


class TranslatePredictor(UniversalPredictor):
    """The new task's predictor module, all of it: a load and the method its route names."""

    task = TRANSLATE  # type: ignore[assignment]  # the member the Task enum would gain

    def load(self) -> bool:
        self.backend = Backend.TRANSFORMERS
        return True

    async def translate(self, body: TranslateRequest, request: Request) -> dict[str, Any]:
        data = [{"index": i, "text": f"[{body.target}] {text[::-1]}"} for i, text in enumerate(body.texts)]
        return {"object": "list", "model": self.name, "data": data}


def translator(*, ready: bool = True) -> TranslatePredictor:
    # The config's task is one the project has; the class's own ``task`` is what binding reads.
    predictor = TranslatePredictor(PredictorConfig(model_name=SERVED, task=Task.EMBED, source="/unused"))
    predictor.ready = ready and predictor.load()
    return predictor


@contextlib.contextmanager
def served(predictor: UniversalPredictor) -> Iterator[str]:
    """``predictor`` behind uvicorn on a loopback port, with the routes and errors a predictor process has."""
    from universal_predictors.server import install_routes

    app = FastAPI()
    install_routes(app, predictor, EXTENDED)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


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
    assert task["description"].endswith("ocr, document, anomaly, transcribe or translate.")
    assert "translate" not in spec_schema(custom_resource_definition())["properties"]["task"]["enum"]


@pytest.mark.parametrize(("backend", "admitted"), [("transformers", True), ("auto", True), ("pyod", False)])
def test_the_crds_backend_rule_admits_the_new_tasks_backends_only(backend: str, admitted: bool) -> None:
    assert backend_rule_admits(spec_schema(custom_resource_definition(EXTENDED)), "translate", backend) is admitted


def test_the_crds_backend_message_names_the_new_tasks_backends_and_the_old_tasks_keep_theirs() -> None:
    schema = spec_schema(custom_resource_definition(EXTENDED))
    [rule] = [v for v in schema["x-kubernetes-validations"] if v.get("fieldPath") == ".backend"]
    assert "rerank, classify, ner, document and translate take transformers" in rule["message"]
    assert "transcribe takes transformers or faster-whisper" in rule["message"]
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
    with served(translator()) as url:
        yield url


@pytest.mark.parametrize("prefix", ["/v1", "/openai/v1"])
async def test_the_gateway_routes_the_new_tasks_route_to_its_model(upstream: str, prefix: str) -> None:
    body = {"model": SERVED, "texts": ["bonjour"], "target": "en"}
    gateway = Gateway(OneUpstream(upstream, SERVED, TRANSLATE), catalog=EXTENDED)
    async with gateway.serving() as url, httpx.AsyncClient(base_url=url) as client:
        response = await client.post(f"{prefix}/translate", json=body)
        wrong_method = await client.get(f"{prefix}/translate")
    assert response.status_code == 200, response.text
    assert response.json() == {"object": "list", "model": SERVED, "data": [{"index": 0, "text": "[en] ruojnob"}]}
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


# -- the predictor's routes, bound from the entry ---------------------------------------------------------------


async def test_the_predictor_answers_the_entrys_route_with_the_method_it_names() -> None:
    with served(translator()) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            answered = await client.post("/v1/translate", json={"model": SERVED, "texts": ["ab", "c"], "target": "de"})
            unnamed = await client.post("/v1/translate", json={"texts": ["ab"], "target": "de"})
            invalid = await client.post("/v1/translate", json={"model": SERVED, "texts": ["ab"], "target": "German"})
            other = await client.post("/v1/translate", json={"model": "other", "texts": ["ab"], "target": "de"})
    assert answered.json()["data"] == [{"index": 0, "text": "[de] ba"}, {"index": 1, "text": "[de] c"}]
    assert unnamed.status_code == 200
    assert invalid.status_code == 400
    assert invalid.json()["error"]["param"] == "target"
    assert other.status_code == 404
    assert other.json()["error"]["code"] == "model_not_found"


async def test_the_bound_route_says_the_model_is_loading_until_it_is() -> None:
    with served(translator(ready=False)) as url:
        async with httpx.AsyncClient(base_url=url) as client:
            response = await client.post("/v1/translate", json={"model": SERVED, "texts": ["ab"], "target": "de"})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "model_loading"


def test_a_route_naming_a_method_the_predictor_lacks_stops_it_at_start() -> None:
    from fastapi import APIRouter

    renamed = ENTRY.model_copy(update={"routes": (ENTRY.routes[0].model_copy(update={"handler": "translate_all"}),)})
    with pytest.raises(TypeError, match="TranslatePredictor has no method 'translate_all' for POST /v1/translate"):
        translator().add_routes(APIRouter(), CATALOG.with_task(renamed))


def test_every_catalog_route_names_a_method_of_its_tasks_predictor() -> None:
    import importlib

    for entry in CATALOG.tasks:
        module, _, name = entry.predictor.partition(":")
        predictor = getattr(importlib.import_module(module), name)
        for route in entry.routes:
            assert asyncio.iscoroutinefunction(getattr(predictor, route.handler, None)), (entry.name, route.handler)
