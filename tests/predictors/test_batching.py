"""The micro-batcher's wait for company when callers say how many items are on their way (``expected``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from universal_predictors.batching import BatchPolicy, MicroBatcher

#: Far longer than any test may take: a batch that waited it out would fail the ``wait_for`` bound below.
FOREVER_MS = 600_000.0


def recording() -> tuple[list[list[int]], MicroBatcher[int, int], list[int]]:
    batches: list[list[int]] = []
    on_the_way = [0]

    def run(items: Sequence[int]) -> list[int]:
        batches.append(list(items))
        return [item * 10 for item in items]

    batcher: MicroBatcher[int, int] = MicroBatcher(
        run, model_name="t", policy=BatchPolicy(max_batch_size=8, max_wait_ms=FOREVER_MS),
        expected=lambda: on_the_way[0],
    )  # fmt: skip
    return batches, batcher, on_the_way


def test_a_batch_waits_for_an_item_on_its_way_and_goes_once_it_arrives() -> None:
    async def scenario() -> tuple[list[list[int]], list[int]]:
        batches, batcher, on_the_way = recording()
        on_the_way[0] = 2  # two callers are decoding their pages
        first = asyncio.ensure_future(batcher.submit(1))
        await asyncio.sleep(0)  # the first is queued; the batcher now waits for the second
        second = asyncio.ensure_future(batcher.submit(2))
        results = await asyncio.wait_for(asyncio.gather(first, second), timeout=30)
        await batcher.close()
        return batches, list(results)

    batches, results = asyncio.run(scenario())
    assert batches == [[1, 2]]
    assert results == [10, 20]


def test_a_lone_item_does_not_wait_and_a_caller_giving_up_ends_the_wait() -> None:
    async def scenario() -> list[list[int]]:
        batches, batcher, on_the_way = recording()
        on_the_way[0] = 1
        await asyncio.wait_for(batcher.submit(1), timeout=30)  # nobody else coming: straight through
        on_the_way[0] = 2
        pending = asyncio.ensure_future(batcher.submit(2))
        await asyncio.sleep(0)
        on_the_way[0] = 1  # the other caller failed to decode its page
        batcher.notify()
        await asyncio.wait_for(pending, timeout=30)
        await batcher.close()
        return batches

    assert asyncio.run(scenario()) == [[1], [2]]
