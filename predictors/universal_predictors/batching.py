"""Dynamic micro-batching: concurrent requests arriving within a short window share one forward pass.

A :class:`MicroBatcher` owns one worker thread (the engine thread): the event loop only enqueues and
awaits, so it never blocks on the model. Items are sorted by cost (e.g. token length) inside a batch to
limit padding, and results are handed back to each caller in its own order, so batching never mixes
results. A bounded queue turns overload into a 503 instead of unbounded latency.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from universal_predictors import metrics
from universal_predictors.errors import RequestTooLarge, Unavailable

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class BatchPolicy:
    """How batches form: at most ``max_batch_size`` items and ``max_batch_cost`` total cost,
    waiting at most ``max_wait_ms`` after the first item for others to join."""

    max_batch_size: int = 32
    max_wait_ms: float = 5.0
    max_batch_cost: int | None = None
    max_queue: int = 4096


@dataclass
class _Pending(Generic[T, R]):
    item: T
    cost: int
    future: asyncio.Future[R]
    enqueued: float = field(default_factory=time.monotonic)


class MicroBatcher(Generic[T, R]):
    """Batch ``run_batch(items) -> results`` (same length, same order) across concurrent callers."""

    def __init__(
        self,
        run_batch: Callable[[Sequence[T]], Sequence[R]],
        *,
        model_name: str,
        policy: BatchPolicy | None = None,
        cost: Callable[[T], int] | None = None,
        expected: Callable[[], int] | None = None,
    ) -> None:
        """``expected``: how many items callers are about to submit, those queued included (pages still
        being decoded, say); with it, a batch waits for company only while some is on its way, and stops
        waiting as soon as it has arrived (callers that give up call :meth:`notify`)."""
        self._run_batch = run_batch
        self._expected = expected
        self._arrival = asyncio.Event()
        self._policy = policy or BatchPolicy()
        self._cost = cost or (lambda _item: 1)
        self._model = model_name
        self._queue: asyncio.Queue[_Pending[T, R]] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{model_name}")

    @property
    def policy(self) -> BatchPolicy:
        return self._policy

    @property
    def queued(self) -> int:
        """Items submitted and not yet taken into a batch."""
        return self._queue.qsize() if self._queue is not None else 0

    def _ensure_started(self) -> asyncio.Queue[_Pending[T, R]]:
        if self._queue is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.get_running_loop().create_task(self._work(), name=f"batcher-{self._model}")
        return self._queue

    async def submit(self, item: T) -> R:
        """Process one item as part of whatever batch forms; returns its own result."""
        results = await self.submit_many([item])
        return results[0]

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """Process several items of one request (they may be split across batches); results in order."""
        queue = self._ensure_started()
        if len(items) > self._policy.max_queue:  # never admitted, however long the client waits
            raise RequestTooLarge(
                f"The request has {len(items)} items; this model queues at most {self._policy.max_queue} at once. "
                "Split it into smaller requests.",
                code="too_many_items",
            )
        if queue.qsize() + len(items) > self._policy.max_queue:
            raise Unavailable(
                f"The model is overloaded ({queue.qsize()} items queued); retry shortly.", code="overloaded"
            )
        loop = asyncio.get_running_loop()
        pending = [_Pending(item, self._cost(item), loop.create_future()) for item in items]
        for entry in pending:
            queue.put_nowait(entry)
        self._arrival.set()
        metrics.QUEUE_DEPTH.labels(self._model).set(queue.qsize())
        try:
            return list(await asyncio.gather(*(p.future for p in pending)))
        except asyncio.CancelledError:
            for entry in pending:
                entry.future.cancel()  # the worker skips cancelled entries
            raise

    def _take_batch(self, first: _Pending[T, R], queue: asyncio.Queue[_Pending[T, R]]) -> list[_Pending[T, R]]:
        batch = [first]
        total = first.cost
        limit = self._policy.max_batch_cost
        while len(batch) < self._policy.max_batch_size and not queue.empty():
            candidate = queue._queue[0]  # type: ignore[attr-defined]  # peek: stop before exceeding the budget
            if limit is not None and total + candidate.cost > limit:
                break
            batch.append(queue.get_nowait())
            total += candidate.cost
        return batch

    async def _work(self) -> None:
        assert self._queue is not None
        queue = self._queue
        loop = asyncio.get_running_loop()
        while True:
            first = await queue.get()
            if first.future.cancelled():
                continue
            await self._wait_for_company(queue)
            batch = [p for p in self._take_batch(first, queue) if not p.future.cancelled()]
            metrics.QUEUE_DEPTH.labels(self._model).set(queue.qsize())
            if not batch:
                continue
            order = sorted(range(len(batch)), key=lambda i: batch[i].cost)
            items = [batch[i].item for i in order]
            metrics.BATCH_SIZE.labels(self._model).observe(len(items))
            try:
                results = await loop.run_in_executor(self._executor, self._run_batch, items)
                if len(results) != len(items):
                    raise RuntimeError(f"batch function returned {len(results)} results for {len(items)} items")
            except BaseException as exc:  # hand the failure to every caller in the batch
                for entry in batch:
                    if not entry.future.done():
                        entry.future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
                continue
            metrics.ITEMS.labels(self._model).inc(len(items))
            for position, index in enumerate(order):
                entry = batch[index]
                if not entry.future.done():
                    entry.future.set_result(results[position])

    def notify(self) -> None:
        """Something :data:`expected` counts changed without a submit (a caller gave up): look again."""
        self._arrival.set()

    async def _wait_for_company(self, queue: asyncio.Queue[_Pending[T, R]]) -> None:
        """Give concurrent callers a moment to join, unless the batch is already full."""
        wait = self._policy.max_wait_ms / 1000
        if wait <= 0 or queue.qsize() + 1 >= self._policy.max_batch_size:
            return
        if self._expected is None:
            await asyncio.sleep(wait)
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait
        while queue.qsize() + 1 < self._policy.max_batch_size and self._expected() > queue.qsize() + 1:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrival.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrival.wait(), remaining)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._executor.shutdown(wait=False, cancel_futures=True)
