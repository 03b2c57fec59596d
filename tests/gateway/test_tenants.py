"""Named API keys with limits, the usage ledger and the audit log, through a real ``universal-runtime serve`` process
and the real ``openai`` SDK: a key's N-th request per minute passes and the next gets 429 with OpenAI's headers; a
stream whose key runs out of output tokens ends with an error event between two pieces; concurrent requests over a
key's limit are refused; the ledger's totals equal the sum of the answers' ``usage``; a changed keys file is read
without a restart; ``keys create`` stores a key hashed."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.gateway.harness import GatewayProcess, running_gateway, write_chat_manifest
from tests.predictors.generation.tiny_llama import build_llama
from universal_gateway.audit import FLUSH_S

MODEL = "tiny-chat"
ADMIN, TEAM, TIGHT, STREAMER, SINGLE = (
    "sk-admin-0123456789abcdef",
    "sk-team-0123456789abcdef",
    "sk-tight-0123456789abcdef",
    "sk-streamer-0123456789ab",
    "sk-single-0123456789abcd",
)
OUTPUT_BUDGET = 5


def sha(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def keys_document() -> dict[str, Any]:
    return {
        "keys": [
            {"id": "ops", "owner": "platform", "sha256": sha(ADMIN), "admin": True},
            {"id": "team-a", "owner": "search", "secret": TEAM, "models": [MODEL]},
            {"id": "tight", "owner": "search", "sha256": sha(TIGHT), "limits": {"requestsPerMinute": 2}},
            {"id": "streamer", "sha256": sha(STREAMER), "limits": {"outputTokensPerMinute": OUTPUT_BUDGET}},
            {"id": "single", "sha256": sha(SINGLE), "modelLimits": {MODEL: {"concurrentRequests": 1}}},
        ]
    }


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Path:
    llama = build_llama(tmp_path_factory.mktemp("models") / "llama")
    folder = tmp_path_factory.mktemp("manifests")
    write_chat_manifest(folder, "chat", MODEL, llama)
    return folder


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    path.write_text(yaml.safe_dump(keys_document(), sort_keys=False))
    return path


@pytest.fixture(scope="module")
def gateway(manifests: Path, keys_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    logs = tmp_path_factory.mktemp("gw")
    audit = logs / "audit.jsonl"
    with running_gateway([manifests], logs, "--api-keys-file", str(keys_file), "--audit-log", str(audit)) as process:
        yield process


def client(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key=key, max_retries=0, timeout=300)


def audit_count(gateway: GatewayProcess) -> int:
    """How many audit lines the requests so far wrote (the log is written every FLUSH_S: waited for)."""
    time.sleep(FLUSH_S + 0.3)
    return len(audit_lines(gateway))


def audit_lines(gateway: GatewayProcess) -> list[dict[str, Any]]:
    path = gateway.log_path.parent / "audit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def audited(gateway: GatewayProcess, key_id: str, after: int) -> dict[str, Any]:
    """The first audit line of ``key_id`` beyond the first ``after`` lines (the log is written every half second)."""
    deadline = time.monotonic() + 10
    while True:
        found = [line for line in audit_lines(gateway)[after:] if line["key_id"] == key_id]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no audit line for {key_id!r}"
        time.sleep(0.1)


def chat(key: str, gateway: GatewayProcess, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2, **fields}
    return httpx.post(f"{gateway.base_url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=300)  # fmt: skip


def test_the_nth_request_passes_and_the_next_is_a_429_with_openai_s_headers(gateway: GatewayProcess) -> None:
    first, second, third = (chat(TIGHT, gateway) for _ in range(3))  # 2 per minute: one refills in 30 s
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert [first.headers["x-ratelimit-remaining-requests"], second.headers["x-ratelimit-remaining-requests"]] == [
        "1",
        "0",
    ]
    assert first.headers["x-ratelimit-reset-requests"].endswith("s")
    assert third.status_code == 429
    error = third.json()["error"]
    assert error["code"] == "rate_limit_exceeded"
    assert error["type"] == "requests"
    assert "'tight'" in error["message"]
    assert "requests per minute" in error["message"]
    assert 1 <= int(third.headers["retry-after"]) <= 30
    assert third.headers["x-ratelimit-remaining-requests"] == "0"
    # The SDK reads it as its RateLimitError.
    with pytest.raises(openai.RateLimitError):
        client(gateway, TIGHT).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    # Another key is not limited by this one's, and a key without limits gets no rate-limit headers.
    other = chat(TEAM, gateway)
    assert other.status_code == 200
    assert "x-ratelimit-limit-requests" not in other.headers


def test_a_stream_that_runs_out_of_output_tokens_ends_with_an_error_event(gateway: GatewayProcess) -> None:
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Count"}], "max_tokens": 24, "temperature": 0}
    whole = client(gateway, TEAM).chat.completions.create(**ask)  # type: ignore[call-overload]
    assert whole.usage.completion_tokens > OUTPUT_BUDGET + 2  # (greedy: the same every run)
    pieces: list[str] = []

    def read_stream() -> None:
        for chunk in client(gateway, STREAMER).chat.completions.create(stream=True, **ask):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)

    seen = audit_count(gateway)
    with pytest.raises(openai.APIError, match="output tokens per minute of key 'streamer' ran out"):
        read_stream()
    assert pieces
    assert whole.choices[0].message.content.startswith("".join(pieces))
    counted = audited(gateway, "streamer", seen)
    assert 1 <= counted["output_tokens"] <= OUTPUT_BUDGET  # cut between two pieces, never past the budget
    # A unary answer is admitted while any token is left and may take the bucket below zero; the next request then
    # waits for it to refill.
    assert chat(STREAMER, gateway, max_tokens=3).status_code == 200
    again = chat(STREAMER, gateway)
    assert again.status_code == 429
    assert again.json()["error"]["type"] == "tokens"
    assert again.headers["x-ratelimit-remaining-tokens"] == "0"
    assert again.headers["x-ratelimit-limit-output-tokens"] == str(OUTPUT_BUDGET)


def test_concurrent_requests_over_a_key_s_limit_on_a_model_are_refused(gateway: GatewayProcess) -> None:
    # A long greedy answer (the tiny model never says EOS on this prompt: checked first) keeps the first request
    # running while a second one of the same key is sent. On a fast machine the whole stream may end before the second
    # request is admitted, which proves nothing either way: such a try is repeated. A try counts once the stream was
    # still open when the second answer came back, and then that answer must be the 429.
    long = {"model": MODEL, "messages": [{"role": "user", "content": "Go"}], "max_tokens": 160, "temperature": 0}
    assert chat(TEAM, gateway, **long).json()["usage"]["completion_tokens"] == 160
    for _ in range(10):
        started = threading.Event()
        outcome: dict[str, Any] = {}

        def long_stream(started: threading.Event, outcome: dict[str, Any]) -> None:
            with httpx.stream("POST", f"{gateway.base_url}/chat/completions", json={**long, "stream": True},
                              timeout=300, headers={"Authorization": f"Bearer {SINGLE}"}) as response:  # fmt: skip
                outcome["status"] = response.status_code
                for _ in response.iter_lines():
                    started.set()
            outcome["ended"] = time.monotonic()

        thread = threading.Thread(target=long_stream, args=(started, outcome))
        thread.start()
        try:
            assert started.wait(120)
            second = chat(SINGLE, gateway)
            answered = time.monotonic()
        finally:
            thread.join(300)
        assert outcome["status"] == 200
        if outcome["ended"] > answered:
            break
    else:
        pytest.fail("the long stream never outlasted a second request in 10 tries")
    assert second.status_code == 429, second.text
    assert "concurrent requests" in second.json()["error"]["message"]
    assert chat(SINGLE, gateway).status_code == 200  # the first one finished: its place is free


def test_the_ledger_equals_the_answers_usage(gateway: GatewayProcess) -> None:
    api = client(gateway, TEAM)
    expected = {"requests": 0, "input_tokens": 0, "output_tokens": 0}

    def add(prompt: int, completion: int) -> None:
        expected["requests"] += 1
        expected["input_tokens"] += prompt
        expected["output_tokens"] += completion

    before = ledger_totals(gateway, "team-a")
    answer = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "One"}], max_tokens=5)
    assert answer.usage is not None
    add(answer.usage.prompt_tokens, answer.usage.completion_tokens)
    usage = None
    for chunk in api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Two"}], max_tokens=7,
                                             stream=True, stream_options={"include_usage": True}):  # fmt: skip
        usage = chunk.usage or usage
    assert usage is not None
    add(usage.prompt_tokens, usage.completion_tokens)
    streamed_without_usage = list(
        api.completions.create(model=MODEL, prompt="Three", max_tokens=4, temperature=0, stream=True)
    )  # the client did not ask for usage, and gets none: the gateway took its comments out
    assert all(c.usage is None for c in streamed_without_usage)
    unary = api.completions.create(model=MODEL, prompt="Three", max_tokens=4, temperature=0)
    assert unary.usage is not None
    add(unary.usage.prompt_tokens, unary.usage.completion_tokens)
    add(unary.usage.prompt_tokens, unary.usage.completion_tokens)  # the streamed one: the same greedy answer
    responses = api.responses.create(model=MODEL, input="Four", max_output_tokens=3)
    assert responses.usage is not None
    add(responses.usage.input_tokens, responses.usage.output_tokens)
    after = ledger_totals(gateway, "team-a")
    assert {k: after[k] - before[k] for k in expected} == expected
    assert after["predictor_seconds"] > before["predictor_seconds"]

    # Prometheus counters by key id (the admin key may read /metrics: it names every model).
    metrics = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert (
        f'universal_gateway_usage_output_tokens_total{{key_id="team-a",model="{MODEL}"}} {after["output_tokens"]}'
        in metrics
    )

    # A key reads its own usage only; the admin key any key's, as JSON or CSV.
    own = httpx.get(f"{gateway.base_url}/usage", headers={"Authorization": f"Bearer {TEAM}"}).json()["data"]
    assert {row["key_id"] for row in own} == {"team-a"}
    other = httpx.get(f"{gateway.base_url}/usage?key=tight", headers={"Authorization": f"Bearer {TEAM}"})
    assert other.status_code == 403
    table = httpx.get(f"{gateway.base_url}/usage?format=csv&key=team-a", headers={"Authorization": f"Bearer {ADMIN}"})
    assert table.headers["content-type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(table.text)))
    assert sum(int(r["output_tokens"]) for r in rows) == after["output_tokens"]


def ledger_totals(gateway: GatewayProcess, key_id: str) -> dict[str, float]:
    rows = httpx.get(f"{gateway.base_url}/usage?key={key_id}", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    totals: dict[str, float] = {"requests": 0, "input_tokens": 0, "output_tokens": 0, "predictor_seconds": 0.0}
    for row in rows["data"]:
        for name in totals:
            totals[name] += row[name]
    return totals


def test_every_request_has_one_audit_line_without_secrets_or_bodies(gateway: GatewayProcess) -> None:
    marker = "a sentence only the audited request holds"
    seen = audit_count(gateway)
    answer = chat(TEAM, gateway, messages=[{"role": "user", "content": marker}])
    assert answer.status_code == 200
    line = audited(gateway, "team-a", seen)
    assert line["key_id"] == "team-a"
    assert line["owner"] == "search"
    assert line["model"] == MODEL
    assert line["route"] == "/v1/chat/completions"
    assert line["status"] == 200
    assert line["output_tokens"] == answer.json()["usage"]["completion_tokens"]
    text = (gateway.log_path.parent / "audit.jsonl").read_text() + gateway.log()
    assert marker not in text
    assert all(secret not in text for secret in (ADMIN, TEAM, TIGHT, STREAMER, SINGLE))


def test_a_changed_keys_file_is_read_without_a_restart(gateway: GatewayProcess, keys_file: Path) -> None:
    added = "sk-added-0123456789abcdef"
    assert chat(added, gateway).status_code == 401
    document = keys_document()
    document["keys"].append({"id": "added", "sha256": sha(added)})
    keys_file.write_text(yaml.safe_dump(document, sort_keys=False))
    deadline = time.monotonic() + 30
    while chat(added, gateway).status_code != 200:
        assert time.monotonic() < deadline, "the new key was not taken within 30 s"
        time.sleep(0.5)
    # An invalid file keeps the keys there were, and says so in the log.
    keys_file.write_text("keys:\n- id: broken\n")
    time.sleep(3)
    assert chat(added, gateway).status_code == 200
    assert "kept the API keys there were" in gateway.log()
    keys_file.write_text(yaml.safe_dump(keys_document(), sort_keys=False))


def test_keys_create_stores_the_secret_hashed(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    command = [sys.executable, "-m", "universal_gateway.cli", "keys", "create", "--file", str(path), "--id", "billing",
               "--owner", "finance", "--models", f"{MODEL},{MODEL}:support", "--requests-per-minute", "60"]  # fmt: skip
    made = subprocess.run(command, capture_output=True, text=True, check=True)
    secret = made.stdout.strip()
    assert secret.startswith("sk-ur-")
    assert len(secret) > 40
    stored = path.read_text()
    assert secret not in stored
    [entry] = yaml.safe_load(stored)["keys"]
    assert entry == {"id": "billing", "sha256": sha(secret), "owner": "finance",
                     "models": [MODEL, f"{MODEL}:support"], "limits": {"requestsPerMinute": 60}}  # fmt: skip
    assert path.stat().st_mode & 0o077 == 0
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode != 0
    assert "'billing' is taken" in again.stderr
    assert again.stderr.count("\n") == 1
