"""OpenAI-shaped errors: every failure a client sees is ``{"error": {message, type, param, code}}``.

Handlers raise :class:`APIError` (or a subclass); the server turns it into the JSON body and status,
adding ``Retry-After`` where waiting helps. No stack trace ever reaches a client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status_code: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status_code is not None:
            self.status_code = status_code
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class InvalidRequest(APIError):
    """400: the request is malformed or asks for something this model cannot do."""


class ModelNotFound(APIError):
    """404: the body names a model this predictor does not serve."""

    status_code = 404
    error_type = "not_found_error"

    def __init__(self, requested: str, served: str, adapters: Sequence[str] = ()) -> None:
        also = f" and its adapters {', '.join(repr(a) for a in adapters)}" if adapters else ""
        super().__init__(
            f"The model {requested!r} does not exist here; this server serves {served!r}{also}.",
            param="model",
            code="model_not_found",
        )


class RequestTooLarge(APIError):
    """413: the body (or an image, a page count...) is over a limit; the message names the limit."""

    status_code = 413
    error_type = "invalid_request_error"


class Unavailable(APIError):
    """503: loading, overloaded or shutting down; ``Retry-After`` says when to come back."""

    status_code = 503
    error_type = "server_error"

    def __init__(self, message: str, *, code: str = "unavailable", retry_after: float = 1.0) -> None:
        super().__init__(message, code=code, retry_after=retry_after)


class InternalError(APIError):
    """500: a failure inside the model; the message is generic, the details go to the log."""

    status_code = 500
    error_type = "server_error"

    def __init__(self, message: str = "The model failed to process the request; see the predictor's log.") -> None:
        super().__init__(message, code="internal_error")


#: Anthropic's error ``type`` for each HTTP status (its API reference, "Errors"): the Messages API's routes answer
#: errors in Anthropic's shape (the catalog's ``Route.errors``), from the predictor and from the gateway alike.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(error: APIError) -> dict[str, Any]:
    """``error`` in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``: it has no ``param``, so the
    field leads the message when the message does not name it already."""
    kind = ANTHROPIC_ERROR_TYPES.get(error.status_code)
    if kind is None:
        kind = "api_error" if error.status_code >= 500 else "invalid_request_error"
    message = error.message
    if error.param and not message.startswith(error.param):
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": kind, "message": message}}
