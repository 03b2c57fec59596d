"""What the gateway bounds: request limits, the per-model concurrency gate with its queue, and the requests held
while a model wakes."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass

from universal_predictors.errors import APIError

MiB = 2**20


@dataclass
class GatewayLimits:
    """Request limits; beyond the queue a request gets 429 with Retry-After."""

    max_body_bytes: int = 32 * MiB
    max_concurrency_per_model: int = 64
    max_queue_per_model: int = 256
    #: Requests held per model while it wakes (a model's ``scaling.maxHeldRequests`` overrides it); one more gets
    #: 429 with Retry-After from the expected wake time.
    max_held_per_model: int = 128
    #: A held streaming request gets its answer's head at once and an SSE comment this often (seconds) until the
    #: model answers, so that proxies with a read timeout (ingress-nginx: 60 s) keep it; 0: no keep-alive.
    wake_keepalive_s: float = 15.0
    connect_timeout: float = 5.0
    read_timeout: float = 600.0
    #: How long a client may pause while sending a request before it gets 408.
    receive_timeout: float = 60.0
    #: How long after its first byte a request's line and headers must be complete (408 after).
    head_timeout: float = 30.0
    #: Open client connections; one more is answered 503 and closed.
    max_connections: int = 1024
    #: Request body bytes held at once across every connection; a body that would go over gets 503.
    max_buffered_bytes: int = 256 * MiB


class ModelGate:
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


class WakeWaits:
    """Requests held while a model wakes, per model, within a bound; and how long wakes take (an average of the
    recent ones, what Retry-After says to a request turned away)."""

    #: What a model's first wake is expected to take, before one has been measured (seconds).
    FIRST_WAKE_S = 30.0
    #: Weight of the newest wake in the average.
    NEWEST = 0.3

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.expected_s: dict[str, float] = {}
        #: When the first request still held for each model arrived (monotonic): how far its wake has come.
        self.since: dict[str, float] = {}
        self.refused = 0

    def enter(self, name: str, limit: int) -> None:
        """Count a request held for ``name``'s wake; 429 beyond ``limit``. :meth:`leave` once it is no longer
        held: the model answered, the wake failed, or the client left (the wake goes on for the others)."""
        if self.held.get(name, 0) >= limit:
            self.refused += 1
            expected = self.expected_s.get(name, self.FIRST_WAKE_S)
            waited = time.monotonic() - self.since.get(name, time.monotonic())
            raise APIError(
                f"The model {name!r} is waking and already holds {limit} requests (its scaling.maxHeldRequests, or "
                f"the gateway's --max-held-requests); retry in about {math.ceil(expected)} s.",
                status_code=429,
                code="rate_limit_exceeded",
                retry_after=max(1, math.ceil(expected - waited)),
            )
        if not self.held.get(name):
            self.since[name] = time.monotonic()
        self.held[name] = self.held.get(name, 0) + 1

    def leave(self, name: str) -> None:
        self.held[name] -= 1

    def woke(self, name: str, seconds: float) -> None:
        previous = self.expected_s.get(name)
        self.expected_s[name] = seconds if previous is None else self.NEWEST * seconds + (1 - self.NEWEST) * previous
