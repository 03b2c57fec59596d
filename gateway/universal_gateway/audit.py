"""The audit log: one JSON line per proxied request, who asked what and what it cost.

Fields: ``time`` (RFC 3339, UTC, milliseconds), ``key_id`` (``-`` on an open gateway), ``owner``, ``model``,
``route``, ``status``, ``input_tokens``, ``output_tokens``, ``latency_s``, ``woke`` (the request waited for its
model to wake) and ``wake_s``, ``stream``. No bodies, unless ``--audit-bodies`` asks for them (``body``, the request
as sent, up to :data:`MAX_BODY` bytes): they hold what users wrote.

Written to a file or, with ``-``, to standard output, where a cluster's log collector reads it. Lines are buffered
and written at most :data:`FLUSH_S` after they were made (and at close): a write per request would cost more than
the rest of the accounting. A file moved away (logrotate) is noticed at the next flush and a new one opened, as
``logging.handlers.WatchedFileHandler`` does.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import IO, Any

import orjson

#: Bytes of a request body an audit line carries at most, with --audit-bodies.
MAX_BODY = 64 * 1024
#: Seconds a line may wait in the buffer.
FLUSH_S = 0.5
#: Buffered lines beyond which they are written at once.
MAX_BUFFERED = 1000


class AuditLog:
    """Writes audit lines to ``target`` (a path, or ``-`` for standard output)."""

    def __init__(self, target: str, *, bodies: bool = False) -> None:
        self.bodies = bodies
        self._target = target
        self._lines: list[bytes] = []
        self._lock = threading.Lock()
        self._file: IO[bytes] = sys.stdout.buffer if target == "-" else open(target, "ab")  # noqa: SIM115
        self._inode = self._stat()
        self._second = -1
        self._stamp = ""
        self._closed = threading.Event()
        self._flusher = threading.Thread(target=self._flush_every, name="audit-log", daemon=True)
        self._flusher.start()

    def _stat(self) -> tuple[int, int] | None:
        if self._target == "-":
            return None
        try:
            st = os.stat(self._target)
        except OSError:
            return None
        return st.st_dev, st.st_ino

    def _time(self) -> str:
        now = time.time()
        second = int(now)
        if second != self._second:  # formatted once a second
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((now - second) * 1000):03d}Z"

    def record(self, fields: dict[str, Any], body: bytes | None = None) -> None:
        line: dict[str, Any] = {"time": self._time(), **fields}
        if self.bodies and body is not None:
            line["body"] = body[:MAX_BODY].decode("utf-8", "replace")
        with self._lock:
            self._lines.append(orjson.dumps(line) + b"\n")
            full = len(self._lines) >= MAX_BUFFERED
        if full:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            if self._target != "-" and self._stat() != self._inode:  # rotated away: a new file
                self._file.close()
                self._file = open(self._target, "ab")  # noqa: SIM115
                self._inode = self._stat()
            if lines:
                self._file.write(b"".join(lines))
                self._file.flush()

    def _flush_every(self) -> None:
        while not self._closed.wait(FLUSH_S):
            with contextlib.suppress(OSError):  # a full disk: the lines are lost, the requests go on
                self.flush()

    def close(self) -> None:
        self._closed.set()
        self._flusher.join()
        self.flush()
        if self._target != "-":
            self._file.close()
