"""Replicas' leases on the limits kept in a real ``redis-server`` (:mod:`universal_gateway.redis_leases`): far from a
limit a replica admits from its lease without asking Redis; over any number of replicas the sum admitted never
exceeds what one exact bucket admits; near the limit every admission is exact again, to the last request; what a
lease did not use goes back to Redis when it ends, or ends there, counted as spent, with a replica that died; and
a lease keeps serving while Redis is away, then this replica's memory does."""

from __future__ import annotations

import asyncio
import bisect
import random
import uuid
from collections.abc import AsyncIterator, Callable

import pytest
import redis

from tests.gateway.redis_server import RedisServer
from universal_gateway.quotas import INPUT, REQUESTS, Admission, Bucket
from universal_gateway.redis_counters import RedisCounters
from universal_gateway.redis_leases import LEASE_GRACE_S, LEASE_S, LEASE_SHARE, PLACES_SHARE

T0 = 1_800_000_000.0
LIMIT = 1280  # requests a minute: leases of LIMIT / LEASE_SHARE = 20
REQ = Bucket("k|requests", REQUESTS, LIMIT, "key")
SIZE = LIMIT // LEASE_SHARE


class Clock:
    """The replicas' wall clock, moved by the test."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def make(redis_url: str) -> AsyncIterator[Callable[..., RedisCounters]]:
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    made: list[RedisCounters] = []

    def counters(clock: Clock, **options: object) -> RedisCounters:
        made.append(RedisCounters(redis_url, prefix=prefix, clock=clock, **options))  # type: ignore[arg-type]
        return made[-1]

    yield counters
    for counters_ in made:
        await counters_.close()


def stored(url: str, counters: RedisCounters, name: str) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    """A bucket's hash and its leases, as Redis holds them."""
    client = redis.Redis.from_url(url)
    return client.hgetall(counters.prefix + name), client.hgetall(counters.prefix + name + ":leases")  # type: ignore[return-value]


async def admit_until_refused(replicas: list[RedisCounters], buckets: list[Bucket], slots: list[tuple[str, int]],
                              clock: Clock) -> tuple[list[Admission], list[int]]:  # fmt: skip
    """Admissions round the replicas, letting their lease calls answer, until every replica is refused with no
    lease call in flight: every admission made, and each replica's count."""
    admitted: list[Admission] = []
    per_replica = [0] * len(replicas)
    rng = random.Random(7)
    while True:
        refused_everywhere = True
        for i, replica in enumerate(replicas):
            answer = await replica.admit(buckets, slots, clock())
            if answer.refused is None and answer.slots_refused is None:
                admitted.append(answer)
                per_replica[i] += 1
                refused_everywhere = False
            if rng.random() < 0.3:
                await asyncio.sleep(0)  # a lease call may answer meanwhile, or not yet
        if refused_everywhere:
            for replica in replicas:
                await replica.lease_calls_done()
            answers = [await replica.admit(buckets, slots, clock()) for replica in replicas]
            if all(a.refused is not None or a.slots_refused is not None for a in answers):
                return admitted, per_replica
            for i, answer in enumerate(answers):  # (one that was admitted after all: counted)
                if answer.refused is None and answer.slots_refused is None:
                    admitted.append(answer)
                    per_replica[i] += 1


async def test_replicas_drawing_leases_admit_exactly_the_limit_in_total(
    make: Callable[..., RedisCounters], redis_url: str
) -> None:
    clock = Clock()  # still: no refill, so the limit is the most that may ever be admitted
    replicas = [make(clock), make(clock), make(clock)]
    admitted, per_replica = await admit_until_refused(replicas, [REQ], [], clock)
    assert len(admitted) == LIMIT  # never more, and near the limit exact: not one fewer either
    assert all(n > SIZE for n in per_replica)
    from_leases = sum(1 for a in admitted if a.places_from == "lease")
    assert from_leases > LIMIT // 2  # far from the limit, most never waited on Redis
    refused = await replicas[0].admit([REQ], [], clock())
    assert refused.refused is not None
    assert refused.refused.remaining == 0.0
    assert refused.retry_after_s == pytest.approx(60 / LIMIT)
    level, leases = stored(redis_url, replicas[0], REQ.name)
    assert float(level[b"level"]) == 0.0
    assert leases == {}


async def test_what_replicas_admit_in_any_window_is_bounded_as_one_exact_bucket(
    make: Callable[..., RedisCounters],
) -> None:
    clock = Clock()
    replicas = [make(clock), make(clock), make(clock)]
    admitted_at: list[float] = []
    rng = random.Random(3)
    for _ in range(8):
        # A pause (long enough to fill the bucket, or not), a few requests on each replica (which take leases), a
        # pause shorter than a lease (the bucket refills while they are out: the case the scripts' cap is for),
        # then a burst at one instant: as many as the replicas admit.
        clock.now += rng.choice([30.0, 30.0, 1.9, 0.5])
        for replica in replicas:
            for _ in range(3):
                if (await replica.admit([REQ], [], clock.now)).refused is None:
                    admitted_at.append(clock.now)
            await replica.lease_calls_done()
        clock.now += rng.choice([0.5, 1.5, 1.9])
        for _ in range(2000):
            if (await rng.choice(replicas).admit([REQ], [], clock.now)).refused is None:
                admitted_at.append(clock.now)
            if rng.random() < 0.3:
                await asyncio.sleep(0)  # a lease call may answer meanwhile, or not yet
    span = clock.now - T0
    assert span > 60
    assert len(admitted_at) > 2 * LIMIT
    # A token bucket admits at most its limit plus what refills in any window: every window that starts at an
    # admission, of several lengths.
    for start_index, start in enumerate(admitted_at):
        for length in (0.0, 0.5, 2.0, 10.0):
            inside = bisect.bisect_right(admitted_at, start + length) - start_index
            assert inside <= LIMIT + length * LIMIT / 60 + 1e-9, (start - T0, length)


async def test_unused_lease_tokens_go_back_when_the_lease_ends(
    make: Callable[..., RedisCounters], redis_url: str
) -> None:
    clock = Clock()
    replica = make(clock)
    first = await replica.admit([REQ], [], clock())  # exact; its lease is taken in the background
    assert first.places_from == ""
    assert first.levels[0].remaining == LIMIT - 1
    await replica.lease_calls_done()
    level, leases = stored(redis_url, replica, REQ.name)
    assert float(level[b"level"]) == LIMIT - 1 - SIZE
    [(_holder, held)] = leases.items()
    assert held.split()[0] == str(SIZE).encode()
    assert float(held.split()[1]) == T0 + LEASE_S + LEASE_GRACE_S
    for n in range(5):
        local = await replica.admit([REQ], [], clock())
        assert local.places_from == "lease"
        # Approximate within the lease: the level Redis last gave plus what this replica has left of its lease.
        assert local.levels[0].remaining == LIMIT - 1 - SIZE + SIZE - 1 - n
    clock.now = T0 + LEASE_S + 0.5  # the lease ended here; the sweep (every LEASE_S / 2) gives the rest back
    for _ in range(100):
        level, leases = stored(redis_url, replica, REQ.name)
        if not leases:
            break
        await asyncio.sleep(0.05)
    assert leases == {}
    # Given back: the 15 not used; the 5 used stayed taken until reported, so the bucket refilled only to the limit
    # less them: never past what exact admissions would leave.
    assert float(level[b"level"]) == LIMIT - 5


async def test_a_lease_that_ended_is_not_admitted_from_again(make: Callable[..., RedisCounters]) -> None:
    clock = Clock()
    replica = make(clock)
    await replica.admit([REQ], [], clock())
    await replica.lease_calls_done()
    for _ in range(5):
        assert (await replica.admit([REQ], [], clock())).places_from == "lease"
    clock.now = T0 + LEASE_S + LEASE_GRACE_S + 1  # ended, in Redis too: what it held counted as spent
    assert (await replica.admit([REQ], [], clock())).places_from == ""
    await replica.lease_calls_done()  # a new lease: SIZE, and not a token more of the one that ended
    assert replica.book is not None
    assert replica.book.buckets[REQ.name].unused == SIZE
    for _ in range(SIZE):
        assert (await replica.admit([REQ], [], clock())).places_from == "lease"
    # Spent: the next waits for the refresh its lease started when short (no await yielded since: it had not run),
    # rather than make an exact call of its own, and is admitted from the refreshed lease.
    assert (await replica.admit([REQ], [], clock())).places_from == "lease"
    assert replica.book.buckets[REQ.name].unused == SIZE - 1


async def test_a_burst_after_the_lease_ended_waits_for_one_refresh_rather_than_each_asking_redis(
    make: Callable[..., RedisCounters], redis_url: str
) -> None:
    """An idle spell ends the lease; the burst that follows makes one exact call (its first request's) and one
    refresh, which the others wait for and are admitted from (each asking Redis queued them all on the link)."""
    clock = Clock()
    replica = make(clock)
    await replica.admit([REQ], [], clock())
    await replica.lease_calls_done()
    clock.now = T0 + LEASE_S + LEASE_GRACE_S + 1  # idle: the lease ended
    burst = await asyncio.gather(*(replica.admit([REQ], [], clock()) for _ in range(SIZE - 1)))
    assert [admission.places_from for admission in burst] == [""] + ["lease"] * (SIZE - 2)
    assert replica.book is not None
    assert replica.book.buckets[REQ.name].unused == 2  # the new lease, SIZE, less the burst's SIZE - 2
    _, leases = stored(redis_url, replica, REQ.name)
    [(_holder, held)] = leases.items()
    assert held.split()[0] == str(SIZE).encode()  # in Redis: one lease of SIZE, held by this replica


async def test_a_replica_stopping_gives_its_lease_back_and_one_that_dies_leaves_it_to_end(
    make: Callable[..., RedisCounters], redis_url: str
) -> None:
    clock = Clock()
    stopping, dying, other = make(clock), make(clock), make(clock, leases=False)  # (other: exact, to look)
    for replica in (stopping, dying):
        await replica.admit([REQ], [], clock())
        await replica.lease_calls_done()
        assert (await replica.admit([REQ], [], clock())).places_from == "lease"
    level, leases = stored(redis_url, stopping, REQ.name)
    assert len(leases) == 2
    assert float(level[b"level"]) == LIMIT - 2 - 2 * SIZE
    await stopping.close()  # gives back the SIZE - 1 it did not use
    await dying.close(give_back=False)  # as a replica killed: nothing given back
    level, leases = stored(redis_url, stopping, REQ.name)
    assert len(leases) == 1
    assert float(level[b"level"]) == LIMIT - 2 - 2 * SIZE + SIZE - 1
    ends = T0 + LEASE_S + LEASE_GRACE_S
    # Still held: the bucket refills up to its limit less what the dead replica's lease holds.
    before = await other.admit([REQ], [], ends - 0.001)
    assert stored(redis_url, stopping, REQ.name)[1] != {}
    assert before.levels[0].remaining == LIMIT - SIZE - 1
    # Ended: what it held counts as spent (not back in the level), and the bucket refills up to its limit again.
    after = await other.admit([REQ], [], ends + 0.001)
    assert stored(redis_url, stopping, REQ.name)[1] == {}
    assert after.levels[0].remaining == pytest.approx(before.levels[0].remaining - 1 + 0.002 * LIMIT / 60)
    assert (await other.admit([REQ], [], ends + 60)).levels[0].remaining == LIMIT - 1


async def test_near_the_limit_no_lease_is_granted_and_the_boundary_is_exact(
    make: Callable[..., RedisCounters],
) -> None:
    clock = Clock()
    first, second = make(clock), make(clock)
    exact = make(clock, leases=False)  # the same Redis, never leasing: brings the bucket near its limit
    for _ in range(LIMIT - 3 * SIZE):
        assert (await exact.admit([REQ], [], clock())).refused is None
    left = 3 * SIZE  # below LEASE_FAR leases per holder plus one: no lease is granted from here on
    for n in range(left):
        replica = first if n % 2 else second
        answer = await replica.admit([REQ], [], clock())
        await replica.lease_calls_done()
        assert answer.refused is None
        assert answer.places_from == ""
        assert answer.levels[0].remaining == left - 1 - n  # exact, counting down across both replicas
    assert replica.book is not None
    assert all(lease.unused == 0 for lease in replica.book.buckets.values())
    for replica in (first, second):
        refused = await replica.admit([REQ], [], clock())
        assert refused.refused is not None
        assert refused.refused.remaining == 0


async def test_token_buckets_are_leased_and_taken_from_at_a_request_s_end(
    make: Callable[..., RedisCounters], redis_url: str
) -> None:
    clock = Clock()
    replica = make(clock)
    tokens = Bucket("k|input_tokens", INPUT, 64_000, "key")  # leases of 1,000 tokens
    await replica.admit([REQ, tokens], [], clock())
    await replica.lease_calls_done()
    admitted = await replica.admit([REQ, tokens], [], clock())
    assert admitted.places_from == "lease"
    await replica.finish([(tokens, 300.0)], [], clock(), admitted.places_from)  # from the lease: no call
    assert stored(redis_url, replica, tokens.name)[0][b"level"] == b"63000"
    await replica.finish([(tokens, 900.0)], [], clock(), "")  # 700 from the lease, 200 from Redis
    assert stored(redis_url, replica, tokens.name)[0][b"level"] == b"62800"
    await replica.close()
    level, leases = stored(redis_url, replica, tokens.name)
    assert leases == {}
    assert level[b"level"] == b"62800"


async def test_leased_places_never_exceed_the_concurrency_limit_and_come_back_near_it(
    make: Callable[..., RedisCounters],
) -> None:
    clock = Clock()
    first, second = make(clock), make(clock)
    limit = 4 * PLACES_SHARE  # leases of 4 places
    slot = [("k|concurrent", limit)]
    admitted, per_replica = await admit_until_refused([first, second], [], slot, clock)
    assert len(admitted) == limit
    assert min(per_replica) > 0
    assert any(a.places_from == "lease" for a in admitted)
    # A request ends on the first replica once its lease has ended (a live lease keeps its places for its replica,
    # for at most LEASE_S): its place goes back to Redis at once, and the other replica gets it, not a third.
    clock.now += LEASE_S
    assert first.book is not None
    origin = "lease" if first.book.places["k|concurrent"].in_use else ""
    await first.finish([], ["k|concurrent"], clock(), origin)
    await first.lease_calls_done()
    assert (await second.admit([], slot, clock())).slots_refused is None
    assert (await first.admit([], slot, clock())).slots_refused == ("k|concurrent", limit)


async def test_a_lease_serves_while_redis_is_away_then_this_replica_s_memory(
    make: Callable[..., RedisCounters], redis_server: RedisServer
) -> None:
    clock = Clock()
    errors: list[int] = []
    replica = make(clock, on_error=lambda: errors.append(1))
    await replica.admit([REQ], [], clock())
    await replica.lease_calls_done()
    redis_server.stop()
    try:
        from_lease = [await replica.admit([REQ], [], clock()) for _ in range(SIZE)]
        assert all(a.refused is None and a.places_from == "lease" for a in from_lease)  # its own tokens
        await replica.lease_calls_done()  # its refresh failed: counted, and Redis is not asked for a while
        assert errors == [1]
        after = await replica.admit([REQ], [], clock())
        assert after.refused is None
        assert after.places_from == "memory"
        assert after.levels[0].remaining == LIMIT - 1  # a full bucket in memory, as before leases
        assert len(errors) == 1
    finally:
        redis_server.start()
