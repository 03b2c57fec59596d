"""Timestamps as the API server writes them."""

from __future__ import annotations

import datetime


def now() -> datetime.datetime:
    """The current time, in UTC."""
    return datetime.datetime.now(tz=datetime.UTC)


def rfc3339(moment: datetime.datetime | None = None) -> str:
    """Second-precision RFC3339 with ``Z``, as Kubernetes renders ``metav1.Time``."""
    return (moment or now()).astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
