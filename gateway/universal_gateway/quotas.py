"""Per-key limits: requests and tokens per minute, concurrent requests, and OpenAI's ``x-ratelimit-*`` headers.

Per minute, a limit is a token bucket (as OpenAI describes its own limits): it holds up to the limit, refills
continuously at limit/60 per second, and a request takes one from its requests bucket. Tokens are known only once
the model has counted them, so a request is admitted while its key's token buckets are above zero, and its tokens
are taken as they come: output tokens as they stream (a stream that would take more than is left is cut before
the piece that would, with an error event), input tokens with the answer's usage. A unary answer may take a bucket
below zero; the key's next requests then wait until it has refilled.

Which buckets a request takes from: its key's own (``limits``, over all its requests) and its key's on that model
(the key's ``modelLimits`` for it, else the keys file's default for the model). The headers on every answer to a
limited key say the tighter of the two: ``x-ratelimit-{limit,remaining,reset}-requests`` and ``-tokens`` (the
token bucket, input or output, with the least left), with ``-input-tokens``/``-output-tokens`` each. A refused
request gets 429 in OpenAI's shape (``type`` ``requests`` or ``tokens``, code ``rate_limit_exceeded``) with
``Retry-After`` (and ``retry-after-ms``, which the OpenAI SDKs read first).

Where the levels live is :class:`Counters`: this process (:class:`MemoryCounters`, the local ``serve`` and a single
replica) or Redis, shared by every gateway replica (:mod:`.redis_counters`; far from a limit, each replica admits
from a lease it took there: :mod:`.redis_leases`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from universal_gateway.auth import ApiKeys, Key, Limits
from universal_predictors.errors import APIError

REQUESTS, INPUT, OUTPUT, CONCURRENT = "requests", "input_tokens", "output_tokens", "concurrent"
ANONYMOUS = "-"
#: What a token bucket needs to admit a request: anything above zero.
_ABOVE_ZERO = math.ulp(0.0)


@dataclass(frozen=True, slots=True)
class Bucket:
    """One per-minute limit a request draws on: ``name`` is where its level is kept."""

    name: str
    kind: str  # REQUESTS, INPUT or OUTPUT
    limit: int
    scope: str  # "key" or the model's name: for messages
    #: Its limit as the headers write it, and the header suffixes it may set (made once).
    limit_text: str = field(init=False, compare=False, repr=False)
    suffixes: tuple[str, ...] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "limit_text", str(self.limit))
        object.__setattr__(self, "suffixes", _SUFFIXES[self.kind])


@dataclass(slots=True)
class Level:
    """A bucket's state after a take: what is left (may be below zero) and the seconds until it is full."""

    bucket: Bucket
    remaining: float
    reset_s: float


@dataclass
class Admission:
    """What :meth:`Counters.admit` decided: every bucket's level, and the first that refused, if any."""

    levels: list[Level]
    refused: Level | None = None
    retry_after_s: float = 0.0
    slots_refused: tuple[str, int] | None = None  # (scope, limit) of a concurrency limit reached
    places_from: str = ""  # where its concurrency places were taken (the counters' own word, given back to finish)


class Counters(Protocol):
    """Where bucket levels and concurrency counts live."""

    async def admit(self, buckets: Sequence[Bucket], slots: Sequence[tuple[str, int]], now: float) -> Admission:
        """Atomically: refuse if a requests bucket has less than one left, a token bucket nothing left, or a slot
        counter is at its limit; else take one from each requests bucket and a slot from each counter."""
        ...

    async def take(
        self, takes: Sequence[tuple[Bucket, float]], now: float, *, all_or_nothing: bool
    ) -> list[Level] | None:
        """Atomically take each amount from its bucket, their levels after; with ``all_or_nothing``, None (nothing
        taken) when a bucket has less than its amount left. (One call for all a request's buckets: one round trip
        where the levels are kept in Redis.)"""
        ...

    async def release(self, slots: Sequence[str]) -> None: ...

    async def finish(
        self, takes: Sequence[tuple[Bucket, float]], slots: Sequence[str], now: float, places_from: str = ""
    ) -> None:
        """A request's end: take each amount (a give-back when negative; never all or nothing) and release its
        places (``places_from``: its admission's), in one call (one round trip where they are kept in Redis)."""
        ...

    async def close(self) -> None: ...


def refill(level: float, at: float, limit: int, now: float) -> float:
    return min(float(limit), level + max(0.0, now - at) * limit / 60.0)


def until_full(level: float, limit: int) -> float:
    return max(0.0, (limit - level) * 60.0 / limit)


@dataclass
class MemoryCounters:
    """Levels in this process: exact, but each gateway replica has its own."""

    levels: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (level, when)
    slots: dict[str, int] = field(default_factory=dict)

    def _level(self, bucket: Bucket, now: float) -> float:
        """``refill``'s arithmetic written out (the same operations in the same order, so the levels equal
        RedisCounters' to the last bit, tested): it runs for every bucket of every limited request."""
        kept = self.levels.get(bucket.name)
        if kept is None:
            return float(bucket.limit)
        level, at = kept
        return min(float(bucket.limit), level + max(0.0, now - at) * bucket.limit / 60.0)

    async def admit(self, buckets: Sequence[Bucket], slots: Sequence[tuple[str, int]], now: float) -> Admission:
        # On every request of a limited key: one pass, _level's and until_full's arithmetic written out.
        stored = self.levels
        current = []
        for bucket in buckets:
            kept = stored.get(bucket.name)
            limit = bucket.limit
            level = (
                float(limit) if kept is None else min(float(limit), kept[0] + max(0.0, now - kept[1]) * limit / 60.0)
            )
            if level < (1.0 if bucket.kind == REQUESTS else _ABOVE_ZERO):
                return self._refused(buckets, now, bucket, level)
            current.append(level)
        counts = self.slots
        for name, limit in slots:
            if counts.get(name, 0) >= limit:
                state = [Level(b, lv, until_full(lv, b.limit)) for b, lv in zip(buckets, current, strict=True)]
                return Admission(state, slots_refused=(name, limit), retry_after_s=1.0)
        taken = []
        for bucket, level in zip(buckets, current, strict=True):
            if bucket.kind == REQUESTS:
                level -= 1.0
            stored[bucket.name] = (level, now)
            limit = bucket.limit
            taken.append(Level(bucket, level, max(0.0, (limit - level) * 60.0 / limit)))
        for name, _ in slots:
            counts[name] = counts.get(name, 0) + 1
        return Admission(taken)

    def _refused(self, buckets: Sequence[Bucket], now: float, bucket: Bucket, level: float) -> Admission:
        need = 1.0 if bucket.kind == REQUESTS else _ABOVE_ZERO
        wait = (need - level) * 60.0 / bucket.limit
        state = [Level(b, lv, until_full(lv, b.limit)) for b in buckets for lv in (self._level(b, now),)]
        return Admission(state, Level(bucket, level, until_full(level, bucket.limit)), wait)

    async def take(
        self, takes: Sequence[tuple[Bucket, float]], now: float, *, all_or_nothing: bool
    ) -> list[Level] | None:
        levels = [(bucket, amount, self._level(bucket, now)) for bucket, amount in takes]
        if all_or_nothing and any(level < amount for _, amount, level in levels):
            return None
        taken = []
        for bucket, amount, level in levels:
            after = min(float(bucket.limit), level - amount)  # a give-back (amount < 0) never fills past the limit
            self.levels[bucket.name] = (after, now)
            taken.append(Level(bucket, after, until_full(after, bucket.limit)))
        return taken

    async def release(self, slots: Sequence[str]) -> None:
        for name in slots:
            left = self.slots.get(name, 0) - 1
            if left > 0:
                self.slots[name] = left
            else:
                self.slots.pop(name, None)

    async def finish(
        self, takes: Sequence[tuple[Bucket, float]], slots: Sequence[str], now: float, places_from: str = ""
    ) -> None:
        stored = self.levels
        for bucket, amount in takes:  # take(..., all_or_nothing=False), without the levels nobody reads
            stored[bucket.name] = (min(float(bucket.limit), self._level(bucket, now) - amount), now)
        counts = self.slots
        for name in slots:  # release
            left = counts.get(name, 0) - 1
            if left > 0:
                counts[name] = left
            else:
                counts.pop(name, None)

    async def close(self) -> None:
        return None


def duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: ``17ms``, ``1s``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


class RateLimited(APIError):
    status_code = 429

    def __init__(self, message: str, kind: str, retry_after: float, headers: list[tuple[str, str]]) -> None:
        super().__init__(message, code="rate_limit_exceeded", retry_after=retry_after)
        self.error_type = kind
        self._extra = headers

    def headers(self) -> dict[str, str]:
        wait = max(1, math.ceil(self.retry_after or 1))
        return {
            **dict(self._extra),
            "Retry-After": str(wait),
            "retry-after-ms": str(math.ceil(1000 * (self.retry_after or 1))),
        }


def rate_headers(levels: Sequence[Level]) -> list[tuple[str, str]]:
    """OpenAI's ``x-ratelimit-*`` headers for the buckets a request drew on: per kind of limit, the bucket with the
    least left for its size (``tokens``: input or output, whichever)."""
    tightest: dict[str, tuple[float, Level]] = {}
    for level in levels:
        bucket = level.bucket
        share = level.remaining / bucket.limit
        for suffix in bucket.suffixes:
            held = tightest.get(suffix)
            if held is None or share < held[0]:
                tightest[suffix] = (share, level)
    out: list[tuple[str, str]] = []
    for suffix, (_, level) in tightest.items():
        limit, remaining, reset = _HEADER_NAMES[suffix]
        left = level.remaining
        out += (
            (limit, level.bucket.limit_text),
            (remaining, str(int(left) if left >= 0 else 0)),  # math.floor's, for a level at or above zero
            (reset, duration(level.reset_s)),
        )
    return out


#: The header suffixes a bucket of each kind may set, and each suffix's three header names.
_SUFFIXES = {REQUESTS: ("requests",), INPUT: ("tokens", "input-tokens"), OUTPUT: ("tokens", "output-tokens")}
_HEADER_NAMES = {
    suffix: (f"x-ratelimit-limit-{suffix}", f"x-ratelimit-remaining-{suffix}", f"x-ratelimit-reset-{suffix}")
    for suffix in ("requests", "tokens", "input-tokens", "output-tokens")
}
_KIND_NAMES = {
    REQUESTS: "requests per minute",
    INPUT: "input tokens per minute",
    OUTPUT: "output tokens per minute",
}


def buckets_for(
    key: Key | None, model: str, limits: tuple[Limits, Limits]
) -> tuple[list[Bucket], list[tuple[str, int]]]:
    """The buckets and concurrency counters a request by ``key`` to ``model`` draws on."""
    who = key.id if key is not None else ANONYMOUS
    buckets: list[Bucket] = []
    slots: list[tuple[str, int]] = []
    for scope, prefix, lim in (("key", f"{who}", limits[0]), (model, f"{who}|{model}", limits[1])):
        for kind, value in (
            (REQUESTS, lim.requests_per_minute),
            (INPUT, lim.input_tokens_per_minute),
            (OUTPUT, lim.output_tokens_per_minute),
        ):
            if value is not None:
                buckets.append(Bucket(f"{prefix}|{kind}", kind, value, scope))
        if lim.concurrent_requests is not None:
            slots.append((f"{prefix}|{CONCURRENT}", lim.concurrent_requests))
    return buckets, slots


def _whose(key: Key | None, bucket_scope: str) -> str:
    name = repr(key.id) if key is not None else "the gateway's callers"
    return f"key {name}" if bucket_scope == "key" else f"key {name} on the model {bucket_scope!r}"


#: Output tokens a stream takes from its buckets at a time and then spends as it goes (what is left given back at
#: its end): one counter operation per this many tokens rather than per piece, which matters when the counters
#: are in Redis. A stream near its key's budget takes what each piece needs, so the cut is still exact.
OUTPUT_LEASE = 32


class Ticket:
    """One admitted request's draw on its limits: its headers, its streamed output, its final usage."""

    def __init__(self, quotas: Quotas, key: Key | None, buckets: list[Bucket], slots: list[str],
                 headers: list[tuple[str, str]], places_from: str = "") -> None:  # fmt: skip
        self._quotas = quotas
        self.key = key
        self._buckets = buckets
        self._output_buckets = [b for b in buckets if b.kind == OUTPUT]
        self._slots = slots
        self._places_from = places_from
        self.headers = headers
        self.output_taken = 0  # output tokens spent
        self._leased = 0  # output tokens taken from the buckets and not spent yet
        self._closed = False

    @property
    def limits_output(self) -> bool:
        return bool(self._output_buckets)

    async def _take_output(self, amount: int) -> bool:
        """``amount`` from every output bucket, or from none (one counters call)."""
        takes = [(bucket, float(amount)) for bucket in self._output_buckets]
        return await self._quotas.counters.take(takes, self._quotas.clock(), all_or_nothing=True) is not None

    async def output(self, tokens: int) -> bool:
        """Spend ``tokens`` more streamed output tokens; False (nothing spent) when a bucket has fewer left."""
        if tokens <= 0:
            return True
        if tokens > self._leased:
            need = tokens - self._leased
            if await self._take_output(max(need, OUTPUT_LEASE)):
                self._leased += max(need, OUTPUT_LEASE)
            elif await self._take_output(need):  # near the budget: exactly what this piece needs
                self._leased += need
            else:
                return False
        self._leased -= tokens
        self.output_taken += tokens
        return True

    async def finish(self, input_tokens: int, output_tokens: int) -> None:
        """The request's end: take the answer's input tokens and its output tokens not yet spent as they streamed,
        give back the rest of a lease, and free its concurrency places: one counters call, made once."""
        if self._closed:
            return
        self._closed = True
        unspent = self._leased - max(0, output_tokens - self.output_taken)
        takes = []
        for bucket in self._buckets:
            if bucket.kind == INPUT and input_tokens > 0:
                takes.append((bucket, float(input_tokens)))
            elif bucket.kind == OUTPUT and unspent:
                takes.append((bucket, float(-unspent)))
        self._leased = 0
        self.output_taken = max(self.output_taken, output_tokens)
        if takes or self._slots:
            await self._quotas.counters.finish(takes, self._slots, self._quotas.clock(), self._places_from)


class Quotas:
    """The limits of every key, kept in ``counters``."""

    def __init__(self, keys: ApiKeys, counters: Counters | None = None) -> None:
        self.keys = keys
        self.counters: Counters = counters if counters is not None else MemoryCounters()
        self.clock = time.time  # wall time: Redis-kept levels are shared between machines
        #: (key id, model) -> its buckets and counters, made once per version of the keys.
        self._plans: dict[tuple[str | None, str], tuple[list[Bucket], list[tuple[str, int]]]] = {}
        self._generation = -1

    def _plan(self, key: Key | None, model: str) -> tuple[list[Bucket], list[tuple[str, int]]]:
        if self._generation != self.keys.generation:
            self._plans.clear()
            self._generation = self.keys.generation
        who = key.id if key is not None else None
        plan = self._plans.get((who, model))
        if plan is None:
            if len(self._plans) > 100_000:  # models named by requests: bounded
                self._plans.clear()
            plan = self._plans[(who, model)] = buckets_for(key, model, self.keys.limits(key, model))
        return plan

    async def close(self) -> None:
        await self.counters.close()

    async def admit(self, key: Key | None, model: str) -> Ticket | None:
        """The request's ticket (None: nothing limits it); :class:`RateLimited` when a limit is reached."""
        buckets, slots = self._plan(key, model)
        if not buckets and not slots:
            return None
        admission = await self.counters.admit(buckets, slots, self.clock())
        headers = rate_headers(admission.levels)
        if admission.refused is not None:
            level = admission.refused
            bucket = level.bucket
            kind = "requests" if bucket.kind == REQUESTS else "tokens"
            raise RateLimited(
                f"Rate limit reached for {_whose(key, bucket.scope)} on {_KIND_NAMES[bucket.kind]}: limit "
                f"{bucket.limit}, left {max(0, math.floor(level.remaining))}; retry in "
                f"{math.ceil(admission.retry_after_s)} s.",
                kind,
                admission.retry_after_s,
                headers,
            )
        if admission.slots_refused is not None:
            name, limit = admission.slots_refused
            scope = "key" if name.count("|") == 1 else name.split("|")[1]
            raise RateLimited(
                f"Too many concurrent requests for {_whose(key, scope)}: limit {limit}; retry when one has finished.",
                "requests",
                1.0,
                headers,
            )
        return Ticket(self, key, buckets, [name for name, _ in slots], headers, admission.places_from)
