"""The audit log: one JSON line per proxied request, who asked what and what it cost.

Fields: ``time`` (RFC 3339, UTC, milliseconds), ``key_id`` (``-`` on an open gateway), ``owner``, ``model``,
``route``, ``status``, ``input_tokens``, ``output_tokens``, ``latency_s``, ``woke`` (the request waited for its
model to wake) and ``wake_s``, ``stream``. No bodies, unless ``--audit-bodies`` asks for them (``body``, the request
as sent, up to :data:`MAX_BODY` bytes): they hold what users wrote.

Written to a file or, with ``-``, to standard output, where a cluster's log collector reads it. Lines are buffered
and written at most :data:`FLUSH_S` after they were made (and at close): a write per request would cost more than
the rest of the accounting. They are formatted when written, by the thread that writes them, not on the request's
event loop (measured on the gateway's loop under load: 10.6 us a request to make its line there, 2.4 us to keep its
fields). A file moved away (logrotate) is noticed at the next flush and a new one opened, as
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
#: Lines the flushing thread formats between two offers of the GIL (a few microseconds each).
FORMATTED_BETWEEN_YIELDS = 16


class AuditLog:
    """Writes audit lines to ``target`` (a path, or ``-`` for standard output)."""

    def __init__(self, target: str, *, bodies: bool = False) -> None:
        self.bodies = bodies
        self._target = target
        self._lines: list[tuple[float, dict[str, Any], bytes | None]] = []  # (time, fields, body), not formatted yet
        self._lock = threading.Lock()
        self._writing = threading.Lock()
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

    def _time(self, now: float) -> str:
        second = int(now)
        if second != self._second:  # formatted once a second
            self._second, self._stamp = second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._stamp}.{int((now - second) * 1000):03d}Z"

    def record(self, fields: dict[str, Any], body: bytes | None = None) -> None:
        """A request's line: its fields kept as they are, with the time, for :meth:`flush` to write out (the request's
        loop only appends; the flushing thread formats)."""
        with self._lock:  # held only to append or to swap the list, never while formatting or writing
            self._lines.append((time.time(), fields, body if self.bodies else None))
            full = len(self._lines) >= MAX_BUFFERED
        if full:
            self.flush()

    def _format(self, records: list[tuple[float, dict[str, Any], bytes | None]]) -> bytes:
        """The records' JSON lines. Called on the flushing thread, which gives the GIL up every
        :data:`FORMATTED_BETWEEN_YIELDS` lines: a thread that holds it keeps the loop that wants it waiting up to the
        switch interval, 5 ms (as the traces' export thread: ``universal_predictors.tracing.Batches``)."""
        out = []
        for done, (now, fields, body) in enumerate(records, 1):
            line: dict[str, Any] = {"time": self._time(now), **fields}
            if body is not None:
                line["body"] = body[:MAX_BODY].decode("utf-8", "replace")
            out.append(orjson.dumps(line))
            if done % FORMATTED_BETWEEN_YIELDS == 0:
                os.sched_yield()
        out.append(b"")
        return b"\n".join(out)

    def flush(self) -> None:
        with self._writing:  # one flush at a time: the lines in order
            with self._lock:
                records, self._lines = self._lines, []
            if self._target != "-" and self._stat() != self._inode:  # rotated away: a new file
                self._file.close()
                self._file = open(self._target, "ab")  # noqa: SIM115
                self._inode = self._stat()
            if records:
                self._file.write(self._format(records))
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
