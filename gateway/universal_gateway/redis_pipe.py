"""One pipelined Redis connection for the calls a request waits on (the limits' admission and end).

Why not redis-py's asyncio client for these: each of its calls takes a connection from a pool, writes, waits for its
reply and gives the connection back, about 130 us of this process's CPU per call measured here (redis-py 8.2,
EVALSHA of the admission script, c=32), and at 32 requests at once its pool opens 32 connections, the first use of
each a connect and a handshake. A request with limits makes two such calls, so they were most of what keys with
limits cost a gateway that keeps them in Redis. Here every caller writes its command on the one connection as soon
as it has one and waits for its reply, which Redis sends in the order it got the commands (RESP's pipelining:
https://redis.io/docs/latest/develop/use/pipelining/); one reader matches replies to callers in that order. A
command costs its encoding and its reply's parsing, no connection handling.

The same failure rules as redis-py's client in :class:`~universal_gateway.redis_link.RedisLink`: a call that gets
no reply within ``timeout_s``, or whose connection breaks, raises (:class:`ConnectionError`, an ``OSError``); every
call waiting on that connection then fails with it, and the next call connects again. A Redis error reply raises
redis-py's :class:`~redis.exceptions.ResponseError`, so callers catch one set of errors (``STORE_ERRORS``).

Plain TCP (``redis://``) and Unix sockets (``unix://``), with the URL's user, password and database as redis-py
reads them (``redis.asyncio.connection.parse_url``). TLS (``rediss://``) stays on redis-py's client
(:func:`pipelined`), whose certificate options this does not repeat.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import time
from typing import Any

from redis.asyncio.connection import UnixDomainSocketConnection, parse_url
from redis.exceptions import NoScriptError, ResponseError

Reply = Any  # bytes, int, None, or a list of replies


def pipelined(url: str) -> bool:
    """Whether :class:`PipelinedRedis` can open ``url`` (TLS cannot: redis-py's client serves those)."""
    return url.startswith(("redis://", "unix://"))


def encode(args: tuple[bytes | str | int | float, ...]) -> bytes:
    """A command as RESP's array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class Script:
    """A Lua script called by its SHA1 (``EVALSHA``), sent whole (``EVAL``) when Redis does not hold it."""

    def __init__(self, text: str) -> None:
        self.text = text.encode()
        self.sha = hashlib.sha1(self.text).hexdigest().encode()  # (Redis names scripts by SHA1)


class PipelinedRedis:
    """Commands from any number of tasks on one connection, each reply given to its caller."""

    def __init__(self, url: str, *, timeout_s: float = 0.5) -> None:
        if not pipelined(url):
            raise ValueError(f"not a redis:// or unix:// URL: {url.split('@')[-1]!r}")
        self._options = parse_url(url)
        self.timeout_s = timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._connecting: asyncio.Future[None] | None = None
        #: Each command's future and when it was written, in the order written.
        self._waiting: collections.deque[tuple[asyncio.Future[Reply], float]] = collections.deque()
        self._watchdog: asyncio.TimerHandle | None = None

    async def call(self, *args: bytes | str | int | float) -> Reply:
        if self._reader is None:  # (set once the handshake is done)
            await self._connect()
        writer = self._writer
        if writer is None or writer.is_closing():
            raise ConnectionError("the connection to Redis closed")
        return await self._send(writer, args)

    def _send(self, writer: asyncio.StreamWriter, args: tuple[bytes | str | int | float, ...]) -> asyncio.Future[Reply]:
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._waiting.append((future, time.monotonic()))
        writer.write(encode(args))
        if self._watchdog is None:
            self._watchdog = asyncio.get_running_loop().call_later(self.timeout_s, self._check_late)
        return future

    async def run(self, script: Script, keys: list[str], args: list[str | int]) -> Reply:
        try:
            return await self.call(b"EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            return await self.call(b"EVAL", script.text, len(keys), *keys, *args)

    async def _connect(self) -> None:
        if self._connecting is not None:  # another caller is connecting: wait for it
            await asyncio.shield(self._connecting)
            return
        self._connecting = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(self._open(), self.timeout_s)
        except BaseException as exc:
            reason = f"{exc}" or type(exc).__name__  # (a timeout's text is empty)
            error = exc if isinstance(exc, ResponseError) else ConnectionError(f"could not connect to Redis: {reason}")
            self._drop(error)
            self._connecting.set_exception(error)
            self._connecting.exception()  # (retrieved: no "never retrieved" warning when nobody else waited)
            if error is exc or not isinstance(exc, Exception):  # a refused login; a cancel
                raise
            raise error from exc
        else:
            self._connecting.set_result(None)
        finally:
            self._connecting = None

    async def _open(self) -> None:
        """Connect, log in and choose the database; only then may other callers write (their commands must follow
        the handshake's)."""
        options = self._options
        if options.get("connection_class") is UnixDomainSocketConnection:
            reader, writer = await asyncio.open_unix_connection(options["path"])
        else:
            reader, writer = await asyncio.open_connection(options.get("host", "localhost"), options.get("port", 6379))
        self._reading = asyncio.create_task(self._read_replies(reader))
        handshake = []
        if options.get("password") is not None:
            user = options.get("username")
            login = (b"AUTH", user, options["password"]) if user else (b"AUTH", options["password"])
            handshake.append(self._send(writer, login))
        if options.get("db"):
            handshake.append(self._send(writer, (b"SELECT", options["db"])))
        self._writer = writer  # (for _drop, should the handshake fail: it closes it)
        try:
            for step in handshake:
                await step
        except BaseException:
            self._drop(ConnectionError("the handshake with Redis failed"))
            raise
        self._reader = reader

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                reply = await _read_reply(reader)
                if not self._waiting:
                    raise ConnectionError("Redis sent a reply nobody asked for")
                future, _ = self._waiting.popleft()
                if not future.done():
                    if isinstance(reply, ResponseError):
                        future.set_exception(reply)
                    else:
                        future.set_result(reply)
        except asyncio.CancelledError:
            raise
        except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
            self._drop(ConnectionError(f"the connection to Redis broke: {exc or type(exc).__name__}"))

    def _check_late(self) -> None:
        """A command without its reply for ``timeout_s`` fails its connection (as a socket timeout would)."""
        self._watchdog = None
        if not self._waiting:
            return
        late_by = time.monotonic() - self._waiting[0][1] - self.timeout_s
        if late_by >= 0:
            self._drop(ConnectionError(f"Redis did not answer within {self.timeout_s} s"))
        else:
            self._watchdog = asyncio.get_running_loop().call_later(-late_by, self._check_late)

    def _drop(self, error: BaseException) -> None:
        """Close the connection and fail every command waiting on it."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self._reading is not None and self._reading is not asyncio.current_task():
            self._reading.cancel()
        self._reading = None
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
        waiting, self._waiting = self._waiting, collections.deque()
        for future, _ in waiting:
            if not future.done():
                future.set_exception(error)
                future.exception()  # (a caller cancelled meanwhile never reads it)

    async def close(self) -> None:
        reading = self._reading
        self._drop(ConnectionError("closed"))
        if reading is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await reading


async def _read_reply(reader: asyncio.StreamReader) -> Reply:
    """One RESP2 reply; an error reply is returned (not raised) as redis-py's exception for it."""
    line = await reader.readuntil(b"\r\n")
    kind, rest = line[:1], line[1:-2]
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        data = await reader.readexactly(size + 2)
        return data[:-2]
    if kind == b":":
        return int(rest)
    if kind == b"+":
        return rest
    if kind == b"*":
        count = int(rest)
        if count < 0:
            return None
        return [await _read_reply(reader) for _ in range(count)]
    if kind == b"-":
        message = rest.decode(errors="replace")
        return NoScriptError(message) if message.startswith("NOSCRIPT") else ResponseError(message)
    raise ValueError(f"not a RESP reply: {line[:40]!r}")
