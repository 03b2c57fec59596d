"""What the gateway bounds: request limits and the per-model concurrency gate with its queue."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from universal_predictors.errors import APIError

MiB = 2**20


@dataclass
class GatewayLimits:
    """Request limits; beyond the queue a request gets 429 with Retry-After."""

    max_body_bytes: int = 32 * MiB
    max_concurrency_per_model: int = 64
    max_queue_per_model: int = 256
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
