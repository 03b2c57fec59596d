"""OpenTelemetry traces: off unless the environment asks for them, and then exported over OTLP/HTTP.

The switch is the SDK's own (opentelemetry-sdk 1.45.2, ``opentelemetry/sdk/_configuration/__init__.py``,
``_get_exporter_names``): ``OTEL_TRACES_EXPORTER`` unset or ``none`` means no exporter, so no traces; ``otlp``
exports over OTLP with HTTP/protobuf (the only protocol installed: no gRPC), ``console`` prints spans to stdout.
``OTEL_SDK_DISABLED=true`` turns everything off whatever else is set (``opentelemetry/sdk/environment_variables``).
Everything else is the SDK's to read, as the specification names it: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces``
appended) or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (as given), ``OTEL_EXPORTER_OTLP_HEADERS``, ``_TIMEOUT``,
``_COMPRESSION``, ``_CERTIFICATE``; ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``; ``OTEL_TRACES_SAMPLER``
and ``OTEL_TRACES_SAMPLER_ARG`` (default ``parentbased_always_on``: a predictor follows the gateway's decision);
``OTEL_BSP_*`` for the batch processor. Context travels as W3C Trace Context (``traceparent``, ``tracestate``).

Off, nothing of the SDK is imported and no span object is made: :data:`ACTIVE` is None, the hooks return their
arguments or a shared no-op, and callers pay one attribute load and a comparison (bench/gateway.py measures it).
On, the predictor's spans are ``predictor.request`` (a server span, the child of the caller's ``traceparent``) with
``parse``, and per generated sequence ``queue`` (waiting for the engine to take it into a batch), ``prefill`` (to the
first token) and ``decode`` (to the last), with the GenAI semantic conventions' attributes (``gen_ai.*``, semantic
conventions 1.37: model, operation, token counts, finish reasons). No request or response body is ever recorded.
The gateway's spans (``universal_gateway.tracing``) use the same setup.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the SDK is imported only when tracing is on
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

logger = logging.getLogger(__name__)

#: The exporters this project installs (``OTEL_TRACES_EXPORTER`` may name several, comma-separated).
EXPORTERS = ("otlp", "console")
#: The OTLP protocols installed: HTTP/protobuf only (opentelemetry-exporter-otlp-proto-http).
PROTOCOLS = ("http/protobuf",)
#: The W3C Trace Context headers (https://www.w3.org/TR/trace-context/): replaced, not relayed, by a traced proxy.
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")


class TracingConfigError(ValueError):
    """The OTEL_* environment asks for something this installation cannot do (said in one line)."""


def exporters_from_env(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The trace exporters the environment asks for: none unless ``OTEL_TRACES_EXPORTER`` names some (and
    ``OTEL_SDK_DISABLED`` is not ``true``); a :class:`TracingConfigError` for one not installed here."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    names = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not names or names == "none":
        return []
    exporters = [n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"]
    for name in exporters:
        if name not in EXPORTERS:
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER={name}: not installed here; give one of {', '.join(EXPORTERS)} (or none)"
            )
    if "otlp" in exporters:
        for var in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            protocol = environ.get(var, "").strip().lower()
            if protocol:
                if protocol not in PROTOCOLS:
                    raise TracingConfigError(
                        f"{var}={protocol}: only http/protobuf is installed (port 4318 on a collector); "
                        "unset it or give http/protobuf"
                    )
                break
    return exporters


class Tracing:
    """Tracing on: the provider (its batch processors and exporters), a tracer, the W3C propagator."""

    def __init__(self, provider: TracerProvider, scope: str) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer: Tracer = provider.get_tracer(scope)
        self.propagator = TraceContextTextMapPropagator()

    def extract(self, headers: Mapping[str, str]) -> Context:
        """The caller's context from its ``traceparent``/``tracestate`` (an empty one without them)."""
        return self.propagator.extract(headers)

    def inject(self, span: Span) -> dict[str, str]:
        """The W3C headers that make ``span`` the parent of what the receiver starts."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, trace.set_span_in_context(span))
        return carrier

    def shutdown(self) -> None:
        """Export what is still queued (bounded by ``OTEL_BSP_EXPORT_TIMEOUT``), then stop."""
        self.provider.shutdown()


def start(service_name: str, scope: str, environ: Mapping[str, str] = os.environ,
          attributes: Mapping[str, str] | None = None) -> Tracing | None:  # fmt: skip
    """Tracing as the environment configures it (module docstring), or None when it is off. ``service_name`` is the
    default for ``OTEL_SERVICE_NAME``; ``attributes`` are more resource attributes (``OTEL_RESOURCE_ATTRIBUTES``
    overrides them)."""
    exporters = exporters_from_env(environ)
    if not exporters:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME, which win over what is given here.
    resource = Resource.create({"service.name": service_name, **(attributes or {})})
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER(_ARG)
    for name in dict.fromkeys(exporters):
        exporter: SpanExporter
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()  # endpoint, headers, timeout, compression from OTEL_EXPORTER_OTLP_*
        else:
            exporter = ConsoleSpanExporter()
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* (queue, batch, delay)
    return Tracing(provider, scope)


#: Tracing in this process, once :func:`configure` turned it on; None: off (the default).
ACTIVE: Tracing | None = None


def configure(service_name: str, environ: Mapping[str, str] = os.environ,
              attributes: Mapping[str, str] | None = None) -> Tracing | None:  # fmt: skip
    """Turn tracing on for this process when the environment asks (before any route is bound: the hooks that wrap
    routes decide then). Raises :class:`TracingConfigError` for an environment that asks for what is not here."""
    global ACTIVE
    ACTIVE = start(service_name, "universal_runtime", environ, attributes)
    if ACTIVE is not None:
        logger.info("tracing on: spans exported by %s", environ.get("OTEL_TRACES_EXPORTER"))
    return ACTIVE


def shutdown() -> None:
    """Flush and stop tracing (nothing when off)."""
    global ACTIVE
    if ACTIVE is not None:
        ACTIVE.shutdown()
        ACTIVE = None


# -- the predictor's spans ------------------------------------------------------------------------------------------


class _Off:
    """The span stand-in when tracing is off: a context manager that does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


OFF = _Off()

#: GenAI operation names (semantic conventions, ``gen_ai.operation.name``) for the OpenAI-style routes; other
#: routes are named by their task (``rerank``, ``classify``, ...).
OPERATIONS = {
    "chat_completions": "chat", "completions": "text_completion", "embeddings": "embeddings", "responses": "chat",
    "messages": "chat",
}  # fmt: skip


def operation_name(operation: str, task: str) -> str:
    return OPERATIONS.get(operation, task)


def span(name: str) -> contextlib.AbstractContextManager[Any]:
    """A child span of the current one for the block (``parse``); a shared no-op when tracing is off."""
    tracing = ACTIVE
    if tracing is None:
        return OFF
    return tracing.tracer.start_as_current_span(name, record_exception=False)


def traced_route(answer: Callable[[Any], Awaitable[Any]], operation: str, task: str,
                 model: Callable[[], tuple[str, str]]) -> Callable[[Any], Awaitable[Any]]:  # fmt: skip
    """``answer`` (a route's ``answer(request)``) inside a ``predictor.request`` span, the child of the caller's
    ``traceparent``; ``answer`` itself when tracing is off. ``model``: the served name and backend, asked per request
    (the backend is known once loaded). A streamed answer's span ends with its last byte."""
    tracing = ACTIVE
    if tracing is None:
        return answer
    from opentelemetry import context, trace
    from opentelemetry.trace import SpanKind, StatusCode

    op = operation_name(operation, task)

    @functools.wraps(answer)
    async def traced(request: Any) -> Any:
        parent = tracing.extract(request.headers)
        name, backend = model()
        span = tracing.tracer.start_span(
            "predictor.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": op, "gen_ai.request.model": name, "universal_runtime.backend": backend,
                "universal_runtime.task": task, "http.request.method": request.method,
                "url.path": request.url.path,
            },
        )  # fmt: skip
        token = context.attach(trace.set_span_in_context(span, parent))
        ended = True
        try:
            response = await answer(request)
            status = int(getattr(response, "status_code", 200))
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_status(StatusCode.ERROR)
            body = getattr(response, "body_iterator", None)
            if body is not None:  # a stream: the span lasts as long as its body
                response.body_iterator = _ending(body, span)
                ended = False
            return response
        except BaseException as exc:
            status = int(getattr(exc, "status_code", 500))
            span.set_attribute("http.response.status_code", status)
            span.set_attribute("error.type", type(exc).__name__ if status >= 500 else str(status))
            if status >= 500:
                span.set_status(StatusCode.ERROR)
            raise
        finally:
            context.detach(token)
            if ended:
                span.end()

    return traced


async def _ending(body: Any, span: Span) -> Any:
    """``body`` (a streamed response's iterator), ending ``span`` once it is done (or abandoned)."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        span.end()


def usage(prompt_tokens: int, completion_tokens: int, finish_reasons: Sequence[str | None]) -> None:
    """The current request's token counts and finish reasons, as its response's usage reports them."""
    if ACTIVE is None:
        return
    from opentelemetry import trace

    span = trace.get_current_span()
    span.set_attribute("gen_ai.usage.input_tokens", prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", completion_tokens)
    span.set_attribute("gen_ai.response.finish_reasons", [r or "stop" for r in finish_reasons])


class SequenceSpans:
    """One generated sequence's timeline, made into ``queue``, ``prefill`` and ``decode`` spans at its end (the
    children of the span current when it was made). Times are wall-clock nanoseconds, as spans take them."""

    __slots__ = ("_parent", "entered", "first_token", "prefill_started")

    def __init__(self) -> None:
        from opentelemetry import context

        self._parent = context.get_current()
        self.entered = time.time_ns()
        self.prefill_started: int | None = None
        self.first_token: int | None = None

    def token(self, prefill_started: int | None) -> None:
        """The first token came; ``prefill_started``: when the engine began its prefill, if the engine says."""
        self.first_token = time.time_ns()
        self.prefill_started = prefill_started

    def end(self, tokens: int, finish_reason: str | None, prompt_tokens: int) -> None:
        tracing = ACTIVE
        if tracing is None:
            return
        now = time.time_ns()
        tracer = tracing.tracer

        def record(name: str, start: int, end: int, **attributes: Any) -> None:
            span = tracer.start_span(name, context=self._parent, start_time=start, attributes=attributes)
            span.end(end_time=end)

        first = self.first_token
        prefill = self.prefill_started
        if prefill is not None and first is not None and self.entered <= prefill <= first:
            record("queue", self.entered, prefill)
            record("prefill", prefill, first, **{"gen_ai.usage.input_tokens": prompt_tokens})
        elif first is not None:  # an engine that does not say when it took the sequence: the wait is in prefill
            record("prefill", self.entered, first, **{"gen_ai.usage.input_tokens": prompt_tokens,
                                                      "universal_runtime.includes_queue": True})  # fmt: skip
        else:  # ended before a first token (refused, failed, cancelled)
            record("queue", self.entered, now)
            return
        record("decode", first, now, **{"gen_ai.usage.output_tokens": tokens,
                                        "gen_ai.response.finish_reasons": [finish_reason or "stop"]})  # fmt: skip


def sequence_spans() -> SequenceSpans | None:
    """A sequence's timeline recorder, or None when tracing is off (or its request is not sampled)."""
    if ACTIVE is None:
        return None
    from opentelemetry import trace

    return SequenceSpans() if trace.get_current_span().is_recording() else None
