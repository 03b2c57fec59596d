"""The gateway's upstream client: a small HTTP/1.1 client on asyncio's transports and llhttp (httptools).

Per proxied request it costs a fraction of aiohttp.ClientSession's CPU, and on a machine the gateway
shares with its predictors that CPU is taken from inference. One request at a time per connection; no
pipelining. :class:`UpstreamPool` keeps connections alive per upstream base URL.
"""

from __future__ import annotations

import asyncio
import time
from typing import cast

import httptools
from yarl import URL

from universal_gateway.server import Request
from universal_predictors.config import (
    AUDIO_SECONDS_HEADER,
    IMAGES_HEADER,
    RESPONSES_STORED_HEADER,
    UPSTREAM_TOKEN_HEADER,
    USAGE_COMMENTS_HEADER,
)
from universal_predictors.errors import APIError

#: Hop-by-hop headers and ones the gateway owns; never forwarded.
DROPPED_HEADERS = frozenset({
    "host", "connection", "keep-alive", "proxy-authorization", "te", "trailers", "transfer-encoding",
    "upgrade", "content-length", "authorization", "x-api-key", "expect", UPSTREAM_TOKEN_HEADER.lower(),
    RESPONSES_STORED_HEADER.lower(), USAGE_COMMENTS_HEADER.lower(),
})  # fmt: skip
#: Also never passed back: the gateway is the server. Content-Encoding does pass: the body is relayed
#: as the upstream encoded it (for a client that asked for that encoding).
DROPPED_RESPONSE_HEADERS = DROPPED_HEADERS | {"server", "date", IMAGES_HEADER.lower(), AUDIO_SECONDS_HEADER.lower()}
_DROPPED_HEADER_BYTES = frozenset(name.encode() for name in DROPPED_HEADERS)
#: Unrelayed upstream body beyond which the upstream socket stops being read (backpressure).
_HIGH_WATER = 256 * 1024
#: Idle connections close after this, before a uvicorn predictor's 5 s keep-alive can close one under
#: a request being sent (a POST cannot be retried once sent).
_KEEPALIVE_S = 4.0


class UpstreamError(Exception):
    """The upstream connection broke, or what came back was not HTTP."""


class ClientGone(ConnectionResetError):
    """The client the answer was for went away."""


class Unreachable(UpstreamError):
    """No connection could be made: nothing was sent."""


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class Origin:
    """One upstream base URL, parsed once: where to connect and what the request line carries."""

    __slots__ = ("host", "host_header", "key", "port", "prefix", "ssl")

    def __init__(self, base: str) -> None:
        url = URL(base)
        if url.scheme not in ("http", "https") or not url.raw_host or url.port is None:
            raise APIError(f"The upstream address {base!r} is not an http(s) URL.", status_code=502,
                           code="upstream_unreachable")  # fmt: skip
        self.key = base
        self.host = url.raw_host
        self.port = url.port
        self.ssl = url.scheme == "https"
        self.host_header = url.host_port_subcomponent or self.host
        self.prefix = url.raw_path.rstrip("/")

    def head(
        self, request: Request, path: str, length: int, extra: bytes = b"", replaced: frozenset[bytes] = frozenset()
    ) -> bytes:
        """The request line and headers: the caller's (as sent), less hop-by-hop and the gateway's own and those
        ``extra`` replaces (lower-case names: a traced request's trace context), plus ``extra`` (complete lines)."""
        query = request.query_string
        parts = [f"{request.method} {self.prefix}{path}{'?' + query if query else ''} HTTP/1.1\r\n"
                 f"Host: {self.host_header}\r\n".encode("latin-1")]  # fmt: skip
        dropped = (_DROPPING.get(replaced) or _dropping(replaced)) if replaced else _DROPPED_HEADER_BYTES
        for key, value in request.raw_headers:
            if key.lower() not in dropped:
                parts += (key, b": ", value, b"\r\n")
        if length or request.method == "POST":
            parts.append(b"Content-Length: %d\r\n" % length)
        parts.append(extra)
        parts.append(b"\r\n")
        return b"".join(parts)


#: The headers a head leaves out, with those a set of ``replaced`` ones adds (a traced request's: one set), made once.
_DROPPING: dict[frozenset[bytes], frozenset[bytes]] = {}


def _dropping(replaced: frozenset[bytes]) -> frozenset[bytes]:
    dropped = _DROPPED_HEADER_BYTES | replaced
    if len(_DROPPING) < 16:
        _DROPPING[replaced] = dropped
    return dropped


class UpstreamConnection(asyncio.Protocol):
    """One HTTP/1.1 connection to an upstream, carrying one request at a time."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.closed = False
        self.idle_since = 0.0
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._begin()

    def _begin(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.content_type = ""
        #: The answer's Content-Length, where it declared one (the length a GET would have, for HEAD).
        self.content_length: int | None = None
        self.reusable = False
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._headers_done = False
        self._complete = False
        self._until_close = False
        #: The request was HEAD: its answer ends with its head (RFC 9112 section 6.3).
        self._bodiless = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None

    # -- the caller's side

    def send(self, head: bytes, body: bytes, client: Request) -> None:
        assert self._transport is not None
        self._begin()
        self._bodiless = client.method == "HEAD"
        if not self.open:  # connection_lost has come and gone: nothing would ever wake the reader
            self._error = UpstreamError("the upstream closed the connection")
            return
        client.on_gone = self._client_left
        if body:
            self._transport.writelines((head, body))  # no copy of a large body into one buffer
        else:
            self._transport.write(head)

    def _client_left(self) -> None:
        """The client went away: the caller's next wait raises, and it closes this connection, which
        tells the predictor to stop (a model may be silent for minutes before its first token)."""
        if self._error is None:
            self._error = ClientGone("the client went away")
        self._wake()

    # ``idle_s`` bounds each silence, not the whole answer (a stream may last hours): not asyncio.timeout.

    async def headers_received(self, idle_s: float) -> None:
        while not self._headers_done:
            if self._error is not None:
                raise self._error
            await self._wait(idle_s)

    async def read_some(self, idle_s: float) -> bytes:
        """Body bytes as they arrive; b"" once the answer is complete."""
        while True:
            if self._chunks:
                chunks, self._chunks, self._buffered = self._chunks, [], 0
                if self._paused and self._transport is not None:
                    self._paused = False
                    self._transport.resume_reading()
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if self._complete:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait(idle_s)

    async def read_all(self, idle_s: float) -> bytes:
        parts = []
        while chunk := await self.read_some(idle_s):
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    @property
    def open(self) -> bool:
        return not self.closed and self._transport is not None and not self._transport.is_closing()

    def close(self) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    async def _wait(self, idle_s: float) -> None:
        """Until the parser has more for the caller; TimeoutError after ``idle_s`` of silence."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(idle_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is one without subclassing asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._error = self._error or UpstreamError(f"invalid HTTP from the upstream: {exc}")
            self.close()
            self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._headers_done and self._until_close and not self._complete and self._error is None:
            self._complete = True  # a body without a length ends with the connection
        elif not self._complete and self._error is None:
            self._error = UpstreamError(str(exc) if exc else "the upstream closed the connection")
        self._wake()

    # -- httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        delimited = False
        for key, value in self.headers:
            lowered = key.lower()
            if lowered == "content-type":
                self.content_type = value
            elif lowered in ("content-length", "transfer-encoding"):
                delimited = True
                if lowered == "content-length" and value.isdigit():
                    self.content_length = int(value)
        self._until_close = not delimited
        if self.status >= 200:  # an interim 1xx answer is followed by the real one
            self._headers_done = True
            if self._bodiless:
                # A response to HEAD has no body whatever its Content-Length says (RFC 9112 section 6.3),
                # and llhttp cannot be told so: it would wait for that many bytes. The answer ends here;
                # ``reusable`` stays False, so the connection closes with the parser mid-message.
                self._complete = True
            self._wake()

    def on_body(self, body: bytes) -> None:
        if self._bodiless:
            return  # bytes a HEAD answer should not have had: never relayed
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status < 200:
            self.headers, self.content_type, self.content_length = [], "", None
            return
        if self._bodiless:
            return  # complete since its head, and never reused
        self._complete = True
        self.reusable = self._parser.should_keep_alive()
        self._wake()


class UpstreamPool:
    """Keep-alive connections per upstream base URL; no overall cap (the per-model gates bound them)."""

    def __init__(self) -> None:
        self._origins: dict[str, Origin] = {}
        self._idle: dict[str, list[UpstreamConnection]] = {}

    def origin(self, base: str) -> Origin:
        origin = self._origins.get(base)
        if origin is None:
            if len(self._origins) > 1024:  # addresses change (restarts, rescheduling): stay bounded
                self._origins.clear()
                self.close()
            origin = self._origins[base] = Origin(base)
        return origin

    async def acquire(self, origin: Origin, connect_timeout: float) -> UpstreamConnection:
        idle = self._idle.get(origin.key)
        if idle:
            now = time.monotonic()
            while idle:
                upstream = idle.pop()
                if upstream.open and now - upstream.idle_since < _KEEPALIVE_S:
                    return upstream
                upstream.close()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout):
                _, upstream = await loop.create_connection(
                    lambda: UpstreamConnection(origin.key),
                    origin.host,
                    origin.port,
                    ssl=True if origin.ssl else None,
                    server_hostname=origin.host if origin.ssl else None,
                )
        except TimeoutError:
            raise Unreachable(f"no connection within {connect_timeout:g} s") from None
        except OSError as exc:
            raise Unreachable(str(exc)) from None
        return upstream

    def release(self, upstream: UpstreamConnection, whole: bool) -> None:
        if whole and upstream.reusable and upstream.open:
            upstream.idle_since = time.monotonic()
            self._idle.setdefault(upstream.key, []).append(upstream)
        else:
            upstream.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for upstream in idle:
                upstream.close()
        self._idle.clear()
