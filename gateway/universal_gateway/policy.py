"""How the gateway serves one model, read once from its UniversalModel, and the one rule for idleness.

Both backends use these: the LocalSupervisor (a process per model) and KubernetesBackends (Standard-mode
models, whose TTL the gateway owns). Pure: plain data in, plain data out; the backends bring the clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from universal_operator.spec import ScalingMode, UniversalModel
from universal_operator.warm import WarmWindow, warm_at


@dataclass(frozen=True)
class ServingPolicy:
    """What ``spec.scaling`` asks of whoever starts and stops the model."""

    mode: ScalingMode
    #: Seconds without a request before the model is unloaded (``spec.scaling.idleTimeout``).
    idle_timeout: float
    #: Seconds a start (download and load) may take before it counts as failed (``spec.scaling.startupTimeout``).
    startup_timeout: float
    #: ``minReplicas >= 1``: kept running, never stopped for being idle.
    always_on: bool
    #: The idleTimeout as the manifest writes it, for messages ("idle for 5m").
    idle_timeout_text: str
    startup_timeout_text: str
    #: ``spec.scaling.maxHeldRequests``: requests held while the model wakes (None: the gateway's default).
    max_held: int | None = None
    #: ``spec.scaling.warmSchedule``: windows during which the model is kept running (and started at their start).
    warm_schedule: tuple[WarmWindow, ...] = ()

    def warm(self, now: datetime) -> bool:
        """Whether ``now`` is inside a warm window (:func:`universal_operator.warm.warm_at`)."""
        return bool(self.warm_schedule) and warm_at(list(self.warm_schedule), now)[0]

    @classmethod
    def from_model(cls, model: UniversalModel) -> ServingPolicy:
        scaling = model.spec.scaling
        return cls(
            mode=scaling.mode,
            idle_timeout=scaling.idle_duration.total_seconds(),
            startup_timeout=scaling.startup_duration.total_seconds(),
            always_on=scaling.min_replicas >= 1,
            idle_timeout_text=scaling.idle_timeout,
            startup_timeout_text=scaling.startup_timeout,
            max_held=scaling.max_held_requests,
            warm_schedule=tuple(scaling.warm_schedule),
        )

    def gateway_stops_when_idle(self, *, in_cluster: bool) -> bool:
        """Whether the gateway unloads the model once it is idle: locally every model that is not always on;
        in a cluster only Standard mode, since Knative scales a Knative-mode model to zero itself."""
        if self.always_on:
            return False
        return not in_cluster or self.mode is ScalingMode.STANDARD


def idle_at(last_used: float, in_flight: int, idle_timeout: float) -> float | None:
    """When a model becomes idle: ``idle_timeout`` after its last use (a request's start or end), on the
    clock ``last_used`` is read from; None while a request is in flight, since it cannot be idle then."""
    if in_flight > 0:
        return None
    return last_used + idle_timeout


def is_idle(last_used: float, in_flight: int, idle_timeout: float, now: float) -> bool:
    """Whether a model used last at ``last_used`` with ``in_flight`` requests running is idle at ``now``."""
    at = idle_at(last_used, in_flight, idle_timeout)
    return at is not None and now >= at
