"""A replica's leases on the limits it keeps in Redis: what it may admit without asking (:class:`LeaseBook`).

While a bucket is far from its limit, a replica takes a *lease* on it: ``1/LEASE_SHARE`` of its limit, taken from
the bucket's level in Redis in one script call and recorded there, in the hash ``{bucket}:leases``, as the
replica's ``held`` amount with an end. The replica then admits from it in its own memory: a request takes one
from its lease on each requests bucket, needs something left on each token bucket's lease, and its tokens are
taken from the leases at its end; no round trip. A concurrency counter is leased the same way, as *places*
reserved for the replica (``{counter}:leases``), which count as taken for every replica's admission. The replica
refreshes a lease ahead of need (less than half of it left, or of its time), in the background, and reports what
it spent, so that Redis's ``held`` stays what the replica still holds. A request its leases cannot admit (they
ended after an idle spell, or are spent) waits for the refresh under way and is admitted from it; with none under
way it is admitted by Redis, exactly, and the refresh starts beside it: a burst makes two calls, not one each.

**Never more than the limit, over all replicas.** Redis grants a lease only out of a bucket's level, and a bucket
refills only up to its limit *less what every replica holds* (``level + held <= limit`` at all times; the
scripts' ``level_of``). So what all replicas together can still admit (the level plus what is left in the leases)
never exceeds what one exact bucket would hold, and admissions in any window are bounded as an exact bucket's
are: its level at the start plus limit/60 a second. Places likewise: reservations plus the requests' own places
never exceed the limit.

**Near the limit, exact.** A lease is granted only while the bucket keeps ``LEASE_FAR`` leases per replica that
holds one (itself included) after it: its level at least ``size x (LEASE_FAR x replicas + 1)``. Below that, Redis
grants nothing, the replica gives back what is left of its lease at once, and each admission is one script call
as without leases, so the N-th request passes and the N+1-th is refused on any replica. While another replica still
holds a lease that it has not yet given back (it learns of the level at its next refresh, or gives it back when
its lease ends: at most :data:`LEASE_S`), the tokens in it are not available to the others: a replica can be
refused while another could still admit, never the reverse; the sum is never exceeded.

**What happens to tokens not used.** They go back to Redis: when the lease ends (``LEASE_S`` after it was
granted or refreshed), when the bucket comes near its limit, and when the gateway stops. A replica that dies, or
cannot reach Redis, gives nothing back: its lease ends in Redis ``LEASE_GRACE_S`` after the replica stopped using it
and what it held is counted as spent (the bucket refills it at limit/60 a second, as after a burst). Counting it as
spent, not returning it, is the sound choice: Redis cannot know how much of it the replica used.

**Headers.** A request admitted from a lease reports, in ``x-ratelimit-remaining-*``, the bucket's level as Redis
last told this replica (refilled since) plus what is left of its own lease: other replicas' use since that answer
is not in it. Approximate by at most the other replicas' leases and use since the last refresh (``LEASE_S``), while
far from the limit only; near it every answer comes from Redis, exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from universal_gateway.quotas import REQUESTS, Admission, Bucket, Level, refill, until_full

#: How long a replica admits from a lease before it must be refreshed (seconds).
LEASE_S = 2.0
#: How much longer Redis keeps a lease than its replica uses it (seconds): room for replicas' clocks to differ.
LEASE_GRACE_S = 1.0
#: A bucket's lease is this share of its limit; a bucket whose limit gives less than 2 is never leased.
LEASE_SHARE = 64
#: A concurrency counter's lease is this share of its limit (more places for the requests in flight).
PLACES_SHARE = 8
#: A lease is granted only while the level stays above this many leases per replica holding one.
LEASE_FAR = 2
#: Refreshed ahead of need: when less than this share of the lease, or of its time, is left.
REFRESH_AT = 0.5


def lease_size(limit: int, share: int = LEASE_SHARE) -> int:
    """How much a lease on a limit of ``limit`` takes (0: that limit is too small to be leased: always exact)."""
    size = limit // share
    return size if size >= 2 else 0


@dataclass
class BucketLease:
    """This replica's lease on one bucket: Redis holds ``unused + unreported`` for it."""

    bucket: Bucket
    size: int
    unused: float = 0.0  # what is left to admit from
    unreported: float = 0.0  # spent since the last call told Redis
    until: float = -math.inf  # admits from it until then (this replica's clock)
    seen: float = 0.0  # the bucket's level in Redis after the last call
    seen_at: float = 0.0
    next_try: float = -math.inf  # not asked again before (Redis refused a lease: near the limit)

    def estimate(self, now: float) -> Level:
        """The level this replica believes the bucket has (the headers'): approximate, see the module docstring."""
        limit = self.bucket.limit
        left = min(float(limit), refill(self.seen, self.seen_at, limit, now) + self.unused)
        return Level(self.bucket, left, until_full(left, limit))


@dataclass
class PlaceLease:
    """This replica's places reserved on one concurrency counter."""

    name: str
    limit: int
    size: int
    places: int = 0  # reserved for this replica in Redis
    in_use: int = 0  # requests admitted from them, running
    until: float = -math.inf
    renewed_at: float = -math.inf
    next_try: float = -math.inf


class LeaseBook:
    """The leases this replica holds, and the admissions, takes and releases they can serve without Redis."""

    def __init__(self) -> None:
        self.buckets: dict[str, BucketLease] = {}
        self.places: dict[str, PlaceLease] = {}

    def plan(self, buckets: Sequence[Bucket], slots: Sequence[tuple[str, int]]) -> bool:
        """Whether a request drawing on these may be admitted from leases (every one large enough to lease); the
        leases for them are made here, empty."""
        if not buckets and not slots:
            return False
        for bucket in buckets:
            if bucket.name not in self.buckets:
                size = lease_size(bucket.limit)
                if not size:
                    return False
                self.buckets[bucket.name] = BucketLease(bucket, size)
            elif self.buckets[bucket.name].bucket.limit != bucket.limit:  # the keys changed: a new lease's size
                self.buckets[bucket.name].bucket = bucket
                self.buckets[bucket.name].size = lease_size(bucket.limit)
            if not self.buckets[bucket.name].size:
                return False
        for name, limit in slots:
            held = self.places.get(name)
            if held is None or held.limit != limit:
                size = lease_size(limit, PLACES_SHARE)
                if not size:
                    return False
                if held is None:
                    self.places[name] = PlaceLease(name, limit, size)
                else:
                    held.limit, held.size = limit, size
        return True

    def admit(self, buckets: Sequence[Bucket], slots: Sequence[tuple[str, int]], now: float) -> Admission | None:
        """Admitted from this replica's leases, or None (they cannot: ask Redis). Nothing is taken unless all can."""
        leases = [self.buckets.get(b.name) for b in buckets]
        places = [self.places.get(name) for name, _ in slots]
        for lease in leases:
            if lease is None or now >= lease.until:
                return None
            if lease.unused < 1.0 if lease.bucket.kind == REQUESTS else lease.unused <= 0:
                return None
        for place in places:
            if place is None or now >= place.until or place.in_use >= place.places:
                return None
        levels = []
        for lease in leases:
            assert lease is not None
            if lease.bucket.kind == REQUESTS:
                lease.unused -= 1.0
                lease.unreported += 1.0
            levels.append(lease.estimate(now))
        for place in places:
            assert place is not None
            place.in_use += 1
        return Admission(levels, places_from="lease")

    def take(self, takes: Sequence[tuple[Bucket, float]], now: float) -> list[Level] | None:
        """All of ``takes`` from the leases (all or nothing), or None when a lease cannot (ask Redis)."""
        leases = [self.buckets.get(b.name) for b, _ in takes]
        for lease, (_, amount) in zip(leases, takes, strict=True):
            if lease is None or now >= lease.until or not 0 <= amount <= lease.unused:
                return None
        out = []
        for lease, (_, amount) in zip(leases, takes, strict=True):
            assert lease is not None
            self._spend(lease, amount)
            out.append(lease.estimate(now))
        return out

    def settle(self, takes: Sequence[tuple[Bucket, float]], now: float) -> list[tuple[Bucket, float]]:
        """A request's end: what its leases can take or get back of ``takes``; the rest, for Redis."""
        rest = []
        for bucket, amount in takes:
            lease = self.buckets.get(bucket.name)
            if lease is None or now >= lease.until:
                rest.append((bucket, amount))
                continue
            # A give-back refills the lease at most to what Redis holds for it; a take empties it at most.
            part = max(amount, -lease.unreported) if amount < 0 else min(amount, lease.unused)
            self._spend(lease, part)
            if amount != part:
                rest.append((bucket, amount - part))
        return rest

    @staticmethod
    def _spend(lease: BucketLease, amount: float) -> None:
        lease.unused -= amount
        lease.unreported += amount

    def release(self, name: str) -> bool:
        """A place taken from this replica's reservation, given back; False when it holds none in use."""
        place = self.places.get(name)
        if place is None or place.in_use <= 0:
            return False
        place.in_use -= 1
        return True

    def due(self, buckets: Sequence[Bucket], slots: Sequence[tuple[str, int]], now: float) -> bool:
        """Whether any of these leases wants refreshing now (short of tokens, places or time)."""
        for bucket in buckets:
            lease = self.buckets.get(bucket.name)
            if lease is not None and now >= lease.next_try and _short(lease.unused, lease.size, lease.until, now):
                return True
        for name, _ in slots:
            place = self.places.get(name)
            if place is not None and now >= place.next_try and _short(place.places - place.in_use, place.size,
                                                                       place.until, now):  # fmt: skip
                return True
        return False


def _short(left: float, size: int, until: float, now: float) -> bool:
    return left < size * REFRESH_AT or until - now < LEASE_S * REFRESH_AT
