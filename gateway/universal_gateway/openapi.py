"""The gateway's OpenAPI document (``GET /openapi.json``), built from the catalog and the models it serves.

Each task route appears once at least one served model has its task. A body is the JSON Schema of the
predictor's own request model (generated into ``request_schemas.json`` by ``make crd``, read here as
data), so the document says what the predictors accept, no more and no less; ``model`` is required and
lists the served names for that route's task.
"""

from __future__ import annotations

import copy
from typing import Any

from universal_gateway.backends import ModelView
from universal_predictors.catalog import CATALOG, Catalog, ModelFrom, RequestSchemas, Route, request_schemas

_ERROR = {
    "description": "An OpenAI-shaped error",
    "content": {"application/json": {"schema": {"type": "object", "required": ["error"]}}},
}
_ANTHROPIC_ERROR = {
    "description": "An Anthropic-shaped error",
    "content": {"application/json": {"schema": {"type": "object", "required": ["type", "error"]}}},
}
_RESPONSE_ID = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
#: The gateway's own routes over its response store (responses_store), described when /v1/responses is.
_STORED_RESPONSES: dict[str, dict[str, Any]] = {
    "responses/{response_id}": {
        "get": {"operationId": "get_response", "summary": "A stored response", "tags": ["generate"],
                "parameters": _RESPONSE_ID, "responses": {"200": {"description": "The response"}, "default": _ERROR}},
        "delete": {"operationId": "delete_response", "summary": "Delete a stored response", "tags": ["generate"],
                   "parameters": _RESPONSE_ID,
                   "responses": {"200": {"description": "{id, object, deleted}"}, "default": _ERROR}},
    },
    "responses/{response_id}/input_items": {
        "get": {
            "operationId": "list_response_input_items", "summary": "A stored response's input items",
            "tags": ["generate"],
            "parameters": [
                *_RESPONSE_ID,
                {"name": "order", "in": "query", "schema": {"type": "string", "enum": ["asc", "desc"]}},
                {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
                {"name": "after", "in": "query", "schema": {"type": "string"}},
            ],
            "responses": {"200": {"description": "A list of input items"}, "default": _ERROR},
        }
    },
}  # fmt: skip


def _model_field(names: list[str]) -> dict[str, Any]:
    return {"type": "string", "enum": names, "description": "The served model name."}


def _json_body(route: Route, names: list[str], schemas: RequestSchemas) -> dict[str, Any]:
    schema = copy.deepcopy(schemas.schema_of(route.request) or {"type": "object"})
    schema["properties"] = {**schema.get("properties", {}), "model": _model_field(names)}
    schema["required"] = ["model", *(f for f in schema.get("required", []) if f != "model")]
    return schema


_FILE = {"type": "string", "contentMediaType": "application/octet-stream", "description": "An uploaded file."}


def _upload_body(route: Route, names: list[str], schemas: RequestSchemas) -> dict[str, Any]:
    """A route that takes uploads only (OpenAI's audio API): the ``file``, and its request model's fields as form
    fields."""
    schema = _json_body(route, names, schemas)
    schema["properties"] = {"file": _FILE, **schema["properties"]}
    schema["required"] = ["model", "file", *schema["required"][1:]]
    return schema


def _form_body(names: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "model": _model_field(names),
            # The OCR predictor's upload fields (tasks/ocr.py): images or a PDF under any of the file names,
            # a PDF under document/pdf, and the JSON body's options as text fields.
            **{name: _FILE for name in ("file", "image", "document", "pdf")},
            **{name: {"type": "array", "items": _FILE} for name in ("files", "images")},
            "languages": {"type": "string", "description": "Language codes, comma-separated or the field repeated."},
            "return_boxes": {"type": "boolean"},
        },
        "required": ["model"],
    }


def _operation(route: Route, task: str, names: list[str], schemas: RequestSchemas) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "operationId": route.operation,
        "summary": route.summary,
        "tags": [task],
        "responses": {
            "200": {"description": "The model's answer"},
            "default": _ANTHROPIC_ERROR if route.errors == "anthropic" else _ERROR,
        },
    }
    if route.method == "POST":
        content: dict[str, Any] = {}
        if ModelFrom.JSON in route.model_from:
            content["application/json"] = {"schema": _json_body(route, names, schemas)}
        if ModelFrom.FORM in route.model_from and ModelFrom.JSON in route.model_from:
            content["multipart/form-data"] = {"schema": _form_body(names)}
        elif ModelFrom.FORM in route.model_from:
            content["multipart/form-data"] = {"schema": _upload_body(route, names, schemas)}
        operation["requestBody"] = {"required": True, "content": content}
        return operation
    parameters = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in route.params]
    if ModelFrom.QUERY in route.model_from:
        parameters.append({
            "name": "model", "in": "query", "required": len(names) > 1, "schema": _model_field(names),
            "description": f"The {task} model; may be left out when only one is served.",
        })  # fmt: skip
    if parameters:
        operation["parameters"] = parameters
    return operation


def openapi_document(
    models: list[ModelView],
    catalog: Catalog = CATALOG,
    schemas: RequestSchemas | None = None,
    prefix: str = "/v1",
    *,
    stored_responses: bool = False,
) -> dict[str, Any]:
    """OpenAPI 3.1 for the routes whose task at least one served model has (and, with ``stored_responses``, the
    gateway's routes over its response store, beside ``/v1/responses``)."""
    schemas = request_schemas() if schemas is None else schemas
    paths: dict[str, Any] = {}
    for entry, route in catalog.routes():
        names = sorted(m.name for m in models if m.task == entry.name)
        if names:
            operation = _operation(route, entry.name, names, schemas)
            paths.setdefault(f"{prefix}/{route.path}", {})[route.method.lower()] = operation
    if stored_responses and f"{prefix}/responses" in paths:
        paths.update({f"{prefix}/{path}": copy.deepcopy(item) for path, item in _STORED_RESPONSES.items()})
    paths[f"{prefix}/models"] = {
        "get": {"operationId": "list_models", "responses": {"200": {"description": "Every model and its state"}}}
    }
    paths[f"{prefix}/models/{{name}}"] = {
        "get": {
            "operationId": "get_model",
            "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {"description": "One model"}, "default": _ERROR},
        }
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "Universal Runtime gateway", "version": "0.1.0"},
        "paths": paths,
        "components": {"schemas": schemas.components},
    }
