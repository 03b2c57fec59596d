"""The gateway's spans: ``gateway.request`` for each proxied request, with ``auth``, ``hold`` and ``upstream``.

On and off as :mod:`universal_predictors.tracing` says (``OTEL_TRACES_EXPORTER``; off by default), with the same
OTLP/HTTP export. Off, :func:`traced` hands back the route's handler itself and the other hooks return a shared
no-op: no SDK import, no span object, one global load per hook on the request path (bench/gateway.py measures it).

On, a proxied request's tree is::

    gateway.request (server; the child of the client's traceparent, if it sent one)
      auth          the key's check for the model (with keys on)
      hold          only when the model was asleep: from the request's arrival to the upstream's head (the wake)
      upstream      (client) the predictor's request; its traceparent replaces the client's on the way up, so
                    the predictor's predictor.request span is its child

with the GenAI semantic conventions' attributes where the gateway knows them (``gen_ai.request.model``,
``gen_ai.operation.name``; from a 200's body, ``gen_ai.usage.input_tokens``/``output_tokens`` and
``gen_ai.response.finish_reasons``: a stream's counts need ``stream_options.include_usage``, as for the client).
Bodies are read for those counts only, never recorded. A request's spans are one record on the event loop
(:class:`RequestTrace`: times and what the gateway read), made into spans by the export thread.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import random
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from universal_predictors import tracing as shared
from universal_predictors.tracing import (
    CLIENT,
    INTERNAL,
    OFF,
    SERVER,
    TRACE_CONTEXT_HEADERS,
    TracingConfigError,
    encode_attributes,
    encode_span,
    extract,
    operation_name,
)

if TYPE_CHECKING:
    from universal_gateway.server import Request, Response, StreamedResponse

configure = shared.configure
shutdown = shared.shutdown
__all__ = [
    "NO_UPSTREAM", "REQUEST", "RequestTrace", "TracingConfigError", "Upstream", "auth", "configure", "held", "model",
    "shutdown", "traced", "upstream",
]  # fmt: skip

#: What the upstream's head leaves out when tracing is on: the client's trace context, which ours replaces.
REPLACED_HEADERS = frozenset(name.encode() for name in TRACE_CONTEXT_HEADERS)

#: What marks an event worth parsing: usage, or a finish reason that is a string (JSON with or without spaces).
_MARKERS = (b'"usage"', b'_reason": "', b'_reason":"')
#: The routes whose answers have a finish (or stop) reason: their unary bodies are parsed for it. Every other unary
#: body (embeddings: megabytes of numbers, at times) is parsed only if the gateway's ledger read no counts from it.
_FINISHING_ROUTES = ("/chat/completions", "/completions", "/messages", "/responses")

_Handler = Callable[["Request", Any], Awaitable["Response | StreamedResponse"]]
#: The largest unary body whose parse (for the spans' counts and finish reasons) is left to the export thread; a larger
#: one is parsed as its request ends, not kept in the queue (which holds at most OTEL_BSP_MAX_QUEUE_SIZE requests:
#: 32 MiB of bodies at the default 2,048, a chat completion's being a few KiB).
DEFERRED_BODY = 16384


class RequestTrace:
    """One proxied request's spans, kept as the event loop learns them (times, ids and what the gateway read) and made
    into OTLP spans by the export thread (:meth:`encoded`): ``gateway.request``, ``auth``, each ``hold`` and each
    ``upstream``. It is one entry of the export queue (a :class:`universal_predictors.tracing.Record`).

    Measured in the gateway under bench/gateway.py's load (the tenants part, every request traced, against the same
    gateway untraced in the same run), a request's three span objects cost its event loop 28 to 48 us: made, made
    current, ended, their attributes set as the request went (the loop's CPU, cold under load, several times a
    benchmark's hot loop). Here the loop keeps only what it cannot know later (times, the upstream's span id, which
    goes up in its traceparent), in slots; the root's, the auth's and the hold's span ids are drawn, the attributes
    written and a unary body parsed for its counts and finish reasons by the export thread: 11 us on the loop against
    28 in the same run (20 against 40 us with the export thread's CPU). Also the ``auth`` span's context manager
    (:func:`auth`)."""

    __slots__ = ("auth_end", "auth_error", "auth_start", "earlier", "error_type", "finish", "holds", "key_id", "method",
                 "model", "parent_id", "path", "route", "sampled", "spans", "start", "status", "trace_id", "tracestate",
                 "upstream")  # fmt: skip

    def __init__(self, tracing: shared.Tracing, request: Request, route: tuple[tuple[str, str], ...]) -> None:
        self.start = time.time_ns()
        remote = extract(request.headers)
        if remote is None:
            self.trace_id, self.parent_id, self.tracestate = tracing._ids.getrandbits(128) or 1, 0, ""
        else:
            self.trace_id, self.parent_id, self.tracestate = remote.trace_id, remote.span_id, remote.tracestate
        self.sampled = tracing.sampler.sampled(self.trace_id, remote)
        self.route = route  # the route's own attributes: its operation and task
        self.method = request.method
        self.path = request.path
        self.model: str | None = None
        self.key_id: str | None = None
        self.status = 500
        self.error_type: str | None = None
        self.auth_start = self.auth_end = 0
        self.auth_error: str | None = None
        self.holds: list[tuple[int, int, str, float, bool]] | None = None
        self.upstream: Upstream | None = None  # the last; a request replayed to a new process has more
        self.earlier: list[Upstream] | None = None
        self.finish = 0
        self.spans = 0

    def __enter__(self) -> RequestTrace:  # the auth span's block
        self.auth_start = time.time_ns()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.auth_end = time.time_ns()
        if kind is not None:
            self.auth_error = kind.__name__

    def end(self) -> None:
        """The request is answered (or failed): queued for export if sampled."""
        tracing = shared.ACTIVE
        if self.sampled and tracing is not None:
            self.finish = time.time_ns()
            tracing.batches.add(self)

    def encoded(self) -> bytes:
        """The request's spans, OTLP protobuf (:func:`universal_predictors.tracing.encode_span`): run by the export
        thread (or, when it is behind, by the loop as the request ends)."""
        ids = _EXPORT_IDS.getrandbits
        trace_id, tracestate, root_id, finish = self.trace_id, self.tracestate, ids(64) or 1, self.finish
        children = []
        if self.auth_start:
            error = self.auth_error
            children.append(encode_span(
                trace_id, ids(64) or 1, root_id, tracestate, "auth", INTERNAL, self.auth_start, self.auth_end or finish,
                b"" if error is None else encode_attributes((("error.type", error),)), error is not None,
            ))  # fmt: skip
        for started, ended, name, waited_s, woke in self.holds or ():
            children.append(encode_span(trace_id, ids(64) or 1, root_id, tracestate, "hold", INTERNAL, started, ended,
                                        encode_attributes((("gen_ai.request.model", name),
                                                           ("universal_runtime.wake_seconds", waited_s),
                                                           ("universal_runtime.woke", woke))), not woke))  # fmt: skip
        usage: tuple[tuple[str, Any], ...] = ()
        for upstream in (*(self.earlier or ()), self.upstream) if self.upstream is not None else ():
            status, read = upstream.status, upstream.read()
            usage = read or usage  # the root's: what its last upstream read
            attributes = _group((("gen_ai.request.model", upstream.model), ("server.address", upstream.base),
                                 ("url.path", upstream.path))) + encode_attributes(
                                (("http.response.status_code", status or None), *read))  # fmt: skip
            children.append(encode_span(trace_id, upstream.span_id, root_id, tracestate, "upstream", CLIENT,
                                        upstream.start, upstream.finish or finish, attributes,
                                        not status or status >= 500))  # fmt: skip
        self.spans = 1 + len(children)
        attributes = _group(
            (
                *self.route,
                ("http.request.method", self.method),
                ("url.path", self.path),
                ("gen_ai.request.model", self.model),
                ("universal_runtime.key_id", self.key_id),
            )
        )
        attributes += encode_attributes((("http.response.status_code", self.status), ("error.type", self.error_type),
                                         *usage))  # fmt: skip
        root = encode_span(trace_id, root_id, self.parent_id, tracestate, "gateway.request", SERVER, self.start,
                           finish, attributes, self.status >= 500)  # fmt: skip
        return root + b"".join(children)


#: The encodings of attributes that come together (a route's, a model's upstream's), by their items.
_GROUPS: dict[tuple[tuple[str, Any], ...], bytes] = {}


def _group(items: tuple[tuple[str, Any], ...]) -> bytes:
    """``items`` encoded (:func:`universal_predictors.tracing.encode_attributes`), cached whole: a route's
    attributes and a model's name recur from request to request (up to 4,096 groups kept)."""
    encoded = _GROUPS.get(items)
    if encoded is None:
        encoded = encode_attributes(items)
        if len(_GROUPS) < 4096:
            _GROUPS[items] = encoded
    return encoded


#: The span ids the export thread draws (the root's, the auth's, a hold's): a generator of its own, as the SDK's
#: RandomIdGenerator draws from ``random`` (getrandbits is one C call, whole under the GIL, from either thread).
_EXPORT_IDS = random.Random()

#: The request being served: the hooks below (auth, model, held, upstream) record into it.
REQUEST: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar("universal_gateway_trace", default=None)


def traced(handler: _Handler, operation: str, task: str) -> _Handler:
    """``handler`` (a proxied route's) recording a ``gateway.request`` span; ``handler`` itself when tracing is off."""
    tracing = shared.ACTIVE
    if tracing is None:
        return handler
    route = (("gen_ai.operation.name", operation_name(operation, task)), ("universal_runtime.task", task))

    @functools.wraps(handler)
    async def request_span(request: Request, params: Any) -> Response | StreamedResponse:
        trace = RequestTrace(tracing, request, route)
        token = REQUEST.set(trace)
        try:
            response = await handler(request, params)
            trace.status = response.status
            return response
        except BaseException as exc:
            status = trace.status = int(
                getattr(exc, "status_code", 499 if isinstance(exc, ConnectionResetError) else 500)
            )
            trace.error_type = type(exc).__name__ if status >= 500 else str(status)
            raise
        finally:
            REQUEST.reset(token)
            trace.end()

    return request_span


def model(name: str, key_id: str | None = None) -> None:
    """The model the current request names (``gen_ai.request.model``) and the id of its API key (never the key)."""
    trace = REQUEST.get()
    if trace is not None:
        trace.model = name
        trace.key_id = key_id


def auth() -> contextlib.AbstractContextManager[Any]:
    """The ``auth`` span's block (the current request's record); a shared no-op when tracing is off."""
    trace = REQUEST.get()
    return OFF if trace is None or not trace.sampled else trace


def held(name: str, waited_s: float, *, woke: bool = True) -> None:
    """A ``hold`` span, ending now, of the ``waited_s`` the request waited for ``name`` to wake (``woke``: it did)."""
    trace = REQUEST.get()
    if trace is None or not trace.sampled:
        return
    end = time.time_ns()
    hold = (end - int(waited_s * 1e9), end, name, waited_s, woke)
    if trace.holds is None:
        trace.holds = [hold]
    else:
        trace.holds.append(hold)


class Upstream:
    """The ``upstream`` span of one proxied request: the traceparent for the upstream's head, and what a 200's body
    says of usage (unary: the JSON body, read by the export thread; a stream: its events' ``usage`` and
    ``finish_reason``, read as they pass)."""

    __slots__ = ("_carry", "_finish", "_finishing", "_observe", "_unary", "_usage", "base", "counts", "finish",
                 "head_lines", "model", "path", "sampled", "span_id", "start", "status")  # fmt: skip

    replaced = REPLACED_HEADERS

    def __init__(self, trace: RequestTrace, span_id: int, model: str, base: str, path: str) -> None:
        self.start = time.time_ns()
        self.sampled = trace.sampled  # (the record holds this, not the other way: no cycle for the collector)
        self.span_id = span_id
        self.model = model
        self.base = base
        self.path = path
        flags = b"01" if trace.sampled else b"00"
        self.head_lines = b"traceparent: 00-%032x-%016x-%s\r\n" % (trace.trace_id, span_id, flags)
        if trace.tracestate:
            self.head_lines += b"tracestate: " + trace.tracestate.encode("latin-1") + b"\r\n"
        self.status = 0
        self.finish = 0
        self.counts: tuple[int | None, int | None] | None = None  # the ledger's (input, output), when it had them
        self._observe: Callable[[bytes, bool], Awaitable[None]] | None = None
        self._carry = b""
        self._usage: dict[str, Any] | None = None
        self._finish: list[str] | None = None
        self._finishing = path.endswith(_FINISHING_ROUTES)  # its route's answers have finish reasons
        self._unary = b""  # a unary 200's body, for the export thread to read
        if trace.sampled:
            if trace.upstream is not None:  # replayed
                trace.earlier = [*(trace.earlier or ()), trace.upstream]
            trace.upstream = self

    def observing(
        self, observe: Callable[[bytes, bool], Awaitable[None]] | None
    ) -> Callable[[bytes, bool], Awaitable[None]] | None:
        """An observer (app.Observer) that reads the counts, then passes the body on to ``observe``; ``observe``
        itself for a request the sampler left out."""
        if not self.sampled:
            return observe
        self._observe = observe
        return self._seen

    async def _seen(self, data: bytes, unary: bool) -> None:
        if unary:
            self._unary = data  # read later (read()), by the export thread unless it is large (end())
        else:
            self._events(data)
        if self._observe is not None:
            await self._observe(data, unary)

    def _events(self, data: bytes) -> None:
        """The ``data:`` lines of server-sent events (a line may span chunks) that carry usage or a finish reason (a
        string: every chunk has ``"finish_reason": null``); a chunk without either is only searched, not split."""
        joined = self._carry + data
        if not any(marker in joined for marker in _MARKERS):
            self._carry = joined[joined.rfind(b"\n") + 1 :][-65536:]
            return
        lines = joined.split(b"\n")
        self._carry = lines.pop()[-65536:]
        for line in lines:
            if line.startswith(b"data: {") and any(marker in line for marker in _MARKERS):
                with contextlib.suppress(orjson.JSONDecodeError):
                    self._read(orjson.loads(line[6:]))

    def _read(self, body: Any) -> None:
        if not isinstance(body, dict):
            return
        inner = body.get("response") if isinstance(body.get("response"), dict) else None  # Responses API events
        message = body.get("message") if isinstance(body.get("message"), dict) else None  # Messages API start
        for source in (body, inner, message):
            if source is not None and isinstance(source.get("usage"), dict):
                self._usage = {**(self._usage or {}), **source["usage"]}
        for choice in body.get("choices") or ():
            if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                self._finish = [*(self._finish or ()), choice["finish_reason"]]
        for source in (body, body.get("delta")):
            if isinstance(source, dict) and isinstance(source.get("stop_reason"), str):
                self._finish = [*(self._finish or ()), source["stop_reason"]]  # Anthropic's Messages API
        if inner is not None and isinstance(inner.get("status"), str) and inner["status"] != "in_progress":
            self._finish = [inner["status"]]  # Responses API: completed, incomplete

    def end(self, status: int, metered: Any = None) -> None:
        """The span ends: ``status`` the upstream's (0: none came); ``metered``: the request's usage as the gateway's
        ledger read it (``input_tokens``, ``output_tokens``: a stream's usage comments too), preferred when it has
        counts."""
        self.finish = time.time_ns()
        self.status = status
        self._observe, self._carry = None, b""  # nothing the request made kept while it waits for export
        if metered is not None and (metered.input_tokens or metered.output_tokens):
            self.counts = (metered.input_tokens, metered.output_tokens)
            if not self._finishing:
                self._unary = b""  # nothing left to read in it
        if len(self._unary) > DEFERRED_BODY:  # not kept for the export thread: read now
            self._parse_unary()

    def _parse_unary(self) -> None:
        body, self._unary = self._unary, b""
        with contextlib.suppress(orjson.JSONDecodeError):
            self._read(orjson.loads(body))

    def read(self) -> tuple[tuple[str, Any], ...]:
        """The counts and finish reasons its body said (the root's too), as attributes; none if it said none. For the
        export thread: a unary body kept for it is read here."""
        if self._unary:
            self._parse_unary()
        if self.counts is not None:
            counts = self.counts
        else:
            usage = self._usage or {}
            counts = (_count(usage, "prompt_tokens", "input_tokens"),
                      _count(usage, "completion_tokens", "output_tokens"))  # fmt: skip
        if counts == (None, None) and not self._finish:
            return ()
        return (("gen_ai.usage.input_tokens", counts[0]), ("gen_ai.usage.output_tokens", counts[1]),
                ("gen_ai.response.finish_reasons", self._finish or None))  # fmt: skip


def _count(usage: dict[str, Any], *names: str) -> int | None:
    """The first of ``names`` that ``usage`` has as an integer."""
    for name in names:
        value = usage.get(name)
        if isinstance(value, int):
            return value
    return None


class _NoUpstream:
    """The ``upstream`` stand-in when tracing is off."""

    __slots__ = ()

    head_lines = b""
    replaced: frozenset[bytes] = frozenset()

    def observing(
        self, observe: Callable[[bytes, bool], Awaitable[None]] | None
    ) -> Callable[[bytes, bool], Awaitable[None]] | None:
        return observe

    def end(self, status: int, metered: Any = None) -> None:
        return None


NO_UPSTREAM = _NoUpstream()


def upstream(name: str, base: str, path: str) -> Upstream | _NoUpstream:
    """The ``upstream`` client span for a request to ``base`` + ``path``; a shared no-op when tracing is off."""
    tracing = shared.ACTIVE
    trace = REQUEST.get()
    if tracing is None or trace is None:
        return NO_UPSTREAM
    return Upstream(trace, tracing._ids.getrandbits(64) or 1, name, base, path)
