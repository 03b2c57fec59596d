"""Stored responses for the Responses API: ``store``, ``previous_response_id``, the ``/v1/responses/{id}`` routes.

Predictors answer ``/v1/responses`` statelessly (``universal_predictors.generation.responses_api``); the gateway keeps
the conversation, because it serves every replica's clients and outlives a model scaled to zero. For a request with
``store`` (true unless the caller says false, as OpenAI's API) the gateway records the request's input items and the
response the predictor made; a later request naming it as ``previous_response_id`` is sent to the predictor with the
whole conversation as its input (each response of the chain: its input items, then its output items; OpenAI's rule:
the earlier ``instructions`` are not carried over). ``GET /v1/responses/{id}``, ``DELETE`` and
``GET /v1/responses/{id}/input_items`` read the record.

A record belongs to the API key that created it (its SHA-256; one shared owner when the gateway has no keys):
another key gets 404, as for a response that does not exist. Records expire after the retention (``--responses-
retention``, 30 days by default, as OpenAI keeps them).

Two stores: :class:`SqliteStore` (one file under ``serve``'s state directory: survives a restart) and
:class:`RedisStore` (a Redis server every gateway replica of a cluster shares; each record one key with the retention
as its TTL). A chain is read back one record at a time, so each record holds only its own items, and a long
conversation costs storage linear in its length.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sqlite3
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

#: How long a record is kept by default (OpenAI keeps responses 30 days).
DEFAULT_RETENTION_S = 30 * 24 * 3600
#: The longest chain of previous_response_id links followed (each link one store read).
MAX_CHAIN = 1000


def owner_of(credentials: str | None) -> str:
    """The owner of records made with ``credentials`` (an Authorization header value): its key's SHA-256, or ``""``
    without one (a gateway with no keys: one owner)."""
    if not credentials:
        return ""
    _, _, key = credentials.partition(" ")
    return hashlib.sha256((key.strip() or credentials).encode()).hexdigest()


@dataclass
class StoredResponse:
    id: str
    owner: str
    created_at: float
    previous_response_id: str | None
    input_items: list[dict[str, Any]]  # this request's input, as items with ids
    response: dict[str, Any]  # the response object as the client got it

    def to_json(self) -> bytes:
        return orjson.dumps(self.__dict__)

    @classmethod
    def from_json(cls, data: bytes | str) -> StoredResponse:
        return cls(**orjson.loads(data))


class ResponseStore(ABC):
    """Where records live; every method is a coroutine, safe to call from the gateway's event loop."""

    def __init__(self, retention_s: float = DEFAULT_RETENTION_S) -> None:
        self.retention_s = retention_s

    @abstractmethod
    async def put(self, record: StoredResponse) -> None: ...

    @abstractmethod
    async def get(self, owner: str, response_id: str) -> StoredResponse | None: ...

    @abstractmethod
    async def delete(self, owner: str, response_id: str) -> bool: ...

    async def close(self) -> None:
        return None

    def describe(self) -> str:
        return type(self).__name__


class SqliteStore(ResponseStore):
    """One SQLite file (WAL): records keyed by (owner, id), expired ones purged as new ones are written."""

    def __init__(self, path: Path, retention_s: float = DEFAULT_RETENTION_S) -> None:
        super().__init__(retention_s)
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS responses (owner TEXT NOT NULL, id TEXT NOT NULL, expires REAL NOT NULL, "
            "record BLOB NOT NULL, PRIMARY KEY (owner, id))"
        )
        self._lock = asyncio.Lock()

    async def _run(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        async with self._lock:  # one statement at a time on the one connection
            return await asyncio.to_thread(lambda: self._db.execute(sql, args).fetchall())

    async def put(self, record: StoredResponse) -> None:
        now = time.time()
        await self._run("DELETE FROM responses WHERE expires < ?", (now,))
        await self._run(
            "INSERT OR REPLACE INTO responses (owner, id, expires, record) VALUES (?, ?, ?, ?)",
            (record.owner, record.id, now + self.retention_s, record.to_json()),
        )

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        rows = await self._run(
            "SELECT record FROM responses WHERE owner = ? AND id = ? AND expires >= ?",
            (owner, response_id, time.time()),
        )
        return StoredResponse.from_json(rows[0][0]) if rows else None

    async def delete(self, owner: str, response_id: str) -> bool:
        found = await self.get(owner, response_id)
        await self._run("DELETE FROM responses WHERE owner = ? AND id = ?", (owner, response_id))
        return found is not None

    async def close(self) -> None:
        self._db.close()

    def describe(self) -> str:
        return f"SQLite at {self.path}"


class RedisStore(ResponseStore):
    """A Redis server shared by every gateway replica: one key per record, the retention its TTL."""

    PREFIX = "universal-runtime:response:"

    def __init__(self, url: str, retention_s: float = DEFAULT_RETENTION_S) -> None:
        super().__init__(retention_s)
        import redis.asyncio

        self.url = url
        self._redis = redis.asyncio.Redis.from_url(url)

    def _key(self, owner: str, response_id: str) -> str:
        return f"{self.PREFIX}{owner}:{response_id}"

    async def put(self, record: StoredResponse) -> None:
        await self._redis.set(self._key(record.owner, record.id), record.to_json(), ex=max(1, int(self.retention_s)))

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        data = await self._redis.get(self._key(owner, response_id))
        return StoredResponse.from_json(data) if data is not None else None

    async def delete(self, owner: str, response_id: str) -> bool:
        return bool(await self._redis.delete(self._key(owner, response_id)))

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._redis.aclose()

    def describe(self) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(self.url)
        return f"Redis at {parts.hostname}:{parts.port or 6379}"  # never the password


def open_store(spec: str, state_dir: Path | None, retention_s: float) -> ResponseStore | None:
    """The store ``spec`` names: ``sqlite`` (under ``state_dir``) or ``sqlite:PATH``, ``redis://...`` or
    ``rediss://...``, or ``off`` (None: ``store`` is refused as not available)."""
    if spec == "off":
        return None
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, retention_s)
    if spec == "sqlite" or spec.startswith("sqlite:"):
        path = Path(spec.removeprefix("sqlite").removeprefix(":")) if spec != "sqlite" else None
        if path is None:
            if state_dir is None:
                raise ValueError("--responses-store sqlite needs a state directory (or give sqlite:PATH)")
            path = state_dir / "responses.sqlite3"
        return SqliteStore(path, retention_s)
    raise ValueError(f"--responses-store {spec!r}: give off, sqlite, sqlite:PATH or a redis:// URL")


# -- the items of a request and a response -------------------------------------------------------------------------


def input_items(value: Any) -> list[dict[str, Any]]:
    """A request's ``input`` as items, each with an id (a string becomes one user message, as OpenAI lists it)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    items = []
    for item in value if isinstance(value, list) else []:
        if not isinstance(item, dict):
            continue
        item = {"type": "message", **item} if "type" not in item else dict(item)
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        item.setdefault("id", f"{'msg' if item['type'] == 'message' else 'item'}_{uuid.uuid4().hex}")
        items.append(item)
    return items


def output_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the next request's input items (messages and function calls as they are)."""
    return [item for item in output if isinstance(item, dict) and item.get("type") in ("message", "function_call")]


async def conversation(store: ResponseStore, owner: str, response_id: str) -> list[dict[str, Any]] | str:
    """The whole conversation up to and including ``response_id``'s output, oldest first; or, when a link of the
    chain is missing (never stored, expired, deleted, another key's), the id that is missing."""
    chain: list[StoredResponse] = []
    current: str | None = response_id
    while current is not None and len(chain) < MAX_CHAIN:
        record = await store.get(owner, current)
        if record is None:
            return current
        chain.append(record)
        current = record.previous_response_id
    items: list[dict[str, Any]] = []
    for record in reversed(chain):
        items += record.input_items
        items += output_as_input(record.response.get("output") or [])
    return items


class FinalResponse:
    """The response object a /v1/responses answer carries: the JSON body of a unary answer, or the ``response`` of a
    stream's last ``response.completed``/``response.incomplete`` event, found as the bytes are relayed."""

    def __init__(self) -> None:
        self.response: dict[str, Any] | None = None
        self._pending = b""

    def unary(self, payload: bytes) -> None:
        with contextlib.suppress(orjson.JSONDecodeError):
            parsed = orjson.loads(payload)
            if isinstance(parsed, dict) and parsed.get("object") == "response":
                self.response = parsed

    def chunk(self, data: bytes) -> None:
        self._pending += data
        *events, self._pending = self._pending.replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                with contextlib.suppress(orjson.JSONDecodeError):
                    parsed = orjson.loads(line[5:].strip())
                    if isinstance(parsed, dict) and parsed.get("type") in ("response.completed", "response.incomplete"):
                        self.response = parsed.get("response")
