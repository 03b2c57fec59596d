"""Giving freed memory back to the system once a predictor goes idle.

glibc's malloc keeps what Python and native libraries free in its arenas for reuse: after a burst of
large requests (a logprobs response of megabytes, a schema of megabytes) the process stays at its peak
RSS although nothing holds that memory, and a container's memory limit counts it. ``malloc_trim(0)``
returns the free pages; it costs milliseconds, so :class:`TrimWhenIdle` calls it on a worker thread once
no request has been in flight for a moment, never on the event loop and never while a request runs.
Elsewhere than glibc (musl, macOS) there is nothing to call and this does nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
from collections.abc import Callable, Collection
from typing import Any


def _malloc_trim() -> Callable[[int], int] | None:
    with contextlib.suppress(OSError, AttributeError):
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
        return trim
    return None


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Return the allocator's free pages to the system; False where there is no ``malloc_trim``."""
    if _MALLOC_TRIM is None:
        return False
    _MALLOC_TRIM(0)
    return True


class TrimWhenIdle:
    """ASGI middleware: :func:`trim_heap` on a worker thread ``delay`` seconds after the last request in
    flight ends (requests to ``quiet_paths``, the probes, neither count nor trigger it)."""

    def __init__(self, app: Any, quiet_paths: Collection[str] = (), delay: float = 0.5) -> None:
        self.app = app
        self.quiet_paths = frozenset(quiet_paths)
        self.delay = delay
        self.in_flight = 0
        self._timer: asyncio.TimerHandle | None = None
        self._trimming: asyncio.Task[bool] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.quiet_paths:
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._timer = asyncio.get_running_loop().call_later(self.delay, self._trim)

    def _trim(self) -> None:
        self._timer = None
        if self.in_flight == 0 and (self._trimming is None or self._trimming.done()):
            self._trimming = asyncio.ensure_future(asyncio.to_thread(trim_heap))
