"""The compiled-schema cache is keyed by what compiling needs and bounded by bytes: 90 distinct schemas
with 8 MiB descriptions took the predictor's RSS from 519 to 2,096 MB (an LRU of 512 entries keyed by the
whole schema text, each holding the schema twice)."""

from __future__ import annotations

import time
from typing import Any

from tests.predictors.harness import PredictorProcess
from tests.security.memory import rss_mb
from tests.security.predictor_fixtures import *  # noqa: F403  (the predictor fixtures)
from universal_predictors.generation.constraints import GrammarCache, grammar_relevant

#: What RSS may stay above the warmed-up idle once the requests end.
RSS_SLACK_MB = 80
DESCRIPTION = "x" * (4 * 2**20)


def described(index: int, description: str = DESCRIPTION) -> dict[str, Any]:
    """A distinct schema (its enum) carrying two large descriptions (8 MiB of a 16 MiB body limit)."""
    return {"type": "object", "title": "t", "description": description,
            "properties": {"a": {"enum": [index], "description": description, "examples": ["e"]}},
            "required": ["a"]}  # fmt: skip


def test_annotations_do_not_key_the_cache_but_a_property_named_like_one_does() -> None:
    assert grammar_relevant(described(1)) == grammar_relevant(described(1, "other words"))
    named = {"type": "object", "properties": {"description": {"type": "string", "title": "t"}}}
    assert grammar_relevant(named) == {"type": "object", "properties": {"description": {"type": "string"}}}
    assert grammar_relevant({"enum": [{"title": "kept: a value"}]}) == {"enum": [{"title": "kept: a value"}]}


def test_the_grammar_cache_holds_no_more_bytes_than_its_budget() -> None:
    cache = GrammarCache(max_bytes=2**20)
    for index in range(100):
        cache.put(f"schema {index}", "g" * 50_000)
    assert cache.bytes <= 2**20
    assert 0 < len(cache) < 100
    assert cache.get("schema 99") is not None  # the most recent stay
    assert cache.get("schema 0") is None


def test_rss_returns_near_idle_after_many_schemas_with_huge_descriptions(chat_predictor: PredictorProcess) -> None:
    def request(schema: dict[str, Any]) -> dict[str, Any]:
        return {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}  # fmt: skip

    pid = chat_predictor.process.pid
    with chat_predictor.client() as client:
        assert client.post("/openai/v1/chat/completions", json=request(described(-1, "warm"))).status_code == 200
        idle = rss_mb(pid)
        for index in range(20):
            response = client.post("/openai/v1/chat/completions", json=request(described(index)))
            assert response.status_code == 200, response.text[:300]
    deadline = time.monotonic() + 10
    while rss_mb(pid) > idle + RSS_SLACK_MB and time.monotonic() < deadline:
        time.sleep(0.2)  # the predictor trims its heap once idle: poll for it
    assert rss_mb(pid) <= idle + RSS_SLACK_MB, f"RSS {rss_mb(pid)} MB, idle {idle} MB"
