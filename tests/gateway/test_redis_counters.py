"""The limits' counters in a real ``redis-server`` (:class:`RedisCounters`): the same answers as the in-memory ones
for any sequence of calls, the refill arithmetic at chosen times, idle buckets that vanish, concurrency places that a
dead replica cannot keep, and, when Redis cannot be reached, limits held in the replica's memory, counted."""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import pytest
import redis

from tests.predictors.harness import free_port
from universal_gateway.quotas import INPUT, OUTPUT, REQUESTS, Admission, Bucket, Level, MemoryCounters
from universal_gateway.redis_counters import IDLE_GRACE_S, RedisCounters

T0 = 1_800_000_000.0  # a chosen wall-clock time: the counters take the caller's


@pytest.fixture
async def make(redis_url: str) -> AsyncIterator[Callable[..., RedisCounters]]:
    """RedisCounters on the module's Redis, each test under its own prefix (one per call: one per replica)."""
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    made: list[RedisCounters] = []

    def counters(**options: object) -> RedisCounters:
        made.append(RedisCounters(redis_url, prefix=prefix, **options))  # type: ignore[arg-type]
        return made[-1]

    yield counters
    for counters_ in made:
        await counters_.close()


REQ = Bucket("k|requests", REQUESTS, 60, "key")
INP = Bucket("k|input_tokens", INPUT, 50, "key")
OUT = Bucket("k|output_tokens", OUTPUT, 20, "key")
MODEL_REQ = Bucket("k|m|requests", REQUESTS, 5, "m")


async def test_a_requests_bucket_refills_at_its_limit_per_minute(make: Callable[..., RedisCounters]) -> None:
    counters = make()
    for n in range(60):
        admitted = await counters.admit([REQ], [], T0)
        assert admitted.refused is None
        assert admitted.levels[0].remaining == 59 - n
    refused = await counters.admit([REQ], [], T0)
    assert refused.refused is not None
    assert refused.refused.remaining == 0.0
    assert refused.retry_after_s == 1.0  # 60 per minute: one a second
    half = await counters.admit([REQ], [], T0 + 0.5)
    assert half.refused is not None
    assert half.refused.remaining == 0.5
    assert half.retry_after_s == 0.5
    again = await counters.admit([REQ], [], T0 + 1.0)
    assert again.refused is None
    assert again.levels[0].remaining == 0.0
    assert again.levels[0].reset_s == 60.0  # empty: a minute to full
    full = await counters.admit([REQ], [], T0 + 1000)
    assert full.levels[0].remaining == 59  # refilled to the limit, not beyond


async def test_a_token_bucket_admits_while_above_zero_and_may_go_below(make: Callable[..., RedisCounters]) -> None:
    counters = make()
    assert (await counters.admit([OUT], [], T0)).refused is None
    taken = await counters.take([(OUT, 25)], T0, all_or_nothing=False)
    assert taken == [Level(OUT, -5.0, 75.0)]
    assert await counters.take([(OUT, 1)], T0, all_or_nothing=True) is None  # (nothing taken)
    refused = await counters.admit([OUT], [], T0 + 10)  # -5 + 10 s x 20/60 = -1.67
    assert refused.refused is not None
    assert refused.refused.remaining == pytest.approx(-5 + 10 / 3)
    assert (await counters.admit([OUT], [], T0 + 16)).refused is None  # -5 + 16/3 > 0
    emptied = await counters.take([(OUT, 20)], T0 + 100, all_or_nothing=True)  # full again, then exactly empty
    assert emptied == [Level(OUT, 0.0, 60.0)]
    at_zero = await counters.admit([OUT], [], T0 + 100)
    assert at_zero.refused is not None  # a token bucket admits above zero only
    assert 0 < at_zero.retry_after_s < 1e-300


async def test_all_or_nothing_takes_from_every_bucket_or_none(make: Callable[..., RedisCounters]) -> None:
    counters = make()
    model_output = Bucket("k|m|output_tokens", OUTPUT, 5, "m")
    assert await counters.take([(OUT, 4), (model_output, 4)], T0, all_or_nothing=True) == [
        Level(OUT, 16.0, 12.0),
        Level(model_output, 1.0, 48.0),
    ]
    assert await counters.take([(OUT, 4), (model_output, 4)], T0, all_or_nothing=True) is None  # 1 left on one
    again = await counters.take([(OUT, 1), (model_output, 1)], T0, all_or_nothing=True)
    assert again == [Level(OUT, 15.0, 15.0), Level(model_output, 0.0, 60.0)]  # the refused take took nothing


async def test_an_idle_bucket_expires_once_it_would_be_full_again(
    make: Callable[..., RedisCounters], redis_url: str
) -> None:
    counters = make()
    await counters.admit([REQ], [], T0)
    await counters.take([(OUT, 20)], T0, all_or_nothing=False)
    client = redis.Redis.from_url(redis_url)
    ttl_request = client.pttl(counters.prefix + REQ.name) / 1000
    ttl_output = client.pttl(counters.prefix + OUT.name) / 1000
    assert IDLE_GRACE_S < ttl_request <= IDLE_GRACE_S + 1  # 59 of 60 left: one second to full
    assert IDLE_GRACE_S + 59 < ttl_output <= IDLE_GRACE_S + 60  # empty: a minute to full


async def test_two_replicas_draw_on_one_bucket(make: Callable[..., RedisCounters]) -> None:
    first, second = make(), make()
    answers = [await (first if n % 2 else second).admit([MODEL_REQ], [], T0) for n in range(6)]
    assert [a.levels[0].remaining for a in answers[:5]] == [4, 3, 2, 1, 0]
    assert answers[5].refused is not None


async def test_concurrency_places_are_shared_and_freed(make: Callable[..., RedisCounters]) -> None:
    first, second = make(), make()
    slot = [("k|concurrent", 2)]
    assert (await first.admit([], slot, T0)).slots_refused is None
    assert (await second.admit([], slot, T0)).slots_refused is None
    assert (await first.admit([], slot, T0)).slots_refused == ("k|concurrent", 2)
    await second.release(["k|concurrent"])
    assert (await first.admit([], slot, T0)).slots_refused is None
    # A request's end frees its place and settles its tokens in the same call.
    await first.finish([(OUT, 5.0)], ["k|concurrent"], T0)
    assert (await second.admit([], slot, T0)).slots_refused is None
    assert await second.take([(OUT, 0.0)], T0, all_or_nothing=False) == [Level(OUT, 15.0, 15.0)]


async def test_a_dead_replica_s_places_come_free_when_their_leases_end(make: Callable[..., RedisCounters]) -> None:
    dead, alive = make(slot_lease_s=30.0), make(slot_lease_s=30.0)
    slot = [("k|concurrent", 1)]
    assert (await dead.admit([], slot, T0)).slots_refused is None
    await dead.close()  # dies mid-request: never releases, never renews
    assert (await alive.admit([], slot, T0 + 29)).slots_refused is not None
    assert (await alive.admit([], slot, T0 + 31)).slots_refused is None


async def test_a_running_request_s_lease_is_renewed(make: Callable[..., RedisCounters], redis_url: str) -> None:
    now = [T0]
    holder = make(slot_lease_s=0.3, clock=lambda: now[0])
    assert (await holder.admit([], [("k|concurrent", 1)], T0)).slots_refused is None
    key = holder.prefix + "k|concurrent"
    client = redis.Redis.from_url(redis_url)
    now[0] = T0 + 100  # the replica's clock moves on; its renewer runs every lease/3
    renewed = client.zrange(key, 0, -1, withscores=True)
    for _ in range(50):
        renewed = client.zrange(key, 0, -1, withscores=True)
        if renewed and renewed[0][1] > T0 + 100:
            break
        await asyncio.sleep(0.05)
    assert renewed[0][1] == pytest.approx(T0 + 100.3)


def _random_calls(seed: int) -> list[tuple[str, object]]:
    rng = random.Random(seed)
    buckets = [REQ, INP, OUT, MODEL_REQ]
    calls: list[tuple[str, object]] = []
    now = T0
    for _ in range(300):
        now += rng.choice([0.0, 0.0, 0.01, 0.3, 1.0, 2.5, 7.0])
        kind = rng.random()
        if kind < 0.5:
            chosen = rng.sample(buckets, rng.randint(1, 4))
            slots = [("k|concurrent", 3)] if rng.random() < 0.5 else []
            calls.append(("admit", (chosen, slots, now)))
        elif kind < 0.85:
            chosen = rng.sample(buckets[1:], rng.randint(1, 3))
            takes = [(bucket, rng.choice([-3, 1, 2, 7, 19, 40])) for bucket in chosen]
            calls.append(("take", (takes, now, rng.random() < 0.5)))
        elif kind < 0.92:
            calls.append(("release", now))
        else:  # a request's end: its give-backs and input tokens, and its place, in one call
            chosen = rng.sample(buckets[1:], rng.randint(0, 3))
            calls.append(("finish", ([(bucket, rng.choice([-5, -1, 3, 12])) for bucket in chosen], now)))
    return calls


async def _run(counters: MemoryCounters | RedisCounters, calls: Sequence[tuple[str, object]]) -> list[object]:
    held = 0
    out: list[object] = []
    for name, args in calls:
        if name == "admit":
            buckets, slots, now = args  # type: ignore[misc]
            admission: Admission = await counters.admit(buckets, slots, now)
            if slots and admission.refused is None and admission.slots_refused is None:
                held += 1
            out.append(admission)
        elif name == "take":
            takes, now, all_or_nothing = args  # type: ignore[misc]
            out.append(await counters.take(takes, now, all_or_nothing=all_or_nothing))
        elif name == "finish":
            takes, now = args  # type: ignore[misc]
            await counters.finish(takes, ["k|concurrent"] if held else [], now)
            held = max(0, held - 1)
        elif held:
            held -= 1
            await counters.release(["k|concurrent"])
    return out


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_the_same_answers_as_the_memory_counters_for_any_calls(
    make: Callable[..., RedisCounters], seed: int
) -> None:
    calls = _random_calls(seed)
    expected = await _run(MemoryCounters(), calls)
    outcomes = {type(a).__name__ + str(getattr(a, "refused", a) is None) for a in expected}
    assert outcomes >= {"AdmissionTrue", "AdmissionFalse", "listFalse", "NoneTypeTrue"}  # every kind of answer
    got = await _run(make(slot_lease_s=3600.0), calls)  # (a lease longer than the calls' span: places never end)
    assert got == expected  # every level, refusal and wait, to the last bit


async def test_unreachable_redis_holds_the_limits_in_this_replica_s_memory(caplog: pytest.LogCaptureFixture) -> None:
    errors: list[int] = []
    counters = RedisCounters(f"redis://127.0.0.1:{free_port()}/0", on_error=lambda: errors.append(1))
    bucket = Bucket("k|requests", REQUESTS, 2, "key")
    with caplog.at_level(logging.WARNING, logger="universal_gateway.redis_link"):
        answers = [await counters.admit([bucket], [], T0) for _ in range(3)]
    await counters.close()
    assert [a.refused is None for a in answers] == [True, True, False]  # still limited, per replica
    assert errors == [1]  # one failed call; then none tried for a while (a request does not wait on each)
    assert len([r for r in caplog.records if "limits are held per replica" in r.getMessage()]) == 1
