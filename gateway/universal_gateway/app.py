"""The OpenAI-compatible front door: routes each request to its model's predictor by the body's ``model``.

``/v1/*`` and ``/openai/v1/*`` are the same routes. Streams pass through chunk by chunk (a slow client
slows the upstream read: backpressure), and a client that goes away closes the upstream request so the
predictor stops generating. Errors are OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from yarl import URL

from universal_gateway.auth import ApiKeys, Forbidden
from universal_gateway.backends import Backends, ModelState, ModelView
from universal_gateway.limits import GatewayLimits
from universal_gateway.openapi import openapi_document
from universal_gateway.server import Headers, HttpServer, Request, Response, StreamedResponse
from universal_predictors.config import UPSTREAM_TOKEN_HEADER, Task
from universal_predictors.errors import APIError, InvalidRequest, ModelNotFound, Unavailable

logger = logging.getLogger(__name__)

#: What the metrics count for a request whose client left first (nginx's code; the predictors use it too).
CLIENT_CLOSED = 499

_Handler = Callable[[Request], Awaitable["Response | StreamedResponse"]]

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
_DROPPED_HEADERS = frozenset({
    "host", "connection", "keep-alive", "proxy-authorization", "te", "trailers", "transfer-encoding",
    "upgrade", "content-length", "authorization", "expect", UPSTREAM_TOKEN_HEADER.lower(),
})  # fmt: skip
#: Also never passed back: the gateway is the server. Content-Encoding does pass: the body is relayed
#: as the upstream encoded it (for a client that asked for that encoding).
_DROPPED_RESPONSE_HEADERS = _DROPPED_HEADERS | {"server", "date"}
_DROPPED_HEADER_BYTES = frozenset(name.encode() for name in _DROPPED_HEADERS)
#: Bodies at least this big are routed by a leading ``{"model": "..."`` without a full parse (an OCR
#: image as base64 is megabytes); the predictor validates the whole body anyway.
_FAST_MODEL_BYTES = 64 * 1024
_LEADING_MODEL = re.compile(rb'\A\s*\{\s*"model"\s*:\s*"([^"\\]{1,512})"')


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


class _ModelRoute:
    """Per-model state the proxy path reuses: its gate and its metric children (``labels()`` takes a
    lock and builds a key on every call, five times a request otherwise)."""

    __slots__ = ("_metrics", "_name", "_requests", "gate", "in_flight", "latency", "ttfb")

    def __init__(self, name: str, metrics: GatewayMetrics, limits: GatewayLimits) -> None:
        self._name = name
        self._metrics = metrics
        self.gate = _ModelGate(limits.max_concurrency_per_model, limits.max_queue_per_model)
        self.in_flight = metrics.in_flight.labels(name)
        self.latency = metrics.latency.labels(name)
        self.ttfb = metrics.ttfb.labels(name)
        self._requests: dict[int, Any] = {}

    def count(self, status: int) -> None:
        counter = self._requests.get(status)
        if counter is None:
            counter = self._requests[status] = self._metrics.requests.labels(self._name, str(status))
        counter.inc()


class Gateway:
    """The routes and the request path, served by :class:`HttpServer`."""

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
        self._routes: dict[str, _ModelRoute] = {}
        self._upstreams = _UpstreamPool()
        token = backends.upstream_token
        self._token_header = f"{UPSTREAM_TOKEN_HEADER}: {token}\r\n".encode("latin-1") if token else b""
        self._server: HttpServer | None = None
        self._table: dict[str, dict[str, _Handler]] = {}
        for prefix in PREFIXES:
            for route, (upstream_path, tasks) in ROUTES.items():
                self._table[f"{prefix}/{route}"] = {"POST": self._proxy_route(upstream_path, tasks)}
            self._table[f"{prefix}/models"] = {"GET": self._list_models}
            self._table[f"{prefix}/anomaly/detectors"] = {"GET": self._anomaly_passthrough}
        #: Answered without an API key (probes): they name no model.
        self._open_paths = frozenset({"/healthz", "/readyz"})
        self._table["/openapi.json"] = {"GET": self._openapi}
        self._table["/healthz"] = {"GET": self._healthz}
        self._table["/readyz"] = {"GET": self._readyz}
        self._table["/metrics"] = {"GET": self._metrics}

    # -- serving -----------------------------------------------------------------------------------

    async def start(self, host: str, port: int) -> HttpServer:
        """Start the backends, then listen (``port`` 0: any free port, see ``server.port``)."""
        await self.backends.start()
        server = HttpServer(
            self.handle,
            max_body_bytes=self.limits.max_body_bytes,
            extra_headers=self._cors if self.cors_origins else None,
            receive_timeout_s=self.limits.receive_timeout,
            head_timeout_s=self.limits.head_timeout,
            authorize=self.authorize_head if self.keys.enabled else None,
            max_connections=self.limits.max_connections,
            max_buffered_bytes=self.limits.max_buffered_bytes,
        )
        await server.start(host, port)
        self._server = server
        return server

    async def close(self) -> None:
        """Stop listening, let requests in flight finish, then stop the backends (and every predictor)."""
        if self._server is not None:
            await self._server.close()
        await self.backends.close()
        self._upstreams.close()

    @contextlib.asynccontextmanager
    async def serving(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
        """Serve for the block; its base URL (``http://host:port``)."""
        server = await self.start(host, port)
        try:
            yield f"http://{host}:{server.port}"
        finally:
            await self.close()

    def authorize_head(self, request: Request) -> APIError | None:
        """With keys on, a request without a valid key is refused on its head, before its body is read
        (the model-specific check, 403, comes once the body names the model). Probes and CORS
        preflights (a browser sends no key with those) pass."""
        if request.path in self._open_paths or request.method == "OPTIONS":
            return None
        try:
            self.keys.authorize(request.headers.get("authorization"), None)
        except APIError as error:
            return error
        return None

    def _allowed(self, request: Request) -> frozenset[str] | None:
        """The models this caller may see (None: all); raises 401 without a valid key when keys are on."""
        return self.keys.authorize(request.headers.get("authorization"), None)

    async def handle(self, request: Request) -> Response | StreamedResponse:
        try:
            methods = self._table.get(request.path) or self._pattern(request.path)
            if methods is None:
                raise APIError(f"Nothing is served at {request.path}; the API is under /v1 (see /openapi.json).",
                               status_code=404, code="not_found")  # fmt: skip
            handler = methods.get(request.method)
            if handler is None and request.method == "HEAD":
                handler = methods.get("GET")  # the server sends the head of the GET answer only
            if handler is None:
                if request.method == "OPTIONS" and self._cors(request):
                    return self._preflight(request, methods)
                error = APIError(f"{request.path} does not take {request.method}; it takes {', '.join(methods)}.",
                                 status_code=405, code="method_not_allowed")  # fmt: skip
                return Response.error(error, headers=[("Allow", ", ".join(methods))])
            return await handler(request)
        except APIError as error:
            return Response.error(error)

    def _pattern(self, path: str) -> dict[str, _Handler] | None:
        for prefix in PREFIXES:
            if path.startswith(prefix):
                rest = path[len(prefix) :]
                if rest.startswith("/models/") and len(rest) > len("/models/"):
                    return {"GET": self._get_model}
                detector = rest.removeprefix("/anomaly/detectors/")
                if detector != rest and detector and "/" not in detector:
                    return {"DELETE": self._anomaly_passthrough}
        return None

    def _cors(self, request: Request) -> Headers:
        origin = request.headers.get("origin")
        if origin and ("*" in self.cors_origins or origin in self.cors_origins):
            return [("Access-Control-Allow-Origin", origin), ("Vary", "Origin")]
        return []

    def _preflight(self, request: Request, methods: dict[str, _Handler]) -> Response:
        asked = request.headers.get("access-control-request-headers", "Authorization, Content-Type")
        return Response(status=204, headers=[
            ("Access-Control-Allow-Methods", ", ".join(methods)),
            ("Access-Control-Allow-Headers", asked),
            ("Access-Control-Max-Age", "600"),
        ])  # fmt: skip

    # -- plain routes ------------------------------------------------------------------------------

    async def _openapi(self, request: Request) -> Response:
        allowed = self._allowed(request)
        views = [v for v in self.backends.models() if allowed is None or v.name in allowed]
        return Response.json(openapi_document(views))

    async def _healthz(self, request: Request) -> Response:
        return Response.json({"status": "ok"})

    async def _readyz(self, request: Request) -> Response:
        # Open to probes, so with keys on it says only whether the gateway is ready (the reason can
        # name namespaces, the count tells how many models there are; both go to the log instead).
        reason = self.backends.readiness()
        if reason is not None:  # e.g. the cluster's models not listed yet: routing now would 404 them
            if self.keys.enabled:
                logger.debug("not ready: %s", reason)
                reason = "The gateway is not ready yet."
            raise Unavailable(reason, code="not_ready", retry_after=5)
        if self.keys.enabled:
            return Response.json({"status": "ready"})
        return Response.json({"status": "ready", "models": len(self.backends.models())})

    async def _metrics(self, request: Request) -> Response:
        # The series are labelled with every model's name: with keys on, only a key for every model.
        if self._allowed(request) is not None:
            raise Forbidden("The metrics name every model; they need a key not limited to some models.",
                            code="model_not_allowed")  # fmt: skip
        return Response(generate_latest(self.metrics.registry), headers=[("Content-Type", CONTENT_TYPE_LATEST)])

    async def _list_models(self, request: Request) -> Response:
        allowed = self._allowed(request)
        cards = [v.card() for v in self.backends.models() if allowed is None or v.name in allowed]
        return Response.json({"object": "list", "data": cards})

    async def _get_model(self, request: Request) -> Response:
        name = request.path.split("/models/", 1)[1]
        self.keys.authorize(request.headers.get("authorization"), name)
        view = self.backends.find(name)
        if view is None:
            raise self._unknown(name)
        return Response.json(view.card())

    # -- proxying ----------------------------------------------------------------------------------

    def _unknown(self, name: str) -> APIError:
        error = ModelNotFound(name, "")
        available = ", ".join(sorted(v.name for v in self.backends.models())) or "none"
        error.message = f"The model {name!r} does not exist; available models: {available}."
        return error

    def _proxy_route(self, upstream_path: str, tasks: frozenset[Task]) -> _Handler:
        async def handler(request: Request) -> Response | StreamedResponse:
            name = self._model_name(request)
            return await self._forward(request, name, upstream_path, tasks, request.body)

        return handler

    async def _anomaly_passthrough(self, request: Request) -> Response | StreamedResponse:
        name = request.query.get("model")
        if name is None:
            anomaly = [v.name for v in self.backends.models() if v.task is Task.ANOMALY]
            if len(anomaly) != 1:
                raise InvalidRequest(
                    f"name the anomaly model with ?model=NAME (anomaly models: {', '.join(anomaly) or 'none'})",
                    param="model",
                )
            name = anomaly[0]
        path = request.raw_path  # as the client encoded it: the detector name stays one segment
        for prefix in PREFIXES:
            if path.startswith(prefix + "/anomaly/"):
                path = "/v1" + path[len(prefix) :]
        return await self._forward(request, name, path, frozenset({Task.ANOMALY}), b"")

    def _model_name(self, request: Request) -> str:
        body = request.body
        if request.content_type.startswith("multipart/"):
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

    def _route(self, name: str) -> _ModelRoute:
        route = self._routes.get(name)
        if route is None:
            route = self._routes[name] = _ModelRoute(name, self.metrics, self.limits)
        return route

    async def _forward(
        self, request: Request, name: str, path: str, tasks: frozenset[Task], body: bytes
    ) -> Response | StreamedResponse:
        if self.keys.enabled:
            self.keys.authorize(request.headers.get("authorization"), name)
        view = self.backends.find(name)
        if view is None:
            raise self._unknown(name)
        if view.task not in tasks:
            wanted = " or ".join(sorted(t.value for t in tasks))
            raise InvalidRequest(
                f"The model {name!r} does {view.task.value}; {request.path} needs a {wanted} model.", param="model"
            )
        started = time.monotonic()
        route = self._route(name)
        status = 500
        route.in_flight.inc()
        try:
            async with route.gate:
                woke = view.state is not ModelState.READY
                async with self.backends.lease(name) as upstream:
                    if woke:
                        self.metrics.cold_starts.labels(name).inc()
                        self.metrics.wake.labels(name).observe(time.monotonic() - started)
                    response = await self._relay(request, view, route, upstream, path, body, started)
                    status = response.status
                    return response
        except APIError as error:
            status = error.status_code
            raise
        except ConnectionResetError:
            status = CLIENT_CLOSED  # the client left before its answer was complete
            raise
        finally:
            route.in_flight.dec()
            route.count(status)
            route.latency.observe(time.monotonic() - started)

    async def _relay(
        self,
        request: Request,
        view: ModelView,
        route: _ModelRoute,
        base: str,
        path: str,
        body: bytes,
        started: float,
    ) -> Response | StreamedResponse:
        name = view.name
        # A Knative model scaling from zero answers only once loaded: wait as long as its startupTimeout.
        read_timeout = max(self.limits.read_timeout, self.backends.upstream_timeout(name) or 0)
        origin = self._upstreams.origin(base)
        head = origin.head(request, path, len(body), self._token_header)
        attempt = 0
        while True:
            try:
                upstream = await self._upstreams.acquire(origin, self.limits.connect_timeout)
                break
            except _Unreachable as exc:
                # Nothing was sent yet: one retry is safe (the process may have just restarted).
                attempt += 1
                if attempt > 1:
                    raise APIError(
                        f"The model {name!r} is unreachable: {exc}", status_code=502, code="upstream_unreachable"
                    ) from None
                await asyncio.sleep(0.2)
        # Any way out but a whole answer (an error, the client leaving) closes the connection, which
        # tells the predictor to stop; only a connection whose answer was read to the end is reused.
        whole = False
        try:
            upstream.send(head, body, request)
            try:
                await upstream.headers_received(read_timeout)
            except (TimeoutError, _UpstreamError) as exc:
                raise APIError(
                    f"The model {name!r} did not answer: {type(exc).__name__}", status_code=502, code="upstream_error"
                ) from None
            passed = [(k, v) for k, v in upstream.headers if k.lower() not in _DROPPED_RESPONSE_HEADERS]
            if not upstream.content_type.startswith("text/event-stream"):
                try:
                    payload = await upstream.read_all(read_timeout)
                except (TimeoutError, _UpstreamError):
                    raise APIError(
                        f"The model {name!r} failed while answering.", status_code=502, code="upstream_error"
                    ) from None
                whole = True
                route.ttfb.observe(time.monotonic() - started)
                return Response(payload, status=upstream.status, headers=passed)
            response = await request.stream(upstream.status, passed)
            first = True
            try:
                while chunk := await upstream.read_some(read_timeout):
                    if first:
                        route.ttfb.observe(time.monotonic() - started)
                        first = False
                    await response.write(chunk)  # waits for the client: backpressure
                whole = True
            except (TimeoutError, _UpstreamError):
                error = APIError(f"The model {name!r} failed mid-stream.", status_code=502, code="upstream_error")
                await response.write(b"data: " + orjson.dumps(error.body()) + b"\n\n")
            await response.end()
            return response
        finally:
            self._upstreams.release(upstream, whole)


_BOUNDARY = re.compile(r'boundary=(?:"([^"]+)"|([^;\s]+))', re.IGNORECASE)
_FIELD_NAME = re.compile(rb';\s*name="([^"]*)"|;\s*name=([^;\s]+)', re.IGNORECASE)


def multipart_model(content_type: str, body: bytes) -> str:
    """The ``model`` field of a multipart/form-data body, found without copying the other parts (an
    uploaded image or PDF is megabytes; the predictor parses the whole form anyway)."""

    def unparsable(why: str) -> InvalidRequest:
        return InvalidRequest(f"The multipart body cannot be parsed: {why}.", code="invalid_body")

    found = _BOUNDARY.search(content_type)
    if found is None:
        raise unparsable("its Content-Type names no boundary")
    delimiter = b"--" + (found.group(1) or found.group(2)).encode("latin-1")
    position = body.find(delimiter)
    if position < 0:
        raise unparsable("the boundary named in Content-Type never occurs")
    while True:
        start = position + len(delimiter)
        if body.startswith(b"--", start):
            break  # the closing delimiter
        end = body.find(b"\r\n" + delimiter, start)
        if end < 0:
            raise unparsable("a part is not closed by the boundary")
        head_end = body.find(b"\r\n\r\n", start, end + 2)
        if head_end < 0:
            raise unparsable("a part has no header block")
        for line in body[start:head_end].split(b"\r\n"):
            key, _, value = line.partition(b":")
            if key.strip().lower() == b"content-disposition" and b"filename" not in value.lower():
                name = _FIELD_NAME.search(value)
                if name is not None and (name.group(1) or name.group(2)) == b"model":
                    try:
                        model = body[head_end + 4 : end].decode()
                    except UnicodeDecodeError:
                        raise unparsable("the 'model' field is not UTF-8") from None
                    if not model:
                        break
                    return model
        position = end + 2
    raise InvalidRequest("model: the multipart form needs a 'model' field", param="model")


# -- the upstream client ---------------------------------------------------------------------------
# A small HTTP/1.1 client on asyncio's transports and llhttp (httptools): per proxied request it costs
# a fraction of aiohttp.ClientSession's CPU, and on a machine the gateway shares with its predictors
# that CPU is taken from inference. One request at a time per connection; no pipelining.

#: Unrelayed upstream body beyond which the upstream socket stops being read (backpressure).
_HIGH_WATER = 256 * 1024
#: Idle connections close after this, before a uvicorn predictor's 5 s keep-alive can close one under
#: a request being sent (a POST cannot be retried once sent).
_KEEPALIVE_S = 4.0


class _UpstreamError(Exception):
    """The upstream connection broke, or what came back was not HTTP."""


class _ClientGone(ConnectionResetError):
    """The client the answer was for went away."""


class _Unreachable(_UpstreamError):
    """No connection could be made: nothing was sent."""


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Origin:
    """One upstream base URL, parsed once: where to connect and what the request line carries."""

    __slots__ = ("host", "host_header", "key", "port", "prefix", "ssl")

    def __init__(self, base: str) -> None:
        url = URL(base)
        if url.scheme not in ("http", "https") or not url.raw_host or url.port is None:
            raise APIError(f"The upstream address {base!r} is not an http(s) URL.", status_code=502,
                           code="upstream_unreachable")  # fmt: skip
        self.key = base
        self.host = url.raw_host
        self.port = url.port
        self.ssl = url.scheme == "https"
        self.host_header = url.host_port_subcomponent or self.host
        self.prefix = url.raw_path.rstrip("/")

    def head(self, request: Request, path: str, length: int, extra: bytes = b"") -> bytes:
        """The request line and headers: the caller's (as sent), less hop-by-hop and the gateway's own,
        plus ``extra`` (complete header lines)."""
        query = request.query_string
        parts = [f"{request.method} {self.prefix}{path}{'?' + query if query else ''} HTTP/1.1\r\n"
                 f"Host: {self.host_header}\r\n".encode("latin-1")]  # fmt: skip
        for key, value in request.raw_headers:
            if key.lower() not in _DROPPED_HEADER_BYTES:
                parts += (key, b": ", value, b"\r\n")
        if length or request.method == "POST":
            parts.append(b"Content-Length: %d\r\n" % length)
        parts.append(extra)
        parts.append(b"\r\n")
        return b"".join(parts)


class _Upstream(asyncio.Protocol):
    """One HTTP/1.1 connection to an upstream, carrying one request at a time."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.closed = False
        self.idle_since = 0.0
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._begin()

    def _begin(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.content_type = ""
        self.reusable = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._headers_done = False
        self._complete = False
        self._until_close = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- the caller's side

    def send(self, head: bytes, body: bytes, client: Request) -> None:
        assert self._transport is not None
        self._begin()
        if not self.open:  # connection_lost has come and gone: nothing would ever wake the reader
            self._error = _UpstreamError("the upstream closed the connection")
            return
        client.on_gone = self._client_left
        if body:
            self._transport.writelines((head, body))  # no copy of a large body into one buffer
        else:
            self._transport.write(head)

    def _client_left(self) -> None:
        """The client went away: the caller's next wait raises, and it closes this connection, which
        tells the predictor to stop (a model may be silent for minutes before its first token)."""
        if self._error is None:
            self._error = _ClientGone("the client went away")
        self._wake()

    # ``idle_s`` bounds each silence, not the whole answer (a stream may last hours): not asyncio.timeout.

    async def headers_received(self, idle_s: float) -> None:
        while not self._headers_done:
            if self._error is not None:
                raise self._error
            await self._wait(idle_s)

    async def read_some(self, idle_s: float) -> bytes:
        """Body bytes as they arrive; b"" once the answer is complete."""
        while True:
            if self._chunks:
                chunks, self._chunks, self._buffered = self._chunks, [], 0
                if self._paused and self._transport is not None:
                    self._paused = False
                    self._transport.resume_reading()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait(idle_s)

    async def read_all(self, idle_s: float) -> bytes:
        parts = []
        while chunk := await self.read_some(idle_s):
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def open(self) -> bool:
        return not self.closed and self._transport is not None and not self._transport.is_closing()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    async def _wait(self, idle_s: float) -> None:
        """Until the parser has more for the caller; TimeoutError after ``idle_s`` of silence."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(idle_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is one without subclassing asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._error = self._error or _UpstreamError(f"invalid HTTP from the upstream: {exc}")
            self.close()
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._headers_done and self._until_close and not self._complete and self._error is None:
            self._complete = True  # a body without a length ends with the connection
        elif not self._complete and self._error is None:
            self._error = _UpstreamError(str(exc) if exc else "the upstream closed the connection")
        self._wake()

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        delimited = False
        for key, value in self.headers:
            lowered = key.lower()
            if lowered == "content-type":
                self.content_type = value
            elif lowered in ("content-length", "transfer-encoding"):
                delimited = True
        self._until_close = not delimited
        if self.status >= 200:  # an interim 1xx answer is followed by the real one
            self._headers_done = True
            self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status < 200:
            self.headers, self.content_type = [], ""
            return
        self._complete = True
        self.reusable = self._parser.should_keep_alive()
        self._wake()


class _UpstreamPool:
    """Keep-alive connections per upstream base URL; no overall cap (the per-model gates bound them)."""

    def __init__(self) -> None:
        self._origins: dict[str, _Origin] = {}
        self._idle: dict[str, list[_Upstream]] = {}

    def origin(self, base: str) -> _Origin:
        origin = self._origins.get(base)
        if origin is None:
            if len(self._origins) > 1024:  # addresses change (restarts, rescheduling): stay bounded
                self._origins.clear()
                self.close()
            origin = self._origins[base] = _Origin(base)
        return origin

    async def acquire(self, origin: _Origin, connect_timeout: float) -> _Upstream:
        idle = self._idle.get(origin.key)
        if idle:
            now = time.monotonic()
            while idle:
                upstream = idle.pop()
                if upstream.open and now - upstream.idle_since < _KEEPALIVE_S:
                    return upstream
                upstream.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, upstream = await loop.create_connection(
                    lambda: _Upstream(origin.key),
                    origin.host,
                    origin.port,
                    ssl=True if origin.ssl else None,
                    server_hostname=origin.host if origin.ssl else None,
                )
        except TimeoutError:
            raise _Unreachable(f"no connection within {connect_timeout:g} s") from None
        except OSError as exc:
            raise _Unreachable(str(exc)) from None
        return upstream

    def release(self, upstream: _Upstream, whole: bool) -> None:
        if whole and upstream.reusable and upstream.open:
            upstream.idle_since = time.monotonic()
            self._idle.setdefault(upstream.key, []).append(upstream)
        else:
            upstream.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for upstream in idle:
                upstream.close()
        self._idle.clear()


def pretty_models(models: list[dict[str, Any]]) -> str:
    return json.dumps(models, indent=2)
