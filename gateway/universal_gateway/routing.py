"""Which handler answers a path, and which model a request names: pure functions of the request.

The task routes come from the catalog (:mod:`universal_predictors.catalog`); ``/v1/*`` and
``/openai/v1/*`` are the same routes. A path is looked up in a dict first (every route without
parameters), then against the patterned ones (``{param}``: one segment; a final ``{param:path}``: the
rest of the path).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar
from urllib.parse import quote

import orjson

from universal_gateway.multipart import multipart_model
from universal_gateway.server import Request
from universal_predictors.catalog import Catalog, ModelFrom, Route
from universal_predictors.errors import APIError, InvalidRequest

PREFIXES = ("/v1", "/openai/v1")

#: Bodies at least this big are routed by a leading ``{"model": "..."`` without a full parse (an OCR
#: image as base64 is megabytes); the predictor validates the whole body anyway.
_FAST_MODEL_BYTES = 64 * 1024
_LEADING_MODEL = re.compile(rb'\A\s*\{\s*"model"\s*:\s*"([^"\\]{1,512})"')
_PARAM = re.compile(r"^\{([a-z_]+)(:path)?\}$")

H = TypeVar("H")
Params = dict[str, str]
_NO_PARAMS: Params = {}


class Router(Generic[H]):
    """Paths to ``{method: handler}``."""

    def __init__(self) -> None:
        self._exact: dict[str, dict[str, H]] = {}
        self._patterns: list[tuple[tuple[str, ...], dict[str, H]]] = []

    def add(self, path: str, method: str, handler: H) -> None:
        segments = tuple(path.split("/"))
        if not any(_PARAM.fullmatch(s) for s in segments):
            self._exact.setdefault(path, {})[method] = handler
            return
        for pattern, methods in self._patterns:
            if pattern == segments:
                methods[method] = handler
                return
        self._patterns.append((segments, {method: handler}))

    def match(self, path: str) -> tuple[dict[str, H], Params] | None:
        """The handlers for ``path`` (percent-decoded) by method, and its parameters; None: nothing here."""
        methods = self._exact.get(path)
        if methods is not None:
            return methods, _NO_PARAMS
        segments = path.split("/")
        for pattern, methods in self._patterns:
            params = _bind(pattern, segments)
            if params is not None:
                return methods, params
        return None


def _bind(pattern: tuple[str, ...], segments: list[str]) -> Params | None:
    params: Params = {}
    for index, part in enumerate(pattern):
        param = _PARAM.fullmatch(part)
        if param is not None and param.group(2):  # {name:path}: the rest, at least one character
            rest = "/".join(segments[index:])
            if not rest:
                return None
            params[param.group(1)] = rest
            return params
        if index >= len(segments):
            return None
        if param is not None:
            if not segments[index]:
                return None
            params[param.group(1)] = segments[index]
        elif part != segments[index]:
            return None
    return params if len(segments) == len(pattern) else None


@dataclass(frozen=True)
class TaskRoute:
    """One catalog route as the gateway serves it: the task that serves it, and where it goes upstream."""

    task: str
    route: Route

    @property
    def accepts_form(self) -> bool:
        return ModelFrom.FORM in self.route.model_from

    def upstream_path(self, params: Params) -> str:
        """The predictor's path, each parameter one encoded segment (as the client meant it)."""
        path = self.route.upstream
        for name, value in params.items():
            path = path.replace(f"{{{name}}}", quote(value, safe=""))
        return path


def task_routes(catalog: Catalog) -> Iterable[tuple[str, TaskRoute]]:
    """Every task route of ``catalog`` under every prefix: (full path, route)."""
    for entry, route in catalog.routes():
        for prefix in PREFIXES:
            yield f"{prefix}/{route.path}", TaskRoute(entry.name, route)


def body_model(request: Request, *, accepts_form: bool) -> str:
    """The ``model`` a POST names: its JSON body's field, or a multipart form's field where one is taken."""
    body = request.body
    if request.content_type.startswith("multipart/"):
        if not accepts_form:
            raise APIError(
                f"{request.path} takes a JSON body (Content-Type: application/json), not a multipart form.",
                status_code=415, code="unsupported_media_type",
            )  # fmt: skip
        return multipart_model(request.headers.get("content-type", ""), body)
    if len(body) >= _FAST_MODEL_BYTES:
        leading = _LEADING_MODEL.match(body, 0, 1024)
        if leading is not None:
            with contextlib.suppress(UnicodeDecodeError):
                return leading.group(1).decode()
    try:
        data = orjson.loads(body) if body else None
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError alike
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object with a 'model' field.", code="invalid_json")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model: required (a string naming the model)", param="model")
    return model


def query_model(request: Request, task: str, served: list[str]) -> str:
    """The ``model`` a GET or DELETE names: ``?model=NAME``, else the one model of ``task`` (``served``)."""
    name = request.query.get("model") if request.query_string else None
    if name:
        return name
    if len(served) != 1:
        raise InvalidRequest(
            f"name the {task} model with ?model=NAME ({task} models: {', '.join(served) or 'none'})", param="model"
        )
    return served[0]
