"""KServe's ModelServer, hosting one UniversalPredictor with our routes in front of its own.

KServe refuses to start unless a model is ready at start; we want the opposite (answer 503 "loading"
while a large model loads, readiness false until it is done), so registration does not wait for
readiness and loading runs in the model's ``start_engine`` once the event loop is up.
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

import kserve
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kserve import model_server

from universal_predictors.allocator import TrimWhenIdle
from universal_predictors.base import UniversalPredictor, common_routes
from universal_predictors.catalog import CATALOG, Catalog
from universal_predictors.config import UPSTREAM_TOKEN_ENV, UPSTREAM_TOKEN_HEADER
from universal_predictors.errors import APIError, InvalidRequest
from universal_predictors.http import error_response, field_path

logger = logging.getLogger(__name__)


class UniversalModelServer(kserve.ModelServer):
    """ModelServer whose models become ready after the server starts listening, on ``host``."""

    def __init__(self, *args: Any, host: str | None = None, **kwargs: Any) -> None:
        self._host = host
        super().__init__(*args, **kwargs)

    # KServe 0.21.0 python/kserve/kserve/protocol/rest/server.py (RESTServer.__init__) builds its
    # uvicorn.Config with host="0.0.0.0" and no way to change it; ModelServer.start assigns the
    # RESTServer to ``_rest_server`` before uvicorn binds (in asyncio.run), so the address is set here.
    @property
    def _rest_server(self) -> Any:
        return self.__dict__.get("_universal_rest_server")

    @_rest_server.setter
    def _rest_server(self, server: Any) -> None:
        if server is not None and self._host:
            server.config.host = self._host
        self.__dict__["_universal_rest_server"] = server

    def _register_and_check_atleast_one_model_is_ready(self, models: list[Any]) -> None:
        for model in models:
            self.register_model(model)
            model.enable_latency_logging = self.enable_latency_logging
            model.start()
            if model.engine:
                self.servers.append(model.start_engine())


#: Answered without the gateway's token: the kubelet's and the local supervisor's probes
#: (KServe's "/" liveness and the v2 health routes) and /metrics, which name nothing but this model.
TOKEN_FREE_PATHS = frozenset({"/", "/v2/health/live", "/v2/health/ready", "/metrics"})


class RequireToken:
    """ASGI middleware: every request but ``TOKEN_FREE_PATHS`` must carry the gateway's token (401)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token.encode()
        self.header = UPSTREAM_TOKEN_HEADER.lower().encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in TOKEN_FREE_PATHS:
            given = next((value for key, value in scope["headers"] if key == self.header), b"")
            if not hmac.compare_digest(given, self.token):
                error = APIError("This predictor answers its gateway only.", status_code=401,
                                 code="invalid_upstream_token")  # fmt: skip
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class AnswerHead:
    """ASGI middleware: HEAD is answered as GET without the body (RFC 9110 section 9.3.2), headers included
    (``content-length`` as GET's). FastAPI's routes take only the methods they name, so HEAD was a 405 on every
    route; a HEAD that is relayed to us (the gateway's own HEAD handling aside) now gets what GET would say."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body":
                if not message.get("more_body", False):
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, without_body)


def install_routes(app: FastAPI, predictor: UniversalPredictor, catalog: Catalog = CATALOG) -> None:
    """Put the predictor's routes (its task's in ``catalog``) ahead of KServe's (Starlette matches in order)."""
    router = common_routes(predictor)
    predictor.add_routes(router, catalog)
    app.include_router(router)

    # The Messages API's routes answer errors in Anthropic's shape.
    anthropic = frozenset(
        path
        for _, route in catalog.routes()
        if route.errors == "anthropic"
        for path in (route.upstream, *route.aliases)
    )

    def shaped(request: Request, error: APIError) -> JSONResponse:
        return error_response(error, "anthropic" if request.url.path in anthropic else "openai")

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return shaped(request, exc)

    async def invalid_body(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        where = field_path(tuple(p for p in first["loc"] if p != "body"))
        message = f"{where}: {first['msg']}" if where else str(first["msg"])
        return shaped(request, InvalidRequest(message, param=where or None))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_middleware(TrimWhenIdle, quiet_paths=TOKEN_FREE_PATHS)
    app.add_middleware(AnswerHead)  # inside the token check (the last added is the outermost)
    token = os.environ.get(UPSTREAM_TOKEN_ENV)
    if token:
        app.add_middleware(RequireToken, token=token)


def serve(
    predictor: UniversalPredictor,
    http_port: int,
    *,
    host: str | None = None,
    enable_grpc: bool = False,
    grpc_port: int = 8081,
) -> None:
    """Serve until SIGTERM/SIGINT, on ``host`` (None: every interface)."""
    install_routes(model_server.app, predictor)
    server = UniversalModelServer(
        http_port=http_port, grpc_port=grpc_port, enable_grpc=enable_grpc, workers=1, host=host
    )
    server.start([predictor])
