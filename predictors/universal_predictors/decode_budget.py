"""One budget, per predictor, for the memory that decoded images and pages take across concurrent requests.

Each request's limits (``max_pixels``, ``max_total_pixels``) bound what one request decodes; nothing bounded them
together: 16 concurrent 6300x6300 OCR pages, each within its limits, took an OCR predictor from 680 to 4,915 MB,
and 8 chat requests of 8 inline 5000x5000 PNGs a vision model from 937 to 3,883 MB. A request now reserves what
its decoding and the work on those pixels will hold (pixels times a per-pixel cost measured for that path) before
it decodes anything, and gives it back when that work is done. Reservations are granted first come, first served
(a large one is not starved by small ones behind it). One larger than the whole budget is a 413
``decode_budget_exceeded`` naming the budget; one that waits longer than ``decode_wait_s`` a 503
``decode_budget_busy`` with ``Retry-After``.

The decoding itself runs on the budget's own threads, as many as the budget holds of its largest reservation
(at least one, at most the cores), not on the event loop's shared pool. glibc's malloc gives each thread an
arena of its own and keeps what that thread frees for its next allocation: pixels decoded and freed on six
pool threads, one after another, stayed resident six times over (a tiny vision model went 840 MiB above idle
decoding 23-megapixel PNGs strictly one at a time, against 177 MiB on one thread). With the threads bounded
by the budget, what their arenas keep is within it too; the heap is trimmed once the predictor is idle
(universal_predictors.allocator).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from universal_predictors.errors import RequestTooLarge, Unavailable

T = TypeVar("T")


class DecodeBudget:
    """Bytes of decoded pixels (and what works on them) the predictor holds at once (module docstring).
    Used from the event loop only."""

    def __init__(self, total_bytes: int, wait_s: float, arg: str = "decode_budget_mb", *,
                 largest_bytes: int | None = None) -> None:  # fmt: skip
        """``largest_bytes``: the most one decode on a thread may hold (the limits' largest image), which
        sizes the decode threads (module docstring)."""
        self.total = total_bytes
        self.wait_s = wait_s
        self.arg = arg
        self.held = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()
        at_once = total_bytes // max(1, largest_bytes or total_bytes)
        self.threads = max(1, min(os.cpu_count() or 1, at_once))
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on one of the budget's decode threads (module docstring)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="decode")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    @contextlib.asynccontextmanager
    async def reserve(self, nbytes: int, field: str, inputs: str = "images") -> AsyncIterator[None]:
        """Hold ``nbytes`` of the budget for the block (waiting in line for them); ``inputs`` names what is decoded,
        in the errors."""
        nbytes = max(0, nbytes)
        if nbytes > self.total:
            raise RequestTooLarge(
                f"{field}: decoding and reading these {inputs} needs about {nbytes // 2**20} MiB, more than this "
                f"model's whole decode budget ({self.total // 2**20} MiB, the engine argument {self.arg}); send "
                f"smaller or fewer {inputs} per request, or raise it",
                param=field,
                code="decode_budget_exceeded",
            )
        if self._waiters or self.held + nbytes > self.total:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            entry = (nbytes, waiter)
            self._waiters.append(entry)
            try:
                await asyncio.wait_for(asyncio.shield(waiter), self.wait_s)
            except TimeoutError:
                if waiter.done():  # granted just as the wait ran out: give it back
                    self.held -= nbytes
                else:
                    self._waiters.remove(entry)
                self._grant()
                raise Unavailable(
                    f"{field}: the model is decoding other requests' {inputs} up to its decode budget "
                    f"({self.total // 2**20} MiB, {self.arg}) and this request waited {self.wait_s:g} s for its "
                    "share; retry shortly",
                    code="decode_budget_busy",
                    retry_after=max(1.0, self.wait_s / 2),
                ) from None
            except asyncio.CancelledError:
                if waiter.done():
                    self.held -= nbytes
                else:
                    self._waiters.remove(entry)
                self._grant()
                raise
        else:
            self.held += nbytes
        try:
            yield
        finally:
            self.held -= nbytes
            self._grant()

    def _grant(self) -> None:
        """Wake waiters in order while the first one fits."""
        while self._waiters and self.held + self._waiters[0][0] <= self.total:
            nbytes, waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self.held += nbytes
            waiter.set_result(None)
