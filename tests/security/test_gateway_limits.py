"""Issue 12, item 4: what an unauthenticated or abusive client can make the gateway hold.

A real gateway (keys on) in front of a real upstream that echoes; raw sockets decide which bytes go out
and when. Before the fix the gateway read a whole body before looking at its key (40 unauthenticated
30 MB uploads took it to 1.27 GB), had no bound on connections or on the bytes held across them, and a
client sending one byte every few seconds held its connection forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import eventually
from tests.gateway.harness import OneUpstream
from tests.gateway.test_http_server import Answer, Client
from universal_gateway.app import Gateway
from universal_gateway.auth import ApiKeys
from universal_gateway.limits import GatewayLimits
from universal_gateway.server import HttpServer
from universal_predictors.catalog import Task

KEY = "sk-test-key"
MODEL = "embedder"
MiB = 2**20


@dataclass
class Served:
    gateway: Gateway
    server: HttpServer
    port: int
    upstream_calls: list[bytes]
    upstream_tokens: list[str | None]
    clients: list[Client]

    async def connect(self) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        client = Client(reader, writer)
        self.clients.append(client)
        return client


@contextlib.asynccontextmanager
async def serving(limits: GatewayLimits, upstream_token: str | None = None) -> AsyncIterator[Served]:
    calls: list[bytes] = []
    tokens: list[str | None] = []

    async def embeddings(request: web.Request) -> web.Response:
        calls.append(await request.read())
        tokens.append(request.headers.get("X-Universal-Runtime-Token"))
        return web.json_response({"object": "list", "data": []})

    app = web.Application(client_max_size=64 * MiB)
    app.router.add_post("/openai/v1/embeddings", embeddings)
    upstream = TestServer(app)
    await upstream.start_server()
    backends = OneUpstream(str(upstream.make_url("")).rstrip("/"), MODEL, Task.EMBED)
    backends.upstream_token = upstream_token
    gateway = Gateway(backends, keys=ApiKeys.of({KEY: None}), limits=limits)
    server = await gateway.start("127.0.0.1", 0)
    served = Served(gateway, server, server.port, calls, tokens, [])
    try:
        yield served
    finally:
        for client in served.clients:
            await client.close()
        await gateway.close()
        await upstream.close()


def head(length: int, *headers: str) -> bytes:
    lines = ["POST /v1/embeddings HTTP/1.1", "Host: gateway", "Content-Type: application/json",
             f"Content-Length: {length}", *headers]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def body_of(length: int) -> bytes:
    """A JSON body of exactly ``length`` bytes naming the model."""
    start = b'{"model": "%s", "input": "' % MODEL.encode()
    return start + b"x" * (length - len(start) - 2) + b'"}'


def error_of(answer: Answer) -> dict[str, object]:
    payload = json.loads(answer.body)
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    error: dict[str, object] = payload["error"]
    return error


@pytest.mark.parametrize(
    ("authorization", "code"),
    [(None, "missing_api_key"), ("Authorization: Bearer not-the-key", "invalid_api_key"),
     ("Authorization: Basic c2s6eA==", "missing_api_key")],
)  # fmt: skip
@pytest.mark.parametrize("expect", [False, True])
async def test_a_request_without_a_valid_key_is_refused_on_its_head_before_any_body_is_sent(
    authorization: str | None, code: str, expect: bool
) -> None:
    async with serving(GatewayLimits(max_body_bytes=32 * MiB)) as served:
        client = await served.connect()
        headers = [h for h in (authorization, "Expect: 100-continue" if expect else None) if h]
        await client.send(head(30 * MiB, *headers))  # a 30 MB upload announced; not one byte of it sent

        answer = await client.read_answer()

        assert answer.status == 401
        assert error_of(answer)["code"] == code
        assert answer.header("connection") == "close"
        if expect:  # the client was never told to go on, and the connection ends with the answer
            assert await client.at_eof()
        else:  # what it sends now is dropped, not held
            await client.send(b"x" * MiB)
            assert served.server.buffered == 0
        assert served.upstream_calls == []


@pytest.mark.parametrize(
    ("request_line", "framing"),
    [("POST /healthz", f"Content-Length: {31 * MiB}"), ("GET /readyz", f"Content-Length: {31 * MiB}"),
     ("OPTIONS /v1/embeddings", f"Content-Length: {31 * MiB}"), ("POST /healthz", "Transfer-Encoding: chunked")],
)  # fmt: skip
async def test_a_body_sent_where_no_key_is_needed_is_refused_on_its_head_and_never_held(
    request_line: str, framing: str
) -> None:
    """Issue 31, item 2: probes and preflights pass without a key, so a body on them was read on nobody's
    authority (slow 31 MiB bodies filled the body budget, and keyed requests got 503)."""
    async with serving(GatewayLimits(max_body_bytes=32 * MiB)) as served:
        client = await served.connect()
        await client.send(f"{request_line} HTTP/1.1\r\nHost: gateway\r\n{framing}\r\n\r\n".encode())
        await client.send((b"100000\r\n" if "chunked" in framing else b"") + b"x" * MiB)  # a slow upload begun

        answer = await client.read_answer()

        assert answer.status == 413
        error = error_of(answer)
        assert error["code"] == "body_not_allowed"
        assert f"{request_line} takes no request body" in str(error["message"])
        assert framing in str(error["message"])
        assert answer.header("connection") == "close"
        await client.send(b"x" * MiB)  # dropped as it arrives, not held
        assert served.server.buffered == 0
        assert served.upstream_calls == []


async def test_a_request_with_the_key_still_goes_through() -> None:
    async with serving(GatewayLimits()) as served:
        client = await served.connect()
        body = body_of(1000)
        await client.send(head(len(body), f"Authorization: Bearer {KEY}") + body)
        answer = await client.read_answer()
        assert answer.status == 200, answer.body
        assert served.upstream_calls == [body]
        assert served.server.buffered == 0


@pytest.mark.parametrize("token", [None, "the-shared-token"])
async def test_the_upstream_token_is_the_gateways_never_the_clients(token: str | None) -> None:
    async with serving(GatewayLimits(), upstream_token=token) as served:
        client = await served.connect()
        body = body_of(100)
        forged = "X-Universal-Runtime-Token: forged"
        await client.send(head(len(body), f"Authorization: Bearer {KEY}", forged) + body)
        assert (await client.read_answer()).status == 200
        assert served.upstream_tokens == [token]


async def test_connections_over_max_connections_get_503_and_a_freed_slot_is_reused() -> None:
    async with serving(GatewayLimits(max_connections=3)) as served:
        held = [await served.connect() for _ in range(3)]
        await eventually(lambda: len(served.server.connections) == 3)

        over = await served.connect()
        answer = await over.read_answer()
        assert answer.status == 503
        assert error_of(answer)["code"] == "too_many_connections"
        assert answer.header("retry-after") == "1"
        assert await over.at_eof()

        await held[0].close()
        await eventually(lambda: len(served.server.connections) == 2)
        again = await served.connect()
        await again.send(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        assert (await again.read_answer()).status == 200


async def test_bodies_held_across_connections_are_bounded_and_released_after_the_answer() -> None:
    limits = GatewayLimits(max_body_bytes=2 * MiB, max_buffered_bytes=3 * MiB)
    async with serving(limits) as served:
        authorized = f"Authorization: Bearer {KEY}"
        bodies = [body_of(2 * MiB) for _ in range(2)]
        first, second = await served.connect(), await served.connect()
        # Each stays one byte short of complete: the gateway holds what arrived.
        await first.send(head(2 * MiB, authorized) + bodies[0][:-1])
        await eventually(lambda: served.server.buffered == 2 * MiB - 1)
        await second.send(head(2 * MiB, authorized) + bodies[1][:-1])

        refused = await second.read_answer()
        assert refused.status == 503
        assert error_of(refused)["code"] == "server_busy"
        assert refused.header("retry-after") == "1"
        assert served.server.buffered == 2 * MiB - 1  # the refused body is not kept

        await first.send(bodies[0][-1:])
        assert (await first.read_answer()).status == 200
        assert served.upstream_calls == [bodies[0]]
        await eventually(lambda: served.server.buffered == 0)


async def test_a_head_trickled_a_byte_at_a_time_is_cut_off_at_the_head_deadline() -> None:
    # The between-bytes timer (receive_timeout) never fires for this client: bytes keep coming.
    async with serving(GatewayLimits(head_timeout=1.0, receive_timeout=60.0)) as served:
        client = await served.connect()
        await client.send(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n")
        trickle = iter(b"X-Slow: " + b"a" * 1000)
        answered = None
        for byte in trickle:  # at most ~10 s of trickling; the deadline is 1 s
            await client.send(bytes([byte]))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.01):
                    answered = await client.reader.readuntil(b"\r\n\r\n")
            if answered is not None:
                break
        assert answered is not None, "the gateway kept reading a head that never ended"
        assert answered.startswith(b"HTTP/1.1 408 ")
        assert b"Connection: close" in answered
