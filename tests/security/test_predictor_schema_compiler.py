"""llguidance's compiler runs in a process of its own (universal_predictors.generation.schema_compiler): a schema
that kills it costs that request a 400, not the model. The kill here is real: the compiler's memory cap lowered
to 16 MiB through its environment variable, an allocation fails in llguidance's Rust code and it aborts
(SIGABRT), as any native crash in it would; before, the compile ran in the predictor itself."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.predictors.harness import PredictorProcess, running_predictor
from tests.security.predictor_fixtures import *  # noqa: F403  (the predictor fixtures)
from tests.security.predictor_fixtures import openai_error
from universal_predictors.catalog import Backend, Task
from universal_predictors.config import PredictorConfig
from universal_predictors.generation.constraints import MAX_SCHEMA_BYTES
from universal_predictors.generation.schema_compiler import MEMORY_MB_ENV

#: 900 alternatives of five integer properties: within the size bound, about 30 MiB to compile.
HEAVY: dict[str, Any] = {
    "anyOf": [
        {"type": "object", "properties": {f"k{j}_{i}": {"type": "integer", "minimum": i} for j in range(5)}}
        for i in range(900)
    ]
}
LIGHT: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def tight_compiler(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(model_name="tiny-llama", task=Task.GENERATE, backend=Backend.TRANSFORMERS,
                             source=str(tiny_llama_dir))  # fmt: skip
    env = {MEMORY_MB_ENV: "16"}
    with running_predictor(config, tmp_path_factory.mktemp("schema-compiler"), env=env) as predictor:
        yield predictor


def request(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 12,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }


def test_the_heavy_schema_is_within_the_size_bound() -> None:
    assert len(json.dumps(HEAVY)) < MAX_SCHEMA_BYTES


def test_a_schema_that_kills_the_compiler_is_a_400_and_the_model_serves_on(tight_compiler: PredictorProcess) -> None:
    with tight_compiler.client() as client:
        error = openai_error(client.post("/openai/v1/chat/completions", json=request(HEAVY)), 400)
        assert error["param"] == "response_format"
        assert "too complex to compile" in error["message"]
        assert "SIGABRT" in error["message"]
        assert tight_compiler.process.poll() is None

        # A new compiler process takes the next schema; the output follows it.
        light = client.post("/openai/v1/chat/completions", json=request(LIGHT))
        assert light.status_code == 200, light.text
        content = light.json()["choices"][0]["message"]["content"]
        if light.json()["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(content)["a"], int)
        else:
            assert content.startswith('{"a":')

        # The same schema again is refused from memory: no second compiler is lost to it.
        again = openai_error(client.post("/openai/v1/chat/completions", json=request(HEAVY)), 400)
        assert again["message"] == error["message"]
    aborts = tight_compiler.log_tail(400).count("memory allocation of")
    assert aborts >= 1
    assert tight_compiler.process.poll() is None


def test_a_bound_past_every_integer_is_refused_naming_what_cannot_be_enforced(tight_compiler: PredictorProcess) -> None:
    # Python's json writes the integer whole; handed over as a Python object it could not even be serialised
    # for llguidance before ("Value is not JSON serializable").
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -(10**40)}}, "required": ["n"]}
    with tight_compiler.client() as client:
        error = openai_error(client.post("/openai/v1/chat/completions", json=request(schema)), 400)
    assert error["param"] == "response_format"
    assert "cannot be enforced" in error["message"]
