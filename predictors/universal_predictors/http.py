"""Request parsing and responses for the OpenAI and task routes.

Bodies are parsed by hand (not by FastAPI's signature magic) so every failure is ours to shape: a body
over the limit is a 413 naming the limit, invalid JSON or a bad field is a 400 naming the field. A task
that takes file uploads (OCR) reads ``multipart/form-data`` with :func:`parse_form`, under the same limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from universal_predictors import metrics, wake_phases
from universal_predictors.errors import APIError, InternalError, InvalidRequest, RequestTooLarge, anthropic_error_body

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

#: Default body limit; a task can pass its own (OCR takes images).
DEFAULT_MAX_BODY_BYTES = int(os.environ.get("UNIVERSAL_MAX_BODY_BYTES", str(16 * 2**20)))


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


async def read_body(request: Request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> bytes:
    """The raw body, refusing (413) anything over ``max_bytes`` before reading it all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLarge(f"The request body is {_mib(int(declared))}; the limit is {_mib(max_bytes)}.")
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise RequestTooLarge(f"The request body is over the limit of {_mib(max_bytes)}.")
        chunks.append(chunk)
    return b"".join(chunks)


#: Location parts pydantic adds for union members and validators: not fields a client wrote.
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "is-instance", "json-or-python", "literal"}


def field_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as the dotted/indexed path a client wrote (``messages[0].content``)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out and (str(part) in _TYPE_TAGS or "[" in str(part) or str(part).startswith(("function-", "tagged-"))):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def validation_error(exc: ValidationError) -> InvalidRequest:
    """The first pydantic error as an OpenAI 400 naming the field."""
    first = exc.errors()[0]
    where = field_path(tuple(first["loc"]))
    message = str(first["msg"]).removeprefix("Value error, ")
    return InvalidRequest(f"{where}: {message}" if where else message, param=where or None, code="invalid_value")


#: A ``\\uD800``-``\\uDFFF`` escape: only such an escape can put a lone surrogate into a parsed string.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE_ESCAPE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]")


def loads_json(raw: bytes | str, what: str = "The request body", param: str | None = None) -> Any:
    """Parse JSON from a client (a body, or a JSON string inside one); every way it can fail is a 400
    ``invalid_json`` saying why, whatever its size.

    ``json.loads`` alone lets hostile input through as other exceptions: an integer of more digits than
    Python converts (``ValueError``), nesting deeper than the recursion limit (``RecursionError``), and a
    lone surrogate escape (``"\\ud800"``), which parses but fails later wherever the text is encoded.
    """

    def invalid(reason: str) -> InvalidRequest:
        return InvalidRequest(f"{what} is not valid JSON: {reason}", param=param, code="invalid_json")

    try:
        data = json.loads(raw)
    except RecursionError:
        raise invalid("it nests too deeply.") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, and int's max_str_digits ValueError
        raise invalid(str(exc) if isinstance(exc, json.JSONDecodeError) else str(exc).split(";")[0]) from None
    escape = _SURROGATE_ESCAPE_BYTES.search(raw) if isinstance(raw, bytes) else _SURROGATE_ESCAPE.search(raw)
    if escape:  # rare: check the parsed strings only when such an escape is present
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except (UnicodeEncodeError, RecursionError):
            raise invalid("a string holds an unpaired surrogate escape (\\ud800-\\udfff).") from None
    return data


async def parse_json(
    request: Request,
    model: type[M],
    max_bytes: int = DEFAULT_MAX_BODY_BYTES,
    precheck: Callable[[dict[str, Any]], None] | None = None,
) -> M:
    """Read and validate a JSON body as ``model``; 400/413 with the field named on failure. ``precheck``
    sees the parsed object first: counts and sizes refused there cost no model validation."""
    raw = await read_body(request, max_bytes)
    if not raw.strip():
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    data = loads_json(raw)
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    if precheck is not None:
        precheck(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


@dataclass(frozen=True)
class FormPart:
    """One part of a ``multipart/form-data`` body: a form field, or a file when it has a ``filename``."""

    name: str
    data: bytes
    filename: str | None = None
    content_type: str | None = None

    @property
    def is_file(self) -> bool:
        return self.filename is not None

    def text(self) -> str:
        """A form field's value; a 400 naming it when it is not UTF-8."""
        try:
            return self.data.decode()
        except UnicodeDecodeError:
            raise InvalidRequest(f"{self.name}: the form field is not UTF-8 text", param=self.name) from None


def is_multipart_form(request: Request) -> bool:
    return request.headers.get("content-type", "").lower().startswith("multipart/form-data")


async def parse_form(request: Request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> list[FormPart]:
    """Read a ``multipart/form-data`` body (413 over ``max_bytes``, as for JSON) and split it into parts."""
    raw = await read_body(request, max_bytes)
    return parse_multipart(request.headers.get("content-type", ""), raw)


#: RFC 2046 section 5.1.1: a multipart boundary is 1 to 70 characters.
MAX_BOUNDARY_CHARS = 70


def parse_multipart(content_type: str, body: bytes) -> list[FormPart]:
    """The parts of a ``multipart/form-data`` body, in order (python-multipart's parser, held in memory:
    the body is already read and bounded, and a read-only root file system has nowhere to spool files)."""
    from python_multipart.exceptions import FormParserError
    from python_multipart.multipart import MultipartParser, parse_options_header

    def unparsable(why: str) -> InvalidRequest:
        return InvalidRequest(f"The multipart body cannot be parsed: {why}.", code="invalid_body")

    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise unparsable("its Content-Type names no boundary")
    if len(boundary) > MAX_BOUNDARY_CHARS:
        raise unparsable(f"the boundary in its Content-Type is {len(boundary)} characters; RFC 2046 allows at most "
                         f"{MAX_BOUNDARY_CHARS}: send a shorter one")  # fmt: skip
    parts: list[FormPart] = []
    headers: dict[bytes, bytes] = {}
    field, value = bytearray(), bytearray()
    data = bytearray()
    ended = False

    def header_end() -> None:
        headers[bytes(field).strip().lower()] = bytes(value).strip()
        field.clear()
        value.clear()

    def part_end() -> None:
        disposition, params = parse_options_header(headers.get(b"content-disposition", b""))
        name = params.get(b"name")
        if disposition.lower() != b"form-data" or name is None:
            raise unparsable("a part has no Content-Disposition: form-data name")
        filename = params.get(b"filename")
        parts.append(
            FormPart(
                name=name.decode("utf-8", "replace"),
                data=bytes(data),
                filename=filename.decode("utf-8", "replace") if filename is not None else None,
                content_type=headers[b"content-type"].decode("latin-1") if b"content-type" in headers else None,
            )
        )
        headers.clear()
        data.clear()

    def end() -> None:
        nonlocal ended
        ended = True

    try:  # building the parser checks the boundary too: inside, so no refusal of python-multipart's is a 500
        parser = MultipartParser(
            boundary,
            {
                "on_header_field": lambda chunk, start, stop: field.extend(chunk[start:stop]),
                "on_header_value": lambda chunk, start, stop: value.extend(chunk[start:stop]),
                "on_header_end": header_end,
                "on_part_data": lambda chunk, start, stop: data.extend(chunk[start:stop]),
                "on_part_end": part_end,
                "on_end": end,
            },
        )
        parser.write(body)
        parser.finalize()
    except FormParserError as exc:
        raise unparsable(str(exc).rstrip(".")) from None
    if not ended:
        raise unparsable("it ends before the closing boundary")
    return parts


def error_response(error: APIError, errors: str = "openai") -> JSONResponse:
    """``error`` as JSON: OpenAI's shape, or Anthropic's (``errors="anthropic"``, the Messages API's routes)."""
    body = anthropic_error_body(error) if errors == "anthropic" else error.body()
    return JSONResponse(body, status_code=error.status_code, headers=error.headers())


#: nginx's status for "the client closed the connection first": what a handler answers nobody.
CLIENT_CLOSED = 499


async def until_disconnect(request: Request) -> None:
    """Return once the client has gone (its body already read: nothing else can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[Response | dict[str, Any]]) -> Response:
    """``work``'s answer (a dict as JSON), or, when the client leaves first, ``work`` cancelled (its decoding, a PDF
    render process, its pages still queued for a batch) and a 499 that nobody reads (for logs and metrics)."""
    job = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnect(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
        if job.done():
            answer = job.result()
            return answer if isinstance(answer, Response) else JSONResponse(answer)
        return Response(status_code=CLIENT_CLOSED)
    finally:
        for task in (job, gone):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


_OUTCOMES = {400: "invalid", 404: "not_found", 413: "too_large", 429: "overloaded", 503: "unavailable"}


def endpoint(
    route: str, model_name: Callable[[], str], errors: str = "openai"
) -> Callable[[Callable[..., Awaitable[Response]]], Callable[..., Awaitable[Response]]]:
    """Wrap a route: count outcomes and latency, turn APIError into OpenAI JSON (Anthropic's where ``errors`` says
    so), hide internal errors."""

    def decorate(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
        @functools.wraps(handler)
        async def wrapper(*args: Any, **kwargs: Any) -> Response:
            name = model_name()
            started = time.perf_counter()
            metrics.IN_FLIGHT.labels(name).inc()
            metrics.LAST_REQUEST.labels(name).set_to_current_time()
            outcome = "ok"
            try:
                response = await handler(*args, **kwargs)
                if response.status_code == CLIENT_CLOSED:
                    outcome = "cancelled"
                return response
            except APIError as error:
                outcome = "overloaded" if error.code == "overloaded" else _OUTCOMES.get(error.status_code, "error")
                return error_response(error, errors)
            except Exception:
                outcome = "error"
                logger.exception("%s failed", route)
                return error_response(InternalError(), errors)
            finally:
                metrics.IN_FLIGHT.labels(name).dec()
                metrics.LAST_REQUEST.labels(name).set_to_current_time()
                metrics.REQUESTS.labels(name, route, outcome).inc()
                spent = time.perf_counter() - started
                metrics.LATENCY.labels(name, route).observe(spent)
                if outcome == "ok" and wake_phases.CLOCK.first_answer(spent):
                    metrics.LOAD_SECONDS.labels(model=name, phase="first_inference").set(spent)
                    logger.info("%s answered its first request (%s) in %.2fs", name, route, spent)

        return wrapper

    return decorate
