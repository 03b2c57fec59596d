"""The usage ledger in a real ``redis-server`` (:class:`RedisLedger`): every replica's records in one report, by
hour, key and model (an adapter's ``base:adapter`` name too), kept for the retention; while Redis cannot be reached
records wait in memory and are written when it answers, and the report is a 503 rather than a short total."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import redis

from tests.gateway.redis_server import running_redis
from universal_gateway.redis_ledger import WRITE_EVERY_S, RedisLedger
from universal_gateway.redis_link import RedisLink
from universal_gateway.usage import Usage
from universal_predictors.errors import Unavailable

HOUR0 = 1_800_000_000 // 3600 * 3600


@pytest.fixture
async def make(redis_url: str) -> AsyncIterator[Callable[..., RedisLedger]]:
    prefix = f"test-{uuid.uuid4().hex[:8]}:"
    made: list[RedisLedger] = []

    def ledger(**options: object) -> RedisLedger:
        made.append(RedisLedger(options.pop("url", redis_url), prefix=prefix, **options))  # type: ignore[arg-type]
        return made[-1]

    yield ledger
    for ledger_ in made:
        await ledger_.close()


def at(seconds: float) -> Callable[[], float]:
    return lambda: HOUR0 + seconds


async def test_every_replica_s_records_add_up_by_hour_key_and_model(make: Callable[..., RedisLedger]) -> None:
    first, second = make(clock=at(10)), make(clock=at(20))
    one = Usage(requests=1, input_tokens=7, output_tokens=3, predictor_seconds=0.25)
    await first.record("team-a", "chat:support", one)  # an adapter: ':' in its name
    await second.record("team-a", "chat:support", one)
    await second.record("team-a", "chat", Usage(requests=1, images=2, pages=3, rows=4))
    await first.record("-", "chat", Usage(requests=1))  # an open gateway's callers
    second.clock = at(3600 + 5)  # the next hour
    await second.record("team-a", "chat", Usage(requests=1, output_tokens=9))
    await asyncio.sleep(WRITE_EVERY_S + 0.5)  # each replica writes what it recorded every half second
    rows = await first.rows(HOUR0, HOUR0 + 7200, None)
    assert rows == [
        (HOUR0, "-", "chat", Usage(requests=1)),
        (HOUR0, "team-a", "chat", Usage(requests=1, images=2, pages=3, rows=4)),
        (HOUR0, "team-a", "chat:support", Usage(requests=2, input_tokens=14, output_tokens=6, predictor_seconds=0.5)),
        (HOUR0 + 3600, "team-a", "chat", Usage(requests=1, output_tokens=9)),
    ]
    assert await second.rows(HOUR0, HOUR0 + 7200, "-") == [rows[0]]
    assert await second.rows(HOUR0 + 3600, HOUR0 + 7200, None) == [rows[3]]  # from the second hour
    assert await second.rows(HOUR0, HOUR0 + 3600, "team-a") == rows[1:3]  # to before the second hour


async def test_an_hour_is_kept_for_the_retention(make: Callable[..., RedisLedger], redis_url: str) -> None:
    now = time.time()
    ledger = make(clock=lambda: now, retention_s=2 * 86400)
    await ledger.record("team-a", "chat", Usage(requests=1))
    await ledger.rows(0, 1, None)  # (a report writes what is pending first)
    hour = int(now) // 3600 * 3600
    ttl = redis.Redis.from_url(redis_url).ttl(f"{ledger.prefix}{hour}:team-a:chat")
    assert hour + 2 * 86400 - now - 2 <= ttl <= hour + 2 * 86400 - now + 1  # (whole seconds)


async def test_records_wait_while_redis_is_unreachable_and_are_written_when_it_answers(
    make: Callable[..., RedisLedger], tmp_path: Path
) -> None:
    errors: list[int] = []
    dropped: list[int] = []
    elapsed = [0.0]  # the link's clock: how long after a failure the next call is tried
    with running_redis(tmp_path) as server:
        link = RedisLink(server.url, "the usage ledger", on_error=lambda: errors.append(1), clock=lambda: elapsed[0])
        ledger = make(url=server.url, link=link, clock=at(0), on_dropped=lambda: dropped.append(1),
                      max_pending_rows=2)  # fmt: skip
        await ledger.record("team-a", "chat", Usage(requests=1, output_tokens=5))
        await ledger.rows(HOUR0, HOUR0 + 3600, None)  # written (a report writes what is pending first)
        server.stop(keep_data=True)
        for _ in range(3):
            await ledger.record("team-a", "chat", Usage(requests=1, output_tokens=5))
        await ledger.record("team-b", "chat", Usage(requests=1))
        await ledger.record("team-c", "chat", Usage(requests=1))  # a third row: over the buffer's bound
        assert dropped == [1]
        with pytest.raises(Unavailable):  # the pending rows cannot be written: no short total
            await ledger.rows(HOUR0, HOUR0 + 3600, None)
        assert errors
        server.start()
        elapsed[0] += link.pause_s
        rows = await ledger.rows(HOUR0, HOUR0 + 3600, None)
    assert rows == [
        (HOUR0, "team-a", "chat", Usage(requests=4, output_tokens=20)),
        (HOUR0, "team-b", "chat", Usage(requests=1)),
    ]
    assert ledger.pending == {}
