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
Bodies are read for those counts only, never recorded.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson

from universal_predictors import tracing as shared
from universal_predictors.tracing import (
    CLIENT,
    CURRENT,
    SERVER,
    TRACE_CONTEXT_HEADERS,
    Span,
    TracingConfigError,
    extract,
    operation_name,
)

if TYPE_CHECKING:
    from universal_gateway.server import Request, Response, StreamedResponse

configure = shared.configure
shutdown = shared.shutdown
__all__ = [
    "NO_UPSTREAM", "TracingConfigError", "Upstream", "auth", "configure", "held", "model", "shutdown", "traced",
    "upstream",
]  # fmt: skip

#: What the upstream's head leaves out when tracing is on: the client's trace context, which ours replaces.
REPLACED_HEADERS = frozenset(name.encode() for name in TRACE_CONTEXT_HEADERS)

#: What marks an event worth parsing: usage, or a finish reason that is a string (JSON with or without spaces).
_MARKERS = (b'"usage"', b'_reason": "', b'_reason":"')
#: The routes whose answers have a finish (or stop) reason: their unary bodies are parsed for it. Every other unary
#: body (embeddings: megabytes of numbers, at times) is parsed only if the gateway's ledger read no counts from it.
_FINISHING_ROUTES = ("/chat/completions", "/completions", "/messages", "/responses")

_Handler = Callable[["Request", Any], Awaitable["Response | StreamedResponse"]]


def traced(handler: _Handler, operation: str, task: str) -> _Handler:
    """``handler`` (a proxied route's) inside a ``gateway.request`` span; ``handler`` itself when tracing is off."""
    tracing = shared.ACTIVE
    if tracing is None:
        return handler
    op = operation_name(operation, task)

    @functools.wraps(handler)
    async def request_span(request: Request, params: Any) -> Response | StreamedResponse:
        span = tracing.start("gateway.request", SERVER, extract(request.headers), {
            "gen_ai.operation.name": op, "universal_runtime.task": task, "http.request.method": request.method,
            "url.path": request.path,
        })  # fmt: skip
        token = CURRENT.set(span)
        status = 500
        try:
            response = await handler(request, params)
            status = response.status
            return response
        except BaseException as exc:
            status = int(getattr(exc, "status_code", 499 if isinstance(exc, ConnectionResetError) else 500))
            span.attributes["error.type"] = type(exc).__name__ if status >= 500 else str(status)
            raise
        finally:
            span.attributes["http.response.status_code"] = status
            span.error = status >= 500
            CURRENT.reset(token)
            span.end()

    return request_span


def model(name: str, key_id: str | None = None) -> None:
    """The model the current request names (``gen_ai.request.model``) and the id of its API key (never the key)."""
    span = CURRENT.get()
    if span is not None:
        span.attributes["gen_ai.request.model"] = name
        if key_id is not None:
            span.attributes["universal_runtime.key_id"] = key_id


def auth() -> contextlib.AbstractContextManager[Any]:
    """The ``auth`` span for the block; a shared no-op when tracing is off."""
    return shared.span("auth")


def held(name: str, waited_s: float, *, woke: bool = True) -> None:
    """A ``hold`` span, ending now, of the ``waited_s`` the request waited for ``name`` to wake (``woke``: it did)."""
    tracing = shared.ACTIVE
    if tracing is None or CURRENT.get() is None:
        return
    end = time.time_ns()
    span = tracing.start("hold", start=end - int(waited_s * 1e9), attributes={
        "gen_ai.request.model": name, "universal_runtime.wake_seconds": waited_s, "universal_runtime.woke": woke,
    })  # fmt: skip
    span.error = not woke
    span.end(end)


class Upstream:
    """The ``upstream`` span of one proxied request: the traceparent for the upstream's head, and what a 200's body
    says of usage (unary: the JSON body; a stream: its events' ``usage`` and ``finish_reason``)."""

    __slots__ = ("_carry", "_finish", "_finishing", "_observe", "_root", "_unary", "_usage", "head_lines", "span")

    replaced = REPLACED_HEADERS

    def __init__(self, span: Span, root: Span, finishing: bool = True) -> None:
        self.span = span
        self._root = root
        self.head_lines = span.header_lines()
        self._observe: Callable[[bytes, bool], Awaitable[None]] | None = None
        self._carry = b""
        self._usage: dict[str, Any] | None = None
        self._finish: list[str] = []
        self._finishing = finishing  # its route's answers have finish reasons
        self._unary = b""  # a unary body without them: its usage read only if the ledger's is not had

    def observing(
        self, observe: Callable[[bytes, bool], Awaitable[None]] | None
    ) -> Callable[[bytes, bool], Awaitable[None]] | None:
        """An observer (app.Observer) that reads the counts, then passes the body on to ``observe``; ``observe``
        itself for a request the sampler left out."""
        if not self.span.sampled:
            return observe
        self._observe = observe
        return self._seen

    async def _seen(self, data: bytes, unary: bool) -> None:
        if unary:
            if self._finishing:
                with contextlib.suppress(orjson.JSONDecodeError):
                    self._read(orjson.loads(data))
            else:  # usage only, which the gateway's ledger reads too (end())
                self._unary = data
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
                self._finish.append(choice["finish_reason"])
        for source in (body, body.get("delta")):
            if isinstance(source, dict) and isinstance(source.get("stop_reason"), str):
                self._finish.append(source["stop_reason"])  # Anthropic's Messages API
        if inner is not None and isinstance(inner.get("status"), str) and inner["status"] != "in_progress":
            self._finish = [inner["status"]]  # Responses API: completed, incomplete

    def end(self, status: int, metered: Any = None) -> None:
        """The span ends: ``status`` the upstream's (0: none came); ``metered``: the request's usage as the gateway's
        ledger read it (``input_tokens``, ``output_tokens``: a stream's usage comments too), preferred when it has
        counts."""
        span = self.span
        if not span.sampled:
            return
        if status:
            span.attributes["http.response.status_code"] = status
        span.error = not status or status >= 500
        if metered is not None and (metered.input_tokens or metered.output_tokens):
            counts: tuple[int | None, int | None] = (metered.input_tokens, metered.output_tokens)
        else:
            if self._unary:  # the ledger is off (or read no counts): the body parsed for them
                with contextlib.suppress(orjson.JSONDecodeError):
                    self._read(orjson.loads(self._unary))
            usage = self._usage or {}
            counts = (_count(usage, "prompt_tokens", "input_tokens"),
                      _count(usage, "completion_tokens", "output_tokens"))  # fmt: skip
        attributes, root = span.attributes, self._root.attributes
        if counts[0] is not None:
            attributes["gen_ai.usage.input_tokens"] = root["gen_ai.usage.input_tokens"] = counts[0]
        if counts[1] is not None:
            attributes["gen_ai.usage.output_tokens"] = root["gen_ai.usage.output_tokens"] = counts[1]
        if self._finish:
            span.attributes["gen_ai.response.finish_reasons"] = self._root.attributes[
                "gen_ai.response.finish_reasons"
            ] = self._finish
        span.end()


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
    root = CURRENT.get()
    if tracing is None or root is None:
        return NO_UPSTREAM
    attributes = {"gen_ai.request.model": name, "server.address": base, "url.path": path}
    return Upstream(tracing.start("upstream", CLIENT, root, attributes), root, path.endswith(_FINISHING_ROUTES))
