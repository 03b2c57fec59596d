"""Issue 31, item 1: HEAD relayed by the gateway.

The gateway relays HEAD as HEAD; the answer carries a Content-Length (the GET's, from an upstream that
answers HEAD as GET, as aiohttp does here) and never a body (RFC 9112 section 6.3). Before the fix the
upstream client waited for that body: each HEAD took the read timeout (65 s in the report) and then 502,
holding one of the model's concurrency slots all the while, so 64 of them locked every other request to
the model out.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.gateway.harness import OneUpstream
from tests.gateway.test_http_server import Client
from universal_gateway.app import Gateway
from universal_gateway.limits import GatewayLimits
from universal_predictors.catalog import Task

MODEL = "sensors"
LISTED = {"object": "list", "persistence": False, "data": [{"name": "only"}]}
MISSING = {"error": {"message": "No detector 'gone'.", "type": "not_found_error", "param": "name", "code": None}}


@dataclass
class Served:
    port: int
    #: The method of each request the upstream received, in order.
    upstream_methods: list[str]

    async def connect(self) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        return Client(reader, writer)


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[Served]:
    """One anomaly model with a single concurrency slot and no queue: a request that holds its slot
    longer than it should gets the next one a 429. The read timeout is short, so the unfixed gateway's
    502 comes within the test client's patience."""
    methods: list[str] = []

    async def detectors(request: web.Request) -> web.Response:
        methods.append(request.method)
        return web.Response(body=orjson.dumps(LISTED), content_type="application/json")

    async def detector(request: web.Request) -> web.Response:
        methods.append(request.method)
        return web.Response(body=orjson.dumps(MISSING), status=404, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/anomaly/detectors", detectors)  # aiohttp answers HEAD on a GET route
    app.router.add_get("/v1/anomaly/detectors/{name}", detector)
    upstream = TestServer(app)
    await upstream.start_server()
    limits = GatewayLimits(read_timeout=3.0, max_concurrency_per_model=1, max_queue_per_model=0)
    gateway = Gateway(OneUpstream(str(upstream.make_url("")).rstrip("/"), MODEL, Task.ANOMALY), limits=limits)
    server = await gateway.start("127.0.0.1", 0)
    try:
        yield Served(server.port, methods)
    finally:
        await gateway.close()
        await upstream.close()


def request(method: str, path: str) -> bytes:
    return f"{method} {path}?model={MODEL} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode()


@pytest.mark.parametrize(
    ("path", "status", "payload"),
    [("/v1/anomaly/detectors", 200, LISTED), ("/v1/anomaly/detectors/gone", 404, MISSING)],
    ids=["listed", "missing"],
)
async def test_head_is_answered_with_the_gets_status_and_length_and_frees_its_slot(
    path: str, status: int, payload: dict[str, object]
) -> None:
    async with serving() as served:
        client = await served.connect()
        try:
            # Three HEADs in a row on one connection: each must end with its head, or the next is a 429
            # (the slot is still held) or never parsed (the connection is out of step).
            for _ in range(3):
                await client.send(request("HEAD", path))
                head = await client.read_answer(head_request=True)
                assert head.status == status
                assert head.header("content-length") == str(len(orjson.dumps(payload)))
            await client.send(request("GET", path))
            got = await client.read_answer()
        finally:
            await client.close()

    assert got.status == status
    assert orjson.loads(got.body) == payload
    assert head.header("content-length") == got.header("content-length")
    assert served.upstream_methods == ["HEAD", "HEAD", "HEAD", "GET"]
