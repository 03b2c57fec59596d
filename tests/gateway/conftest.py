"""Fixtures the gateway's tests share: a real redis-server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.gateway.redis_server import RedisServer, running_redis


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free port, for the module's tests (one may stop and start it)."""
    with running_redis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url
