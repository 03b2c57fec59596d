"""OpenTelemetry traces: off unless the environment asks for them, and then exported over OTLP/HTTP.

The switch is the SDK's own (opentelemetry-sdk 1.45.2, ``opentelemetry/sdk/_configuration/__init__.py``,
``_get_exporter_names``): ``OTEL_TRACES_EXPORTER`` unset or ``none`` means no exporter, so no traces; ``otlp``
exports over OTLP with HTTP/protobuf (the only protocol installed: no gRPC). ``OTEL_SDK_DISABLED=true`` turns
everything off whatever else is set (``opentelemetry/sdk/environment_variables``). The rest is read as the
specification names it: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (``/v1/traces`` appended) or
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (as given), ``..._HEADERS``, ``_TIMEOUT``, ``_COMPRESSION``, ``_CERTIFICATE``
(by the SDK's own OTLP/HTTP exporter, which sends each batch, on its urllib3 transport unless a proxy is set:
:func:`export_transport`); ``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES``
(the SDK's ``Resource.create``); ``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` (default
``parentbased_always_on``: a predictor follows the gateway's decision); ``OTEL_BSP_SCHEDULE_DELAY``,
``_MAX_QUEUE_SIZE``, ``_MAX_EXPORT_BATCH_SIZE``, ``_EXPORT_TIMEOUT`` for the batching. Context travels as W3C Trace
Context (``traceparent``, ``tracestate``).

Spans are recorded here, not with the SDK's ``Tracer``: a request's spans are known whole when they end (names,
ids, times, a few attributes), and the SDK spends about 30 us making each and 25 us encoding it for export, on the
gateway's one event loop (bench/gateway.py --part tracing). Here a span is a small object, queued when it ends;
a thread encodes the queued spans to OTLP protobuf (the encoding of repeated attributes cached), off the event loop,
and sends them in batches.

Off, nothing of the SDK is imported and no span object is made: :data:`ACTIVE` is None, the hooks return their
arguments or a shared no-op, and callers pay one global load and a comparison. On, the predictor's spans are
``predictor.request`` (a server span, the child of the caller's ``traceparent``) with ``parse``, and per generated
sequence ``queue`` (waiting for the engine to take it into a batch), ``prefill`` (to the first token) and ``decode``
(to the last), with the GenAI semantic conventions' attributes (``gen_ai.*``: model, operation, token counts, finish
reasons). No request or response body is ever recorded. The gateway's spans (``universal_gateway.tracing``) use the
same sampler and export, each request's kept as one :class:`Record` until the export thread encodes it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import functools
import logging
import os
import random
import struct
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

logger = logging.getLogger(__name__)

#: The exporters this project installs (``OTEL_TRACES_EXPORTER`` may name several, comma-separated).
EXPORTERS = ("otlp",)
#: The OTLP protocols installed: HTTP/protobuf only (opentelemetry-exporter-otlp-proto-http).
PROTOCOLS = ("http/protobuf",)
#: The samplers of the specification's OTEL_TRACES_SAMPLER this recorder implements (the SDK's ``_KNOWN_SAMPLERS``,
#: opentelemetry-sdk 1.45.2 ``opentelemetry/sdk/trace/sampling.py``).
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on", "parentbased_always_off",
            "parentbased_traceidratio")  # fmt: skip
#: The W3C Trace Context headers (https://www.w3.org/TR/trace-context/): replaced, not relayed, by a traced proxy.
TRACE_CONTEXT_HEADERS = ("traceparent", "tracestate")
#: OTLP span kinds (opentelemetry/proto/trace/v1/trace.proto, Span.SpanKind).
INTERNAL, SERVER, CLIENT = 1, 2, 3


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
    exporters = list(dict.fromkeys(n.strip() for n in names.split(",") if n.strip() and n.strip() != "none"))
    for name in exporters:
        if name not in EXPORTERS:
            raise TracingConfigError(
                f"OTEL_TRACES_EXPORTER={name}: not installed here; give {' or '.join(EXPORTERS)} (or none)"
            )
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


# -- OTLP protobuf, by hand (opentelemetry-proto 1.45.2: trace/v1/trace.proto, common/v1/common.proto) ---------------


_BYTES = [bytes((n,)) for n in range(0x80)]


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _BYTES[n]
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_TAGS = {number: _varint(number << 3 | 2) for number in range(1, 16)}


def _field(number: int, data: bytes) -> bytes:
    """A length-delimited field."""
    size = len(data)
    return _TAGS[number] + (_BYTES[size] if size < 0x80 else _varint(size)) + data


def _any_value(value: Any) -> bytes:
    """An AnyValue: string 1, bool 2, int 3, double 4, array 5."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + struct.pack("<d", value)
    if isinstance(value, str):
        return _field(1, value.encode())
    return _field(5, b"".join(_field(1, _any_value(v)) for v in value))


_KEY_VALUES: dict[tuple[str, Any], bytes] = {}


def _key_value(key: str, value: Any, number: int = 9) -> bytes:
    """A KeyValue as field ``number`` (a Span's attributes: 9); those of strings, booleans and integers cached
    (routes, model names, statuses and token counts repeat from request to request)."""
    if isinstance(value, float | list) or number != 9:
        return _field(number, _field(1, key.encode()) + _field(2, _any_value(value)))
    cached = _KEY_VALUES.get((key, value))
    if cached is None:
        cached = _field(9, _field(1, key.encode()) + _field(2, _any_value(value)))
        if len(_KEY_VALUES) < 8192:
            _KEY_VALUES[(key, value)] = cached
    return cached


_NAMES: dict[str, bytes] = {}


def _name(name: str) -> bytes:
    """A span's name field (field 5), cached: a handful of names recur."""
    cached = _NAMES.get(name)
    if cached is None:
        cached = _NAMES[name] = _field(5, name.encode())
    return cached


#: A span's ids, as its fields 1 and 2 (trace_id, 16 bytes; span_id, 8), big-endian as the bytes of the hex id.
_IDS = struct.Struct(">2sQQ2sQ").pack
_TRACE_HALF = (1 << 64) - 1
#: Its kind (field 6, varint) and times (fields 7 and 8, fixed64 nanoseconds), in one call.
_KIND_TIMES = struct.Struct("<2scQcQ").pack
_KINDS = {kind: bytes((0x30, kind)) for kind in (INTERNAL, SERVER, CLIENT)}
_ERROR_STATUS = _field(15, b"\x18\x02")  # Status{code: STATUS_CODE_ERROR}
_PARENT = b"\x22\x08"


# -- spans ------------------------------------------------------------------------------------------------------------


class Span:
    """One span as this process records it; queued for export when it ends (if sampled)."""

    __slots__ = ("attributes", "error", "finish", "kind", "name", "parent_id", "sampled", "span_id", "start",
                 "trace_id", "tracestate")  # fmt: skip

    def __init__(self, name: str, kind: int, trace_id: int, span_id: int, parent_id: int, sampled: bool,
                 tracestate: str, start: int, attributes: dict[str, Any]) -> None:  # fmt: skip
        self.name = name
        self.kind = kind
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.sampled = sampled
        self.tracestate = tracestate
        self.start = start
        self.attributes = attributes
        self.error = False
        self.finish = 0  # its end (ns), once it ended

    def set_attribute(self, key: str, value: Any) -> None:
        self.attributes[key] = value

    def traceparent(self) -> dict[str, str]:
        """The W3C headers that make this span the parent of what the receiver starts."""
        headers = {"traceparent": f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"}
        if self.tracestate:
            headers["tracestate"] = self.tracestate
        return headers

    def header_lines(self) -> bytes:
        """:meth:`traceparent`'s headers as the lines of an HTTP/1.1 head."""
        lines = b"traceparent: 00-%032x-%016x-%s\r\n" % (self.trace_id, self.span_id, b"01" if self.sampled else b"00")
        if self.tracestate:
            lines += b"tracestate: " + self.tracestate.encode("latin-1") + b"\r\n"
        return lines

    def end(self, end: int | None = None) -> None:
        """The span ends (now, or at ``end`` ns): queued as it is, for the export thread to encode (:func:`encode`;
        :class:`Batches`). Nothing changes a span once it ended."""
        tracing = ACTIVE
        if not self.sampled or tracing is None:
            return
        self.finish = time.time_ns() if end is None else end
        tracing.batches.add(self)


def encode(span: Span | Record) -> bytes:
    """An ended span as a ScopeSpans' span (its field 2), OTLP protobuf; a :class:`Record`'s spans, one after the
    other (:meth:`Record.encoded`)."""
    if not isinstance(span, Span):
        return span.encoded()
    # A copy taken in one step (list() of a dict's items runs in C, under the GIL): this runs on the export thread.
    attributes = encode_attributes(list(span.attributes.items()))
    return encode_span(span.trace_id, span.span_id, span.parent_id, span.tracestate, span.name, span.kind,
                       span.start, span.finish, attributes, span.error)  # fmt: skip


def encode_attributes(items: Iterable[tuple[str, Any]]) -> bytes:
    """Attributes as a Span's KeyValues (its field 9), each looked up in the cache by its (key, value) item; None
    values left out."""
    cached = _KEY_VALUES.get
    parts = []
    for item in items:
        value = item[1]
        if value is None:
            continue
        parts.append(_key_value(*item) if type(value) is list else cached(item) or _key_value(*item))
    return b"".join(parts)


def encode_span(trace_id: int, span_id: int, parent_id: int, tracestate: str, name: str, kind: int, start: int,
                end: int, attributes: bytes, error: bool) -> bytes:  # fmt: skip
    """One span as a ScopeSpans' span (its field 2), its ``attributes`` encoded already (:func:`encode_attributes`).
    Written out (the export thread runs it for every span): the ids and times packed by two Structs."""
    parts = [
        _IDS(b"\x0a\x10", trace_id >> 64, trace_id & _TRACE_HALF, b"\x12\x08", span_id),
        _NAMES.get(name) or _name(name),
        _KIND_TIMES(_KINDS[kind], b"\x39", start, b"\x41", end),
    ]
    if parent_id:
        parts += (_PARENT, parent_id.to_bytes(8, "big"))
    if tracestate:
        parts.append(_field(3, tracestate.encode()))
    parts.append(attributes)
    if error:
        parts.append(_ERROR_STATUS)
    body = b"".join(parts)
    size = len(body)
    return b"\x12" + (_BYTES[size] if size < 0x80 else _varint(size)) + body


class Record(Protocol):
    """Spans kept as something other than :class:`Span` objects until the export thread encodes them (the gateway's
    requests: ``universal_gateway.tracing.RequestTrace``): one entry of :class:`Batches`, however many spans."""

    #: How many spans :meth:`encoded` made (set by it).
    spans: int

    def encoded(self) -> bytes:
        """Its spans, each as a ScopeSpans' span (:func:`encode_span`), one after the other."""


#: The span of the request this task is serving (its children's parent).
CURRENT: contextvars.ContextVar[Span | None] = contextvars.ContextVar("universal_runtime_span", default=None)


class Remote:
    """A caller's span, from its ``traceparent`` (https://www.w3.org/TR/trace-context/#traceparent-header)."""

    __slots__ = ("sampled", "span_id", "trace_id", "tracestate")

    def __init__(self, trace_id: int, span_id: int, sampled: bool, tracestate: str) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.sampled = sampled
        self.tracestate = tracestate


def extract(headers: Mapping[str, str]) -> Remote | None:
    """The caller's span context from ``traceparent`` (and ``tracestate``), or None without a valid one."""
    header = headers.get("traceparent")
    if not header:
        return None
    parts = header.strip().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff" or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    if parts[0] == "00" and len(parts) != 4:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    if not trace_id or not span_id:
        return None
    return Remote(trace_id, span_id, bool(flags & 1), headers.get("tracestate", "")[:512])


class Sampler:
    """OTEL_TRACES_SAMPLER's decision for a new span, as the SDK's samplers take it (``sampling.py``)."""

    def __init__(self, name: str, ratio: float) -> None:
        self.parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        # TraceIdRatioBased: sampled when the trace id's low 64 bits are below round(rate * 2**64).
        self.bound = {"always_on": 1 << 64, "always_off": 0}.get(root, round(ratio * (1 << 64)))

    def sampled(self, trace_id: int, parent: Span | Remote | None) -> bool:
        if parent is not None and self.parent_based:
            return parent.sampled
        return trace_id & 0xFFFFFFFFFFFFFFFF < self.bound


def sampler_from_env(environ: Mapping[str, str]) -> Sampler:
    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower() or "parentbased_always_on"
    if name not in SAMPLERS:
        raise TracingConfigError(f"OTEL_TRACES_SAMPLER={name}: not one of {', '.join(SAMPLERS)}")
    ratio = 1.0
    if name.endswith("traceidratio"):
        arg = environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0")
        try:
            ratio = float(arg)
        except ValueError:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg}: give a number from 0 to 1") from None
        if not 0.0 <= ratio <= 1.0:
            raise TracingConfigError(f"OTEL_TRACES_SAMPLER_ARG={arg}: give a number from 0 to 1")
    return Sampler(name, ratio)


#: Spans the export thread encodes between two offers of the GIL (about 2 us each: :class:`Batches`); and when it is
#: behind.
ENCODED_BETWEEN_YIELDS, BEHIND_BETWEEN_YIELDS = 8, 64


class Batches:
    """Ended spans waiting for export, encoded and sent by a thread in batches (the SDK's BatchSpanProcessor's rules:
    every ``OTEL_BSP_SCHEDULE_DELAY`` ms, or at once when a batch is full; beyond the queue's size spans are dropped).

    The thread encodes, not the event loop that ended the spans: their encoding was about half of what tracing cost a
    proxied request on the gateway's loop (bench/gateway.py --part tenants). It gives the GIL up every
    :data:`ENCODED_BETWEEN_YIELDS` spans (``os.sched_yield``, which releases it): a thread that holds the GIL running
    Python keeps a loop that wants it waiting for the switch interval, 5 ms (measured on one core: the loop's wake-up
    late by 5.1 ms at the median against 0.1 ms with the yields, the same as with the thread idle). A loop that never
    waits (a saturated gateway) leaves the thread the GIL only once per switch interval, too little to encode 8 spans
    at a time of what it ends (measured: half the spans were dropped): with a batch or more still waiting the thread
    encodes 64 at a time, and once :attr:`encode_from` spans are queued :meth:`add` encodes an ending span itself, as
    the loop did before, so the queue holds both.

    An entry of the queue is a :class:`Span` or a :class:`Record` (the gateway keeps a request's two to four spans as
    one): ``OTEL_BSP_MAX_QUEUE_SIZE`` and :attr:`encode_from` count entries, a batch and the offers of the GIL count
    the spans encoded (a batch may pass ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE`` by the spans of its last entry)."""

    def __init__(self, send: Callable[[list[bytes]], None], environ: Mapping[str, str]) -> None:
        def number(name: str, default: int) -> int:
            value = environ.get(name, "").strip()
            if not value:
                return default
            if not value.isdigit():
                raise TracingConfigError(f"{name}={value}: give a whole number")
            return int(value)

        self.delay_s = number("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.max_queue = number("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        self.batch = max(1, min(number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512), self.max_queue))
        self.timeout_s = number("OTEL_BSP_EXPORT_TIMEOUT", 30000) / 1000
        #: Queued spans from which an ending span is encoded by the thread that ends it: half the queue (a batch
        #: if that is more).
        self.encode_from = max(self.batch, self.max_queue // 2)
        self.dropped = 0
        self._send = send
        self._queue: collections.deque[Span | Record | bytes] = collections.deque()  # bytes: encoded as it ended
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="otlp-traces", daemon=True)
        self._thread.start()

    def add(self, span: Span | Record) -> None:
        queue = self._queue
        waiting = len(queue)
        if waiting >= self.max_queue:
            self.dropped += 1
            return
        # Encoded here, by the thread that ended it, only when the export thread is behind (encode_from).
        queue.append(span if waiting < self.encode_from else encode(span))
        if waiting + 1 >= self.batch and not self._wake.is_set():  # set() takes the event's lock each time
            self._wake.set()

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.delay_s)
            self._wake.clear()
            self._drain()
        self._drain()

    def _drain(self) -> None:
        queue = self._queue
        while queue:
            spans: list[bytes] = []
            encoded = 0  # spans in this batch: an entry encoded here may be a Record's several
            offer = ENCODED_BETWEEN_YIELDS
            while queue and encoded < self.batch:
                span = queue.popleft()
                kind = type(span)
                if kind is bytes:
                    spans.append(span)  # type: ignore[arg-type]
                    encoded += 1
                else:
                    spans.append(encode(span))  # type: ignore[arg-type]
                    encoded += 1 if kind is Span else span.spans  # type: ignore[union-attr]
                if encoded >= offer:
                    os.sched_yield()
                    # Behind (a batch or more still waiting), in longer slices: each costs a switch interval's wait.
                    offer = encoded + (ENCODED_BETWEEN_YIELDS if len(queue) < self.batch else BEHIND_BETWEEN_YIELDS)
            try:
                self._send(spans)
            except Exception:  # an export that fails loses its batch, never the request path
                logger.exception("exporting %d spans failed", len(spans))

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(self.timeout_s)


class Tracing:
    """Tracing on: the sampler, the resource, and the batches for the exporter."""

    def __init__(self, sampler: Sampler, batches: Batches) -> None:
        self.sampler = sampler
        self.batches = batches
        self._ids = random.Random()  # the SDK's RandomIdGenerator draws from `random` too

    def start(self, name: str, kind: int = INTERNAL, parent: Span | Remote | None = None,
              attributes: dict[str, Any] | None = None, start: int | None = None) -> Span:  # fmt: skip
        """A new span, the child of ``parent`` (None: the current span; a new trace without one)."""
        if parent is None:
            parent = CURRENT.get()
        bits = self._ids.getrandbits
        if parent is None:
            trace_id, parent_id, tracestate = bits(128) or 1, 0, ""
        else:
            trace_id, parent_id, tracestate = parent.trace_id, parent.span_id, parent.tracestate
        return Span(name, kind, trace_id, bits(64) or 1, parent_id, self.sampler.sampled(trace_id, parent),
                    tracestate, start if start is not None else time.time_ns(), attributes or {})  # fmt: skip

    def shutdown(self) -> None:
        """Export what is still queued (bounded by ``OTEL_BSP_EXPORT_TIMEOUT``), then stop."""
        self.batches.shutdown()


def start(service_name: str, environ: Mapping[str, str] = os.environ,
          attributes: Mapping[str, str] | None = None) -> Tracing | None:  # fmt: skip
    """Tracing as the environment configures it (module docstring), or None when it is off. ``service_name`` is the
    default for ``OTEL_SERVICE_NAME``; ``attributes`` are more resource attributes (``OTEL_RESOURCE_ATTRIBUTES``
    overrides them)."""
    if not exporters_from_env(environ):
        return None
    sampler = sampler_from_env(environ)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource

    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME, which win over what is given here.
    resource = Resource.create({"service.name": service_name, **(attributes or {})})
    encoded_resource = _field(1, b"".join(_key_value(k, v, 1) for k, v in resource.attributes.items()))
    scope = _field(1, _field(1, b"universal_runtime"))  # ScopeSpans.scope: InstrumentationScope{name}
    # The SDK's exporter reads the endpoint, headers, timeout, compression and certificates from OTEL_EXPORTER_OTLP_*;
    # its client sends a serialized ExportTraceServiceRequest with retries (opentelemetry-exporter-otlp-proto-http
    # 1.45.2, trace_exporter/__init__.py: export() encodes the SDK's spans, then calls self._client.export(bytes)).
    exporter = OTLPSpanExporter(_transport=export_transport())

    def send(spans: list[bytes]) -> None:
        request = _field(1, encoded_resource + _field(2, scope + b"".join(spans)))  # ResourceSpans{resource, scope}
        result = exporter._client.export(request)
        if not result.success:
            logger.warning("%d spans not exported: %s", len(spans), result.error or result.status_code)

    return Tracing(sampler, Batches(send, environ))


def export_transport() -> Any:
    """The SDK's urllib3 transport for the exporter's POSTs, with the TLS files it would give its default (requests)
    transport; None (that default) where the environment names a proxy or a credential provider.

    The exporter's client (the SDK's: retries, compression, headers, timeout) hands each request to a transport;
    its default is a ``requests.Session``, which merges the environment into every call (proxies, ``.netrc``,
    certificate bundles: files looked up each time). Measured against the trivial upstream (bench/gateway.py), an
    export of 100 KB took 0.66 ms of its thread's CPU with requests and 0.30 ms with urllib3; that CPU is held under
    the GIL, which the gateway's event loop then waits for, six or seven times a second with every request traced.
    Where a proxy variable is set (``HTTPS_PROXY`` and the rest, as ``urllib.request.getproxies`` reads them) the
    default stays: requests honours them and urllib3's pool does not. Otherwise the two differ only in requests'
    ``.netrc`` lookup and redirects (urllib3's transport follows none; an OTLP receiver answers, it does not
    redirect). The TLS files are resolved as the SDK resolves them (opentelemetry-exporter-otlp-proto-http 1.45.2,
    ``_common/__init__.py``, ``_build_transport``): the traces' own variable, else the general one."""
    import urllib.request

    from opentelemetry.exporter.http.transport._urllib3 import Urllib3HTTPTransport
    from opentelemetry.sdk.environment_variables import (
        OTEL_EXPORTER_OTLP_CERTIFICATE,
        OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE,
        OTEL_EXPORTER_OTLP_CLIENT_KEY,
        OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE,
        OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE,
        OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY,
    )

    environ = os.environ  # what both transports read
    proxies = {scheme for scheme, url in urllib.request.getproxies_environment().items() if url and scheme != "no"}
    if proxies or any(environ.get(name) for name in CREDENTIAL_PROVIDERS):
        return None
    verify: bool | str = environ.get(OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE) or environ.get(
        OTEL_EXPORTER_OTLP_CERTIFICATE) or True  # fmt: skip
    key = environ.get(OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY) or environ.get(OTEL_EXPORTER_OTLP_CLIENT_KEY)
    certificate = environ.get(OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE) or environ.get(
        OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE)  # fmt: skip
    return Urllib3HTTPTransport(verify=verify, cert=(certificate, key) if certificate and key else certificate)


#: The SDK's variables naming a credential provider for the traces exporter (it returns a ``requests.Session``, which
#: only the default transport takes): opentelemetry-exporter-otlp-proto-http 1.45.2, ``_common/__init__.py``,
#: ``_load_session_from_envvar``.
CREDENTIAL_PROVIDERS = ("OTEL_PYTHON_EXPORTER_OTLP_HTTP_CREDENTIAL_PROVIDER",
                        "OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER")  # fmt: skip

#: Tracing in this process, once :func:`configure` turned it on; None: off (the default).
ACTIVE: Tracing | None = None


def configure(service_name: str, environ: Mapping[str, str] = os.environ,
              attributes: Mapping[str, str] | None = None) -> Tracing | None:  # fmt: skip
    """Turn tracing on for this process when the environment asks (before any route is bound: the hooks that wrap
    routes decide then). Raises :class:`TracingConfigError` for an environment that asks for what is not here."""
    global ACTIVE
    ACTIVE = start(service_name, environ, attributes)
    if ACTIVE is not None:
        atexit.register(shutdown)  # a process that ends normally (SIGTERM in KServe's server) exports what it holds
        logger.info("tracing on: spans exported over OTLP/HTTP (%s)", environ.get("OTEL_TRACES_SAMPLER") or
                    "parentbased_always_on")  # fmt: skip
    return ACTIVE


def shutdown() -> None:
    """Flush and stop tracing (nothing when off)."""
    global ACTIVE
    tracing = ACTIVE
    if tracing is not None:
        tracing.shutdown()
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


class _Child:
    """A child span of the current one for a ``with`` block, current within it."""

    __slots__ = ("_span", "_token")

    def __init__(self, span: Span) -> None:
        self._span = span

    def __enter__(self) -> Span:
        self._token = CURRENT.set(self._span)
        return self._span

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        CURRENT.reset(self._token)
        if kind is not None:
            self._span.error = True
            self._span.attributes["error.type"] = kind.__name__
        self._span.end()


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
    if tracing is None or CURRENT.get() is None:
        return OFF
    return _Child(tracing.start(name))


def traced_route(answer: Callable[[Any], Awaitable[Any]], operation: str, task: str,
                 model: Callable[[], tuple[str, str]]) -> Callable[[Any], Awaitable[Any]]:  # fmt: skip
    """``answer`` (a route's ``answer(request)``) inside a ``predictor.request`` span, the child of the caller's
    ``traceparent``; ``answer`` itself when tracing is off. ``model``: the served name and backend, asked per request
    (the backend is known once loaded). A streamed answer's span ends with its last byte."""
    tracing = ACTIVE
    if tracing is None:
        return answer
    op = operation_name(operation, task)

    @functools.wraps(answer)
    async def traced(request: Any) -> Any:
        name, backend = model()
        span = tracing.start("predictor.request", SERVER, extract(request.headers), {
            "gen_ai.operation.name": op, "gen_ai.request.model": name, "universal_runtime.backend": backend,
            "universal_runtime.task": task, "http.request.method": request.method, "url.path": request.url.path,
        })  # fmt: skip
        token = CURRENT.set(span)
        ended = True
        try:
            response = await answer(request)
            status = int(getattr(response, "status_code", 200))
            span.attributes["http.response.status_code"] = status
            span.error = status >= 500
            body = getattr(response, "body_iterator", None)
            if body is not None:  # a stream: the span lasts as long as its body
                response.body_iterator = _ending(body, span)
                ended = False
            return response
        except BaseException as exc:
            status = int(getattr(exc, "status_code", 500))
            span.attributes["http.response.status_code"] = status
            span.attributes["error.type"] = type(exc).__name__ if status >= 500 else str(status)
            span.error = status >= 500
            raise
        finally:
            CURRENT.reset(token)
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
    span = CURRENT.get()
    if span is None:
        return
    span.attributes["gen_ai.usage.input_tokens"] = prompt_tokens
    span.attributes["gen_ai.usage.output_tokens"] = completion_tokens
    span.attributes["gen_ai.response.finish_reasons"] = [r or "stop" for r in finish_reasons]


class SequenceSpans:
    """One generated sequence's timeline, made into ``queue``, ``prefill`` and ``decode`` spans at its end (the
    children of the span current when it was made). Times are wall-clock nanoseconds, as spans take them."""

    __slots__ = ("_parent", "_tracing", "entered", "first_token", "prefill_started")

    def __init__(self, tracing: Tracing, parent: Span) -> None:
        self._tracing = tracing
        self._parent = parent
        self.entered = time.time_ns()
        self.prefill_started: int | None = None
        self.first_token: int | None = None

    def token(self, prefill_started: int | None) -> None:
        """The first token came; ``prefill_started``: when the engine began its prefill, if the engine says."""
        self.first_token = time.time_ns()
        self.prefill_started = prefill_started

    def end(self, tokens: int, finish_reason: str | None, prompt_tokens: int) -> None:
        now = time.time_ns()

        def record(name: str, start: int, end: int, **attributes: Any) -> None:
            self._tracing.start(name, INTERNAL, self._parent, attributes, start).end(end)

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
    tracing = ACTIVE
    if tracing is None:
        return None
    parent = CURRENT.get()
    return SequenceSpans(tracing, parent) if parent is not None and parent.sampled else None
