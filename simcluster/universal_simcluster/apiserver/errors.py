"""API failures answered as a Kubernetes ``v1 Status``."""

from __future__ import annotations

from universal_simcluster.apiserver.resources import JSON

_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Gone",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """An API failure to be answered as a Kubernetes ``Status`` (never escapes to kmock)."""

    def __init__(self, code: int, message: str, reason: str | None = None, details: JSON | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or _REASONS.get(code, "Unknown")
        self.details = details or {}


def status_body(code: int, message: str, reason: str | None = None, details: JSON | None = None) -> JSON:
    """A ``v1 Status`` failure body as Kubernetes sends it."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason or _REASONS.get(code, "Unknown"),
        "details": details or {},
        "code": code,
    }
