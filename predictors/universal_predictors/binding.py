"""A task's HTTP routes, bound from the catalog (:mod:`universal_predictors.catalog`) to its predictor's methods.

Each :class:`~universal_predictors.catalog.Route` names its predictor path (and any ``aliases``), its request
model and the predictor method that answers it (``handler``). The binder does what every route did by hand:

- a POST reads its body with :meth:`UniversalPredictor.read_request` (by default the route's request model from
  JSON, within the predictor's body limit; tasks that take uploads read ``multipart/form-data`` too), checks the
  ``model`` it names (404 for another) and readiness (503 while loading), then calls
  ``handler(body, request)``;
- a GET or DELETE checks readiness and calls ``handler(path_params, request)``; a path parameter in the last
  segment takes the rest of the path, so ``a/b`` or an encoded ``..%2Fx`` reaches the method and its 400,
  not a bare 404;
- the answer (a ``Response``, or a dict sent as JSON) goes out through :func:`~universal_predictors.http.endpoint`:
  metrics labelled by the route's ``operation``, API errors as OpenAI error JSON, no stack traces. With
  ``stop_on_disconnect``, a client that leaves cancels its request's work.

A task is therefore its predictor module and its catalog entry; nothing else writes its paths again.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from universal_predictors import tracing
from universal_predictors.catalog import Backend, Route, Task
from universal_predictors.http import endpoint, unless_disconnected


class UniversalPredictor(Protocol):
    """What the binder uses of a predictor (:class:`universal_predictors.base.UniversalPredictor`)."""

    name: str
    task: ClassVar[Task]
    backend: Backend
    stop_on_disconnect: bool

    async def read_request(self, route: Route, request: Request) -> tuple[str | None, Any]: ...

    def check_model(self, requested: str | None) -> None: ...

    def require_ready(self) -> None: ...


Handler = Callable[[Any, Request], Awaitable["Response | dict[str, Any]"]]


@functools.cache
def request_model(path: str) -> type[BaseModel]:
    """The pydantic model a route's ``request`` names (``module:Class``)."""
    module, _, name = path.partition(":")
    model = getattr(importlib.import_module(module), name)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise TypeError(f"{path} is not a pydantic model")
    return model


def as_response(answer: Response | dict[str, Any]) -> Response:
    return answer if isinstance(answer, Response) else JSONResponse(answer)


def bind_routes(predictor: UniversalPredictor, router: APIRouter, routes: Sequence[Route]) -> None:
    """Add ``routes`` to ``router``, each answered by the predictor method it names (module docstring)."""
    for route in routes:
        handler = getattr(predictor, route.handler, None)
        if not callable(handler):
            raise TypeError(
                f"{type(predictor).__name__} has no method {route.handler!r} for {route.method} {route.upstream} "
                "(the catalog's route names it)"
            )
        answer = _body_route(predictor, route, handler) if route.method == "POST" else _query_route(predictor, handler)
        answer = tracing.traced_route(answer, route.operation, predictor.task.value,
                                      lambda: (predictor.name, predictor.backend.value))  # fmt: skip
        bound = endpoint(route.operation, lambda: predictor.name, route.errors)(answer)
        for path in (route.upstream, *route.aliases):
            router.add_api_route(_rest_of_path(path), bound, methods=[route.method], name=route.operation)


def _body_route(
    predictor: UniversalPredictor, route: Route, handler: Handler
) -> Callable[[Request], Awaitable[Response]]:
    async def answer(request: Request) -> Response:
        with tracing.span("parse"):
            model, body = await predictor.read_request(route, request)
        predictor.check_model(model)
        predictor.require_ready()
        if predictor.stop_on_disconnect:
            return await unless_disconnected(request, handler(body, request))
        return as_response(await handler(body, request))

    return answer


def _query_route(predictor: UniversalPredictor, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def answer(request: Request) -> Response:
        predictor.require_ready()
        return as_response(await handler(dict(request.path_params), request))

    return answer


def _rest_of_path(path: str) -> str:
    """``/a/{name}`` as ``/a/{name:path}``: a parameter in the last segment takes the rest of the path."""
    head, _, last = path.rpartition("/")
    if last.startswith("{") and last.endswith("}") and ":" not in last:
        return f"{head}/{last[:-1]}:path}}"
    return path
