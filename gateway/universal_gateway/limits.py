"""What the gateway bounds: request limits, the per-model concurrency gate with its queue, and the requests held
while a model wakes."""

from __future__ import annotations

import asyncio
import collections
import itertools
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
    """Per-model concurrency with a bounded queue, shared fairly between API keys.

    When the model is saturated (its ``max_concurrency_per_model`` requests running), a freed place goes to the
    queued request of the key that has been served least: a virtual token counter per key (Sheng et al., "Fairness
    in Serving Large Language Models", OSDI 2024), counting one per request let through and then the tokens its
    answer used (:meth:`charge`: input tokens, output tokens twice, as that paper weighs decoding). A key that starts
    queueing is lifted to the least counter among the keys already queued (or the last one served), so that a key
    idle for an hour does not bank an hour of priority. Within one key, first come first served. With one key (or
    none) this is the plain FIFO queue it was.
    """

    #: What an output token counts against an input token.
    OUTPUT_WEIGHT = 2.0

    def __init__(self, concurrency: int, queue: int, *, fair: bool = True) -> None:
        self._free = concurrency
        self._queue = queue
        #: False: first come first served across keys too (what the bench compares the fair order with).
        self.fair = fair
        self._arrivals = itertools.count()
        self._waiting: dict[str, collections.deque[tuple[int, asyncio.Future[None]]]] = {}
        self._queued = 0
        #: Service each key has had (requests let through, tokens used): who goes first when places are scarce.
        self.counters: dict[str, float] = {}
        self._last_served = 0.0

    def slot(self, who: str = "-") -> _Slot:
        """``async with gate.slot(key_id):`` a place for one request of ``who``."""
        return _Slot(self, who)

    async def __aenter__(self) -> None:  # a request without a key
        await self.acquire("-")

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    async def acquire(self, who: str) -> None:
        if self._free > 0 and not self._queued:
            self._free -= 1
            self._served(who)
            return
        if self._queued >= self._queue:
            raise APIError(
                "Too many requests are queued for this model; retry shortly.",
                status_code=429,
                code="rate_limit_exceeded",
                retry_after=1,
            )
        if not self._waiting.get(who):  # it starts queueing: no credit banked while it was away
            queued = [self.counters.get(k, 0.0) for k in self._waiting]
            floor = min(queued) if queued else self._last_served
            self.counters[who] = max(self.counters.get(who, 0.0), floor)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(who, collections.deque()).append((next(self._arrivals), turn))
        self._queued += 1
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # given the place just as it left: pass it on
                self.release()
            else:
                queue = self._waiting[who]
                queue.remove(next(entry for entry in queue if entry[1] is turn))
                self._queued -= 1
                if not queue:
                    del self._waiting[who]
            raise

    def release(self) -> None:
        while self._queued:
            if self.fair:
                who = min(self._waiting, key=lambda k: self.counters.get(k, 0.0))
            else:
                who = min(self._waiting, key=lambda k: self._waiting[k][0][0])
            _, turn = self._waiting[who].popleft()
            self._queued -= 1
            if not self._waiting[who]:
                del self._waiting[who]
            if not turn.done():
                self._served(who)
                turn.set_result(None)
                return
        self._free += 1

    def _served(self, who: str) -> None:
        self.counters[who] = self.counters.get(who, 0.0) + 1.0
        self._last_served = self.counters[who]

    def charge(self, who: str, input_tokens: int, output_tokens: int) -> None:
        """Count the tokens a request of ``who`` used toward its key's share."""
        if input_tokens or output_tokens:
            self.counters[who] = self.counters.get(who, 0.0) + input_tokens + self.OUTPUT_WEIGHT * output_tokens


class _Slot:
    __slots__ = ("_gate", "_who")

    def __init__(self, gate: ModelGate, who: str) -> None:
        self._gate, self._who = gate, who

    async def __aenter__(self) -> None:
        await self._gate.acquire(self._who)

    async def __aexit__(self, *exc: object) -> None:
        self._gate.release()


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
