"""The Redis connection behind the limits and the usage ledger that every gateway replica shares, and its outages.

A call that fails (Redis unreachable, or slower than ``timeout_s``) is counted (``on_error``: the gateway's
``universal_gateway_limits_store_errors_total``), logged at most once per ``log_every_s``, and for ``pause_s`` no
call is tried: a request then does not wait for a connect timeout each time, and the callers keep what they do in
this process until Redis answers again (:mod:`.redis_counters`, :mod:`.redis_ledger` say what).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from universal_gateway.redis_pipe import PipelinedRedis, Reply, Script, pipelined

#: What a failing call raises: redis-py's errors, and the socket's own.
STORE_ERRORS: tuple[type[BaseException], ...] = (RedisError, OSError)
#: Where every key of the limits and the ledger starts (the response store's records are ``...:response:``).
PREFIX = "universal-runtime:"

logger = logging.getLogger(__name__)


def is_redis_url(spec: str | None) -> bool:
    return bool(spec) and str(spec).startswith(("redis://", "rediss://", "unix://"))


class RedisLink:
    """One Redis client for one use (``what``: for the log), with the outage bookkeeping."""

    def __init__(
        self,
        url: str,
        what: str,
        *,
        on_error: Callable[[], None] | None = None,
        timeout_s: float = 0.5,
        pause_s: float = 2.0,
        log_every_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.url = url
        self.what = what
        # No retries inside the client: one failed call is one decision (this process's limits, the buffer), taken
        # at once; a request does not wait for three connect timeouts.
        self.client = redis.asyncio.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )
        #: The calls a request waits on go through one pipelined connection (:mod:`.redis_pipe` says why).
        self.pipe = PipelinedRedis(url, timeout_s=timeout_s) if pipelined(url) else None
        self.on_error = on_error
        self.pause_s = pause_s
        self.log_every_s = log_every_s
        self._clock = clock
        self._paused_until = -math.inf
        self._logged_at = -math.inf
        self._unlogged = 0

    @property
    def paused(self) -> bool:
        """Whether a call failed within the last ``pause_s`` (none is tried meanwhile)."""
        return self._clock() < self._paused_until

    def failed(self, exc: BaseException, consequence: str) -> None:
        """A call failed: count it, pause, and log it unless a line went out within ``log_every_s``."""
        if self.on_error is not None:
            self.on_error()
        now = self._clock()
        self._paused_until = now + self.pause_s
        self._unlogged += 1
        if now - self._logged_at >= self.log_every_s:
            logger.warning(
                "%s: %s failed %d time(s) since the last such line (%s: %s); %s",
                self.describe(), self.what, self._unlogged, type(exc).__name__, exc, consequence,
            )  # fmt: skip
            self._logged_at, self._unlogged = now, 0

    def describe(self) -> str:
        parts = urlsplit(self.url)
        if parts.scheme == "unix":
            return f"Redis at {parts.path}"
        return f"Redis at {parts.hostname}:{parts.port or 6379}"  # never the password

    async def run(self, script: Script, keys: list[str], args: list[str | int]) -> Reply:
        """``script`` on ``keys`` with ``args``: on the pipelined connection where there is one."""
        if self.pipe is not None:
            return await self.pipe.run(script, keys, args)
        try:
            return await self.client.evalsha(script.sha.decode(), len(keys), *keys, *args)
        except NoScriptError:
            return await self.client.eval(script.text.decode(), len(keys), *keys, *args)

    async def close(self) -> None:
        if self.pipe is not None:
            await self.pipe.close()
        with contextlib.suppress(*STORE_ERRORS):
            await self.client.aclose()
