"""The predictor-wide decode budget (universal_predictors.decode_budget) on its own: first come, first served,
a request over the whole budget refused at once, a wait bounded."""

from __future__ import annotations

import asyncio

import pytest

from universal_predictors.decode_budget import DecodeBudget
from universal_predictors.errors import RequestTooLarge, Unavailable

MIB = 2**20


async def test_reservations_are_granted_in_order_and_never_exceed_the_budget() -> None:
    budget = DecodeBudget(100 * MIB, wait_s=30)
    order: list[str] = []
    most = 0

    async def hold(name: str, mib: int, seconds: float) -> None:
        nonlocal most
        async with budget.reserve(mib * MIB, name):
            order.append(name)
            most = max(most, budget.held)
            await asyncio.sleep(seconds)

    first = asyncio.create_task(hold("a", 60, 0.05))
    await asyncio.sleep(0)
    # "big" waits for "a"; "small" would fit beside "a" but comes after "big": it does not overtake it.
    await asyncio.gather(first, hold("big", 90, 0.01), hold("small", 10, 0.01))
    assert order == ["a", "big", "small"]
    assert most <= 100 * MIB
    assert budget.held == 0


async def test_more_than_the_whole_budget_is_a_413_naming_it() -> None:
    budget = DecodeBudget(100 * MIB, wait_s=30)
    with pytest.raises(RequestTooLarge) as refused:
        async with budget.reserve(101 * MIB, "images[0]"):
            pass
    assert refused.value.code == "decode_budget_exceeded"
    assert "decode_budget_mb" in refused.value.message
    assert budget.held == 0


async def test_a_wait_past_decode_wait_s_is_a_503_and_leaves_the_queue() -> None:
    budget = DecodeBudget(100 * MIB, wait_s=0.05)
    async with budget.reserve(80 * MIB, "first"):
        with pytest.raises(Unavailable) as busy:
            async with budget.reserve(50 * MIB, "second"):
                pass
        assert busy.value.code == "decode_budget_busy"
    assert budget.held == 0
    async with budget.reserve(100 * MIB, "third"):  # nothing left waiting in line ahead of it
        assert budget.held == 100 * MIB
