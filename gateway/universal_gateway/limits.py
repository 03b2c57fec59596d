"""The gateway's request limits: their one set of defaults, which ``universal-runtime serve`` and ``gateway``
offer as options and the Helm chart's values repeat (a chart test holds the two equal)."""

from __future__ import annotations

from dataclasses import dataclass

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
