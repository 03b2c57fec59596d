"""The per-model gate shares a saturated model between API keys: a key queueing behind another's burst is served
next, not after it; a key whose requests used many tokens waits behind one whose did not; a key idle for a while
banks no priority; a client that leaves the queue frees its place."""

from __future__ import annotations

import asyncio

import pytest

from universal_gateway.limits import ModelGate
from universal_predictors.errors import APIError


async def served_order(gate: ModelGate, arrivals: list[str], tokens: dict[str, int] | None = None) -> list[str]:
    """Hold the gate's one place, queue ``arrivals`` in order, then free places one at a time: who got each.
    ``tokens``: the output tokens each key's answers use, counted as each is served."""
    order: list[str] = []
    await gate.acquire("holder")

    async def request(who: str) -> None:
        async with gate.slot(who):
            order.append(who)
            gate.charge(who, 0, (tokens or {}).get(who, 0))

    tasks = []
    for who in arrivals:
        tasks.append(asyncio.create_task(request(who)))
        await asyncio.sleep(0)  # queued in this order
    gate.release()  # the holder is done: every place after goes on as each request leaves
    await asyncio.gather(*tasks)
    return order


async def test_a_key_queued_behind_another_s_burst_is_served_next() -> None:
    order = await served_order(ModelGate(1, 100), ["a"] * 6 + ["b"] * 3)
    assert order[:6] == ["a", "b", "a", "b", "a", "b"]  # FIFO would serve a six times first
    assert order.count("a") == 6


async def test_with_one_key_the_queue_is_first_come_first_served() -> None:
    gate = ModelGate(1, 100)
    order: list[int] = []
    await gate.acquire("k")

    async def request(i: int) -> None:
        async with gate.slot("k"):
            order.append(i)

    tasks = [asyncio.create_task(request(i)) for i in range(5)]
    await asyncio.sleep(0)
    gate.release()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2, 3, 4]


async def test_tokens_used_count_toward_a_key_s_share() -> None:
    # Both queue at once; "heavy"'s answers are 100 tokens long, "light"'s 5: light gets the places after.
    order = await served_order(ModelGate(1, 100), ["heavy", "light"] * 4, tokens={"heavy": 100, "light": 5})
    assert order[:5] == ["heavy", "light", "light", "light", "light"]


async def test_a_key_idle_for_a_while_banks_no_priority() -> None:
    gate = ModelGate(1, 100)
    gate.counters.update({"busy": 500.0})  # served much while "idle" was away
    order = await served_order(gate, ["busy", "busy", "idle", "idle", "idle", "idle"])
    # "idle" is lifted to busy's counter when it starts queueing: they alternate, it does not take four in a row.
    assert order[:4] in (["busy", "idle", "busy", "idle"], ["idle", "busy", "idle", "busy"])


async def test_a_full_queue_is_a_429_and_a_client_that_leaves_frees_its_place() -> None:
    gate = ModelGate(1, 2)
    await gate.acquire("a")
    first = asyncio.create_task(gate.acquire("a"))
    second = asyncio.create_task(gate.acquire("b"))
    await asyncio.sleep(0)
    with pytest.raises(APIError) as refused:
        await gate.acquire("c")
    assert refused.value.status_code == 429
    first.cancel()
    await asyncio.sleep(0)
    third = asyncio.create_task(gate.acquire("c"))  # the place "first" left
    await asyncio.sleep(0)
    gate.release()
    await second
    gate.release()
    await third
    gate.release()
    assert gate._free == 1


async def test_unfair_is_first_come_first_served_across_keys() -> None:
    # What the bench compares the fair order with.
    order = await served_order(ModelGate(1, 100, fair=False), ["a"] * 6 + ["b"] * 3)
    assert order == ["a"] * 6 + ["b"] * 3
