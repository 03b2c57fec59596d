"""What every list-then-watch loop of the gateway shares: how a failure reads, whether it is a routine expiry, and how
long to wait before listing again."""

from __future__ import annotations

from lightkube.core.exceptions import ApiError

#: A failed list or watch is retried at once, then after 1 s, 2 s... at most every 30 s.
WATCH_RETRY_MAX_S = 30.0


def describe(exc: BaseException) -> str:
    """A failed call in one line (an ApiError's str() is the message alone; the code says more to an operator)."""
    if isinstance(exc, ApiError):
        return f"{exc.status.code} {exc.status.reason}: {exc.status.message}"
    return str(exc) or type(exc).__name__


def expired(exc: BaseException) -> bool:
    """Whether a watch ended with 410: its resourceVersion left the server's window, which is routine (list again at
    once). It comes as the HTTP status, or (from the watch cache: Kubernetes storage/cacher/cacher.go newErrWatcher)
    as an ERROR event mid-stream, which lightkube raises with the Status it carried and no response."""
    status = getattr(getattr(exc, "status", None), "code", None)
    return 410 in (getattr(getattr(exc, "response", None), "status_code", None), status)


def retry_delay(failures: int) -> float:
    """Seconds before the next list after ``failures`` consecutive failures (the first retried at once)."""
    return min(WATCH_RETRY_MAX_S, 2.0 ** (failures - 1)) if failures else 0.0
