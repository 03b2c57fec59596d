"""The audit log: one JSON line per proxied request, who asked what and what it cost.

Fields: ``time`` (RFC 3339, UTC), ``key_id`` (``-`` on an open gateway), ``owner``, ``model``, ``route``,
``status``, ``input_tokens``, ``output_tokens``, ``latency_s``, ``woke`` (the request waited for its model to wake)
and ``wake_s``, ``stream``. No bodies, unless ``--audit-bodies`` asks for them (``body``, the request as sent, up to
:data:`MAX_BODY` bytes): they hold what users wrote. Written to a file (re-opened when rotated away:
``logging.handlers.WatchedFileHandler``) or, with ``-``, to standard output, where a cluster's log collector reads it.
"""

from __future__ import annotations

import logging
import logging.handlers
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

#: Bytes of a request body an audit line carries at most, with --audit-bodies.
MAX_BODY = 64 * 1024


class AuditLog:
    """Writes audit lines to ``target`` (a path, or ``-`` for standard output)."""

    def __init__(self, target: str, *, bodies: bool = False) -> None:
        self.bodies = bodies
        self._logger = logging.Logger("universal_gateway.audit")  # not in the hierarchy: never the root's handlers
        handler: logging.Handler = (
            logging.StreamHandler(sys.stdout) if target == "-" else logging.handlers.WatchedFileHandler(target)
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        self._logger.addHandler(handler)
        self._logger.setLevel(logging.INFO)

    def record(self, fields: dict[str, Any], body: bytes | None = None) -> None:
        line: dict[str, Any] = {"time": datetime.now(UTC).isoformat(timespec="milliseconds"), **fields}
        if self.bodies and body is not None:
            line["body"] = body[:MAX_BODY].decode("utf-8", "replace")
        self._logger.info(orjson.dumps(line).decode())

    def close(self) -> None:
        for handler in self._logger.handlers:
            handler.close()
