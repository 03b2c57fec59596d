"""Per-key limits kept in Redis, so that they hold across every gateway replica (:class:`RedisCounters`).

The same buckets and concurrency counters as :class:`~universal_gateway.quotas.MemoryCounters`, with the same
arithmetic, each call one Lua script (run by its SHA, ``EVALSHA``, the script sent again only when Redis lost it),
on one pipelined connection (:mod:`.redis_pipe`): Redis runs a script alone, so an admission reads and takes every
bucket and slot of a request at once, whichever replica asks.

- **A bucket** is a hash ``{level, at}`` (the level after the last take, and when). A missing one is full; each
  write sets its expiry to the time it takes to fill again plus :data:`IDLE_GRACE_S`, so an idle key's buckets
  vanish (found again full, as they would be).
- **The clock** is the caller's (the ``now`` each call is given, the gateway's wall clock), not Redis's ``TIME``:
  so the counters keep the one contract the memory ones have (and tests drive them with chosen times). Replicas'
  clocks differ by milliseconds under NTP; a bucket's ``at`` never goes back (a replica behind refills nothing
  until it catches up), so the refills a bucket ever gets add up to at most its real age plus the largest clock
  difference: a clock that is off by *d* grants at most *d* x limit/60 more in the bucket's whole life, not on
  every request.
- **A concurrency counter** is a sorted set of leases, one member per request, scored by when the lease ends. An
  admission first drops the ended ones, then counts. A replica renews its requests' leases every third of
  :data:`SLOT_LEASE_S` while they run; a replica that dies mid-request renews nothing, and its places come free
  within :data:`SLOT_LEASE_S`. (A fixed longest lifetime instead would have to outlast the longest stream, minutes,
  and a dead replica would hold a place that long.)
- **Leases** (:mod:`.redis_leases`, which says why they are sound): far from its limits, a replica takes a share of
  a key's buckets and places in one call (:data:`_LEASE`), admits from it in its memory with no round trip, takes
  its requests' tokens from it at their end and frees their places there, and refreshes it in the background. A
  bucket's leases (``{bucket}:leases``: replica -> what it holds and until when) count in every script: a bucket
  refills only up to its limit less what they hold, and a counter's reservations count as taken places. Near a
  limit no lease is granted, what is left goes back, and each admission is one script call as above: exact.

**When Redis cannot be reached: open, onto this replica's own counters.** A call that fails is counted in
``universal_gateway_limits_store_errors_total{use="limits"}`` and logged (at most once a minute,
:class:`~universal_gateway.redis_link.RedisLink`), and until Redis answers each replica keeps the limits in its
own memory (:class:`MemoryCounters`, full buckets to start): a key then gets at most its limit per replica,
never unlimited. Why not closed: the limits exist to share models fairly and to bound what a team spends, and the
ledger (:mod:`.redis_ledger`) still counts every request, so a few minutes at up to N times a limit cost little;
refusing every limited request would turn an outage of a cache into an outage of inference for every team. Keys
without limits never touch Redis for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from universal_gateway.quotas import REQUESTS, Admission, Bucket, Level, MemoryCounters, until_full
from universal_gateway.redis_leases import LEASE_FAR, LEASE_GRACE_S, LEASE_S, BucketLease, LeaseBook, PlaceLease
from universal_gateway.redis_link import PREFIX, STORE_ERRORS, RedisLink
from universal_gateway.redis_pipe import Script

#: How long a concurrency place is held without its replica renewing it (seconds).
SLOT_LEASE_S = 30.0
#: How long a bucket is kept past the time it would be full again (seconds).
IDLE_GRACE_S = 120.0

# Numbers cross between Lua and Python as strings written with 17 significant digits, which a double survives
# exactly (a Lua number returned as such would be truncated to an integer).
_LUA_COMMON = """
local function fmt(x) return string.format('%.17g', x) end
-- Replicas' leases on a bucket or counter (redis_leases.py): the hash KEY:leases, replica -> 'held ends'. An ended
-- one is dropped (what it held counts as spent). Answers what the others hold, how many they are, and own's.
-- (Named from the bucket's key rather than passed: the scripts already span keys of any slot, one Redis only.)
local function leases_of(key, now, own)
  local others, holders, held, ends = 0, 0, 0, 0
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local amount, ending = string.match(all[i + 1], '^(%S+) (%S+)$')
    amount, ending = tonumber(amount), tonumber(ending)
    if ending <= now then redis.call('HDEL', key, all[i])
    elseif all[i] == own then held, ends = amount, ending
    else others, holders = others + amount, holders + 1 end
  end
  return others, holders, held, ends
end
-- A bucket refills up to its limit less what the leases on it hold: the level plus every lease never exceeds it.
local function level_of(key, limit, now, leased)
  local kept = redis.call('HMGET', key, 'level', 'at')
  local level, at = limit - leased, now
  if kept[1] then level = tonumber(kept[1]); at = tonumber(kept[2]) end
  return math.min(limit - leased, level + math.max(0, now - at) * limit / 60.0), math.max(at, now)
end
local function keep(key, limit, level, at, grace)
  redis.call('HSET', key, 'level', fmt(level), 'at', fmt(at))
  redis.call('PEXPIRE', key, math.ceil((math.max(0, (limit - level) * 60.0 / limit) + grace) * 1000))
end
"""

# KEYS: the buckets, then the concurrency counters. ARGV: now, the number of buckets, the request's member, the
# lease (s), the grace (s), then per bucket its limit and 1 for a requests bucket, then per counter its limit.
# Answers {0, 0, levels...} (admitted, levels after the take), {1, i, levels...} (bucket i refused) or
# {2, j, levels...} (counter j full), the levels as they were in the refusals.
_ADMIT = (
    _LUA_COMMON
    + """
local now, nb, member, lease, grace = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]),
  tonumber(ARGV[5])
local limits, requests, levels, ats, out = {}, {}, {}, {}, {0, 0}
for i = 1, nb do
  limits[i] = tonumber(ARGV[4 + 2 * i])
  requests[i] = ARGV[5 + 2 * i] == '1'
  levels[i], ats[i] = level_of(KEYS[i], limits[i], now, leases_of(KEYS[i] .. ':leases', now, ''))
  out[2 + i] = fmt(levels[i])
end
for i = 1, nb do
  if (requests[i] and levels[i] < 1) or ((not requests[i]) and levels[i] <= 0) then
    out[1], out[2] = 1, i
    return out
  end
end
for j = nb + 1, #KEYS do
  redis.call('ZREMRANGEBYSCORE', KEYS[j], '-inf', now)
  local reserved = leases_of(KEYS[j] .. ':leases', now, '')  -- places the replicas' leases hold
  if redis.call('ZCARD', KEYS[j]) + reserved >= tonumber(ARGV[5 + 2 * nb + j - nb]) then
    out[1], out[2] = 2, j - nb
    return out
  end
end
for i = 1, nb do
  if requests[i] then levels[i] = levels[i] - 1 end
  keep(KEYS[i], limits[i], levels[i], ats[i], grace)
  out[2 + i] = fmt(levels[i])
end
for j = nb + 1, #KEYS do
  redis.call('ZADD', KEYS[j], now + lease, member)
  redis.call('PEXPIRE', KEYS[j], math.ceil(lease * 1000))
end
return out
"""
)

# KEYS: the buckets. ARGV: now, 1 for all or nothing, the grace (s), then per bucket its limit and the amount.
# Answers {1, levels after...}, or {0, levels...} when all or nothing found a bucket short (nothing taken).
_TAKE = (
    _LUA_COMMON
    + """
local now, grace = tonumber(ARGV[1]), tonumber(ARGV[3])
local limits, amounts, levels, ats, leased, out = {}, {}, {}, {}, {}, {1}
for i = 1, #KEYS do
  limits[i], amounts[i] = tonumber(ARGV[2 + 2 * i]), tonumber(ARGV[3 + 2 * i])
  leased[i] = leases_of(KEYS[i] .. ':leases', now, '')
  levels[i], ats[i] = level_of(KEYS[i], limits[i], now, leased[i])
  out[1 + i] = fmt(levels[i])
  if ARGV[2] == '1' and levels[i] < amounts[i] then out[1] = 0 end
end
if out[1] == 0 then return out end
for i = 1, #KEYS do
  levels[i] = math.min(limits[i] - leased[i], levels[i] - amounts[i])  -- a give-back never fills past the limit
  keep(KEYS[i], limits[i], levels[i], ats[i], grace)
  out[1 + i] = fmt(levels[i])
end
return out
"""
)

# A request's end. KEYS: the buckets, then the counters. ARGV: now, the grace (s), the number of buckets, per bucket
# its limit and the amount (a give-back when negative), then per counter the member to remove. Answers 0.
_FINISH = (
    _LUA_COMMON
    + """
local now, grace, nb = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, nb do
  local limit, amount = tonumber(ARGV[2 + 2 * i]), tonumber(ARGV[3 + 2 * i])
  local leased = leases_of(KEYS[i] .. ':leases', now, '')
  local level, at = level_of(KEYS[i], limit, now, leased)
  keep(KEYS[i], limit, math.min(limit - leased, level - amount), at, grace)
end
for j = nb + 1, #KEYS do
  redis.call('ZREM', KEYS[j], ARGV[3 + 2 * nb + j - nb])
end
return 0
"""
)

# A replica's leases (redis_leases.py): refreshed, or given back. KEYS: the buckets, then the counters. ARGV: now, the
# replica, the number of buckets, a bucket lease's end, a place lease's end, the grace (s), LEASE_FAR; per bucket its
# limit, what the replica spent of its lease since its last call, what it gives back, and the lease it wants (0:
# none); per counter its limit, the places the replica has in use and the places more it wants (0: none). Answers
# per bucket its level and what was granted; per counter its count (every replica's), the replica's places and 1
# when granted.
_LEASE = (
    _LUA_COMMON
    + """
local now, own, nb, lease_end, place_end = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]),
  tonumber(ARGV[5])
local grace, far, a, out = tonumber(ARGV[6]), tonumber(ARGV[7]), 8, {}
local function hold(key, amount, ends)
  if amount > 0 then
    redis.call('HSET', key, own, fmt(amount) .. ' ' .. fmt(ends))
    local ms = math.ceil((ends - now) * 1000)
    if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
  else
    redis.call('HDEL', key, own)
  end
end
for i = 1, nb do
  local limit, spent, back, want = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2]),
    tonumber(ARGV[a + 3])
  a = a + 4
  local leases = KEYS[i] .. ':leases'
  local others, holders, held, ends = leases_of(leases, now, own)
  local level, at = level_of(KEYS[i], limit, now, others + held)
  held = math.max(0, held - spent - back)
  level = math.min(limit - others - held, level + back)
  local granted = 0
  if want > 0 and level - want >= far * want * (holders + 1) then
    level, held, granted, ends = level - want, held + want, want, lease_end
  end
  hold(leases, held, ends)
  keep(KEYS[i], limit, level, at, grace)
  out[#out + 1], out[#out + 2] = fmt(level), fmt(granted)
end
for j = nb + 1, #KEYS do
  local limit, running, want = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  local leases = KEYS[j] .. ':leases'
  redis.call('ZREMRANGEBYSCORE', KEYS[j], '-inf', now)
  local others, holders, places = leases_of(leases, now, own)
  local count = redis.call('ZCARD', KEYS[j]) + others
  -- Never below the places in use (requests running); more only while far from the limit.
  local new, granted = math.max(running, want > 0 and places or 0), 0
  if want > 0 and count + math.max(places, running + want) + far * want * (holders + 1) <= limit then
    new, granted = math.max(places, running + want), 1
  end
  hold(leases, new, place_end)
  out[#out + 1], out[#out + 2], out[#out + 3] = count + new, new, granted
end
return out
"""
)

# KEYS: the counters. ARGV: the lease's new end, the lease (s), then per counter how many members follow, then the
# members. Leases that ended are not brought back (XX: only members still there).
_RENEW = """
local ends, lease, at = ARGV[1], tonumber(ARGV[2]), 3 + #KEYS
for j = 1, #KEYS do
  for m = 1, tonumber(ARGV[2 + j]) do
    redis.call('ZADD', KEYS[j], 'XX', ends, ARGV[at])
    at = at + 1
  end
  redis.call('PEXPIRE', KEYS[j], math.ceil(lease * 1000))
end
return 0
"""


def _number(x: float) -> str:
    return repr(float(x))  # the shortest text a double is read back from exactly


def _plan(buckets: Sequence[Bucket], slots: Sequence[tuple[str, int]]) -> tuple[str, ...]:
    """What a request draws on, as the key of the leases refreshed for it."""
    return tuple(b.name for b in buckets) + tuple(name for name, _ in slots)


class RedisCounters:
    """Bucket levels and concurrency places in Redis, shared by every gateway replica that names the same one."""

    def __init__(
        self,
        url: str,
        *,
        on_error: Callable[[], None] | None = None,
        prefix: str = PREFIX,
        slot_lease_s: float = SLOT_LEASE_S,
        clock: Callable[[], float] = time.time,
        link: RedisLink | None = None,
        leases: bool = True,
    ) -> None:
        self.link = link or RedisLink(url, "the limits' counters", on_error=on_error)
        self.prefix = f"{prefix}limits:"
        self.slot_lease_s = slot_lease_s
        self.clock = clock  # for lease renewals: the same wall clock the gateway passes as ``now``
        self._admit, self._take, self._renew, self._finish, self._lease = map(
            Script, (_ADMIT, _TAKE, _RENEW, _FINISH, _LEASE)
        )
        #: While Redis cannot be reached: this replica's own.
        self.local = MemoryCounters()
        self._replica = uuid.uuid4().hex[:12]
        self._requests = 0
        self._leases: dict[str, list[str]] = {}  # counter name -> this replica's members in it
        self._local_slots: dict[str, int] = {}  # counter name -> places this replica took in ``local``
        self._renewer: asyncio.Task[None] | None = None
        #: This replica's leases (:mod:`.redis_leases`); None: every admission asks Redis.
        self.book: LeaseBook | None = LeaseBook() if leases else None
        self._refreshing: dict[tuple[str, ...], asyncio.Task[None]] = {}  # plan -> the call refreshing its leases
        self._lease_calls: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None

    def _key(self, name: str) -> str:
        return self.prefix + name

    async def admit(self, buckets: Sequence[Bucket], slots: Sequence[tuple[str, int]], now: float) -> Admission:
        book = self.book
        leasable = book is not None and book.plan(buckets, slots)
        if leasable:
            assert book is not None
            admitted = book.admit(buckets, slots, now)  # (its tokens are this replica's, Redis reachable or not)
            if admitted is not None:
                self._refresh_if_due(buckets, slots, now)
                return admitted
            # No lease of this replica's can admit it (ended after an idle spell, or spent). While a call refreshing
            # them is under way, the request waits for it and is admitted from them; else it goes to Redis, exact,
            # and the refresh starts beside it. So a burst after an idle spell makes two calls, not one exact call
            # per request (measured: 32 exact calls queued on the link, 8.7 ms each, the burst in the p99).
            refreshing = self._refreshing.get(_plan(buckets, slots))
            if refreshing is not None:
                await asyncio.wait({refreshing})
                admitted = book.admit(buckets, slots, now)
                if admitted is not None:
                    return admitted
            else:
                self._refresh_if_due(buckets, slots, now)
        if not self.link.paused:
            try:
                admission = await self._admit_shared(buckets, slots, now)
            except STORE_ERRORS as exc:
                self.link.failed(exc, "limits are held per replica, in memory, until it answers")
            else:
                if leasable and admission.refused is None and admission.slots_refused is None:
                    self._refresh_if_due(buckets, slots, now)
                return admission
        admission = await self.local.admit(buckets, slots, now)
        if admission.refused is None and admission.slots_refused is None:
            for name, _ in slots:
                self._local_slots[name] = self._local_slots.get(name, 0) + 1
            admission.places_from = "memory"
        return admission

    async def _admit_shared(self, buckets: Sequence[Bucket], slots: Sequence[tuple[str, int]],
                            now: float) -> Admission:  # fmt: skip
        self._requests += 1
        member = f"{self._replica}:{self._requests}"
        args: list[str | int] = [_number(now), len(buckets), member, _number(self.slot_lease_s), _number(IDLE_GRACE_S)]
        for bucket in buckets:
            args += [bucket.limit, 1 if bucket.kind == REQUESTS else 0]
        args += [limit for _, limit in slots]
        keys = [self._key(b.name) for b in buckets] + [self._key(name) for name, _ in slots]
        answer = await self.link.run(self._admit, keys, args)
        outcome, which = int(answer[0]), int(answer[1])
        levels = [Level(b, float(v), until_full(float(v), b.limit)) for b, v in zip(buckets, answer[2:], strict=True)]
        if outcome == 1:
            refused = levels[which - 1]
            need = 1.0 if refused.bucket.kind == REQUESTS else math.ulp(0.0)  # as MemoryCounters: any above zero
            return Admission(levels, refused, (need - refused.remaining) * 60.0 / refused.bucket.limit)
        if outcome == 2:
            return Admission(levels, slots_refused=slots[which - 1], retry_after_s=1.0)
        for name, _ in slots:
            self._leases.setdefault(name, []).append(member)
        if slots and self._renewer is None:
            self._renewer = asyncio.create_task(self._renew_leases())
        return Admission(levels)

    async def take(
        self, takes: Sequence[tuple[Bucket, float]], now: float, *, all_or_nothing: bool
    ) -> list[Level] | None:
        if self.book is not None and all_or_nothing:
            taken = self.book.take(takes, now)
            if taken is not None:
                return taken
        elif self.book is not None:
            rest = self.book.settle(takes, now)
            if rest != list(takes):  # some of it from this replica's leases: the rest as without them
                found = {level.bucket.name: level for level in await self._take_shared(rest, now, False) or []}
                return [found.get(b.name) or self.book.buckets[b.name].estimate(now) for b, _ in takes]
        return await self._take_shared(takes, now, all_or_nothing)

    async def _take_shared(
        self, takes: Sequence[tuple[Bucket, float]], now: float, all_or_nothing: bool
    ) -> list[Level] | None:
        if not takes:
            return []
        if not self.link.paused:
            args: list[str | int] = [_number(now), 1 if all_or_nothing else 0, _number(IDLE_GRACE_S)]
            for bucket, amount in takes:
                args += [bucket.limit, _number(amount)]
            try:
                answer = await self.link.run(self._take, [self._key(b.name) for b, _ in takes], args)
            except STORE_ERRORS as exc:
                self.link.failed(exc, "limits are held per replica, in memory, until it answers")
            else:
                if not int(answer[0]):
                    return None
                return [
                    Level(bucket, float(v), until_full(float(v), bucket.limit))
                    for (bucket, _), v in zip(takes, answer[1:], strict=True)
                ]
        return await self.local.take(takes, now, all_or_nothing=all_or_nothing)

    def _give_up_places(self, slots: Sequence[str], places_from: str = "") -> list[tuple[str, str]]:
        """This replica's members to remove for ``slots`` (any of its own in each: its places are alike); the
        places taken in ``local`` while Redis was away are released there, and those from its leases in them.
        (``places_from``, the admission's, says which; where not given, a member, a local place, a lease's.)"""
        shared: list[tuple[str, str]] = []
        local: list[str] = []
        for name in slots:
            members = self._leases.get(name)
            if places_from == "lease" and self.book is not None and self.book.release(name):
                continue
            if members and places_from != "memory":
                shared.append((name, members.pop()))
                if not members:
                    del self._leases[name]
            elif self._local_slots.get(name):
                self._local_slots[name] -= 1
                local.append(name)
            elif self.book is not None:
                self.book.release(name)
        for name in local:  # MemoryCounters.release, without an await
            left = self.local.slots.get(name, 0) - 1
            if left > 0:
                self.local.slots[name] = left
            else:
                self.local.slots.pop(name, None)
        return shared

    async def release(self, slots: Sequence[str]) -> None:
        await self.finish([], slots, self.clock())

    async def finish(
        self, takes: Sequence[tuple[Bucket, float]], slots: Sequence[str], now: float, places_from: str = ""
    ) -> None:
        shared = self._give_up_places(slots, places_from)
        if self.book is not None and places_from == "lease":
            # Near the limit (its lease not renewed), a place freed here goes back to Redis now, in the background.
            near = [p for name in slots if (p := self.book.places.get(name)) and now >= p.until and p.places > p.in_use]
            if near and not self.link.paused:
                self._spawn(self._call_leases([], near, now, want=False))
        if self.book is not None and takes:
            takes = self.book.settle(takes, now)  # from this replica's leases what they can
        if not takes and not shared:
            return
        if self.link.paused:
            if takes:
                await self.local.take(takes, now, all_or_nothing=False)
            return
        args: list[str | int] = [_number(now), _number(IDLE_GRACE_S), len(takes)]
        for bucket, amount in takes:
            args += [bucket.limit, _number(amount)]
        args += [member for _, member in shared]
        keys = [self._key(b.name) for b, _ in takes] + [self._key(name) for name, _ in shared]
        try:
            await self.link.run(self._finish, keys, args)
        except STORE_ERRORS as exc:  # a place held comes free when its lease ends, within SLOT_LEASE_S
            self.link.failed(exc, "limits are held per replica, in memory, until it answers")
            if takes:
                await self.local.take(takes, now, all_or_nothing=False)

    # -- leases (redis_leases.py) --------------------------------------------------------------------------------

    def _refresh_if_due(self, buckets: Sequence[Bucket], slots: Sequence[tuple[str, int]], now: float) -> None:
        """The leases for a request's buckets and counters, refreshed in the background when short (one call a
        plan at a time: :attr:`_refreshing`, which a request they cannot admit waits for)."""
        assert self.book is not None
        plan = _plan(buckets, slots)
        if plan in self._refreshing or self.link.paused or not self.book.due(buckets, slots, now):
            return
        bucket_leases = [self.book.buckets[b.name] for b in buckets]
        place_leases = [self.book.places[name] for name, _ in slots]
        self._spawn(self._call_leases(bucket_leases, place_leases, now, want=True), plan)

    def _spawn(self, call: Coroutine[Any, Any, None], plan: tuple[str, ...] | None = None) -> None:
        task = asyncio.create_task(call)
        self._lease_calls.add(task)
        if plan is not None:
            self._refreshing[plan] = task

        def done(_: asyncio.Task[None]) -> None:
            self._lease_calls.discard(task)
            if plan is not None:
                self._refreshing.pop(plan, None)  # (one call a plan at a time: this one)

        task.add_done_callback(done)
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep())

    async def _call_leases(self, buckets: list[BucketLease], places: list[PlaceLease], now: float, *,
                           want: bool) -> None:  # fmt: skip
        """One script call for these leases: ``want``: refreshed (topped up while far from the limit, given back
        where Redis says it is near); else given back (what is unused, and places beyond those in use)."""
        args: list[str | int] = [_number(now), self._replica, len(buckets), _number(now + LEASE_S + LEASE_GRACE_S),
                                 _number(now + self.slot_lease_s), _number(IDLE_GRACE_S), LEASE_FAR]  # fmt: skip
        sent: list[tuple[float, float]] = []  # per bucket lease: (spent, given back) as sent
        for lease in buckets:
            # A live lease is topped up; one that ended, or is given back, is not admitted from again: what is left
            # of it goes back (Redis may already have ended it, counting it as spent: it must not come back to life).
            ended = not want or now >= lease.until
            spent, back = lease.unreported, lease.unused if ended else 0.0
            lease.unreported = 0.0
            if ended:
                lease.unused, lease.until = 0.0, -math.inf
            sent.append((spent, back))
            args += [lease.bucket.limit, _number(spent), _number(back), lease.size if want else 0]
        for place in places:
            if not want:  # none admitted beyond those running: the reservation shrinks to them
                place.places, place.until = min(place.places, place.in_use), -math.inf
            args += [place.limit, place.in_use, place.size if want else 0]
        keys = [self._key(lease.bucket.name) for lease in buckets] + [self._key(place.name) for place in places]
        try:
            answer = await self.link.run(self._lease, keys, args)
        except STORE_ERRORS as exc:
            self.link.failed(exc, "limits are held per replica, in memory, until it answers")
            for lease, (spent, _) in zip(buckets, sent, strict=True):
                if want:
                    lease.unreported += spent  # told at the next call, or spent when the lease ends in Redis
            return
        near_buckets: list[BucketLease] = []
        near_places: list[PlaceLease] = []
        for i, lease in enumerate(buckets):
            level, granted = float(answer[2 * i]), float(answer[2 * i + 1])
            lease.seen, lease.seen_at = level, now
            if not want:
                continue
            if granted:
                lease.unused += granted
                lease.until = now + LEASE_S
            else:  # near the limit: what is left goes back, and admissions ask Redis for a while
                lease.next_try = now + LEASE_S * 0.5
                if lease.unused or lease.unreported:
                    near_buckets.append(lease)
        at = 2 * len(buckets)
        for j, place in enumerate(places):
            reserved, granted = int(answer[at + 3 * j + 1]), int(answer[at + 3 * j + 2])
            place.renewed_at = now
            if not want:
                continue
            if granted:
                place.places, place.until = reserved, now + LEASE_S
            else:
                place.next_try = now + LEASE_S * 0.5
                place.places = reserved
                if reserved > place.in_use:
                    near_places.append(place)
        if near_buckets or near_places:
            await self._call_leases(near_buckets, near_places, self.clock(), want=False)

    async def lease_calls_done(self) -> None:
        """Until the lease calls in flight have their answers (for tests: the background settles)."""
        while self._lease_calls:
            await asyncio.gather(*self._lease_calls, return_exceptions=True)

    async def _sweep(self) -> None:
        """Every half lease: leases that ended given back, and places held for running requests renewed."""
        assert self.book is not None
        while True:
            await asyncio.sleep(LEASE_S / 2)
            if self.link.paused:
                continue
            now = self.clock()
            ended = [
                lease for lease in self.book.buckets.values()
                if now >= lease.until and (lease.unused or lease.unreported)
            ]  # fmt: skip
            places = [
                place for place in self.book.places.values()
                if (now >= place.until and place.places > place.in_use)
                or (place.places and now - place.renewed_at >= self.slot_lease_s / 3)
            ]  # fmt: skip
            if ended or places:
                await self._call_leases(ended, places, now, want=False)

    async def _renew_leases(self) -> None:
        """Every third of the lease: the leases of this replica's requests in flight, renewed."""
        while True:
            await asyncio.sleep(self.slot_lease_s / 3)
            held = {name: list(members) for name, members in self._leases.items() if members}
            if not held or self.link.paused:
                continue
            args: list[str | int] = [_number(self.clock() + self.slot_lease_s), _number(self.slot_lease_s)]
            args += [len(members) for members in held.values()]
            args += [member for members in held.values() for member in members]
            try:
                await self.link.run(self._renew, [self._key(name) for name in held], args)
            except STORE_ERRORS as exc:
                self.link.failed(exc, "leases of requests in flight are renewed when it answers")

    async def close(self, *, give_back: bool = True) -> None:
        """Stop; with ``give_back``, what is left of this replica's leases goes back to Redis first (without, as a
        replica that dies: they end in Redis, counted as spent)."""
        for task in (self._renewer, self._sweeper, *self._lease_calls):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if give_back and self.book is not None and not self.link.paused:
            buckets = [lease for lease in self.book.buckets.values() if lease.unused or lease.unreported]
            places = [place for place in self.book.places.values() if place.places]
            for place in places:
                place.in_use = 0  # (the gateway stops: its requests have ended)
            if buckets or places:
                await self._call_leases(buckets, places, self.clock(), want=False)
        await self.link.close()
