"""Hostile request bodies on real predictor processes: every one a 4xx in OpenAI's error shape, never a 500.

Bodies of 64 KiB or more skip the gateway's own JSON parse and reach the predictor as sent, so each hostile
body here is padded past that size. The predictors: anomaly (no model), embeddings (all-MiniLM-L6-v2 from its
PyPI package) and chat (the tiny random Llama the generation suite builds, on the transformers engine).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.predictors.harness import PredictorProcess
from tests.security.predictor_fixtures import *  # noqa: F403  (the predictor fixtures)
from tests.security.predictor_fixtures import openai_error

#: Past the gateway's 64 KiB parse threshold: what reaches a predictor unparsed.
PADDING = "x" * (70 * 1024)


def padded(body: bytes) -> bytes:
    """``body`` (a JSON object) with an ignored ``pad`` field that takes it past 64 KiB."""
    assert body.startswith(b"{")
    return b'{"pad": "' + PADDING.encode() + b'", ' + body[1:]


#: name -> a JSON object body whose hostile part fails at parsing, whichever route it is sent to.
HOSTILE_BODIES = {
    "5000-digit integer": b'{"input": ' + b"9" * 5000 + b"}",
    "50000-deep nesting": b'{"input": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    "lone surrogate": b'{"input": "\\ud800", "messages": [{"role": "user", "content": "\\ud800"}], '
    b'"detector": "d", "data": [["\\udfff"]]}',
}

ROUTES = {
    "anomaly": "/v1/anomaly/score",
    "embed": "/openai/v1/embeddings",
    "chat": "/openai/v1/chat/completions",
}


def send(predictor: PredictorProcess, path: str, content: bytes) -> httpx.Response:
    with predictor.client() as client:
        return client.post(path, content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("hostile", list(HOSTILE_BODIES))
@pytest.mark.parametrize("task", list(ROUTES))
def test_hostile_json_bodies_are_400s_whatever_the_route(
    task: str, hostile: str, request: pytest.FixtureRequest
) -> None:
    predictor: PredictorProcess = request.getfixturevalue(f"{task}_predictor")
    error = openai_error(send(predictor, ROUTES[task], padded(HOSTILE_BODIES[hostile])), 400)
    assert error["code"] == "invalid_json"
    assert error["message"].startswith("The request body is not valid JSON")


@pytest.mark.parametrize("hostile", list(HOSTILE_BODIES))
def test_hostile_json_rows_in_kserve_v2_bytes_are_400s(anomaly_predictor: PredictorProcess, hostile: str) -> None:
    """v2 BYTES tensors carry each anomaly row as JSON text, parsed by the predictor itself."""
    row = HOSTILE_BODIES[hostile].decode()
    body = {"inputs": [{"name": "rows", "shape": [1], "datatype": "BYTES", "data": [row]}]}
    with anomaly_predictor.client() as client:
        client.post("/v1/anomaly/fit", json={"detector": "only", "data": [[float(i), 1.0] for i in range(20)]})
        error = openai_error(client.post("/v2/models/sensors/infer", json=body), 400)
    assert error["code"] == "invalid_json"
    assert error["param"] == "instances[0]"


def test_scoring_values_near_the_float_limit_is_a_400_naming_the_value(anomaly_predictor: PredictorProcess) -> None:
    rows = [[0.001 * i, 0.002 * i] for i in range(20)]
    with anomaly_predictor.client() as client:
        assert client.post("/v1/anomaly/fit", json={"detector": "small", "data": rows}).status_code == 200
        response = client.post("/v1/anomaly/score", json={"detector": "small", "data": [[1e308, -1e308]]})
    error = openai_error(response, 400)
    assert error["param"] == "data[0][0]"
    assert "too large" in error["message"]


def test_a_seed_beyond_64_bits_is_a_400_naming_seed_and_the_range(chat_predictor: PredictorProcess) -> None:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": 2**70}
    with chat_predictor.client() as client:
        error = openai_error(client.post("/openai/v1/chat/completions", json=body), 400)
    assert error["param"] == "seed"
    assert str(2**63 - 1) in error["message"]


@pytest.mark.parametrize(
    "schema",
    [
        {"$ref": "#"},
        {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
        {"$ref": "#/$defs/x", "$defs": {"x": {"$ref": "#/$defs/x"}}},
    ],
    ids=["root", "required-property", "defs-loop"],
)
def test_a_schema_that_refers_only_to_itself_is_a_400(chat_predictor: PredictorProcess, schema: Any) -> None:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}},
    }
    with chat_predictor.client() as client:
        error = openai_error(client.post("/openai/v1/chat/completions", json=body), 400)
    assert error["param"] == "response_format"
    assert "$ref" in error["message"]
