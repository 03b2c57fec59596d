"""The gateway's HTTP/1.1 server: asyncio transports and llhttp (httptools), little Python per request.

Every request the gateway proxies crosses this code twice (in and out), right after the predictor
has run for milliseconds with the CPU's caches to itself; what the gateway adds at concurrency 1 is
mostly how much code that is. aiohttp's web server (request objects, multidicts, routing, middleware,
a task per handler) took about twice this server's time per request in `bench/gateway.py`.

What it does: keep-alive and pipelined requests (answered in order), ``Expect: 100-continue``, a body
limit checked against the declared length before the body is read and while a chunked body arrives
(413), a bound on the request line and headers (431), an ``authorize`` hook asked as soon as the head
is complete (a refusal goes out before any of the body is read), a bound on open connections and on
the body bytes held across all of them (503), fixed-length and chunked answers, backpressure
on streamed answers (a write waits while the client's socket buffer is full), a callback the moment
the client goes away, 408 for a request whose bytes stop arriving for ``receive_timeout_s`` or whose
head is not complete ``head_timeout_s`` after its first byte, idle
keep-alive connections closed after ``keepalive_s``, and a close that lets requests in flight finish.
Not here: TLS (the ingress terminates it), HTTP/2, upgrades.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import email.utils
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qsl, unquote

import httptools
import orjson

from universal_predictors.errors import APIError, RequestTooLarge

logger = logging.getLogger(__name__)

Headers = list[tuple[str, str]]

#: The request line and headers together may be at most this big (aiohttp allows 8 KiB per line).
MAX_HEAD_BYTES = 64 * 1024
#: Complete requests waiting on one connection before it stops being read (pipelining's bound).
_PIPELINE_DEPTH = 8
#: After refusing a body, how long its remaining bytes are read and dropped before the connection
#: closes (closing at once can reset the connection before the client reads the answer).
_LINGER_S = 10.0
#: What a client over the body limit can do (images inline as base64 are the usual large bodies).
_SMALLER = "Send a smaller body (smaller or fewer images, fewer inputs), or raise the gateway's --max-body-mb."
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
_NO_BODY_STATUSES = frozenset({204, 304})
#: Sent, then the connection closed, to a client over ``max_connections`` (before any of its bytes are read).
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")  # fmt: skip


class Response:
    """A whole answer. ``headers`` without Content-Length, Date or Connection: the server adds them.
    ``length`` is the Content-Length to declare instead of the body's: an answer to HEAD relayed from
    an upstream has no body, but declares the length the GET answer would have."""

    __slots__ = ("body", "headers", "length", "status")

    def __init__(
        self, body: bytes = b"", *, status: int = 200, headers: Headers | None = None, length: int | None = None
    ) -> None:
        self.body = body
        self.status = status
        self.headers = headers if headers is not None else []
        self.length = length

    @classmethod
    def json(cls, payload: Any, *, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> Response:
        return cls(orjson.dumps(payload), status=status, headers=[("Content-Type", "application/json"), *headers])

    @classmethod
    def error(cls, error: APIError, headers: Iterable[tuple[str, str]] = ()) -> Response:
        return cls.json(error.body(), status=error.status_code, headers=[*error.headers().items(), *headers])


class Request:
    """One parsed request. ``path`` is percent-decoded; ``raw_path`` and ``query_string`` are as sent."""

    __slots__ = (
        "_connection", "body", "caller", "headers", "held", "http_11", "keep_alive", "method", "on_gone", "path",
        "query_string", "raw_headers", "raw_path", "refusal",
    )  # fmt: skip

    def __init__(self, connection: _Connection) -> None:
        self._connection = connection
        self.method = ""
        self.raw_path = ""
        self.path = ""
        self.query_string = ""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        #: Lower-case names; repeated headers joined with ", ".
        self.headers: dict[str, str] = {}
        self.body = b""
        #: Body bytes counted against the server's ``max_buffered_bytes`` until the answer is done.
        self.held = 0
        self.keep_alive = True
        self.http_11 = True
        self.refusal: APIError | None = None
        #: What the application found out about the caller from the head (the gateway: its API key).
        self.caller: object = None
        #: Called once if the client goes away before the answer is complete.
        self.on_gone: Callable[[], None] | None = None

    @property
    def gone(self) -> bool:
        return self._connection.gone

    @property
    def content_type(self) -> str:
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(self.query_string, keep_blank_values=True))

    async def stream(self, status: int, headers: Headers) -> StreamedResponse:
        """Start an answer whose body comes in parts (chunked; to an HTTP/1.0 client, until close)."""
        return self._connection.start_stream(self, status, headers)


class StreamedResponse:
    """An answer being written: ``write`` waits while the client's buffer is full."""

    __slots__ = ("_chunked", "_connection", "finished", "status")

    def __init__(self, connection: _Connection, status: int, chunked: bool) -> None:
        self._connection = connection
        self._chunked = chunked
        self.status = status
        self.finished = False

    async def write(self, data: bytes) -> None:
        connection = self._connection
        if connection.gone:
            raise ConnectionResetError("the client went away")
        if not data:
            return
        transport = connection.transport
        if self._chunked:
            transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            transport.write(data)
        if connection.writable is not None:
            await connection.drain()

    async def end(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self._chunked and not self._connection.gone:
            self._connection.transport.write(b"0\r\n\r\n")


Handler = Callable[[Request], Awaitable["Response | StreamedResponse"]]
ExtraHeaders = Callable[[Request], Headers]
#: Asked once a request's head is complete, before its body is read: an error refuses it.
Authorize = Callable[[Request], "APIError | None"]


class HttpServer:
    """Serves ``handler`` on one listening socket.

    ``extra_headers`` (CORS, for one) is asked for headers to add to every answer, errors included.
    ``authorize`` is asked about each request once its head is complete, before any of its body is
    read; an error it returns is the answer, and the connection closes (the body is never buffered).
    """

    def __init__(
        self,
        handler: Handler,
        *,
        max_body_bytes: int,
        extra_headers: ExtraHeaders | None = None,
        keepalive_s: float = 75.0,
        receive_timeout_s: float = 60.0,
        head_timeout_s: float = 30.0,
        authorize: Authorize | None = None,
        max_connections: int = 1024,
        max_buffered_bytes: int = 512 * 2**20,
        linger_s: float = _LINGER_S,
    ) -> None:
        self.handler = handler
        self.max_body_bytes = max_body_bytes
        self.extra_headers = extra_headers
        self.authorize = authorize
        #: Open connections beyond this are answered 503 and closed at once.
        self.max_connections = max_connections
        #: Request body bytes held across all connections (bodies arriving, queued or being answered);
        #: a body that would go over gets 503 and its connection closes.
        self.max_buffered_bytes = max_buffered_bytes
        self.buffered = 0
        #: A request's head (line and headers) must be complete this long after its first byte, however
        #: steadily its bytes trickle in: then 408 and close.
        self.head_timeout_s = head_timeout_s
        self.linger_s = linger_s
        self.keepalive_s = keepalive_s
        #: A request being received may go this long without a byte arriving (a stalled or trickling
        #: client must not hold a connection and its buffers forever): then 408 and close.
        self.receive_timeout_s = receive_timeout_s
        self.connections: set[_Connection] = set()
        self.closing = False
        #: Set once the server is closing and its last connection has closed.
        self.drained = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._date = (0, b"")

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, reuse_address=True,
                                                backlog=1024)  # fmt: skip

    @property
    def port(self) -> int:
        assert self._server is not None
        assert self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self, grace_s: float = 30.0) -> None:
        """Stop accepting; let requests in flight finish (up to ``grace_s``); close every connection."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.close_when_idle()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace_s):
                    await self.drained.wait()
        for connection in list(self.connections):
            connection.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()

    def date(self) -> bytes:
        now = int(time.time())
        if self._date[0] != now:
            self._date = (now, email.utils.formatdate(now, usegmt=True).encode())
        return self._date[1]


def _head_too_large() -> APIError:
    return APIError(f"The request line and headers are over {MAX_HEAD_BYTES} bytes.", status_code=431,
                    code="headers_too_large")  # fmt: skip


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, answers them in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport = cast(asyncio.Transport, None)
        self.gone = False
        #: Set while the client's socket buffer is full; done when it drains (or the client leaves).
        self.writable: asyncio.Future[None] | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._queue: collections.deque[Request] = collections.deque()
        self._task: asyncio.Task[None] | None = None
        self._current: Request | None = None  # being answered
        self._reading = True
        self._idle: asyncio.TimerHandle | None = None
        self._close_after_answer = False
        self._streaming = False
        # The message being parsed:
        self._request: Request | None = None
        self._url: list[bytes] = []
        self._body: list[bytes] = []
        self._size = 0
        self._head_size = 0  # of the head parsed so far (request line and complete headers)
        self._head_open = False  # a message has begun and its head has not ended
        self._head_received = 0  # bytes received since then: a header value httptools still holds counts
        self._discarding = False
        self._linger = True  # after a refusal, read and drop the rest of the body before closing
        self._completed = False  # a message ended during the current data_received
        self._last_read = 0.0  # loop time of the latest bytes, for the receive timeout
        self._receiving: asyncio.TimerHandle | None = None  # armed only while a message stays incomplete
        self._head_deadline: asyncio.TimerHandle | None = None  # armed while a head stays incomplete

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        server = self.server
        if not server.closing and len(server.connections) >= server.max_connections:
            self.gone = True  # never counted, never read
            error = APIError(f"The gateway has {server.max_connections} connections open, its limit; retry shortly.",
                             status_code=503, code="too_many_connections")  # fmt: skip
            body = orjson.dumps(error.body())
            self.transport.write(_BUSY % (len(body), body))
            self.transport.close()
            return
        server.connections.add(self)
        if server.closing:
            self.transport.close()
            return
        self._arm_idle()

    def data_received(self, data: bytes) -> None:
        was_open = self._head_open
        if was_open:
            self._head_received += len(data)
        self._completed = False
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # Upgrades (websocket, h2c) are not spoken here: a request that finished parsing is answered
            # as plain HTTP/1.1, and the connection closes after the answers.
            self._close_after_answer = True
            self._stop_reading()
            if not self._queue and self._task is None and self._current is None:
                self.transport.close()
            return
        except httptools.HttpParserError as exc:
            self._stop_reading()
            self._close_after_answer = True
            error = APIError(f"The request is not valid HTTP/1.1: {exc}", status_code=400, code="bad_request")
            self._refuse(error)
            return
        if self._head_open and not was_open and not self._completed:
            self._head_received += len(data)  # the head began in this chunk, and nothing else is in it
        if self._head_open and self._head_deadline is None:
            # A head still incomplete after the chunk it began in (a head that arrives whole, as
            # nearly all do, never costs a timer): it must end within head_timeout_s.
            self._head_deadline = asyncio.get_running_loop().call_later(self.server.head_timeout_s,
                                                                         self._head_timed_out)  # fmt: skip
        if self._head_open and self._head_size + self._head_received > MAX_HEAD_BYTES:
            # A head that has not ended yet is over the bound (one endless line, say): refuse it now
            # rather than keep what arrives.
            self._stop_reading()
            self._close_after_answer = True
            self._head_open = False
            self._refuse(_head_too_large())
            return
        if self._request is not None and not self._discarding:
            # A message is still incomplete after this chunk (a small request never gets here).
            self._last_read = asyncio.get_running_loop().time()
            if self._receiving is None:
                self._receiving = asyncio.get_running_loop().call_later(
                    self.server.receive_timeout_s, self._receive_timed_out
                )

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self._request is None or not self._head_open or self.gone:
            return
        self._stop_reading()
        self._close_after_answer = True
        self._head_open = False
        self._refuse(APIError(f"The request line and headers did not arrive within {self.server.head_timeout_s:g} s.",
                              status_code=408, code="request_timeout"))  # fmt: skip

    def _receive_timed_out(self) -> None:
        self._receiving = None
        if self._request is None or self._discarding or self.gone:
            return
        waited = asyncio.get_running_loop().time() - self._last_read
        if waited < self.server.receive_timeout_s:  # bytes came meanwhile: wait out the rest
            self._receiving = asyncio.get_running_loop().call_later(
                self.server.receive_timeout_s - waited, self._receive_timed_out
            )
            return
        self._stop_reading()
        self._close_after_answer = True
        self._head_open = False
        self._refuse(APIError(f"Nothing of the request arrived for {self.server.receive_timeout_s:g} s; "
                              "send it whole, or not at all.", status_code=408, code="request_timeout"))  # fmt: skip

    def connection_lost(self, exc: Exception | None) -> None:
        if self.gone and self not in self.server.connections:
            return  # refused in connection_made
        self.gone = True
        self.server.connections.discard(self)
        if self._receiving is not None:
            self._receiving.cancel()
        if self._head_deadline is not None:
            self._head_deadline.cancel()
        for held in (self._request, self._current, *self._queue):
            if held is not None:
                self._release(held)
        if self.server.closing and not self.server.connections:
            self.server.drained.set()
        if self._idle is not None:
            self._idle.cancel()
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        current = self._current
        if current is not None and current.on_gone is not None:
            callback, current.on_gone = current.on_gone, None
            callback()

    def pause_writing(self) -> None:
        if self.writable is None:
            self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None:
            if not self.writable.done():
                self.writable.set_result(None)
            self.writable = None

    async def drain(self) -> None:
        if self.writable is not None:
            await self.writable
        if self.gone:
            raise ConnectionResetError("the client went away")

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self._request = Request(self)
        self._url = []
        self._body = []
        self._size = 0
        self._head_size = 0
        self._head_open = True
        self._head_received = 0
        self._discarding = False
        self._linger = True

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        if self._head_size <= MAX_HEAD_BYTES:
            self._url.append(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self._request
        assert request is not None
        self._head_size += len(name) + len(value) + 4
        if self._head_size > MAX_HEAD_BYTES:
            return  # refused at the end of the head
        request.raw_headers.append((name, value))
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        known = request.headers.get(key)
        request.headers[key] = text if known is None else f"{known}, {text}"

    def on_headers_complete(self) -> None:
        request = self._request
        assert request is not None
        self._head_open = False
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None
        parser = self._parser
        request.method = parser.get_method().decode("latin-1")
        request.http_11 = parser.get_http_version() == "1.1"
        request.keep_alive = parser.should_keep_alive()
        if self._head_size > MAX_HEAD_BYTES:
            self._refuse_body(_head_too_large())
            return
        target = self._url[0] if len(self._url) == 1 else b"".join(self._url)
        if not target.startswith(b"/"):  # absolute form: http://host/path?query
            parsed = httptools.parse_url(target)
            target = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
        raw_path, _, query = target.decode("latin-1").partition("?")
        request.raw_path = raw_path
        request.path = unquote(raw_path) if "%" in raw_path else raw_path
        request.query_string = query
        if self.server.authorize is not None:
            refusal = self.server.authorize(request)
            if refusal is not None:
                # Refused on its head alone: a client waiting for "100 Continue" sends no body to drop.
                self._linger = not self._expects_continue(request)
                self._refuse_body(refusal)
                return
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.server.max_body_bytes):
            # A client waiting for "100 Continue" will not send the body: nothing to read and drop.
            self._linger = not self._expects_continue(request)
            self._refuse_body(RequestTooLarge(f"The request body is {declared} bytes; the limit is "
                                              f"{self.server.max_body_bytes} bytes. {_SMALLER}",
                                              code="request_too_large"))  # fmt: skip
            return
        if self._expects_continue(request) and self._task is None and not self._queue:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self._discarding:
            return
        server = self.server
        self._size += len(body)
        if self._size > server.max_body_bytes:
            self._body = []
            self._refuse_body(RequestTooLarge(f"The request body is over the limit of "
                                              f"{server.max_body_bytes} bytes. {_SMALLER}",
                                              code="request_too_large"))  # fmt: skip
            return
        if server.buffered + len(body) > server.max_buffered_bytes:
            self._body = []
            self._refuse_body(APIError(f"The gateway holds {server.max_buffered_bytes} bytes of request bodies, "
                                       "its limit; retry shortly.", status_code=503, code="server_busy",
                                       retry_after=1))  # fmt: skip
            return
        request = self._request
        assert request is not None
        request.held += len(body)
        server.buffered += len(body)
        self._body.append(body)

    def _release(self, request: Request) -> None:
        """The request's body no longer counts against ``max_buffered_bytes``."""
        self.server.buffered -= request.held
        request.held = 0

    def on_message_complete(self) -> None:
        self._completed = True
        if self._receiving is not None:
            self._receiving.cancel()
            self._receiving = None
        request = self._request
        self._request = None
        if self._discarding:
            # The refusal is queued already; the rest of the connection is not trusted.
            self._stop_reading()
            if not self._queue and self._task is None:
                self.transport.close()
            return
        assert request is not None
        body = self._body
        request.body = body[0] if len(body) == 1 else b"".join(body)
        self._enqueue(request)

    @staticmethod
    def _expects_continue(request: Request) -> bool:
        expect = request.headers.get("expect")
        return request.http_11 and expect is not None and expect.lower() == "100-continue"

    # -- answering

    def _refuse_body(self, error: APIError) -> None:
        """Answer ``error`` in its turn, drop the body still coming, then close the connection."""
        request = self._request
        assert request is not None
        self._release(request)
        request.refusal = error
        request.keep_alive = False
        self._discarding = True
        self._close_after_answer = True
        self._enqueue(request)

    def _refuse(self, error: APIError) -> None:
        request = self._request or Request(self)
        self._release(request)
        self._body = []
        request.refusal = error
        request.keep_alive = False
        self._request = None
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        self._queue.append(request)
        if len(self._queue) >= _PIPELINE_DEPTH:
            self._stop_reading()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._answer_all())

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self.transport.pause_reading()

    async def _answer_all(self) -> None:
        try:
            while self._queue and not self.gone:
                request = self._queue.popleft()
                if not self._reading and not self._close_after_answer and len(self._queue) < _PIPELINE_DEPTH // 2:
                    self._reading = True
                    self.transport.resume_reading()
                await self._answer(request)
                if not request.keep_alive or self.server.closing:
                    if request.refusal is not None and self._discarding and self._request is not None and self._linger:
                        # Its body is still arriving: closed once it ends, or when the linger is over.
                        asyncio.get_running_loop().call_later(self.server.linger_s, self.transport.close)
                        return
                    self.transport.close()
                    return
            if self._close_after_answer and not self._discarding:
                self.transport.close()
        finally:
            self._task = None
        if not self.gone:
            self._arm_idle()

    async def _answer(self, request: Request) -> None:
        self._current = request
        self._streaming = False
        try:
            if request.refusal is not None:
                self._write(request, Response.error(request.refusal))
                return
            try:
                answer = await self.server.handler(request)
            except Exception as exc:
                if self.gone:
                    logger.debug("%s %s: the client went away (%s)", request.method, request.raw_path, exc)
                    return
                logger.exception("%s %s failed", request.method, request.raw_path)
                if self._streaming:  # the head is out: closing is the only way left to say it failed
                    request.keep_alive = False
                    return
                answer = Response.error(APIError("The gateway failed to handle this request; see its log.",
                                                 status_code=500, code="internal_error"))  # fmt: skip
            if isinstance(answer, StreamedResponse):
                await answer.end()
                if not request.http_11:
                    request.keep_alive = False  # an HTTP/1.0 stream ends with the connection
            elif not self.gone:
                self._write(request, answer)
        finally:
            self._current = None
            request.on_gone = None
            self._release(request)

    def _head(self, request: Request, status: int, headers: Headers) -> list[bytes]:
        lines = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown")),
                 b"Date: " + self.server.date() + b"\r\n"]  # fmt: skip
        extra = self.server.extra_headers
        if extra is not None:
            headers = [*headers, *extra(request)]
        for key, value in headers:
            lines.append(f"{key}: {value}\r\n".encode("latin-1", "replace"))
        if not request.keep_alive or self.server.closing or self._close_after_answer:
            lines.append(b"Connection: close\r\n")
        elif not request.http_11:
            lines.append(b"Connection: keep-alive\r\n")  # an HTTP/1.0 client asked for it: say it holds
        return lines

    def _write(self, request: Request, response: Response) -> None:
        lines = self._head(request, response.status, response.headers)
        if response.status in _NO_BODY_STATUSES:
            lines.append(b"\r\n")
            self.transport.writelines(lines)
            return
        length = len(response.body) if response.length is None else response.length
        lines.append(b"Content-Length: %d\r\n\r\n" % length)
        if response.body and request.method != "HEAD":  # HEAD: the length a GET would have, no body
            lines.append(response.body)
        self.transport.writelines(lines)

    def start_stream(self, request: Request, status: int, headers: Headers) -> StreamedResponse:
        if self.gone:
            raise ConnectionResetError("the client went away")
        chunked = request.http_11
        if not chunked:
            request.keep_alive = False  # to HTTP/1.0, a body of unknown length ends with the connection
        lines = self._head(request, status, headers)
        if chunked:
            lines.append(b"Transfer-Encoding: chunked\r\n")
        lines.append(b"\r\n")
        self.transport.writelines(lines)
        self._streaming = True
        return StreamedResponse(self, status, chunked)

    # -- idle connections

    def _arm_idle(self) -> None:
        if self._idle is None and not self.gone:
            self._idle = asyncio.get_running_loop().call_later(self.server.keepalive_s, self._close_idle)

    def _close_idle(self) -> None:
        self._idle = None
        if self._task is None and self._request is None:
            self.transport.close()

    def close_when_idle(self) -> None:
        """For shutdown: close now if nothing is being answered, else after the current answer."""
        self._close_after_answer = True
        if self._task is None and self._request is None:
            self.transport.close()
