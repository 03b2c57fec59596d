"""The OpenAI-compatible front door: routes each request to its model's predictor by the body's ``model``.

``/v1/*`` and ``/openai/v1/*`` are the same routes. Streams pass through chunk by chunk (a slow client
slows the upstream read: backpressure), and a client that goes away closes the upstream request so the
predictor stops generating. Errors are OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from universal_gateway.auth import ApiKeys
from universal_gateway.backends import Backends, ModelState
from universal_gateway.openapi import openapi_document
from universal_predictors.config import Task
from universal_predictors.errors import (
    APIError,
    InvalidRequest,
    ModelNotFound,
    RequestTooLarge,
)

logger = logging.getLogger(__name__)

PREFIXES = ("/v1", "/openai/v1")

#: Route (after the prefix) -> (upstream path, tasks that serve it).
ROUTES: dict[str, tuple[str, frozenset[Task]]] = {
    "chat/completions": ("/openai/v1/chat/completions", frozenset({Task.GENERATE})),
    "completions": ("/openai/v1/completions", frozenset({Task.GENERATE})),
    "embeddings": ("/openai/v1/embeddings", frozenset({Task.EMBED})),
    "rerank": ("/openai/v1/rerank", frozenset({Task.RERANK})),
    "classify": ("/v1/classify", frozenset({Task.CLASSIFY})),
    "ner": ("/v1/ner", frozenset({Task.NER})),
    "ocr": ("/v1/ocr", frozenset({Task.OCR})),
    "anomaly/fit": ("/v1/anomaly/fit", frozenset({Task.ANOMALY})),
    "anomaly/score": ("/v1/anomaly/score", frozenset({Task.ANOMALY})),
    "anomaly/detect": ("/v1/anomaly/detect", frozenset({Task.ANOMALY})),
}
#: Hop-by-hop headers and ones the gateway owns; never forwarded.
_DROPPED_HEADERS = {
    "host", "connection", "keep-alive", "proxy-authorization", "te", "trailers", "transfer-encoding",
    "upgrade", "content-length", "authorization",
}  # fmt: skip


@dataclass
class GatewayLimits:
    """Request limits; beyond the queue a request gets 429 with Retry-After."""

    max_body_bytes: int = 32 * 2**20
    max_concurrency_per_model: int = 64
    max_queue_per_model: int = 256
    connect_timeout: float = 5.0
    read_timeout: float = 600.0


@dataclass
class GatewayMetrics:
    """Prometheus series per model, on the gateway's own registry."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter("universal_gateway_requests_total", "Requests by status.", ["model", "status"],
                                registry=r)  # fmt: skip
        self.latency = Histogram("universal_gateway_request_seconds", "Time to the last byte.", ["model"],
                                 registry=r)  # fmt: skip
        self.ttfb = Histogram("universal_gateway_time_to_first_byte_seconds", "Time to the first byte.", ["model"],
                              registry=r)  # fmt: skip
        self.in_flight = Gauge("universal_gateway_in_flight", "Requests in flight.", ["model"], registry=r)
        self.cold_starts = Counter("universal_gateway_cold_starts_total", "Requests that woke a model.", ["model"],
                                   registry=r)  # fmt: skip
        wake_buckets = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800)
        self.wake = Histogram("universal_gateway_wake_seconds", "Time a request waited for its model to wake.",
                              ["model"], buckets=wake_buckets, registry=r)  # fmt: skip


class _ModelGate:
    """Per-model concurrency with a bounded queue."""

    def __init__(self, concurrency: int, queue: int) -> None:
        self._semaphore = asyncio.Semaphore(concurrency)
        self._waiting = 0
        self._queue = queue

    async def __aenter__(self) -> None:
        if self._semaphore.locked():
            if self._waiting >= self._queue:
                raise APIError(
                    "Too many requests are queued for this model; retry shortly.",
                    status_code=429,
                    code="rate_limit_exceeded",
                    retry_after=1,
                )
            self._waiting += 1
            try:
                await self._semaphore.acquire()
            finally:
                self._waiting -= 1
        else:
            await self._semaphore.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._semaphore.release()


def error_response(error: APIError) -> web.Response:
    return web.json_response(error.body(), status=error.status_code, headers=error.headers())


class Gateway:
    """The aiohttp application and its request path."""

    def __init__(
        self,
        backends: Backends,
        *,
        keys: ApiKeys | None = None,
        limits: GatewayLimits | None = None,
        cors_origins: list[str] | None = None,
    ) -> None:
        self.backends = backends
        self.keys = keys or ApiKeys()
        self.limits = limits or GatewayLimits()
        self.cors_origins = cors_origins or []
        self.metrics = GatewayMetrics()
        self._gates: dict[str, _ModelGate] = {}
        self._session: aiohttp.ClientSession | None = None

    # -- application -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.limits.max_body_bytes, middlewares=[self._errors])
        for prefix in PREFIXES:
            for route in ROUTES:
                app.router.add_post(f"{prefix}/{route}", self._proxy_route(route))
            app.router.add_get(f"{prefix}/models", self._list_models)
            app.router.add_get(f"{prefix}/models/{{name:.+}}", self._get_model)
            app.router.add_get(f"{prefix}/anomaly/detectors", self._anomaly_passthrough)
            app.router.add_delete(f"{prefix}/anomaly/detectors/{{detector}}", self._anomaly_passthrough)
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.limits.connect_timeout, sock_read=self.limits.read_timeout
        )
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        await self.backends.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        await self.backends.close()
        if self._session is not None:
            await self._session.close()

    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            response = await handler(request)
        except APIError as error:
            response = error_response(error)
        except web.HTTPRequestEntityTooLarge:
            response = error_response(RequestTooLarge(f"The request body is over the limit of "
                                                      f"{self.limits.max_body_bytes} bytes."))  # fmt: skip
        except web.HTTPException as exc:
            if exc.status >= 400:
                kind = APIError(
                    exc.reason or "error", status_code=exc.status, code=exc.reason.lower().replace(" ", "_")
                )
                response = error_response(kind)
            else:
                raise
        if self.cors_origins:
            origin = request.headers.get("Origin")
            if origin and ("*" in self.cors_origins or origin in self.cors_origins):
                response.headers["Access-Control-Allow-Origin"] = origin
                response.headers["Vary"] = "Origin"
        return response

    # -- plain routes ------------------------------------------------------------------------------

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(self.backends.models()))

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ready", "models": len(self.backends.models())})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _list_models(self, request: web.Request) -> web.Response:
        allowed = self.keys.authorize(request.headers.get("Authorization"), None)
        cards = [v.card() for v in self.backends.models() if allowed is None or v.name in allowed]
        return web.json_response({"object": "list", "data": cards})

    async def _get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.keys.authorize(request.headers.get("Authorization"), name)
        view = self.backends.find(name)
        if view is None:
            raise self._unknown(name)
        return web.json_response(view.card())

    # -- proxying ----------------------------------------------------------------------------------

    def _unknown(self, name: str) -> APIError:
        error = ModelNotFound(name, "")
        available = ", ".join(sorted(v.name for v in self.backends.models())) or "none"
        error.message = f"The model {name!r} does not exist; available models: {available}."
        return error

    def _proxy_route(self, route: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        upstream_path, tasks = ROUTES[route]

        async def handler(request: web.Request) -> web.StreamResponse:
            body = await self._read_body(request)
            name = await self._model_name(request, body)
            return await self._forward(request, name, upstream_path, tasks, body)

        return handler

    async def _anomaly_passthrough(self, request: web.Request) -> web.StreamResponse:
        name = request.query.get("model")
        if name is None:
            anomaly = [v.name for v in self.backends.models() if v.task is Task.ANOMALY]
            if len(anomaly) != 1:
                raise InvalidRequest(
                    f"name the anomaly model with ?model=NAME (anomaly models: {', '.join(anomaly) or 'none'})",
                    param="model",
                )
            name = anomaly[0]
        path = request.path
        for prefix in PREFIXES:
            if path.startswith(prefix + "/anomaly/"):
                path = "/v1" + path[len(prefix) :]
        return await self._forward(request, name, path, frozenset({Task.ANOMALY}), b"")

    async def _read_body(self, request: web.Request) -> bytes:
        declared = request.content_length
        if declared is not None and declared > self.limits.max_body_bytes:
            raise RequestTooLarge(
                f"The request body is {declared} bytes; the limit is {self.limits.max_body_bytes} bytes."
            )
        return await request.read()

    async def _model_name(self, request: web.Request, body: bytes) -> str:
        content_type = request.content_type
        if content_type.startswith("multipart/"):
            try:
                form = await request.post()
            except (ValueError, AssertionError, aiohttp.ClientError) as exc:
                raise InvalidRequest(f"The multipart body cannot be parsed: {exc}", code="invalid_body") from None
            value = form.get("model")
            if not isinstance(value, str) or not value:
                raise InvalidRequest("model: the multipart form needs a 'model' field", param="model")
            return value
        try:
            data = json.loads(body) if body else None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise InvalidRequest("The request body must be a JSON object with a 'model' field.", code="invalid_json")
        model = data.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("model: required (a string naming the model)", param="model")
        return model

    def _gate(self, name: str) -> _ModelGate:
        gate = self._gates.get(name)
        if gate is None:
            gate = _ModelGate(self.limits.max_concurrency_per_model, self.limits.max_queue_per_model)
            self._gates[name] = gate
        return gate

    async def _forward(
        self, request: web.Request, name: str, path: str, tasks: frozenset[Task], body: bytes
    ) -> web.StreamResponse:
        self.keys.authorize(request.headers.get("Authorization"), name)
        view = self.backends.find(name)
        if view is None:
            raise self._unknown(name)
        if view.task not in tasks:
            wanted = " or ".join(sorted(t.value for t in tasks))
            raise InvalidRequest(
                f"The model {name!r} does {view.task.value}; {request.path} needs a {wanted} model.", param="model"
            )
        started = time.monotonic()
        status = 500
        self.metrics.in_flight.labels(name).inc()
        try:
            async with self._gate(name):
                woke = view.state is not ModelState.READY
                async with self.backends.lease(name) as upstream:
                    if woke:
                        self.metrics.cold_starts.labels(name).inc()
                        self.metrics.wake.labels(name).observe(time.monotonic() - started)
                    response = await self._relay(request, name, upstream + path, body, started)
                    status = response.status
                    return response
        except APIError as error:
            status = error.status_code
            raise
        finally:
            self.metrics.in_flight.labels(name).dec()
            self.metrics.requests.labels(name, str(status)).inc()
            self.metrics.latency.labels(name).observe(time.monotonic() - started)

    async def _relay(
        self, request: web.Request, name: str, url: str, body: bytes, started: float
    ) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROPPED_HEADERS}
        # A Knative model scaling from zero answers only once loaded: wait as long as its startupTimeout.
        read_timeout = max(self.limits.read_timeout, self.backends.upstream_timeout(name) or 0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.limits.connect_timeout, sock_read=read_timeout)
        attempt = 0
        while True:
            try:
                upstream = await self._session.request(
                    request.method, url, data=body or None, headers=headers, params=request.query, timeout=timeout
                )
                break
            except aiohttp.ClientConnectorError as exc:
                # Nothing was sent yet: one retry is safe (the process may have just restarted).
                attempt += 1
                if attempt > 1:
                    raise APIError(
                        f"The model {name!r} is unreachable: {exc.os_error or exc}", status_code=502,
                        code="upstream_unreachable",
                    ) from None  # fmt: skip
                await asyncio.sleep(0.2)
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise APIError(
                    f"The model {name!r} did not answer: {type(exc).__name__}", status_code=502, code="upstream_error"
                ) from None
        async with upstream:
            content_type = upstream.headers.get("Content-Type", "")
            passed = {
                k: v for k, v in upstream.headers.items()
                if k.lower() not in _DROPPED_HEADERS and k.lower() not in ("content-encoding", "server", "date")
            }  # fmt: skip
            if not content_type.startswith("text/event-stream"):
                try:
                    payload = await upstream.read()
                except (TimeoutError, aiohttp.ClientError):
                    raise APIError(
                        f"The model {name!r} failed while answering.", status_code=502, code="upstream_error"
                    ) from None
                self.metrics.ttfb.labels(name).observe(time.monotonic() - started)
                return web.Response(body=payload, status=upstream.status, headers=passed)
            response = web.StreamResponse(status=upstream.status, headers=passed)
            await response.prepare(request)
            first = True
            try:
                async for chunk in upstream.content.iter_any():
                    if first:
                        self.metrics.ttfb.labels(name).observe(time.monotonic() - started)
                        first = False
                    await response.write(chunk)  # waits for the client: backpressure
            except (ConnectionResetError, asyncio.CancelledError):
                # The client went away: leaving the block closes the upstream request, which stops generation.
                upstream.close()
                raise
            except (TimeoutError, aiohttp.ClientError):
                error = APIError(f"The model {name!r} failed mid-stream.", status_code=502, code="upstream_error")
                await response.write(f"data: {json.dumps(error.body())}\n\n".encode())
            await response.write_eof()
            return response


def pretty_models(models: list[dict[str, Any]]) -> str:
    return json.dumps(models, indent=2)
