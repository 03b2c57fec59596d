"""The gateway's OpenAPI document (``GET /openapi.json``), built from its routes and the models it serves.

Request bodies are described loosely (the predictors own the exact validation) but with the fields each
route takes, and ``model`` listing the served names for that route's task, so a client generator or a
fuzzer reaches real predictors.
"""

from __future__ import annotations

from typing import Any

from universal_gateway.backends import ModelView
from universal_predictors.config import Task

_STRINGS = {"type": "array", "items": {"type": "string"}}
_ROWS = {"type": "array", "items": {"type": "array", "items": {"type": "number"}}}
_MESSAGES = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "role": {"type": "string", "enum": ["system", "user", "assistant"]},
            "content": {"type": "string"},
        },
        "required": ["role", "content"],
    },
}
_SAMPLING = {
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "stream": {"type": "boolean"},
    "stop": {"type": "string"},
    "seed": {"type": "integer"},
}

#: Route -> (task, body fields beyond ``model``, required fields).
BODIES: dict[str, tuple[Task, dict[str, Any], list[str]]] = {
    "chat/completions": (Task.GENERATE, {"messages": _MESSAGES, **_SAMPLING}, ["messages"]),
    "completions": (Task.GENERATE, {"prompt": {"type": "string"}, **_SAMPLING}, ["prompt"]),
    "embeddings": (
        Task.EMBED,
        {"input": {"oneOf": [{"type": "string"}, _STRINGS]}, "encoding_format": {"enum": ["float", "base64"]}},
        ["input"],
    ),
    "rerank": (
        Task.RERANK,
        {"query": {"type": "string"}, "documents": _STRINGS, "top_n": {"type": "integer"}},
        ["query", "documents"],
    ),
    "classify": (Task.CLASSIFY, {"texts": _STRINGS, "top_k": {"type": "integer"}}, ["texts"]),
    "ner": (Task.NER, {"texts": _STRINGS}, ["texts"]),
    "ocr": (Task.OCR, {"images": _STRINGS, "return_boxes": {"type": "boolean"}}, ["images"]),
    "anomaly/fit": (
        Task.ANOMALY,
        {"detector": {"type": "string"}, "algorithm": {"enum": ["iforest", "ecod", "hbos"]}, "data": _ROWS},
        ["detector", "data"],
    ),
    "anomaly/score": (Task.ANOMALY, {"detector": {"type": "string"}, "data": _ROWS}, ["detector", "data"]),
    "anomaly/detect": (Task.ANOMALY, {"detector": {"type": "string"}, "data": _ROWS}, ["detector", "data"]),
}

_ERROR = {
    "description": "An OpenAI-shaped error",
    "content": {"application/json": {"schema": {"type": "object", "required": ["error"]}}},
}


def openapi_document(models: list[ModelView], prefix: str = "/v1") -> dict[str, Any]:
    """OpenAPI 3.0 for the routes whose task at least one served model has."""
    paths: dict[str, Any] = {}
    for route, (task, fields, required) in BODIES.items():
        names = sorted(m.name for m in models if m.task is task)
        if not names:
            continue
        schema = {
            "type": "object",
            "properties": {"model": {"type": "string", "enum": names}, **fields},
            "required": ["model", *required],
        }
        paths[f"{prefix}/{route}"] = {
            "post": {
                "operationId": route.replace("/", "_"),
                "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                "responses": {"200": {"description": "The model's answer"}, "default": _ERROR},
            }
        }
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
        "openapi": "3.0.3",
        "info": {"title": "Universal Runtime gateway", "version": "0.1.0"},
        "paths": paths,
    }
