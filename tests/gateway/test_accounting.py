"""A request's accounting after its answer (its key's limits settled, the ledger, the Prometheus totals and the audit
line), as the gateway does it off the answer's path: with every store in the process, one task settles the records in
the order the requests ended; the audit log's lines are formatted by its flushing thread. Nothing is lost on the way:
not under concurrency, not at close, not while a flush is writing."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.gateway.harness import OneUpstream
from universal_gateway import audit as audit_module
from universal_gateway.app import Gateway
from universal_gateway.audit import AuditLog
from universal_gateway.auth import ApiKeys
from universal_predictors.catalog import Task

MODEL = "minilm"
SECRET = "sk-accounting-0123456789abcdef"
LIMITS = "{requestsPerMinute: 100000, inputTokensPerMinute: 10000000, concurrentRequests: 1000}"


async def test_every_request_is_settled_in_the_ledger_limits_and_audit_log_even_at_close(tmp_path: Path) -> None:
    """Concurrent requests whose gateway closes right after their answers: the ledger, the Prometheus totals, the
    key's concurrency places and the audit log each count every one of them."""

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        tokens = len(body["input"])
        return web.json_response({"object": "list", "data": [], "model": MODEL,
                                  "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip

    app = web.Application()
    app.router.add_post("/openai/v1/embeddings", embeddings)
    upstream = TestServer(app)
    await upstream.start_server()
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(f"keys:\n- id: team-a\n  owner: a\n  secret: {SECRET}\n  limits: {LIMITS}\n")
    audit = AuditLog(str(tmp_path / "audit.jsonl"))
    gateway = Gateway(OneUpstream(str(upstream.make_url("")).rstrip("/"), MODEL, Task.EMBED),
                      keys=ApiKeys.load(keys_file, env=""), audit=audit)  # fmt: skip
    count = 60
    try:
        async with gateway.serving() as url, aiohttp.ClientSession() as session:

            async def one(i: int) -> int:
                body = {"model": MODEL, "input": ["x"] * (1 + i % 4)}
                headers = {"Authorization": f"Bearer {SECRET}"}
                async with session.post(f"{url}/v1/embeddings", json=body, headers=headers) as response:
                    assert response.status == 200, await response.text()
                    return int((await response.json())["usage"]["prompt_tokens"])

            tokens = await asyncio.gather(*(one(i) for i in range(count)))
        # Closed as soon as the last answer came: what was not settled yet is settled by close().
    finally:
        await upstream.close()
    rows = await gateway.ledger.rows(0, 2**40, "team-a")
    assert [(row[1], row[2], row[3].requests, row[3].input_tokens) for row in rows] == [
        ("team-a", MODEL, count, sum(tokens))
    ]
    scraped = gateway.metrics.registry.get_sample_value
    labels = {"key_id": "team-a", "model": MODEL}
    assert scraped("universal_gateway_usage_requests_total", labels) == count
    assert scraped("universal_gateway_usage_input_tokens_total", labels) == sum(tokens)
    assert gateway.quotas.counters.slots == {}  # every concurrency place given back  # type: ignore[attr-defined]
    lines = [orjson.loads(line) for line in (tmp_path / "audit.jsonl").read_bytes().splitlines()]
    assert len(lines) == count
    assert sorted(line["input_tokens"] for line in lines) == sorted(tokens)
    assert {(line["key_id"], line["model"], line["status"]) for line in lines} == {("team-a", MODEL, 200)}


def test_audit_lines_made_while_a_flush_writes_are_kept_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines recorded from one thread while another flushes over and over: each written once, in order; the
    formatting thread offers the GIL every FORMATTED_BETWEEN_YIELDS lines."""
    yields: list[str] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(threading.current_thread().name))
    monkeypatch.setattr(audit_module, "FLUSH_S", 3600.0)  # flushed only here
    log = AuditLog(str(tmp_path / "audit.jsonl"))
    for i in range(10 * audit_module.FORMATTED_BETWEEN_YIELDS):
        log.record({"i": i})
    log.flush()
    assert yields == [threading.current_thread().name] * 10  # formatted by the thread that flushed
    count = 5000
    done = threading.Event()

    def flushing() -> None:
        while not done.is_set():
            log.flush()

    flusher = threading.Thread(target=flushing, name="test-flusher")
    flusher.start()
    try:
        for i in range(count):
            log.record({"i": i, "key_id": "k"})
    finally:
        done.set()
        flusher.join()
    log.close()
    written = [orjson.loads(line)["i"] for line in (tmp_path / "audit.jsonl").read_bytes().splitlines()]
    assert written == list(range(10 * audit_module.FORMATTED_BETWEEN_YIELDS)) + list(range(count))
