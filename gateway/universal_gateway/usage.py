"""What each request used, read from the predictors' answers, and the ledger of it per key, model and hour.

Where the counts come from: a unary answer's ``usage`` object (generation, embeddings, rerank, OCR, documents,
anomaly; speech to text's ``{"type": "duration", "seconds": N}``, OpenAI's), and an event stream's usage comments,
which the gateway asks the predictor for (``USAGE_COMMENTS_HEADER``) and takes out before the client sees the stream
(:class:`StreamTap`). So the ledger counts what the engines counted, not an estimate.

The ledger keeps, per key, model and hour: requests, input and output tokens, images, OCR/document pages, anomaly
rows scored, audio seconds transcribed or translated (whole seconds, as the answers bill them), and predictor
seconds (from the request's send to its last byte, the wake included for the request that woke the model). It is
exposed as Prometheus counters (``universal_gateway_usage_*_total{key_id, model}``) and as ``GET /v1/usage``
(:func:`usage_report`). Where the hours are kept is a :class:`UsageLedger`: this process (:class:`Ledger`) or
Redis, shared by every gateway replica (:mod:`.redis_ledger`).
"""

from __future__ import annotations

import csv
import io
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any, Protocol

import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

#: The comment line a predictor's usage comment starts with (``streaming.usage_comment``).
USAGE_COMMENT = b": usage "
HOUR = 3600


@dataclass
class Usage:
    """What one request used (or, in the ledger, many)."""

    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    images: int = 0
    pages: int = 0
    rows: int = 0
    audio_seconds: int = 0
    predictor_seconds: float = 0.0

    def add(self, other: Usage) -> None:
        # Written out rather than a loop over the fields: the ledger adds on every request (test_tenants checks that
        # every field is added, so a field added to the class without a line here fails there).
        self.requests += other.requests
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.images += other.images
        self.pages += other.pages
        self.rows += other.rows
        self.audio_seconds += other.audio_seconds
        self.predictor_seconds += other.predictor_seconds


USAGE_FIELDS = tuple(f.name for f in fields(Usage))


def from_usage_object(usage: Any) -> Usage:
    """A predictor's ``usage`` object (OpenAI's, the Responses and Messages APIs', or a task's own)."""
    if not isinstance(usage, dict):
        return Usage()

    def number(*names: str) -> int:
        for name in names:
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return 0

    return Usage(
        input_tokens=number("prompt_tokens", "input_tokens"),
        output_tokens=number("completion_tokens", "output_tokens"),
        images=number("images"),
        pages=number("pages"),
        rows=number("rows"),
        audio_seconds=number("seconds") if usage.get("type") == "duration" else 0,
    )


def _object_at(payload: bytes, start: int) -> Any:
    """The JSON object that starts at ``payload[start]`` (``{``), read up to its closing brace."""
    depth = 0
    in_string = escaped = False
    for i in range(start, len(payload)):
        c = payload[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:
                in_string = False
        elif c == 0x22:
            in_string = True
        elif c == 0x7B:
            depth += 1
        elif c == 0x7D:
            depth -= 1
            if depth == 0:
                return orjson.loads(payload[start : i + 1])
    raise ValueError("unterminated object")


def unary_usage(payload: bytes) -> Usage:
    """The usage a unary JSON answer reports. Read from its last ``"usage"`` key, where every predictor writes it,
    without parsing the whole answer (an embeddings answer can be megabytes of numbers); the whole answer parsed
    when that fails."""
    at = payload.rfind(b'"usage"')
    if at < 0:
        return Usage()
    brace = payload.find(b"{", at)
    try:
        if brace < 0 or payload[at + 7 : brace].strip() != b":":
            raise ValueError("not an object")
        return from_usage_object(_object_at(payload, brace))
    except ValueError:
        try:
            document = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return Usage()
        found = document.get("usage") if isinstance(document, dict) else None
        if found is None and isinstance(document, dict) and isinstance(document.get("response"), dict):
            found = document["response"].get("usage")
        return from_usage_object(found)


class StreamTap:
    """Takes the usage comments out of an event stream as it is relayed, counting its tokens; ``output`` (if given)
    is asked before each piece of output whether its key has the tokens left (False: the stream is cut there)."""

    def __init__(self, output: Callable[[int], Awaitable[bool]] | None = None) -> None:
        self._output = output
        self._pending = b""
        self.usage = Usage()

    async def feed(self, data: bytes) -> tuple[bytes, bool]:
        """The bytes to relay for ``data`` (whole events only; a partial one waits for its end, which is also when
        a client would see it), and whether the stream is to be cut after them."""
        buffer = self._pending + data if self._pending else data
        end = buffer.rfind(b"\n\n")
        if end < 0:
            self._pending = buffer
            return b"", False
        complete, self._pending = buffer[: end + 2], buffer[end + 2 :]
        if USAGE_COMMENT not in complete:
            return complete, False
        out: list[bytes] = []
        for event in complete.split(b"\n\n")[:-1]:
            if not event.startswith(USAGE_COMMENT):
                out.append(event + b"\n\n")
                continue
            try:
                counts = orjson.loads(event[len(USAGE_COMMENT) :])
                prompt, generated = int(counts["prompt_tokens"]), int(counts["completion_tokens"])
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
            more = generated - self.usage.output_tokens
            if self._output is not None and more > 0 and not await self._output(more):
                return b"".join(out), True
            self.usage.input_tokens = prompt
            self.usage.output_tokens = max(self.usage.output_tokens, generated)
        return b"".join(out), False

    def rest(self) -> bytes:
        """What is left once the upstream's stream ended (an event without its blank line)."""
        rest, self._pending = self._pending, b""
        return rest


class UsageMetrics:
    """The ledger's Prometheus counters, by key id and model: totals kept here and read at each scrape (a collector in
    ``registry``). A request adds to one :class:`Usage`; with a ``Counter`` per field it took a lock per field it
    counted, on the gateway's loop, for every request."""

    FAMILIES = tuple((name, f"universal_gateway_usage_{name}", f"Usage: {name.replace('_', ' ')}.")
                     for name in USAGE_FIELDS)  # fmt: skip

    def __init__(self, registry: CollectorRegistry) -> None:
        #: (key id, model) -> what it used, since this process started.
        self.totals: dict[tuple[str, str], Usage] = {}
        registry.register(self)

    def add(self, key_id: str, model: str, usage: Usage) -> None:
        total = self.totals.get((key_id, model))
        if total is None:
            total = self.totals[(key_id, model)] = Usage()
        total.add(usage)

    def describe(self) -> Iterator[Metric]:
        for _, metric, help_text in self.FAMILIES:
            yield CounterMetricFamily(metric, help_text, labels=("key_id", "model"))

    def collect(self) -> Iterator[Metric]:
        totals = list(self.totals.items())
        for name, metric, help_text in self.FAMILIES:
            family = CounterMetricFamily(metric, help_text, labels=("key_id", "model"))
            for (key_id, model), usage in totals:
                family.add_metric((key_id, model), getattr(usage, name))
            yield family


class UsageLedger(Protocol):
    """Where the ledger's hours are kept."""

    #: Its Prometheus counters (the gateway gives its own when None): each process counts what it served.
    metrics: UsageMetrics | None

    async def record(self, key_id: str, model: str, usage: Usage) -> None: ...

    async def rows(self, start: int, end: int, key_id: str | None) -> list[tuple[int, str, str, Usage]]:
        """Hours from ``start`` to before ``end`` (epoch seconds), for one key or all, in order."""
        ...

    async def close(self) -> None: ...


class Ledger:
    """Usage per key, model and hour, in this process (the local ``serve``, a single gateway replica)."""

    def __init__(self, metrics: UsageMetrics | None = None, clock: Callable[[], float] = time.time) -> None:
        self.hours: dict[tuple[int, str, str], Usage] = {}
        self.metrics = metrics
        self.clock = clock

    async def record(self, key_id: str, model: str, usage: Usage) -> None:
        hour = int(self.clock()) // HOUR * HOUR
        kept = self.hours.get((hour, key_id, model))
        if kept is None:
            kept = self.hours[(hour, key_id, model)] = Usage()
        kept.add(usage)
        if self.metrics is not None:
            self.metrics.add(key_id, model, usage)

    async def rows(self, start: int, end: int, key_id: str | None) -> list[tuple[int, str, str, Usage]]:
        """Hours from ``start`` to before ``end`` (epoch seconds), for one key or all."""
        return sorted(
            (hour, k, m, u)
            for (hour, k, m), u in self.hours.items()
            if start <= hour < end and (key_id is None or k == key_id)
        )

    async def close(self) -> None:
        return None


def usage_report(rows: Iterable[tuple[int, str, str, Usage]], as_csv: bool) -> tuple[bytes, str]:
    """The ledger's hours as JSON (``{"object": "list", "data": [...]}``) or CSV, and the content type."""
    records = [
        {
            "hour": datetime.fromtimestamp(hour, UTC).strftime("%Y-%m-%dT%H:00:00Z"),
            "key_id": key,
            "model": model,
            **asdict(usage),
        }
        for hour, key, model, usage in rows
    ]
    if not as_csv:
        return orjson.dumps({"object": "list", "data": records}), "application/json"
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["hour", "key_id", "model", *(f.name for f in fields(Usage))])
    writer.writeheader()
    writer.writerows(records)
    return out.getvalue().encode(), "text/csv; charset=utf-8"
