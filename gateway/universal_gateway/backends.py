"""Where models live, behind one interface: local processes (LocalSupervisor) or the cluster.

The proxy only asks a backend three things: which models exist (and their state), which task a model
does, and, for one request, a *lease* on a ready upstream: the backend wakes the model if needed, holds
the request until it is ready (bounded), and counts it as in flight so idle unloading never cuts it off.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

from universal_operator.spec import ADAPTER_SEPARATOR
from universal_predictors.catalog import Task


class ModelState(StrEnum):
    """What a client can expect from a model right now."""

    READY = "ready"
    IDLE = "idle"  # unloaded or scaled to zero; the next request wakes it
    LOADING = "loading"
    FAILED = "failed"


class Clock(Protocol):
    """The time a backend judges idleness by: the system's (:data:`SYSTEM_CLOCK`), or one a test moves, so
    that whether a model has been idle long enough is the test's to say, not a loaded machine's."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (``time.monotonic``'s)."""

    def monotonic_at(self, unix_time: float) -> float:
        """When ``unix_time``, a wall-clock time another process stamped, was on :meth:`monotonic`'s clock."""

    def now(self) -> datetime:
        """The wall-clock time, time-zone aware (scheduled warm windows are judged by it)."""


class SystemClock:
    """The system's clocks."""

    monotonic = staticmethod(time.monotonic)

    @staticmethod
    def monotonic_at(unix_time: float) -> float:
        return time.monotonic() - (time.time() - unix_time)

    @staticmethod
    def now() -> datetime:
        return datetime.now(UTC)


SYSTEM_CLOCK: Clock = SystemClock()


@dataclass
class UsageStats:
    """Per-model request accounting for ``ps`` and ``/v1/models``."""

    requests: int = 0
    in_flight: int = 0
    last_used: float | None = None  # wall-clock seconds
    #: What ``last_used_monotonic`` and the latencies are read from: the backend's idle clock.
    clock: Clock = field(default=SYSTEM_CLOCK, repr=False)
    #: The latest request's start or end on ``clock`` (until the first: when the model was added).
    last_used_monotonic: float = field(init=False)
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=512))

    def __post_init__(self) -> None:
        self.last_used_monotonic = self.clock.monotonic()

    def begin(self) -> float:
        self.requests += 1
        self.in_flight += 1
        self.last_used = time.time()
        now = self.last_used_monotonic = self.clock.monotonic()
        return now

    def end(self, started: float) -> None:
        self.in_flight -= 1
        now = self.last_used_monotonic = self.clock.monotonic()
        self.latencies.append(now - started)
        self.last_used = time.time()

    @property
    def p50_ms(self) -> float | None:
        return statistics.median(self.latencies) * 1000 if self.latencies else None


@dataclass
class ModelView:
    """One model as ``/v1/models`` and ``ps`` show it."""

    name: str
    task: Task
    backend: str
    state: ModelState
    message: str = ""
    endpoint: str | None = None
    pid: int | None = None
    stats: UsageStats = field(default_factory=UsageStats)
    extra: dict[str, Any] = field(default_factory=dict)
    #: The model's LoRA adapters (``spec.adapters`` names), each served as ``{name}:{adapter}`` by its predictors.
    adapters: tuple[str, ...] = ()

    def card(self) -> dict[str, Any]:
        """The OpenAI model object, with our state fields. Not where the model runs (its address, its
        process): every key holder reads this, and a predictor is only for the gateway to call."""
        return {
            "id": self.name,
            "object": "model",
            "owned_by": "universal-runtime",
            "task": self.task.value,
            "backend": self.backend,
            "state": self.state.value,
            "message": self.message,
            "requests": self.stats.requests,
            "last_used": self.stats.last_used,
            "p50_ms": self.stats.p50_ms,
            **self.extra,
        }

    def adapter_cards(self) -> list[dict[str, Any]]:
        """One OpenAI model object per adapter: ``parent`` names the base (as vLLM's ``/v1/models`` does), the
        state is the base's (an adapter loads with its first request, once the base runs)."""
        return [
            {"id": f"{self.name}{ADAPTER_SEPARATOR}{adapter}", "object": "model", "owned_by": "universal-runtime",
             "parent": self.name, "task": self.task.value, "backend": self.backend, "state": self.state.value}
            for adapter in self.adapters
        ]  # fmt: skip

    def row(self) -> dict[str, Any]:
        """The fields ``universal-runtime ps`` prints."""
        return {
            "name": self.name,
            "task": self.task.value,
            "backend": self.backend,
            "state": self.state.value,
            "endpoint": self.endpoint,
            "pid": self.pid,
            "last_used": self.stats.last_used,
            "requests": self.stats.requests,
            "p50_ms": self.stats.p50_ms,
        }


class WakeSteps:
    """How long each step of a model's wake took (Starting, Loading locally; Scheduling, Pulling image, Downloading,
    Loading on a cluster, as the operator reads them from the predictor pod), told to ``observe`` when the next
    step begins or the model is up, and each wake told to ``woke``: the gateway's metrics."""

    def __init__(self) -> None:
        self.observe: Callable[[str, str, float], None] | None = None
        self.woke: Callable[[str], None] | None = None
        self._current: dict[str, tuple[str, float]] = {}

    def wake(self, model: str) -> None:
        if self.woke is not None:
            self.woke(model)

    def moved(self, model: str, step: str | None, now: float) -> None:
        """``model`` is at ``step`` now (None: no longer starting)."""
        previous = self._current.get(model)
        if previous is not None and previous[0] == step:
            return
        if previous is not None and self.observe is not None:
            self.observe(model, previous[0], max(0.0, now - previous[1]))
        if step is None:
            self._current.pop(model, None)
        else:
            self._current[model] = (step, now)


class Backends(ABC):
    """The models a gateway routes to."""

    #: Sent to every predictor in ``UPSTREAM_TOKEN_HEADER`` (None: nothing is sent); a predictor
    #: started with the same token refuses requests without it.
    upstream_token: str | None = None

    @property
    def wake_steps(self) -> WakeSteps:
        """Each wake and the time of its steps, for the gateway's metrics (the gateway sets the observers)."""
        steps: WakeSteps | None = self.__dict__.get("_wake_steps")
        if steps is None:
            steps = self.__dict__["_wake_steps"] = WakeSteps()
        return steps

    @abstractmethod
    async def start(self) -> None:
        """Begin watching/serving (start always-on models, watch the cluster...)."""

    @abstractmethod
    async def close(self) -> None:
        """Stop everything this backend started."""

    @abstractmethod
    def models(self) -> list[ModelView]:
        """Every model known, whatever its state."""

    def find(self, name: str) -> ModelView | None:
        for view in self.models():
            if view.name == name:
                return view
        return None

    def upstream_timeout(self, name: str) -> float | None:
        """How long an upstream may take to answer (a scale-from-zero included); None: the default."""
        return None

    def readiness(self) -> str | None:
        """None when the gateway can route every model it should know of; else why not (``/readyz``)."""
        return None

    @abstractmethod
    def lease(self, name: str) -> contextlib.AbstractAsyncContextManager[str]:
        """A ready upstream base URL for one request (waking the model if needed)."""

    async def exited(self, name: str, upstream: str, *, killed: bool = False) -> bool:
        """Whether the process serving ``name`` at ``upstream`` (a URL :meth:`lease` gave) has exited, for a
        request that got no answer from it: True once its exit is recorded (the next lease starts a successor);
        with ``killed``, only if it was killed from outside (SIGKILL or SIGTERM, not the OOM killer over its limit)
        rather than failing of itself. False if it runs on, or nothing is known of it: only a backend that runs the
        processes itself can tell."""
        return False


class counted:
    """Count one request in flight for its whole duration.

    A class, not an ``asynccontextmanager`` generator: it runs on every proxied request."""

    __slots__ = ("_started", "_stats")

    def __init__(self, stats: UsageStats) -> None:
        self._stats = stats
        self._started = 0.0

    async def __aenter__(self) -> None:
        self._started = self._stats.begin()

    async def __aexit__(self, *exc: object) -> None:
        self._stats.end(self._started)
