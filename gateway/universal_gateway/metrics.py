"""The gateway's Prometheus series, per model, on its own registry (``GET /metrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: What the metrics count for a request whose client left first (nginx's code; the predictors use it too).
CLIENT_CLOSED = 499


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
        self.wakes = Counter("universal_gateway_wakes_total", "Wakes of a model from zero (or stopped).", ["model"],
                             registry=r)  # fmt: skip
        self.wake_steps = Histogram("universal_gateway_wake_step_seconds",
                                    "Time a waking model spent in each step (Starting, Loading; on a cluster "
                                    "Scheduling, Pulling image, Downloading, Loading).",
                                    ["model", "step"], buckets=wake_buckets, registry=r)  # fmt: skip
        self.held = Gauge("universal_gateway_held_requests", "Requests held while their model wakes.", ["model"],
                          registry=r)  # fmt: skip
        self.keys_reload_errors = Counter("universal_gateway_api_keys_reload_errors_total",
                                          "Changed API keys files that could not be read (the keys before kept).",
                                          registry=r)  # fmt: skip
        self.key_secrets_invalid = Gauge("universal_gateway_api_key_secrets_invalid",
                                         "Labelled API key Secrets skipped: no valid key, or an id or secret another "
                                         "key has (each named in the log and a Warning Event on it).",
                                         registry=r)  # fmt: skip
        self.store_errors = Counter("universal_gateway_limits_store_errors_total",
                                    "Calls to the Redis that keeps the limits and the usage ledger for every replica "
                                    "that failed, by use (limits: kept in this replica's memory meanwhile; usage: "
                                    "buffered here until written).", ["use"], registry=r)  # fmt: skip
        self.usage_dropped = Counter("universal_gateway_usage_records_dropped_total",
                                     "Usage records lost: Redis could not be reached and the buffer was full, or the "
                                     "gateway stopped before it could write them.", registry=r)  # fmt: skip
        self.held_rejected = Counter("universal_gateway_held_rejected_total",
                                     "Requests refused (429) because their model already held maxHeldRequests.",
                                     ["model"], registry=r)  # fmt: skip


class ModelSeries:
    """One model's metric children, made once (``labels()`` takes a lock and builds a key on every call,
    five times a request otherwise)."""

    __slots__ = ("_metrics", "_name", "_requests", "in_flight", "latency", "ttfb")

    def __init__(self, name: str, metrics: GatewayMetrics) -> None:
        self._name = name
        self._metrics = metrics
        self.in_flight = metrics.in_flight.labels(name)
        self.latency = metrics.latency.labels(name)
        self.ttfb = metrics.ttfb.labels(name)
        self._requests: dict[int, Any] = {}

    def count(self, status: int) -> None:
        counter = self._requests.get(status)
        if counter is None:
            counter = self._requests[status] = self._metrics.requests.labels(self._name, str(status))
        counter.inc()

    def woke(self, waited_s: float) -> None:
        """A request that found the model asleep, and how long it waited for it."""
        self._metrics.cold_starts.labels(self._name).inc()
        self._metrics.wake.labels(self._name).observe(waited_s)
