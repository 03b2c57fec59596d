"""The proxy's transport mechanics against an upstream HTTP server whose timing the test controls.

Real predictors cannot hold a stream at a chosen byte, so the upstream here is a real aiohttp server
that streams when the test says: chunk-by-chunk pass-through, backpressure, a client leaving closes the
upstream connection, a dying upstream is a 502 or an error event, and keep-alive reuse.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.conftest import eventually
from tests.gateway.harness import OneUpstream
from universal_gateway.app import Gateway
from universal_predictors.catalog import Task

MODEL = "stream-model"


@dataclass
class Upstream:
    """What the upstream saw, and the switches the test holds it with."""

    release: asyncio.Event = field(default_factory=asyncio.Event)
    written: int = 0
    finished: bool = False
    client_gone: bool = False
    peers: set[int] = field(default_factory=set)
    request: web.Request | None = None
    server: TestServer | None = None
    queries: list[str] = field(default_factory=list)

    def open_connections(self) -> int:
        assert self.server is not None
        assert self.server.runner is not None
        assert self.server.runner.server is not None
        return len(self.server.runner.server.connections)


async def upstream_app(state: Upstream) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.queries.append(request.query_string)
        state.request = request
        sock = request.transport.get_extra_info("peername") if request.transport else None
        if sock:
            state.peers.add(sock[1])
        mode = body.get("mode")
        if mode == "plain":
            return web.json_response({"echo": body["messages"]})
        if mode == "gzip":
            return web.Response(
                body=gzip.compress(json.dumps({"echo": body["messages"]}).encode()),
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            )
        if mode == "die":  # the headers, half a body, then the connection drops
            response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
            await response.prepare(request)
            await response.write(b'{"partial": ')
            assert request.transport is not None
            request.transport.abort()
            return response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            if mode == "flood":  # far more than any buffer: only backpressure bounds what is written
                chunk = b"data: " + b"x" * 65_536 + b"\n\n"
                for _ in range(1024):
                    await response.write(chunk)
                    state.written += len(chunk)
            else:
                await response.write(b"data: first\n\n")
                await state.release.wait()
                await response.write(b"data: second\n\n")
                if mode == "die-mid-stream":
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            state.finished = True
        except (ConnectionResetError, asyncio.CancelledError):
            state.client_gone = True
            raise
        return response

    app = web.Application()
    app.router.add_post("/openai/v1/chat/completions", chat)
    return app


@pytest.fixture
async def proxied() -> AsyncIterator[tuple[str, Upstream]]:
    state = Upstream()
    # The upstream closes idle connections fast, as a uvicorn predictor does after 5 s.
    upstream = TestServer(await upstream_app(state))
    await upstream.start_server(keepalive_timeout=0.3)
    state.server = upstream
    try:
        backends = OneUpstream(str(upstream.make_url("")).rstrip("/"), MODEL, Task.GENERATE)
        async with Gateway(backends).serving() as gateway:
            yield f"{gateway}/v1/chat/completions", state
    finally:
        await upstream.close()


def chat(mode: str) -> dict[str, object]:
    return {"model": MODEL, "mode": mode, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_stream_passes_through_chunk_by_chunk(proxied: tuple[str, Upstream]) -> None:
    url, state = proxied
    async with aiohttp.ClientSession() as session, session.post(url, json=chat("hold")) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        # The first event arrives while the upstream is still holding the second.
        assert await response.content.readuntil(b"\n\n") == b"data: first\n\n"
        state.release.set()
        assert await response.read() == b"data: second\n\ndata: [DONE]\n\n"
    assert state.finished


async def test_a_client_that_leaves_mid_stream_closes_the_upstream_request(proxied: tuple[str, Upstream]) -> None:
    url, state = proxied
    async with aiohttp.ClientSession() as session:
        response = await session.post(url, json=chat("hold"))
        assert await response.content.readuntil(b"\n\n") == b"data: first\n\n"
        response.close()  # drops the connection while the upstream is silent
    # The gateway notices without waiting for the upstream's next event, and closes its connection.
    await eventually(lambda: state.request is not None and state.request.transport is None, within=10)
    state.release.set()
    await eventually(lambda: state.client_gone, within=10)
    assert not state.finished

    async def counted_as_client_closed() -> bool:  # 499, as the predictors count it; not a 5xx
        async with aiohttp.ClientSession() as session, session.get(url.split("/v1/")[0] + "/metrics") as metrics:
            return f'universal_gateway_requests_total{{model="{MODEL}",status="499"}} 1.0' in await metrics.text()

    await eventually(counted_as_client_closed, within=10)


async def test_a_client_that_does_not_read_holds_the_upstream_back(proxied: tuple[str, Upstream]) -> None:
    url, state = proxied
    total = 1024 * (65_536 + 8)
    async with aiohttp.ClientSession() as session, session.post(url, json=chat("flood")) as response:
        await response.content.readexactly(1)
        # Not reading: the upstream's writes stall once the socket buffers on both legs are full.
        previous = -1
        for _ in range(100):
            if state.written == previous:
                break
            previous = state.written
            await asyncio.sleep(0.1)
        assert state.written < total // 2, f"the upstream wrote {state.written} of {total} bytes unread"
        rest = await response.read()
    assert len(rest) + 1 == total
    assert state.finished


async def test_an_upstream_that_dies_mid_answer_is_a_502(proxied: tuple[str, Upstream]) -> None:
    url, _ = proxied
    async with aiohttp.ClientSession() as session, session.post(url, json=chat("die")) as response:
        assert response.status == 502
        assert (await response.json())["error"]["code"] == "upstream_error"


async def test_an_upstream_that_dies_mid_stream_ends_the_stream_with_an_error_event(
    proxied: tuple[str, Upstream],
) -> None:
    url, state = proxied
    state.release.set()
    async with aiohttp.ClientSession() as session, session.post(url, json=chat("die-mid-stream")) as response:
        text = await response.text()
    assert text.startswith("data: first\n\ndata: second\n\n")
    assert '"upstream_error"' in text.split("\n\n")[2]


async def test_plain_answers_reuse_one_upstream_connection_and_keep_the_query(
    proxied: tuple[str, Upstream],
) -> None:
    url, state = proxied
    async with aiohttp.ClientSession() as session:
        for i in range(5):
            async with session.post(f"{url}?trace=a%20b&i={i}", json=chat("plain")) as response:
                assert response.status == 200
                assert (await response.json())["echo"][0]["content"] == "hi"
    assert len(state.peers) == 1
    assert state.queries == [f"trace=a b&i={i}" for i in range(5)]


async def test_an_unreachable_upstream_is_a_502() -> None:
    dead = TestServer(web.Application())
    await dead.start_server()
    address = str(dead.make_url("")).rstrip("/")
    await dead.close()  # nothing listens there now
    async with (
        Gateway(OneUpstream(address, MODEL, Task.GENERATE)).serving() as gateway,
        aiohttp.ClientSession() as session,
        session.post(f"{gateway}/v1/chat/completions", json=chat("plain")) as response,
    ):
        assert response.status == 502
        assert (await response.json())["error"]["code"] == "upstream_unreachable"


async def test_a_connection_the_upstream_closed_while_idle_is_not_used_again(proxied: tuple[str, Upstream]) -> None:
    url, state = proxied
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=chat("plain")) as response:
            assert response.status == 200
        await eventually(lambda: state.open_connections() == 0, within=10)  # the upstream's keep-alive ran out
        async with session.post(url, json=chat("plain")) as response:
            assert response.status == 200
    assert len(state.peers) == 2


async def test_a_compressed_answer_keeps_its_content_encoding(proxied: tuple[str, Upstream]) -> None:
    url, _ = proxied
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, json=chat("gzip"), headers={"Accept-Encoding": "gzip"}) as response,
    ):
        assert response.status == 200
        assert response.headers["Content-Encoding"] == "gzip"
        assert (await response.json())["echo"][0]["content"] == "hi"  # aiohttp decompresses it


@pytest.mark.parametrize("model_first", [True, False])
async def test_a_large_body_is_routed_by_its_model_field(proxied: tuple[str, Upstream], model_first: bool) -> None:
    url, _ = proxied
    messages = [{"role": "user", "content": "x" * 200_000}]
    body = {"model": MODEL, "mode": "plain", "messages": messages}
    if not model_first:
        body = {"messages": messages, "mode": "plain", "model": MODEL}
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as response:
        assert response.status == 200
        assert (await response.json())["echo"] == messages
    async with aiohttp.ClientSession() as session:
        body["model"] = "no-such-model"
        async with session.post(url, json=body) as response:
            assert response.status == 404
