"""The pipelined Redis connection (:class:`PipelinedRedis`) against a real ``redis-server``: concurrent callers each get
their own reply, the URL's password and database are used before any caller's command, a script Redis lost is sent
again, an error reply fails its call only, and a connection that breaks or stops answering fails the calls waiting on
it and is opened again for the next."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import ResponseError

from tests.gateway.redis_server import RedisServer, running_redis
from universal_gateway.redis_pipe import PipelinedRedis, Script


@pytest.fixture
async def pipe(redis_url: str) -> AsyncIterator[PipelinedRedis]:
    connection = PipelinedRedis(redis_url)
    yield connection
    await connection.close()


async def test_concurrent_callers_each_get_their_own_reply(pipe: PipelinedRedis) -> None:
    key = f"test-pipe-{uuid.uuid4().hex}"
    values = [f"value-{n}" * (n % 7 + 1) for n in range(300)]
    echoed = await asyncio.gather(*(pipe.call("ECHO", v) for v in values))
    assert echoed == [v.encode() for v in values]
    counts = await asyncio.gather(*(pipe.call("INCR", key) for _ in range(100)))
    assert sorted(counts) == list(range(1, 101))
    assert await pipe.call("GET", f"{key}-missing") is None
    assert await pipe.call("RPUSH", f"{key}-list", "a", "b") == 2
    assert await pipe.call("LRANGE", f"{key}-list", 0, -1) == [b"a", b"b"]


async def test_a_script_redis_lost_is_sent_again(pipe: PipelinedRedis, redis_url: str) -> None:
    script = Script("return {KEYS[1], ARGV[1], 7}")
    assert await pipe.run(script, ["k"], ["v"]) == [b"k", b"v", 7]
    redis.Redis.from_url(redis_url).script_flush()
    assert await pipe.run(script, ["k2"], ["v2"]) == [b"k2", b"v2", 7]


async def test_an_error_reply_fails_its_call_only(pipe: PipelinedRedis) -> None:
    key = f"test-pipe-{uuid.uuid4().hex}"
    await pipe.call("SET", key, "text")
    results = await asyncio.gather(pipe.call("INCR", key), pipe.call("ECHO", "after"), return_exceptions=True)
    assert isinstance(results[0], ResponseError)
    assert "not an integer" in str(results[0])
    assert results[1] == b"after"


async def test_the_url_s_password_and_database_come_first(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        redis.Redis(port=server.port).config_set("requirepass", "s3cret")
        admin = redis.Redis(port=server.port, password="s3cret", db=3)
        admin.set("where", "db3")
        connection = PipelinedRedis(f"redis://:s3cret@127.0.0.1:{server.port}/3")
        try:
            # Callers that come while it connects wait for the handshake; none of their commands goes before it.
            answers = await asyncio.gather(*(connection.call("GET", "where") for _ in range(20)))
            assert answers == [b"db3"] * 20
        finally:
            await connection.close()
        wrong = PipelinedRedis(f"redis://:nope@127.0.0.1:{server.port}/3")
        with pytest.raises(ResponseError, match=r"WRONGPASS|invalid password"):
            await wrong.call("GET", "where")
        await wrong.close()
    finally:
        server.stop()


async def test_a_broken_connection_fails_its_callers_and_the_next_call_reconnects(tmp_path: Path) -> None:
    with running_redis(tmp_path) as server:
        connection = PipelinedRedis(server.url, timeout_s=30)  # (it is the kill that ends the wait)
        try:
            assert await connection.call("CLIENT", "SETNAME", "pipe-under-test") == b"OK"
            waiting = asyncio.ensure_future(connection.call("BLPOP", "never-filled", 0))  # held by Redis
            await asyncio.sleep(0.1)
            assert not waiting.done()
            redis.Redis(port=server.port).client_kill_filter(_type="normal", skipme=True)
            with pytest.raises(ConnectionError):
                await waiting
            assert await connection.call("ECHO", "again") == b"again"
        finally:
            await connection.close()


async def test_a_server_that_stops_answering_fails_the_call_within_the_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1 << 16)  # reads the command, never answers
        await asyncio.sleep(30)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    connection = PipelinedRedis(f"redis://127.0.0.1:{port}/0", timeout_s=0.3)
    try:
        calls = [asyncio.ensure_future(connection.call("ECHO", str(n))) for n in range(3)]
        for call in calls:
            with pytest.raises(ConnectionError, match=r"did not answer within 0\.3 s"):
                await asyncio.wait_for(call, 10)
    finally:
        await connection.close()
        server.close()


async def test_nothing_listening_is_a_connection_error() -> None:
    from tests.predictors.harness import free_port

    connection = PipelinedRedis(f"redis://127.0.0.1:{free_port()}/0")
    with pytest.raises(OSError, match="could not connect to Redis"):
        await connection.call("PING")
    await connection.close()


def test_tls_urls_are_left_to_redis_py() -> None:
    with pytest.raises(ValueError, match="not a redis:// or unix:// URL"):
        PipelinedRedis("rediss://:pw@example.com:6380/0")
