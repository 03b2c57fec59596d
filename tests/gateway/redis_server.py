"""A real ``redis-server`` (Debian's package, installed by ``make system-deps``) on a free loopback port, which a test
can stop and start again on the same port (an outage)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.predictors.harness import free_port


class RedisServer:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        server = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.process = subprocess.Popen(
            [server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise AssertionError("redis-server did not start") from None
                time.sleep(0.05)

    def stop(self, *, keep_data: bool = False) -> None:
        """Stop it; with ``keep_data``, its data saved first and read again by the next :meth:`start` (an outage
        that Redis's persistence survives)."""
        if keep_data:
            import redis

            redis.Redis.from_url(self.url).save()
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None


@contextmanager
def running_redis(folder: Path) -> Iterator[RedisServer]:
    server = RedisServer(folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()
