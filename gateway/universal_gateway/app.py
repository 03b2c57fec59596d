"""The OpenAI-compatible front door: routes each request to its model's predictor by the model it names.

``/v1/*`` and ``/openai/v1/*`` are the same routes, the task routes taken from the catalog
(:mod:`universal_predictors.catalog`; :mod:`.routing` matches paths and finds the model). Streams pass
through chunk by chunk (a slow client slows the upstream read: backpressure), and a client that goes
away closes the upstream request so the predictor stops generating. Errors are OpenAI-shaped.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from universal_gateway import tracing
from universal_gateway.audit import AuditLog
from universal_gateway.auth import ApiKeys, Forbidden, Key, allowed_models, may_use
from universal_gateway.backends import Backends, ModelState, ModelView
from universal_gateway.limits import GatewayLimits as GatewayLimits
from universal_gateway.limits import ModelGate, WakeWaits
from universal_gateway.metrics import CLIENT_CLOSED, GatewayMetrics, ModelSeries
from universal_gateway.openapi import openapi_document
from universal_gateway.quotas import MemoryCounters, Quotas, RateLimited, Ticket
from universal_gateway.responses_store import (
    FinalResponse,
    ResponseStore,
    StoredResponse,
    conversation,
    input_items,
    owner_of,
)
from universal_gateway.routing import PREFIXES, Params, Router, TaskRoute, body_model, query_model, task_routes
from universal_gateway.server import Headers, HttpServer, Request, Response, StreamedResponse
from universal_gateway.upstream import DROPPED_RESPONSE_HEADERS, Unreachable, UpstreamError, UpstreamPool
from universal_gateway.usage import Ledger, StreamTap, Usage, UsageLedger, UsageMetrics, unary_usage, usage_report
from universal_operator.spec import ADAPTER_SEPARATOR
from universal_predictors.catalog import CATALOG, Catalog
from universal_predictors.config import (
    AUDIO_SECONDS_HEADER,
    IMAGES_HEADER,
    RESPONSES_STORED_HEADER,
    UPSTREAM_TOKEN_HEADER,
    USAGE_COMMENTS_HEADER,
)
from universal_predictors.errors import (
    APIError,
    InvalidRequest,
    ModelNotFound,
    RequestTooLarge,
    Unavailable,
    anthropic_error_body,
)

logger = logging.getLogger(__name__)

_Handler = Callable[[Request, Params], Awaitable["Response | StreamedResponse"]]


class Gateway:
    """The routes and the request path, served by :class:`HttpServer`."""

    def __init__(
        self,
        backends: Backends,
        *,
        keys: ApiKeys | None = None,
        limits: GatewayLimits | None = None,
        cors_origins: list[str] | None = None,
        catalog: Catalog = CATALOG,
        responses: ResponseStore | None = None,
        quotas: Quotas | None = None,
        ledger: UsageLedger | None = None,
        audit: AuditLog | None = None,
        metering: bool = True,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.backends = backends
        #: Where /v1/responses records live (None: nothing is stored, previous_response_id is refused).
        self.responses = responses
        self.keys = keys or ApiKeys()
        self.limits = limits or GatewayLimits()
        self.wake_waits = WakeWaits()
        self.cors_origins = cors_origins or []
        self.catalog = catalog
        self.metrics = metrics or GatewayMetrics()
        self.keys.on_reload_error = self.metrics.keys_reload_errors.inc
        self.metrics.key_secrets_invalid.set_function(lambda: self.keys.invalid_secrets)
        #: Per-key limits, where their counts live (this process unless given Redis-kept ones).
        self.quotas = quotas or Quotas(self.keys)
        #: Usage per key, model and hour.
        self.ledger: UsageLedger = ledger or Ledger(UsageMetrics(self.metrics.registry))
        if self.ledger.metrics is None:
            self.ledger.metrics = UsageMetrics(self.metrics.registry)
        self.audit = audit
        #: Whether answers are read for their usage (the ledger, token limits, fair shares); off only to measure
        #: what that costs (bench/gateway.py).
        self.metering = metering
        self._keys_watch: asyncio.Task[None] | None = None
        self._accounting: set[asyncio.Task[None]] = set()  # the requests' accounting, after their answers
        #: With the limits' counters and the ledger in this process, accounting never waits: the requests' records
        #: queue here for one task (:meth:`_settle`) rather than each starting a task of its own.
        self._settling: collections.deque[tuple[Any, ...]] | None = None
        if isinstance(self.quotas.counters, MemoryCounters) and isinstance(self.ledger, Ledger):
            self._settling = collections.deque()
        self._settler: asyncio.Task[None] | None = None
        self._settled: asyncio.Future[None] | None = None  # what it waits on, when it waits
        backends.wake_steps.observe = lambda model, step, s: self.metrics.wake_steps.labels(model, step).observe(s)
        backends.wake_steps.woke = lambda model: self.metrics.wakes.labels(model).inc()
        self._models: dict[str, tuple[ModelGate, ModelSeries]] = {}
        self._upstreams = UpstreamPool()
        token = backends.upstream_token
        self._token_header = f"{UPSTREAM_TOKEN_HEADER}: {token}\r\n".encode("latin-1") if token else b""
        # Every upstream request asks for usage comments in event streams (streaming.usage_comment).
        if metering:
            self._token_header += f"{USAGE_COMMENTS_HEADER}: 1\r\n".encode()
        self._server: HttpServer | None = None
        self._router: Router[_Handler] = Router()
        for path, task_route in task_routes(catalog):
            handler = tracing.traced(self._task_handler(task_route), task_route.route.operation, task_route.task)
            self._router.add(path, task_route.route.method, handler)
        for prefix in PREFIXES:
            self._router.add(f"{prefix}/models", "GET", self._list_models)
            self._router.add(f"{prefix}/models/{{name:path}}", "GET", self._get_model)
            self._router.add(f"{prefix}/responses/{{response_id}}", "GET", self._get_response)
            self._router.add(f"{prefix}/responses/{{response_id}}", "DELETE", self._delete_response)
            self._router.add(f"{prefix}/responses/{{response_id}}/input_items", "GET", self._response_input_items)
            self._router.add(f"{prefix}/usage", "GET", self._usage)
        #: Answered without an API key (probes): they name no model.
        self._open_paths = frozenset({"/healthz", "/readyz"})
        #: The Messages API's paths: errors in Anthropic's shape, and the key also taken as ``x-api-key``.
        self._anthropic_paths = frozenset(p for p, t in task_routes(catalog) if t.route.errors == "anthropic")
        self._router.add("/openapi.json", "GET", self._openapi)
        self._router.add("/healthz", "GET", self._healthz)
        self._router.add("/readyz", "GET", self._readyz)
        self._router.add("/metrics", "GET", self._metrics)

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
            authorize=self.authorize_head,
            max_connections=self.limits.max_connections,
            max_buffered_bytes=self.limits.max_buffered_bytes,
        )
        await server.start(host, port)
        self._server = server
        self._keys_watch = asyncio.create_task(self._watch_keys())
        return server

    async def _watch_keys(self) -> None:
        """Re-read a changed keys file (a mounted Secret is rewritten in place) every ``KEYS_REREAD_S``."""
        while True:
            await asyncio.sleep(KEYS_REREAD_S)
            self.keys.refresh()

    async def close(self) -> None:
        """Stop listening, let requests in flight finish, then stop the backends (and every predictor)."""
        if self._keys_watch is not None:
            await _stop(self._keys_watch)
        if self._server is not None:
            await self._server.close()
        await self.backends.close()
        if self._accounting:
            await asyncio.wait(set(self._accounting))
        if self._settler is not None:
            await _stop(self._settler)
        while self._settling:  # what the settling task had not reached
            await self._account(*self._settling.popleft())
        await self.ledger.close()
        await self.quotas.close()
        if self.audit is not None:
            self.audit.close()
        self._upstreams.close()
        if self.responses is not None:
            await self.responses.close()

    @contextlib.asynccontextmanager
    async def serving(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
        """Serve for the block; its base URL (``http://host:port``)."""
        server = await self.start(host, port)
        try:
            yield f"http://{host}:{server.port}"
        finally:
            await self.close()

    def authorize_head(self, request: Request) -> APIError | None:
        """Asked on each request's head, before its body is read. Probes and CORS preflights pass without
        a key (a browser sends none with a preflight), so they may not bring a body: it would be read and
        held on nobody's authority (413 instead, the body never read). With keys on, any other request
        without a valid key is refused (the model-specific check, 403, comes once the body names the model)."""
        if request.path in self._open_paths or request.method == "OPTIONS":
            return _unexpected_body(request)
        if not self.keys.enabled:
            return None
        try:
            request.caller = self.keys.authenticate(self._credentials(request))
        except APIError as error:
            return self._shaped(request, error)
        return None

    def _key(self, request: Request, model: str, base: str | None) -> Key | None:
        """The caller's key, found on the request's head (:meth:`authorize_head`) or now; 403 for a model it may not
        use (None: the gateway is open)."""
        if not self.keys.enabled:
            return None
        key = request.caller if isinstance(request.caller, Key) else self.keys.authenticate(self._credentials(request))
        return may_use(key, model, base)

    def _credentials(self, request: Request) -> str | None:
        """The Authorization header, or on the Messages API's routes an ``x-api-key`` (Anthropic's key header)."""
        header = request.headers.get("authorization")
        if header is None and request.path in self._anthropic_paths:
            key = request.headers.get("x-api-key")
            return f"Bearer {key}" if key else None
        return header

    def _shaped(self, request: Request, error: APIError) -> APIError:
        """``error`` in the shape the route's clients read: Anthropic's on the Messages API's routes."""
        if isinstance(error, _Relayed | AnthropicShaped) or request.path not in self._anthropic_paths:
            return error
        return AnthropicShaped(error)

    def _allowed(self, request: Request) -> frozenset[str] | None:
        """The models this caller may see (None: all); raises 401 without a valid key when keys are on."""
        return allowed_models(self.keys.authenticate(request.headers.get("authorization")))

    async def handle(self, request: Request) -> Response | StreamedResponse:
        try:
            matched = self._router.match(request.path)
            if matched is None:
                raise APIError(f"Nothing is served at {request.path}; the API is under /v1 (see /openapi.json).",
                               status_code=404, code="not_found")  # fmt: skip
            methods, params = matched
            handler = methods.get(request.method)
            if handler is None and request.method == "HEAD":
                handler = methods.get("GET")  # the server sends the head of the GET answer only
            if handler is None:
                if request.method == "OPTIONS" and self._cors(request):
                    return self._preflight(request, methods)
                error = APIError(f"{request.path} does not take {request.method}; it takes {', '.join(methods)}.",
                                 status_code=405, code="method_not_allowed")  # fmt: skip
                return Response.error(error, headers=[("Allow", ", ".join(methods))])
            return await handler(request, params)
        except APIError as error:
            return Response.error(self._shaped(request, error))

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

    async def _openapi(self, request: Request, params: Params) -> Response:
        allowed = self._allowed(request)
        views = [v for v in self.backends.models() if allowed is None or v.name in allowed]
        return Response.json(openapi_document(views, self.catalog, stored_responses=self.responses is not None))

    async def _healthz(self, request: Request, params: Params) -> Response:
        return Response.json({"status": "ok"})

    async def _readyz(self, request: Request, params: Params) -> Response:
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

    async def _metrics(self, request: Request, params: Params) -> Response:
        # The series are labelled with every model's name: with keys on, only a key for every model.
        if self._allowed(request) is not None:
            raise Forbidden("The metrics name every model; they need a key not limited to some models.",
                            code="model_not_allowed")  # fmt: skip
        return Response(generate_latest(self.metrics.registry), headers=[("Content-Type", CONTENT_TYPE_LATEST)])

    async def _list_models(self, request: Request, params: Params) -> Response:
        allowed = self._allowed(request)
        cards: list[dict[str, Any]] = []
        for view in self.backends.models():
            if allowed is None or view.name in allowed:
                cards.append(self._card(view))
            cards += [c for c in view.adapter_cards() if allowed is None or view.name in allowed or c["id"] in allowed]
        return Response.json({"object": "list", "data": cards})

    def _adapter_base(self, name: str) -> str | None:
        """The model ``name`` is a LoRA adapter of (``base:adapter``, or an adapter's bare name, vLLM's
        spelling, when exactly one model lists it and no model is called that), else None."""
        if self.backends.find(name) is not None:
            return None
        base, sep, adapter = name.rpartition(ADAPTER_SEPARATOR)
        if sep:
            view = self.backends.find(base)
            return base if view is not None and adapter in view.adapters else None
        owners = [v.name for v in self.backends.models() if name in v.adapters]
        return owners[0] if len(owners) == 1 else None

    def _card(self, view: ModelView) -> dict[str, Any]:
        """The model's card, with the requests held for its wake right now."""
        return {**view.card(), "held": self.wake_waits.held.get(view.name, 0)}

    async def _get_model(self, request: Request, params: Params) -> Response:
        name = params["name"]
        base = self._adapter_base(name)
        self.keys.authorize(request.headers.get("authorization"), name, base)
        view = self.backends.find(base or name)
        if view is None:
            raise self._unknown(name)
        if base is not None:
            adapter = name.rpartition(ADAPTER_SEPARATOR)[2]
            return Response.json(
                next(c for c in view.adapter_cards() if c["id"] == f"{base}{ADAPTER_SEPARATOR}{adapter}")
            )
        return Response.json(self._card(view))

    async def _usage(self, request: Request, params: Params) -> Response:
        """``GET /v1/usage?from=&to=&key=&format=json|csv``: the ledger's hours. ``from``/``to``: RFC 3339 times or
        epoch seconds (default: the last 24 hours); an admin key reads any key's (``key``) or all, another key its
        own only; an open gateway (no keys) answers everyone."""
        key = self.keys.authenticate(self._credentials(request))
        query = request.query if request.query_string else {}
        now = time.time()
        start = _instant(query.get("from"), "from", now - 24 * 3600)
        end = _instant(query.get("to"), "to", now + 1)
        asked = query.get("key") or None
        if key is not None and not key.admin:
            if asked is not None and asked != key.id:
                raise Forbidden("Only an admin key reads another key's usage; leave out ?key= for this key's own.",
                                param="key", code="admin_key_required")  # fmt: skip
            asked = key.id
        form = query.get("format") or ("csv" if "text/csv" in (request.headers.get("accept") or "") else "json")
        if form not in ("json", "csv"):
            raise InvalidRequest(f"format: give json or csv, not {form!r}", param="format")
        rows = await self.ledger.rows(int(start) // 3600 * 3600, int(end), asked)
        body, content_type = usage_report(rows, form == "csv")
        return Response(body, headers=[("Content-Type", content_type)])

    # -- proxying ----------------------------------------------------------------------------------

    def _unknown(self, name: str) -> APIError:
        error = ModelNotFound(name, "")
        views = self.backends.models()
        base, sep, _ = name.rpartition(ADAPTER_SEPARATOR)
        parent = self.backends.find(base) if sep else None
        if parent is not None:  # a model's adapter it does not list: name the ones it has
            listed = ", ".join(f"{parent.name}{ADAPTER_SEPARATOR}{a}" for a in parent.adapters) or "none"
            error.message = f"The model {parent.name!r} has no adapter {name!r}; its adapters: {listed}."
            return error
        available = ", ".join(sorted(v.name for v in views)) or "none"
        error.message = f"The model {name!r} does not exist; available models: {available}."
        return error

    # -- stored responses (responses_store) ----------------------------------------------------------------------

    def _owner(self, request: Request) -> str:
        """Whose records a request may read: its key's (401 without a valid one when keys are on)."""
        credentials = self._credentials(request)
        if self.keys.enabled:
            self.keys.authorize(credentials, None)
        return owner_of(credentials if self.keys.enabled else None)

    async def _record(self, request: Request, params: Params) -> tuple[ResponseStore, str, StoredResponse]:
        owner = self._owner(request)
        response_id = params["response_id"]
        record = await self.responses.get(owner, response_id) if self.responses is not None else None
        if self.responses is None or record is None:
            why = "" if self.responses is not None else " (this gateway keeps no responses: --responses-store off)"
            raise APIError(f"No response with id {response_id!r} found{why}.", status_code=404,
                           param="response_id", code="response_not_found")  # fmt: skip
        return self.responses, owner, record

    async def _get_response(self, request: Request, params: Params) -> Response:
        _, _, record = await self._record(request, params)
        return Response.json(record.response)

    async def _delete_response(self, request: Request, params: Params) -> Response:
        store, owner, record = await self._record(request, params)
        await store.delete(owner, record.id)
        return Response.json({"id": record.id, "object": "response", "deleted": True})

    async def _response_input_items(self, request: Request, params: Params) -> Response:
        """OpenAI's list of a response's input items: ``order`` (``desc``, the default, or ``asc``), ``limit``
        (1-100, default 20), ``after`` (an item id)."""
        _, _, record = await self._record(request, params)
        query = dict(urllib.parse.parse_qsl(request.query_string))
        order = query.get("order", "desc")
        limit = query.get("limit", "20")
        if order not in ("asc", "desc"):
            raise InvalidRequest("order: give asc or desc", param="order")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise InvalidRequest("limit: give an integer from 1 to 100", param="limit")
        items = record.input_items if order == "asc" else list(reversed(record.input_items))
        after = query.get("after")
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise InvalidRequest(f"after: no input item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[: int(limit)]
        return Response.json({
            "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page),
        })  # fmt: skip

    async def _post_response(
        self, request: Request, name: str, task: str, upstream: str
    ) -> Response | StreamedResponse:
        """``POST /v1/responses`` with the store: ``previous_response_id`` expanded into the conversation, and the
        answer recorded (before its last byte reaches the client, so that the next turn can name it at once)."""
        store = self.responses
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            body = None
        if store is None or not isinstance(body, dict):  # stateless: the predictor answers (and refuses) as it is
            return await self._forward(request, name, task, upstream, request.body)
        if self.keys.enabled:
            self.keys.authorize(self._credentials(request), name)
        owner = self._owner(request)
        previous = body.get("previous_response_id")
        items = input_items(body.get("input"))
        if previous is not None:
            if not isinstance(previous, str):
                raise InvalidRequest("previous_response_id: give a response id", param="previous_response_id")
            history = await conversation(store, owner, previous)
            if isinstance(history, str):
                raise InvalidRequest(
                    f"previous_response_id: the response {history!r} was not found (never stored, expired, deleted, "
                    "or made with another API key); send the conversation as input items instead",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            body["input"] = history + items
        keep = body.get("store", True) is not False
        body["store"] = keep
        final = FinalResponse()
        recorded = False

        async def observe(data: bytes, unary: bool) -> None:
            nonlocal recorded
            if not keep or recorded:
                return
            final.unary(data) if unary else final.chunk(data)
            if final.response is None or not isinstance(final.response.get("id"), str):
                return
            recorded = True
            record = StoredResponse(final.response["id"], owner, time.time(), previous, items, final.response)
            try:
                await store.put(record)
            except Exception:  # the answer still goes out; retrieving it later will 404
                logger.exception("could not store the response %s (%s)", record.id, store.describe())

        marker = f"{RESPONSES_STORED_HEADER}: stored\r\n".encode()
        return await self._forward(request, name, task, upstream, orjson.dumps(body), extra_head=marker,
                                   observe=observe)  # fmt: skip

    def _task_handler(self, task_route: TaskRoute) -> _Handler:
        if task_route.route.method == "POST" and task_route.route.handler == "responses":
            upstream = task_route.route.upstream

            async def responses(request: Request, params: Params) -> Response | StreamedResponse:
                name = body_model(request, accepts_form=False)
                return await self._post_response(request, name, task_route.task, upstream)

            return responses
        if task_route.route.method == "POST":
            accepts_form = task_route.accepts_form
            upstream = task_route.route.upstream

            async def post(request: Request, params: Params) -> Response | StreamedResponse:
                name = body_model(request, accepts_form=accepts_form)
                return await self._forward(request, name, task_route.task, upstream, request.body)

            return post

        async def by_query(request: Request, params: Params) -> Response | StreamedResponse:
            served = [v.name for v in self.backends.models() if v.task == task_route.task]
            name = query_model(request, task_route.task, served)
            return await self._forward(request, name, task_route.task, task_route.upstream_path(params), b"")

        return by_query

    def _model(self, name: str) -> tuple[ModelGate, ModelSeries]:
        model = self._models.get(name)
        if model is None:
            gate = ModelGate(self.limits.max_concurrency_per_model, self.limits.max_queue_per_model)
            model = self._models[name] = (gate, ModelSeries(name, self.metrics))
        return model

    async def _forward(
        self,
        request: Request,
        name: str,
        task: str,
        path: str,
        body: bytes,
        *,
        extra_head: bytes = b"",
        observe: Observer | None = None,
    ) -> Response | StreamedResponse:
        base = self._adapter_base(name)
        with tracing.auth():
            key = self._key(request, name, base)
        tracing.model(name, key.id if key is not None else None)
        view = self.backends.find(base or name)
        if view is None:
            raise self._unknown(name)
        # An adapter's request is its base model's: the same predictor (woken if idle), gate, idle timer, limits
        # and series; the body still names the adapter, which the predictor serves, and the ledger counts it.
        requested, name = name, view.name
        if view.task != task:
            raise InvalidRequest(
                f"The model {name!r} does {view.task.value}; {request.path} needs a {task} model.", param="model"
            )
        started = time.monotonic()
        meter = _Meter(key, await self.quotas.admit(key, name))
        gate, series = self._model(name)
        status = 500
        series.in_flight.inc()
        try:
            async with gate.slot(meter.key_id):
                held = view.state is not ModelState.READY
                waiter = asyncio.current_task()
                stream: StreamedResponse | None = None
                keepalive: asyncio.Task[None] | None = None
                if held:  # held for the wake, within the model's bound (429 beyond)
                    meter.woke_it = not self.wake_waits.held.get(name)  # the first held: its request woke it
                    self._hold(name, view)
                    if waiter is not None:  # a client that leaves while held stops waiting; the wake goes on
                        request.on_gone = _canceller(waiter)
                    if self.limits.wake_keepalive_s > 0 and _asks_to_stream(body):
                        stream = await request.stream(200, [*SSE_HEADERS, *meter.headers])
                        keepalive = asyncio.create_task(self._keep_alive(stream, name, self.limits.wake_keepalive_s))

                async def answered() -> None:
                    """The upstream's head came: the wake is over for this request. Until then it is held, also
                    after the lease: a Knative model at zero is leased at once and its activator holds the request
                    until a pod of the revision can take it (knative-v1.16.0 pkg/activator/net/throttler.go,
                    Throttler.Try), so the bound and the keep-alive comments last until the head."""
                    nonlocal held, keepalive
                    if keepalive is not None:
                        await _stop(keepalive)
                        keepalive = None
                    if held:
                        request.on_gone = None
                        held, waited = False, time.monotonic() - started
                        tracing.held(name, waited)
                        meter.wake_s = waited
                        self._unhold(name)
                        self.wake_waits.woke(name, waited)
                        series.woke(waited)

                try:
                    replayed = False
                    while True:
                        async with self.backends.lease(name) as upstream:
                            meter.sent = time.monotonic()
                            try:
                                response = await self._relay(
                                    request, view, series, upstream, path, body, started, stream, answered=answered,
                                    extra_head=extra_head, observe=observe, meter=meter,
                                )  # fmt: skip
                                break
                            except _Unanswered as unanswered:
                                if replayed:
                                    raise
                                lost = unanswered
                        # Its process is gone (killed as the request came, or before it): sent once more, to the
                        # process the next lease starts. Not where the process failed of itself (the request may
                        # have been what failed it): that one is the caller's 502.
                        if not await self.backends.exited(name, upstream, killed=not lost.unsent):
                            raise lost
                        replayed = True
                        logger.info("%s: %s %s replayed: %s", name, request.method, request.path, lost.message)
                except APIError as error:
                    if stream is None:
                        raise
                    # The head went out while the model woke: the failure ends the stream as an error event.
                    if keepalive is not None:
                        await _stop(keepalive)
                    status = error.status_code
                    await stream.write(_error_frame(self._shaped(request, error)))
                    await stream.end()
                    return stream
                except asyncio.CancelledError:
                    if not (held and request.gone and waiter is not None):
                        raise
                    waiter.uncancel()  # our own cancel, for a client that left: not the server's shutdown
                    raise ConnectionResetError("the client left while the model woke") from None
                finally:
                    if keepalive is not None:
                        await _stop(keepalive)
                    if held:  # the wake failed, or the client left while held
                        request.on_gone = None
                        tracing.held(name, time.monotonic() - started, woke=False)
                        self._unhold(name)
                status = response.status
                return response
        except APIError as error:
            status = error.status_code
            raise
        except ConnectionResetError:
            status = CLIENT_CLOSED  # the client left before its answer was complete
            raise
        finally:
            series.in_flight.dec()
            series.count(status)
            ended = time.monotonic()
            series.latency.observe(ended - started)
            # After the answer, not before it: a unary answer is returned from here and written after; accounting
            # (the limits' and the ledger's writes, in Redis a round trip or two) must not delay it.
            settling = self._settling
            if settling is not None:
                settling.append((request, meter, requested, status, started, ended, body, gate))
                wake = self._settled
                if wake is not None and not wake.done():
                    wake.set_result(None)
                elif self._settler is None:
                    self._settler = asyncio.create_task(self._settle(), context=contextvars.Context())
            else:
                accounting = asyncio.create_task(
                    self._account(request, meter, requested, status, started, ended, body, gate)
                )
                self._accounting.add(accounting)
                accounting.add_done_callback(self._accounting.discard)

    async def _settle(self) -> None:
        """The requests' accounting, in the order they ended, while the gateway serves: with every store in this
        process each ``_account`` runs through without waiting, so the records queued in one turn of the loop are
        settled together in the next, after their answers were written (one task for all of them: a task each cost
        more than the accounting itself)."""
        settling = self._settling
        assert settling is not None
        loop = asyncio.get_running_loop()
        while True:
            while settling:
                try:
                    await self._account(*settling.popleft())
                except Exception:  # a failing audit log loses a line, never the records after it
                    logger.exception("could not account for a request")
            self._settled = wake = loop.create_future()
            await wake
            # Woken by the first of the answers written in this turn of the loop: the others, ready beside it, go
            # first (a burst of answers is not held by the accounting of its first), and are then settled with it.
            await asyncio.sleep(0)

    async def _account(self, request: Request, meter: _Meter, model: str, status: int, started: float,
                       ended: float, body: bytes, gate: ModelGate) -> None:  # fmt: skip
        """After a proxied request: its tokens counted toward its key's share of the model, taken from its key's
        limits and written in the ledger, and its audit line."""
        usage = meter.usage
        usage.requests = 1
        usage.images = max(usage.images, meter.images)
        usage.audio_seconds = max(usage.audio_seconds, meter.audio_seconds)
        if meter.sent is not None:  # it reached the predictor: its seconds, and the wake it waited for
            # The wake counts once, for the request that caused it; the others held with it waited for it too.
            usage.predictor_seconds = ended - meter.sent + ((meter.wake_s or 0.0) if meter.woke_it else 0.0)
        gate.charge(meter.key_id, usage.input_tokens, usage.output_tokens)  # toward its key's fair share
        try:
            if meter.ticket is not None:
                await meter.ticket.finish(usage.input_tokens, usage.output_tokens)
            if self.metering:
                await self.ledger.record(meter.key_id, model, usage)
        except Exception:  # the answer is out: a failing ledger or counter store must not turn it into an error
            logger.exception("could not account for a request to %s (key %s)", model, meter.key_id)
        if self.audit is not None:
            self.audit.record({
                "key_id": meter.key_id, "owner": meter.key.owner if meter.key is not None else "", "model": model,
                "route": request.path, "status": status, "input_tokens": usage.input_tokens,
                "output_tokens": usage.output_tokens, "latency_s": round(ended - started, 4),
                "woke": meter.wake_s is not None, "wake_s": round(meter.wake_s or 0.0, 3), "stream": meter.streamed,
            }, body)  # fmt: skip

    async def _keep_alive(self, stream: StreamedResponse, name: str, every_s: float) -> None:
        """SSE comments (which clients ignore) on a held stream: one at once, then one every ``every_s``, each
        naming the wake's step when the backend knows it (``: waking model (downloading)``)."""
        with contextlib.suppress(ConnectionResetError):  # the client left: its request stops waiting too
            while True:
                view = self.backends.find(name)
                step = view.extra.get("step") if view is not None else None
                comment = f": waking model ({str(step).lower()})" if step else ": waking model"
                await stream.write(comment.encode() + b"\n\n")
                await asyncio.sleep(every_s)

    def _hold(self, name: str, view: ModelView) -> None:
        """Count a request held for ``name``'s wake: 429 beyond its ``scaling.maxHeldRequests`` (or ours)."""
        try:
            self.wake_waits.enter(name, view.extra.get("max_held_requests") or self.limits.max_held_per_model)
        except APIError:
            self.metrics.held_rejected.labels(name).inc()
            raise
        self.metrics.held.labels(name).inc()

    def _unhold(self, name: str) -> None:
        self.wake_waits.leave(name)
        self.metrics.held.labels(name).dec()

    async def _relay(
        self,
        request: Request,
        view: ModelView,
        series: ModelSeries,
        base: str,
        path: str,
        body: bytes,
        started: float,
        into: StreamedResponse | None = None,
        *,
        answered: Callable[[], Awaitable[None]] | None = None,
        extra_head: bytes = b"",
        observe: Observer | None = None,
        meter: _Meter | None = None,
    ) -> Response | StreamedResponse:
        """The upstream's answer, relayed; ``into``: a stream already started (a held streaming request), which an
        event stream continues and any other answer ends as an error event; ``answered``: called once the upstream's
        head came, before anything of it is relayed; ``extra_head``: header lines for the upstream; ``observe``: sees
        a 200's body before the client does (a unary body whole, an event stream chunk by chunk); ``meter``: the
        request's usage, read from the answer (an event stream's usage comments taken out, and the stream cut where
        its key has no output tokens left), and its rate-limit headers."""
        name = view.name
        # A Knative model scaling from zero answers only once loaded: wait as long as its startupTimeout.
        read_timeout = max(self.limits.read_timeout, self.backends.upstream_timeout(name) or 0)
        origin = self._upstreams.origin(base)
        trace = tracing.upstream(name, base, path)
        observe = trace.observing(observe)
        head = origin.head(request, path, len(body), self._token_header + extra_head + trace.head_lines, trace.replaced)
        attempt = 0
        while True:
            try:
                upstream = await self._upstreams.acquire(origin, self.limits.connect_timeout)
                break
            except Unreachable as exc:
                # Nothing was sent yet: one retry is safe (the process may have just restarted).
                attempt += 1
                if attempt > 1:
                    trace.end(0)
                    raise _Unanswered(f"The model {name!r} is unreachable: {exc}", "upstream_unreachable",
                                      unsent=True) from None  # fmt: skip
                await asyncio.sleep(0.2)
        # Any way out but a whole answer (an error, the client leaving) closes the connection, which
        # tells the predictor to stop; only a connection whose answer was read to the end is reused.
        whole = False
        try:
            upstream.send(head, body, request)
            try:
                await upstream.headers_received(read_timeout)
            except TimeoutError:
                raise APIError(
                    f"The model {name!r} did not answer: TimeoutError", status_code=502, code="upstream_error"
                ) from None
            except UpstreamError:  # the connection broke before a byte of the answer
                raise _Unanswered(f"The model {name!r} did not answer: UpstreamError", "upstream_error") from None
            if answered is not None:
                await answered()
            passed = [(k, v) for k, v in upstream.headers if k.lower() not in DROPPED_RESPONSE_HEADERS]
            if meter is not None:
                passed += meter.headers
                meter.images = next((int(v) for k, v in upstream.headers if k.lower() == _IMAGES and v.isdigit()), 0)
                meter.audio_seconds = next(
                    (int(v) for k, v in upstream.headers if k.lower() == _AUDIO_SECONDS and v.isdigit()), 0
                )
            head_only = request.method == "HEAD"  # the upstream's answer ended with its head
            event_stream = upstream.content_type.startswith("text/event-stream")
            if into is not None and not (event_stream and upstream.status == 200):
                try:
                    payload = await upstream.read_all(read_timeout)
                except (TimeoutError, UpstreamError):
                    payload = b""
                whole = True
                await into.write(_error_frame(self._shaped(request, _upstream_error(payload, upstream.status, name))))
                await into.end()
                return into
            if head_only or not event_stream:
                try:
                    payload = await upstream.read_all(read_timeout)
                except (TimeoutError, UpstreamError):
                    raise APIError(
                        f"The model {name!r} failed while answering.", status_code=502, code="upstream_error"
                    ) from None
                whole = True
                series.ttfb.observe(time.monotonic() - started)
                length = upstream.content_length if head_only else None
                if meter is not None and upstream.status == 200 and not head_only and self.metering:
                    meter.usage = unary_usage(payload)
                if observe is not None and upstream.status == 200 and not head_only:
                    await observe(payload, True)
                return Response(payload, status=upstream.status, headers=passed, length=length)
            response = into if into is not None else await request.stream(upstream.status, passed)
            tap = meter.tap() if meter is not None and upstream.status == 200 and self.metering else None
            first = True
            try:
                while chunk := await upstream.read_some(read_timeout):
                    if first:
                        series.ttfb.observe(time.monotonic() - started)
                        first = False
                    cut = False
                    if tap is not None:
                        chunk, cut = await tap.feed(chunk)
                    if chunk and observe is not None and upstream.status == 200:
                        await observe(chunk, False)
                    if chunk:
                        await response.write(chunk)  # waits for the client: backpressure
                    if cut:  # the key's output tokens are spent: ended here, the upstream closed (it stops)
                        assert meter is not None
                        await response.write(_error_frame(self._shaped(request, meter.spent(name))))
                        break
                else:
                    whole = True
                    if tap is not None and (rest := tap.rest()):
                        await response.write(rest)
            except (TimeoutError, UpstreamError):
                error = APIError(f"The model {name!r} failed mid-stream.", status_code=502, code="upstream_error")
                await response.write(_error_frame(self._shaped(request, error)))
            await response.end()
            return response
        finally:
            trace.end(upstream.status, meter.usage if meter is not None else None)
            self._upstreams.release(upstream, whole)


#: What sees an upstream's 200 body on its way to the client: (bytes, whether they are the whole unary body).
Observer = Callable[[bytes, bool], Awaitable[None]]


def _unexpected_body(request: Request) -> APIError | None:
    """A 413 for a request that declares a body (Content-Length above 0, or any Transfer-Encoding: RFC 9112
    section 6.3) where none is taken; None for one without."""
    length = request.headers.get("content-length")
    chunked = "transfer-encoding" in request.headers
    if not chunked and (length is None or (length.isdigit() and int(length) == 0)):
        return None
    declared = f"Transfer-Encoding: {request.headers['transfer-encoding']}" if chunked else f"Content-Length: {length}"
    return RequestTooLarge(
        f"{request.method} {request.path} takes no request body, and this request declares one ({declared}); "
        "send it without a body.",
        code="body_not_allowed",
    )


def _canceller(task: asyncio.Task[Any]) -> Callable[[], None]:
    """A callback that cancels ``task`` (a held request's, when its client leaves)."""

    def cancel() -> None:
        task.cancel()

    return cancel


#: The head of a held streaming request's answer, sent before the model is up.
SSE_HEADERS = [("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache")]


def _instant(value: str | None, param: str, default: float) -> float:
    """An epoch time from a query parameter: RFC 3339 (``2026-12-04T10:00:00Z``) or epoch seconds."""
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        pass
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise InvalidRequest(f"{param}: give an RFC 3339 time (2026-12-04T10:00:00Z) or epoch seconds, not {value!r}",
                             param=param) from None  # fmt: skip
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


_IMAGES = IMAGES_HEADER.lower()
_AUDIO_SECONDS = AUDIO_SECONDS_HEADER.lower()
#: How often the gateway looks for a changed keys file (seconds).
KEYS_REREAD_S = 2.0


class _Meter:
    """One proxied request's key, its draw on the key's limits and what it used."""

    __slots__ = ("audio_seconds", "images", "key", "key_id", "sent", "streamed", "ticket", "usage", "wake_s", "woke_it")

    def __init__(self, key: Key | None, ticket: Ticket | None) -> None:
        self.key = key
        self.key_id = key.id if key is not None else "-"
        self.ticket = ticket
        self.usage = Usage()
        self.sent: float | None = None  # when it was sent to the predictor (monotonic)
        self.wake_s: float | None = None  # how long it waited for its model to wake
        self.woke_it = False  # it was the request that woke its model
        self.streamed = False
        self.images = 0  # the images a chat held (the predictor's IMAGES_HEADER)
        self.audio_seconds = 0  # the audio a transcription billed (the predictor's AUDIO_SECONDS_HEADER)

    @property
    def headers(self) -> list[tuple[str, str]]:
        return self.ticket.headers if self.ticket is not None else []

    def tap(self) -> StreamTap:
        """The event stream's usage reader, whose counts are this request's as they come: a client that leaves
        mid-stream (or before the stream's last bytes) is still billed what it was sent."""
        self.streamed = True
        ticket = self.ticket
        tap = StreamTap(ticket.output if ticket is not None and ticket.limits_output else None)
        self.usage = tap.usage
        return tap

    def spent(self, model: str) -> APIError:
        who = repr(self.key_id) if self.key is not None else "the gateway's callers"
        return RateLimited(
            f"The output tokens per minute of key {who} ran out during this answer from {model!r}; it ends here. "
            "Retry later, or ask for fewer tokens (max_tokens).",
            "tokens",
            1.0,
            [],
        )


def _asks_to_stream(body: bytes) -> bool:
    """Whether a JSON body asks for a stream (``"stream": true``); a body that is not JSON does not."""
    if b'"stream"' not in body:
        return False
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return False
    return isinstance(parsed, dict) and parsed.get("stream") is True


class AnthropicShaped(APIError):
    """An error as Anthropic's API writes it (the Messages API's routes): the same status, message and headers."""

    def __init__(self, error: APIError) -> None:
        super().__init__(error.message, param=error.param, code=error.code, status_code=error.status_code,
                         retry_after=error.retry_after)  # fmt: skip
        self.error_type = error.error_type

    def body(self) -> dict[str, Any]:
        return anthropic_error_body(self)


class _Unanswered(APIError):
    """A 502 for a request whose upstream gave no byte of an answer: no connection could be made (``unsent``), or
    the connection broke before the answer's head. The gateway sends it once more where the process turns out to
    have exited (:meth:`Backends.exited`): for one that was sent, only where the process was killed from outside."""

    def __init__(self, message: str, code: str, *, unsent: bool = False) -> None:
        super().__init__(message, status_code=502, code=code)
        self.unsent = unsent


class _Relayed(APIError):
    """An upstream's own error body, relayed as it came (already in its route's shape)."""

    def __init__(self, payload: dict[str, Any], status: int) -> None:
        super().__init__("relayed", status_code=status)
        self.payload = payload

    def body(self) -> dict[str, Any]:
        return self.payload


def _upstream_error(payload: bytes, status: int, name: str) -> APIError:
    """The error of an upstream's non-stream answer to a held streaming request: its own body when it is an error
    object (OpenAI's or Anthropic's, both under ``error``), else a 502 saying what came."""
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        return _Relayed(parsed, status)
    return APIError(f"The model {name!r} answered {status} instead of a stream.", status_code=502,
                    code="upstream_error")  # fmt: skip


def _error_frame(error: APIError) -> bytes:
    """``error`` as the server-sent event that ends a stream: OpenAI's ``data:`` line, or Anthropic's named
    ``error`` event."""
    body = orjson.dumps(error.body())
    if isinstance(error, AnthropicShaped) or (isinstance(error, _Relayed) and error.payload.get("type") == "error"):
        return b"event: error\ndata: " + body + b"\n\n"
    return b"data: " + body + b"\n\n"


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
