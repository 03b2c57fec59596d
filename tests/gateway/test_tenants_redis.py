"""Limits and the usage ledger shared by two real ``universal-runtime serve`` gateways through one real
``redis-server``, as a cluster's gateway replicas share them: a key's N-th request per minute passes on whichever
gateway and the next is a 429 on either, with OpenAI's headers counting down across both; a key's concurrency limit
holds across both; ``GET /v1/usage`` on either reports both gateways' requests, equal to the answers' ``usage``; and
with Redis stopped, each gateway holds the limits in its own memory (counted in
``universal_gateway_limits_store_errors_total``) and keeps its usage until Redis answers again."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.gateway.harness import GatewayProcess, running_gateway, wait_for, write_chat_manifest
from tests.gateway.redis_server import RedisServer
from tests.predictors.generation.tiny_llama import build_llama
from universal_gateway.redis_ledger import WRITE_EVERY_S

MODEL, SLEEPY = "tiny-chat", "tiny-sleepy"  # SLEEPY: asleep until the concurrency test wakes it
ADMIN, TEAM, TIGHT, SINGLE, OUTAGE = (
    "sk-admin-0123456789abcdef",
    "sk-team-0123456789abcdef",
    "sk-tight-0123456789abcdef",
    "sk-single-0123456789abcd",
    "sk-outage-0123456789abcd",
)
N = 3  # requests per minute of the key "tight": one comes back every 20 s, longer than its N requests take


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    llama = build_llama(tmp_path_factory.mktemp("models") / "llama")
    folder = tmp_path_factory.mktemp("manifests")
    write_chat_manifest(folder, "chat", MODEL, llama)
    write_chat_manifest(folder, "sleepy", SLEEPY, llama)
    return folder


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    document = {
        "keys": [
            {"id": "ops", "sha256": sha(ADMIN), "admin": True},
            {"id": "team-a", "sha256": sha(TEAM)},
            {"id": "tight", "sha256": sha(TIGHT), "modelLimits": {MODEL: {"requestsPerMinute": N}}},
            {"id": "single", "sha256": sha(SINGLE), "limits": {"concurrentRequests": 1}},
            {"id": "outage", "sha256": sha(OUTAGE), "limits": {"requestsPerMinute": 2}},
        ]
    }
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def gateways(
    manifests: Path, keys_file: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, GatewayProcess]]:
    logs = tmp_path_factory.mktemp("gw")
    keys = ("--api-keys-file", str(keys_file))
    # One names the Redis for its limits, the other only as its response store: the limits go there too.
    with (
        running_gateway([manifests], logs / "a", *keys, "--limits-store", redis_server.url) as first,
        running_gateway([manifests], logs / "b", *keys, "--responses-store", redis_server.url) as second,
    ):
        for gateway in (first, second):  # both models awake before any limit is counted
            assert chat(TEAM, gateway).status_code == 200
        yield first, second


def chat(key: str, gateway: GatewayProcess, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2, **fields}
    return httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=300)  # fmt: skip


def metric(gateway: GatewayProcess, line_start: str) -> float:
    text = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    found = [line for line in text.splitlines() if line.startswith(line_start)]
    return float(found[0].rsplit(" ", 1)[1]) if found else 0.0


def test_the_nth_request_passes_on_either_gateway_and_the_next_is_a_429_on_both(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    first, second = gateways
    answers = [chat(TIGHT, (first, second)[n % 2]) for n in range(N)]
    assert [a.status_code for a in answers] == [200] * N, [a.text for a in answers]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == [str(N - 1 - n) for n in range(N)]
    assert all(a.headers["x-ratelimit-limit-requests"] == str(N) for a in answers)
    for gateway in (second, first):
        refused = chat(TIGHT, gateway)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert error["type"] == "requests"
        assert f"on the model {MODEL!r}" in error["message"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60 // N
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-limit-requests"] == str(N)


def test_a_concurrency_limit_holds_across_both_gateways(gateways: tuple[GatewayProcess, GatewayProcess]) -> None:
    first, second = gateways
    outcome: dict[str, httpx.Response] = {}
    # A request to a model asleep holds its key's place while the model wakes (seconds): a request in flight for
    # as long as the test needs, which a stream from the tiny model (a tenth of a second) is not.
    waking = threading.Thread(target=lambda: outcome.setdefault("first", chat(SINGLE, first, model=SLEEPY)))
    waking.start()
    try:
        wait_for(lambda: metric(first, f'universal_gateway_held_requests{{model="{SLEEPY}"}}') == 1, within=60)
        refused = chat(SINGLE, second)
    finally:
        waking.join(300)
    assert outcome["first"].status_code == 200
    assert refused.status_code == 429
    assert "concurrent requests" in refused.json()["error"]["message"]
    assert chat(SINGLE, second).status_code == 200  # the first one finished on the other gateway: its place is free


def usage_totals(gateway: GatewayProcess, key_id: str) -> dict[str, float]:
    answer = httpx.get(f"{gateway.base_url}/usage?key={key_id}", headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.status_code == 200, answer.text
    totals: dict[str, float] = {"requests": 0, "input_tokens": 0, "output_tokens": 0}
    for row in answer.json()["data"]:
        for name in totals:
            totals[name] += row[name]
    return totals


def test_usage_on_either_gateway_is_both_gateways_answers_usage(
    gateways: tuple[GatewayProcess, GatewayProcess],
) -> None:
    first, second = gateways
    before = usage_totals(first, "team-a")
    assert usage_totals(second, "team-a") == before
    expected = {"requests": 0, "input_tokens": 0, "output_tokens": 0}
    for n, gateway in enumerate((first, second, second, first, second)):
        answer = chat(TEAM, gateway, max_tokens=2 + n)
        assert answer.status_code == 200
        expected["requests"] += 1
        expected["input_tokens"] += answer.json()["usage"]["prompt_tokens"]
        expected["output_tokens"] += answer.json()["usage"]["completion_tokens"]
    time.sleep(WRITE_EVERY_S + 0.5)  # each gateway writes what it recorded every half second
    for gateway in (first, second):
        after = usage_totals(gateway, "team-a")
        assert {k: after[k] - before[k] for k in expected} == expected
    # The Prometheus counters are each gateway's own: together, every request.
    series = f'universal_gateway_usage_requests_total{{key_id="team-a",model="{MODEL}"}}'
    assert metric(first, series) + metric(second, series) == usage_totals(first, "team-a")["requests"]


def test_with_redis_stopped_each_gateway_holds_the_limits_and_keeps_the_usage(
    gateways: tuple[GatewayProcess, GatewayProcess], redis_server: RedisServer
) -> None:
    first, second = gateways
    errors = 'universal_gateway_limits_store_errors_total{use="limits"}'
    assert metric(first, errors) == 0
    before = usage_totals(first, "outage")
    redis_server.stop(keep_data=True)
    try:
        # Open, onto each gateway's own counters: the key's 2 per minute hold per gateway, not across both.
        assert [chat(OUTAGE, first).status_code for _ in range(3)] == [200, 200, 429]
        assert [chat(OUTAGE, second).status_code for _ in range(3)] == [200, 200, 429]
        assert metric(first, errors) >= 1
        assert metric(second, errors) >= 1
        assert "limits are held per replica" in first.log()
        unavailable = httpx.get(f"{first.base_url}/usage", headers={"Authorization": f"Bearer {ADMIN}"})
        assert unavailable.status_code == 503
        assert unavailable.json()["error"]["code"] == "usage_store_unavailable"
    finally:
        redis_server.start()

    # Each gateway writes what it kept once Redis answers (tried every 2 s; meanwhile /v1/usage is a 503): either
    # reports the four requests the two admitted.
    def reported(gateway: GatewayProcess) -> float | None:
        answer = httpx.get(f"{gateway.base_url}/usage?key=outage", headers={"Authorization": f"Bearer {ADMIN}"})
        return sum(row["requests"] for row in answer.json()["data"]) if answer.status_code == 200 else None

    wait_for(lambda: reported(second) == before["requests"] + 4, within=30)
    assert usage_totals(first, "outage")["requests"] - before["requests"] == 4
    assert metric(first, "universal_gateway_usage_records_dropped_total") == 0
