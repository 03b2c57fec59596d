"""The gateway's own HTTP/1.1 server (`universal_gateway.server`) on a real socket, byte by byte.

Each test starts an :class:`HttpServer` on 127.0.0.1 with a small handler written here, and talks to it
over a raw connection (so the test decides exactly which bytes go out, and when: pipelining, Expect,
malformed input, a client that stops reading) or through aiohttp where a normal client is the point.
Nothing here waits on the clock: reads wait for bytes or EOF, everything else is polled; where time must pass
between two bytes, the test moves the event loop's clock (:class:`LoopClock`).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from tests.conftest import eventually
from universal_gateway import server as server_module
from universal_gateway.server import Handler, Headers, HttpServer, Request, Response, StreamedResponse

#: The longest any single read may wait for bytes the server should already be sending.
READ_S = 10.0
LIMIT = 1024


@dataclass
class Answer:
    """One answer as it came over the wire."""

    status: int
    reason: str
    headers: list[tuple[str, str]]
    head: bytes
    body: bytes = b""
    #: The raw framing of a chunked body (sizes and CRLFs included), as sent.
    framing: bytes = b""

    def header(self, name: str) -> str | None:
        values = [value for key, value in self.headers if key.lower() == name.lower()]
        return ", ".join(values) if values else None

    def error(self) -> dict[str, Any]:
        """The OpenAI error object, after checking the body has exactly that shape."""
        assert self.header("content-type") == "application/json"
        payload = json.loads(self.body)
        assert set(payload) == {"error"}
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert isinstance(payload["error"]["message"], str)
        assert payload["error"]["message"]
        error: dict[str, Any] = payload["error"]
        return error


class Client:
    """A raw client connection: exactly the bytes given go out; answers are parsed strictly."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def read_head(self) -> Answer:
        async with asyncio.timeout(READ_S):
            head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
        version, status, reason = status_line.split(" ", 2)
        assert version == "HTTP/1.1", status_line
        headers = []
        for line in lines:
            name, _, value = line.partition(":")
            headers.append((name, value.strip()))
        return Answer(int(status), reason, headers, head)

    async def read_answer(self, *, head_request: bool = False) -> Answer:
        """The next answer, framed by its Content-Length, chunked encoding, or (else) the connection's end."""
        answer = await self.read_head()
        async with asyncio.timeout(READ_S):
            length = answer.header("content-length")
            if head_request or answer.status in (204, 304) or 100 <= answer.status < 200:
                pass
            elif answer.header("transfer-encoding") == "chunked":
                parts = []
                while True:
                    size_line = await self.reader.readuntil(b"\r\n")
                    size = int(size_line, 16)
                    data = await self.reader.readexactly(size + 2)
                    answer.framing += size_line + data
                    assert data.endswith(b"\r\n")
                    if size == 0:
                        break
                    parts.append(data[:-2])
                answer.body = b"".join(parts)
            elif length is not None:
                answer.body = await self.reader.readexactly(int(length))
            else:
                answer.body = await self.reader.read()
        return answer

    async def read_to_eof(self) -> bytes:
        async with asyncio.timeout(READ_S):
            return await self.reader.read()

    async def at_eof(self) -> bool:
        """True if the server closed the connection with nothing more to say (waits for it)."""
        return await self.read_to_eof() == b""

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


@dataclass
class Harness:
    servers: list[HttpServer] = field(default_factory=list)
    clients: list[Client] = field(default_factory=list)

    async def serve(self, handler: Handler, *, max_body_bytes: int = LIMIT, **options: Any) -> HttpServer:
        server = HttpServer(handler, max_body_bytes=max_body_bytes, **options)
        await server.start("127.0.0.1", 0)
        self.servers.append(server)
        return server

    async def connect(self, server: HttpServer, *, receive_buffer: int | None = None) -> Client:
        if receive_buffer is None:
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        else:  # a fixed receive buffer: the kernel does not grow it to tens of MiB on loopback
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
            reader, writer = await asyncio.open_connection(sock=sock)
        client = Client(reader, writer)
        self.clients.append(client)
        return client


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    harness = Harness()
    yield harness
    for client in harness.clients:
        await client.close()
    for server in harness.servers:
        await server.close(grace_s=0)


def get(path: str = "/", *headers: str, version: str = "1.1") -> bytes:
    lines = [f"GET {path} HTTP/{version}", "Host: test", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def post(path: str, body: bytes, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in parts) + b"0\r\n\r\n"


async def echo(request: Request) -> Response:
    """Says what it got: method, path and body."""
    return Response(f"{request.method} {request.path} ".encode() + request.body, headers=[("X-Echo", "yes")])


class Recorder:
    """A handler that records the requests it is called with and echoes them."""

    def __init__(self) -> None:
        self.requests: list[Request] = []

    async def __call__(self, request: Request) -> Response:
        self.requests.append(request)
        return await echo(request)


class LoopClock:
    """The running loop's clock, moved ahead by the test: the server's timers see the time pass at once, as
    after a stall, and a slow machine adds only its own little delay (real time still runs underneath)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._real = loop.time
        self._ahead = 0.0

    def time(self) -> float:
        return self._real() + self._ahead

    def advance(self, seconds: float) -> None:
        self._ahead += seconds


@pytest.fixture
async def loop_clock(monkeypatch: pytest.MonkeyPatch) -> LoopClock:
    loop = asyncio.get_running_loop()
    clock = LoopClock(loop)
    monkeypatch.setattr(loop, "time", clock.time)  # what call_later, timers and the server's reads ask
    return clock


async def drain_loop(rounds: int = 20) -> None:
    """Let every callback and task that is ready run, a few rounds over (no clock involved)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


# -- keep-alive ------------------------------------------------------------------------------------


async def test_keep_alive_answers_two_requests_on_one_connection_with_date_and_content_length(
    harness: Harness,
) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    for path in ("/first", "/second"):
        await client.send(get(path))
        answer = await client.read_answer()
        assert answer.status == 200
        assert answer.reason == "OK"
        assert answer.body == f"GET {path} ".encode()
        assert answer.header("content-length") == str(len(answer.body))
        assert answer.header("connection") is None
        assert answer.header("x-echo") == "yes"
        date = answer.header("date")
        assert date is not None
        assert date.endswith(" GMT")
        assert email.utils.parsedate_to_datetime(date).utcoffset() is not None
    assert len(server.connections) == 1


async def test_connection_close_from_the_client_closes_after_the_answer(harness: Harness) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    await client.send(get("/one"))
    assert (await client.read_answer()).status == 200
    await client.send(get("/two", "Connection: close"))
    answer = await client.read_answer()
    assert answer.status == 200
    assert answer.body == b"GET /two "
    assert answer.header("connection") == "close"
    assert await client.at_eof()


async def test_a_normal_client_reuses_one_connection_for_several_requests(harness: Harness) -> None:
    server = await harness.serve(echo)
    url = f"http://127.0.0.1:{server.port}"
    async with aiohttp.ClientSession() as session:
        for i in range(3):
            async with session.post(f"{url}/n/{i}", data=b"body") as response:
                assert response.status == 200
                assert await response.read() == f"POST /n/{i} body".encode()
            assert len(server.connections) == 1


async def test_a_204_answer_has_neither_body_nor_content_length(harness: Harness) -> None:
    async def no_content(request: Request) -> Response:
        return Response(b"ignored", status=204) if request.path == "/empty" else await echo(request)

    server = await harness.serve(no_content)
    client = await harness.connect(server)
    await client.send(get("/empty") + get("/next"))
    empty = await client.read_answer()
    assert empty.status == 204
    assert empty.header("content-length") is None
    assert (await client.read_answer()).body == b"GET /next "  # nothing of the 204's body came in between


async def test_a_head_request_is_answered_without_a_body(harness: Harness) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    await client.send(b"HEAD /thing HTTP/1.1\r\nHost: test\r\n\r\n" + get("/after"))
    head = await client.read_answer(head_request=True)
    assert head.status == 200
    after = await client.read_answer()
    assert after.status == 200
    assert after.body == b"GET /after "


# -- pipelining ------------------------------------------------------------------------------------


async def test_pipelined_requests_are_answered_in_order_even_when_the_first_finishes_last(harness: Harness) -> None:
    release = asyncio.Event()
    started: list[str] = []
    finished: list[str] = []

    async def handler(request: Request) -> Response:
        started.append(request.path)
        if request.path == "/slow":
            await release.wait()
        finished.append(request.path)
        return await echo(request)

    server = await harness.serve(handler)
    client = await harness.connect(server)
    await client.send(get("/slow") + post("/b", b"bee") + get("/c"))
    await eventually(lambda: started)
    await drain_loop()  # a server that ran the others meanwhile would have finished them by now
    release.set()
    answers = [await client.read_answer() for _ in range(3)]
    assert [answer.body for answer in answers] == [b"GET /slow ", b"POST /b bee", b"GET /c "]
    assert sorted(finished) == ["/b", "/c", "/slow"]


async def test_more_pipelined_requests_than_the_pipeline_depth_are_all_answered_and_reading_resumes(
    harness: Harness,
) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    count = server_module._PIPELINE_DEPTH * 3
    await client.send(b"".join(get(f"/{i}") for i in range(count)))
    for i in range(count):
        assert (await client.read_answer()).body == f"GET /{i} ".encode()
    await client.send(get("/after"))  # the server paused reading at the depth; it reads again
    assert (await client.read_answer()).body == b"GET /after "


# -- Expect: 100-continue --------------------------------------------------------------------------


async def test_expect_100_continue_is_answered_before_the_body_is_sent(harness: Harness) -> None:
    recorder = Recorder()
    server = await harness.serve(recorder)
    client = await harness.connect(server)
    await client.send(b"POST /upload HTTP/1.1\r\nHost: test\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    interim = await client.read_head()
    assert interim.head == b"HTTP/1.1 100 Continue\r\n\r\n"
    assert recorder.requests == []
    await client.send(b"hello")
    answer = await client.read_answer()
    assert answer.status == 200
    assert answer.body == b"POST /upload hello"


# -- the body limit --------------------------------------------------------------------------------


def assert_refused_as_too_large(answer: Answer) -> None:
    assert answer.status == 413
    assert answer.header("connection") == "close"
    assert answer.header("content-length") == str(len(answer.body))
    error = answer.error()
    assert error["type"] == "invalid_request_error"
    assert str(LIMIT) in error["message"]


async def test_a_declared_body_over_the_limit_with_expect_is_refused_413_before_the_body_is_sent(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "_LINGER_S", 3600.0)  # no waiting for a body that is not coming
    recorder = Recorder()
    server = await harness.serve(recorder)
    client = await harness.connect(server)
    await client.send(
        f"POST /up HTTP/1.1\r\nHost: test\r\nContent-Length: {LIMIT + 1}\r\nExpect: 100-continue\r\n\r\n".encode()
    )
    answer = await client.read_answer()  # the final answer first: no 100 Continue, no body sent
    assert_refused_as_too_large(answer)
    assert await client.at_eof()  # closed at once, not after the linger
    assert recorder.requests == []


@pytest.mark.parametrize("size", [LIMIT + 1, 2_000_000], ids=["just-over", "megabytes"])
async def test_a_declared_body_over_the_limit_is_refused_413_intact_after_the_client_sent_it_all(
    harness: Harness, size: int
) -> None:
    recorder = Recorder()
    server = await harness.serve(recorder)
    client = await harness.connect(server)
    await client.send(post("/up", b"x" * size))  # the whole body, as a client without Expect does
    assert_refused_as_too_large(await client.read_answer())
    assert await client.at_eof()  # closed once the body was read: a FIN, not a reset
    assert recorder.requests == []


async def test_a_normal_client_posting_too_much_reads_the_413(harness: Harness) -> None:
    recorder = Recorder()
    server = await harness.serve(recorder)
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{server.port}/up", data=b"x" * 1_000_000) as response,
    ):
        assert response.status == 413
        assert set((await response.json())["error"]) == {"message", "type", "param", "code"}
    assert recorder.requests == []


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect"])
async def test_a_chunked_body_over_the_limit_is_refused_413(harness: Harness, expect: bool) -> None:
    recorder = Recorder()
    server = await harness.serve(recorder)
    client = await harness.connect(server)
    head = b"POST /up HTTP/1.1\r\nHost: test\r\nTransfer-Encoding: chunked\r\n"
    if expect:
        await client.send(head + b"Expect: 100-continue\r\n\r\n")
        assert (await client.read_head()).status == 100  # nothing declared: the limit is not known over yet
    else:
        await client.send(head + b"\r\n")
    await client.send(chunked(b"a" * (LIMIT // 2), b"b" * (LIMIT // 2), b"c"))
    assert_refused_as_too_large(await client.read_answer())
    assert await client.at_eof()
    assert recorder.requests == []


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_a_body_of_exactly_the_limit_is_accepted(harness: Harness, framing: str) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    body = b"y" * LIMIT
    if framing == "chunked":
        await client.send(b"POST /up HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(body[:100], body[100:]))
    else:
        await client.send(post("/up", body))
    answer = await client.read_answer()
    assert answer.status == 200
    assert answer.body == b"POST /up " + body


# -- the head limit and malformed input -----------------------------------------------------------


@pytest.mark.parametrize("where", ["headers", "url"])
async def test_a_head_over_max_head_bytes_is_refused_431(harness: Harness, where: str) -> None:
    recorder = Recorder()
    server = await harness.serve(recorder)
    client = await harness.connect(server)
    if where == "headers":
        headers = [f"X-Filler-{i}: {'v' * 1000}" for i in range(server_module.MAX_HEAD_BYTES // 1000 + 1)]
        await client.send(get("/", *headers))
    else:
        await client.send(get("/" + "p" * server_module.MAX_HEAD_BYTES))
    answer = await client.read_answer()
    assert answer.status == 431
    assert answer.header("connection") == "close"
    assert answer.error()["code"] == "headers_too_large"
    assert await client.at_eof()
    assert recorder.requests == []


async def test_a_head_just_under_max_head_bytes_is_accepted(harness: Harness) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    await client.send(get("/", f"X-Filler: {'v' * (server_module.MAX_HEAD_BYTES - 200)}"))
    assert (await client.read_answer()).status == 200


@pytest.mark.parametrize("where", ["url", "header-value"])
async def test_a_head_that_grows_past_max_head_bytes_is_refused_before_it_ends(harness: Harness, where: str) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    start = b"GET /" if where == "url" else b"GET / HTTP/1.1\r\nX-Endless: "
    await client.send(start + b"z" * (server_module.MAX_HEAD_BYTES + 1024))
    client.writer.write_eof()  # no more is coming: the server has had all it needs to refuse this
    data = await client.read_to_eof()
    assert data.startswith(b"HTTP/1.1 431 ")


async def test_bytes_that_are_not_http_get_400_and_the_connection_closes(harness: Harness) -> None:
    recorder = Recorder()
    server = await harness.serve(recorder)
    client = await harness.connect(server)
    await client.send(b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03 this is a TLS hello, not HTTP\r\n\r\n")
    answer = await client.read_answer()
    assert answer.status == 400
    assert answer.header("connection") == "close"
    assert answer.error()["code"] == "bad_request"
    assert await client.at_eof()
    assert recorder.requests == []


async def test_a_valid_request_followed_by_garbage_is_answered_then_the_garbage_is_refused(harness: Harness) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    await client.send(get("/fine") + b"GET / HTTP/1.1\r\nBad Header Without Colon\r\n\r\n")
    first = await client.read_answer()
    assert first.status == 200
    assert first.body == b"GET /fine "
    second = await client.read_answer()
    assert second.status == 400
    assert second.error()["code"] == "bad_request"
    assert await client.at_eof()


async def test_an_upgrade_request_is_answered_as_plain_http_and_the_connection_closes(harness: Harness) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    await client.send(get("/ws", "Connection: Upgrade", "Upgrade: websocket") + b"\x81\x05hello")
    answer = await client.read_answer()
    assert answer.status == 200
    assert answer.body == b"GET /ws "
    assert answer.header("connection") == "close"  # says it will close, then does
    assert await client.at_eof()


# -- HTTP/1.0 and streamed answers -----------------------------------------------------------------


async def test_an_http_10_request_is_answered_and_the_connection_closes(harness: Harness) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    await client.send(get("/old", version="1.0"))
    answer = await client.read_answer()
    assert answer.status == 200
    assert answer.body == b"GET /old "
    assert answer.header("connection") == "close"
    assert await client.at_eof()


async def test_an_http_10_client_that_asks_for_keep_alive_is_told_it_holds_and_gets_it(harness: Harness) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    for path in ("/one", "/two"):
        await client.send(get(path, "Connection: keep-alive", version="1.0"))
        answer = await client.read_answer()
        assert answer.body == f"GET {path} ".encode()
        assert answer.header("connection") == "keep-alive"


async def test_an_http_10_client_is_never_sent_100_continue(harness: Harness) -> None:
    server = await harness.serve(echo)
    client = await harness.connect(server)
    head = b"POST /up HTTP/1.0\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
    await client.send(head + b"hi")
    answer = await client.read_answer()  # the first status line is the answer itself
    assert answer.status == 200
    assert answer.body == b"POST /up hi"


async def stream_three(request: Request) -> StreamedResponse:
    stream = await request.stream(200, [("Content-Type", "text/plain")])
    for part in (b"one ", b"two ", b"three"):
        await stream.write(part)
    return stream


@pytest.mark.parametrize("keep_alive", [False, True], ids=["plain", "keep-alive-asked"])
async def test_a_stream_to_http_10_is_not_chunked_and_ends_with_the_connection(
    harness: Harness, keep_alive: bool
) -> None:
    server = await harness.serve(stream_three)
    client = await harness.connect(server)
    await client.send(get("/s", *(["Connection: keep-alive"] if keep_alive else []), version="1.0"))
    answer = await client.read_head()
    assert answer.status == 200
    assert answer.header("transfer-encoding") is None
    assert answer.header("content-length") is None
    assert answer.header("connection") == "close"
    assert await client.read_to_eof() == b"one two three"


async def test_a_stream_to_http_11_is_chunked_and_the_connection_stays_open(harness: Harness) -> None:
    server = await harness.serve(stream_three)
    client = await harness.connect(server)
    await client.send(get("/s"))
    answer = await client.read_answer()
    assert answer.header("transfer-encoding") == "chunked"
    assert answer.header("content-length") is None
    assert answer.framing == b"4\r\none \r\n4\r\ntwo \r\n5\r\nthree\r\n0\r\n\r\n"
    await client.send(get("/s"))
    assert (await client.read_answer()).body == b"one two three"


# -- what a handler is given -----------------------------------------------------------------------


async def test_request_path_is_decoded_raw_path_and_query_are_as_sent_and_headers_are_joined(
    harness: Harness,
) -> None:
    recorder = Recorder()
    server = await harness.serve(recorder)
    client = await harness.connect(server)
    await client.send(
        b"POST /a%20b/%C3%A9?x=1&y=%20z&flag HTTP/1.1\r\n"
        b"Host: test\r\n"
        b"X-Multi: one\r\n"
        b"Content-Type: Application/JSON; charset=utf-8\r\n"
        b"x-multi: two\r\n"
        b"X-Case: MiXeD\r\n"
        b"Content-Length: 2\r\n"
        b"\r\n{}"
    )
    assert (await client.read_answer()).status == 200
    [request] = recorder.requests
    assert request.method == "POST"
    assert request.http_11
    assert request.path == "/a b/é"
    assert request.raw_path == "/a%20b/%C3%A9"
    assert request.query_string == "x=1&y=%20z&flag"
    assert request.query == {"x": "1", "y": " z", "flag": ""}
    assert request.headers == {
        "host": "test",
        "x-multi": "one, two",
        "content-type": "Application/JSON; charset=utf-8",
        "x-case": "MiXeD",
        "content-length": "2",
    }
    assert request.content_type == "application/json"
    assert request.raw_headers == [
        (b"Host", b"test"),
        (b"X-Multi", b"one"),
        (b"Content-Type", b"Application/JSON; charset=utf-8"),
        (b"x-multi", b"two"),
        (b"X-Case", b"MiXeD"),
        (b"Content-Length", b"2"),
    ]
    assert request.body == b"{}"


@pytest.mark.parametrize(
    ("target", "raw_path", "path", "query"),
    [
        ("http://example.com/p%41th?q=1", "/p%41th", "/pAth", "q=1"),
        ("http://example.com", "/", "/", ""),
    ],
)
async def test_an_absolute_form_target_is_reduced_to_its_path_and_query(
    harness: Harness, target: str, raw_path: str, path: str, query: str
) -> None:
    recorder = Recorder()
    server = await harness.serve(recorder)
    client = await harness.connect(server)
    await client.send(f"GET {target} HTTP/1.1\r\nHost: example.com\r\n\r\n".encode())
    assert (await client.read_answer()).status == 200
    [request] = recorder.requests
    assert (request.raw_path, request.path, request.query_string) == (raw_path, path, query)


# -- backpressure and a client that leaves ---------------------------------------------------------


@dataclass
class Flood:
    """A handler that streams ``total`` bytes in large chunks, and how far it got."""

    chunk: bytes = b"x" * 262_144
    total: int = 128 * 262_144  # 32 MiB: far more than the socket buffers in between hold
    written: int = 0
    in_write: bool = False
    done: bool = False

    async def __call__(self, request: Request) -> StreamedResponse:
        stream = await request.stream(200, [("Content-Type", "application/octet-stream")])
        while self.written < self.total:
            self.in_write = True
            await stream.write(self.chunk)
            self.in_write = False
            self.written += len(self.chunk)
        self.done = True
        return stream


async def test_a_stream_to_a_client_that_does_not_read_stalls_and_resumes_when_it_reads(harness: Harness) -> None:
    flood = Flood()
    server = await harness.serve(flood)
    client = await harness.connect(server, receive_buffer=65_536)
    await client.send(get("/flood"))
    head = await client.read_head()
    assert head.header("transfer-encoding") == "chunked"

    # Not reading: the server pauses writing and the handler waits in write() with its count still.
    seen: list[tuple[int, bool, list[bool]]] = []

    def stalled() -> bool:
        seen.append((flood.written, flood.in_write, [c.writable is not None for c in server.connections]))
        return len(seen) > 1 and seen[-2] == seen[-1] and seen[-1][1:] == (True, [True])

    await eventually(stalled)
    assert flood.written < flood.total // 4, f"the handler wrote {flood.written} of {flood.total} bytes unread"
    assert not flood.done

    # Reading: the handler goes on to the end, and every byte arrives.
    received = 0
    async with asyncio.timeout(READ_S * 3):
        while True:
            size = int(await client.reader.readuntil(b"\r\n"), 16)
            assert (await client.reader.readexactly(size + 2)).endswith(b"\r\n")
            if size == 0:
                break
            received += size
    assert received == flood.total
    assert flood.done


async def test_on_gone_is_called_when_the_client_leaves_while_its_handler_waits(harness: Harness) -> None:
    waiting = asyncio.Event()
    observed: list[bool] = []

    async def handler(request: Request) -> Response:
        left = asyncio.Event()
        request.on_gone = left.set
        waiting.set()
        await left.wait()
        observed.append(request.gone)
        return Response(b"nobody to read this")

    server = await harness.serve(handler)
    client = await harness.connect(server)
    await client.send(get("/wait"))
    await eventually(waiting.is_set)
    await client.close()
    await eventually(lambda: observed)
    assert observed == [True]
    await eventually(lambda: not server.connections)


async def test_on_gone_is_not_called_once_the_answer_is_complete(harness: Harness) -> None:
    calls: list[str] = []

    async def handler(request: Request) -> Response:
        request.on_gone = lambda: calls.append(request.path)
        return Response(b"done")

    server = await harness.serve(handler)
    client = await harness.connect(server)
    await client.send(get("/quick"))
    assert (await client.read_answer()).body == b"done"
    await client.close()
    await eventually(lambda: not server.connections)  # the server has seen the client go
    assert calls == []


async def test_a_stream_write_after_the_client_left_raises_connection_reset(harness: Harness) -> None:
    outcome: list[BaseException] = []

    async def handler(request: Request) -> StreamedResponse:
        left = asyncio.Event()
        request.on_gone = left.set
        stream = await request.stream(200, [])
        await stream.write(b"first")
        await left.wait()
        try:
            await stream.write(b"second")
        except ConnectionResetError as exc:
            outcome.append(exc)
            raise
        return stream

    server = await harness.serve(handler)
    client = await harness.connect(server)
    await client.send(get("/s"))
    await client.read_head()
    assert await client.reader.readuntil(b"first\r\n") == b"5\r\nfirst\r\n"
    await client.close()
    await eventually(lambda: outcome)
    await eventually(lambda: not server.connections)


# -- handler failures ------------------------------------------------------------------------------


async def test_a_handler_that_raises_gets_a_500_and_the_connection_stays_usable(harness: Harness) -> None:
    async def handler(request: Request) -> Response:
        if request.path == "/boom":
            raise RuntimeError("secret internals")
        return await echo(request)

    server = await harness.serve(handler)
    client = await harness.connect(server)
    await client.send(get("/boom"))
    answer = await client.read_answer()
    assert answer.status == 500
    assert answer.header("connection") is None
    error = answer.error()
    assert error["code"] == "internal_error"
    assert "secret" not in error["message"]
    await client.send(get("/after"))
    assert (await client.read_answer()).body == b"GET /after "


async def test_a_handler_that_raises_mid_stream_closes_the_connection_with_a_truncated_body(
    harness: Harness,
) -> None:
    async def handler(request: Request) -> StreamedResponse:
        stream = await request.stream(200, [("Content-Type", "text/event-stream")])
        await stream.write(b"data: partial\n\n")
        raise RuntimeError("failed half way")

    server = await harness.serve(handler)
    client = await harness.connect(server)
    await client.send(get("/s") + get("/never"))
    head = await client.read_head()
    assert head.status == 200
    assert head.header("transfer-encoding") == "chunked"
    rest = await client.read_to_eof()
    assert rest == b"f\r\ndata: partial\n\n\r\n"  # no 0-size chunk: the client can tell it is cut off


# -- idle connections and closing ------------------------------------------------------------------


@pytest.mark.parametrize("after_a_request", [True, False], ids=["after-an-answer", "never-used"])
async def test_an_idle_keep_alive_connection_is_closed_after_keepalive_s(
    harness: Harness, after_a_request: bool
) -> None:
    server = await harness.serve(echo, keepalive_s=0.2)
    client = await harness.connect(server)
    if after_a_request:
        await client.send(get("/"))
        assert (await client.read_answer()).status == 200
    assert await client.at_eof()
    await eventually(lambda: not server.connections)


async def test_a_request_still_arriving_is_not_cut_off_by_the_idle_timer(harness: Harness) -> None:
    server = await harness.serve(echo, keepalive_s=0.2)
    slow = await harness.connect(server)
    await slow.send(get("/first"))
    assert (await slow.read_answer()).status == 200
    await slow.send(b"GET /second HTTP/1.1\r\nHost: te")  # half a head
    # A connection opened after that is closed once it has been idle keepalive_s: by then the slow
    # connection's timer would have fired too (timers run in deadline order).
    witness = await harness.connect(server)
    assert await witness.at_eof()
    await slow.send(b"st\r\n\r\n")
    assert (await slow.read_answer()).body == b"GET /second "


@pytest.mark.parametrize(
    "partial",
    [b"GET /stalled HTTP/1.1\r\nHost: te", b"POST /up HTTP/1.1\r\nHost: test\r\nContent-Length: 10\r\n\r\nabc"],
    ids=["head", "body"],
)
async def test_a_request_that_stops_arriving_gets_408_and_the_connection_closes(
    harness: Harness, partial: bytes
) -> None:
    recorder = Recorder()
    server = await harness.serve(recorder, receive_timeout_s=0.2)
    client = await harness.connect(server)
    await client.send(partial)
    answer = await client.read_answer()
    assert answer.status == 408
    assert answer.header("connection") == "close"
    assert answer.error()["code"] == "request_timeout"
    assert await client.at_eof()
    assert recorder.requests == []


async def test_a_slow_sender_whose_bytes_keep_coming_is_not_cut_off(harness: Harness, loop_clock: LoopClock) -> None:
    # Two thirds of the timeout between bytes, three and a third timeouts in all: the receive timer fires (more
    # than once) while the body is still arriving. Only a stall of a third of the timeout (20 s) on top of a
    # gap could make it reach the timeout.
    timeout = 60.0
    gap = timeout * 2 / 3
    server = await harness.serve(echo, receive_timeout_s=timeout)
    client = await harness.connect(server)
    await client.send(b"POST /slow HTTP/1.1\r\nHost: test\r\nContent-Length: 5\r\n\r\n")
    *first, last = b"hello"
    for held, byte in enumerate(first, start=1):
        loop_clock.advance(gap)
        await client.send(bytes([byte]))
        await eventually(lambda held=held: server.buffered == held)  # the server has it: the next gap starts
    loop_clock.advance(gap)
    await client.send(bytes([last]))
    answer = await client.read_answer()
    assert answer.status == 200
    assert answer.body == b"POST /slow hello"


async def test_close_finishes_the_request_in_flight_closes_idle_connections_and_refuses_new_ones(
    harness: Harness,
) -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def handler(request: Request) -> Response:
        if request.path == "/slow":
            started.set()
            await release.wait()
        return await echo(request)

    server = await harness.serve(handler)
    port = server.port
    busy = await harness.connect(server)
    idle = await harness.connect(server)
    await idle.send(get("/quick"))
    assert (await idle.read_answer()).status == 200
    await busy.send(get("/slow"))
    await eventually(started.is_set)

    closing = asyncio.create_task(server.close())
    assert await idle.at_eof()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)
    assert not closing.done()

    release.set()
    answer = await busy.read_answer()
    assert answer.status == 200
    assert answer.body == b"GET /slow "
    assert answer.header("connection") == "close"
    assert await busy.at_eof()
    async with asyncio.timeout(READ_S):
        await closing
    assert server.drained.is_set()
    assert not server.connections


async def test_a_refusal_pipelined_behind_a_slow_request_does_not_cut_that_request_off(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_module, "_LINGER_S", 0.1)
    release = asyncio.Event()
    started = asyncio.Event()

    async def handler(request: Request) -> Response:
        started.set()
        await release.wait()
        return await echo(request)

    server = await harness.serve(handler, keepalive_s=0.1)
    client = await harness.connect(server)
    await client.send(get("/slow") + f"POST /big HTTP/1.1\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode())
    await eventually(started.is_set)  # both requests are parsed: the refusal's timer is running
    witness = await harness.connect(server)
    assert await witness.at_eof()  # its idle timer was due after the linger timer: that one has fired
    release.set()
    first = await client.read_answer()
    assert first.body == b"GET /slow "
    assert_refused_as_too_large(await client.read_answer())


# -- extra headers ---------------------------------------------------------------------------------


async def test_extra_headers_are_on_every_answer_including_refusals(harness: Harness) -> None:
    def extra(request: Request) -> Headers:
        return [("X-Extra", "yes"), ("X-Origin", request.headers.get("origin", "-"))]

    async def handler(request: Request) -> Response | StreamedResponse:
        if request.path == "/boom":
            raise RuntimeError("boom")
        if request.path == "/stream":
            return await stream_three(request)
        return await echo(request)

    server = await harness.serve(handler, extra_headers=extra)

    async def answer_to(data: bytes) -> Answer:
        client = await harness.connect(server)
        await client.send(data)
        return await client.read_answer()

    origin = "Origin: https://app.test"
    answers = {
        "ok": await answer_to(get("/", origin)),
        "stream": await answer_to(get("/stream", origin)),
        "500": await answer_to(get("/boom", origin)),
        "413": await answer_to(post("/up", b"x" * (LIMIT + 1), origin)),
        "431": await answer_to(get("/" + "p" * server_module.MAX_HEAD_BYTES, origin)),
        "400": await answer_to(b"NOT HTTP AT ALL\r\n\r\n"),
    }
    assert {name: answer.status for name, answer in answers.items()} == {
        "ok": 200,
        "stream": 200,
        "500": 500,
        "413": 413,
        "431": 431,
        "400": 400,
    }
    for name, answer in answers.items():
        assert answer.header("x-extra") == "yes", name
        # A 431's headers past the bound are not kept; bytes that are not HTTP have none.
        assert answer.header("x-origin") == ("-" if name in ("400", "431") else "https://app.test"), name
