"""A clock for idle timers that stands still until the test moves it.

Idle unloading (the gateway's TTL, the KServe stand-in's Knative window) is judged on an injected clock. A test
that hands them this one decides when a model has been idle long enough: a loaded machine taking seconds between
two requests cannot make a window pass, and a window passes at once when the test steps over it. Only the idle
decisions read it; waits, deadlines and the event loop keep real time.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta


class SteppedClock:
    """Monotonic seconds that move only by :meth:`advance` (a :class:`universal_gateway.backends.Clock`)."""

    def __init__(self, start_at: datetime | None = None) -> None:
        self._now = time.monotonic()
        self._start = self._now
        self._wall_start = start_at or datetime.now(UTC)
        #: (Unix time of a step, the reading after it), oldest first.
        self._steps: list[tuple[float, float]] = []

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass at once."""
        self._now += seconds
        self._steps.append((time.time(), self._now))

    def monotonic(self) -> float:
        return self._now

    def now(self) -> datetime:
        """Wall-clock time, moved by the same steps (from ``start_at``, the real time when not given)."""
        return self._wall_start + timedelta(seconds=self._now - self._start)

    def monotonic_at(self, unix_time: float) -> float:
        """The reading this clock had at ``unix_time`` (another process's stamp, a predictor's last request):
        a stamp ages by the steps taken after it, and only by them."""
        return next((reading for at, reading in reversed(self._steps) if at <= unix_time), self._start)
