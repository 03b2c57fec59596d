"""JSON schemas (``response_format``, forced tools) are bounded before llguidance compiles them: a ``$ref``
chain recurses natively in llguidance, and 4,000 ``$defs`` each referring to the previous (138 KiB) killed
the predictor with SIGSEGV (three in a row marked the model failed). Checking them is linear and off the
event loop: 6,000 unreferenced chained ``$defs`` took 29 s of the loop in a quadratic fixed point."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from tests.predictors.harness import PredictorProcess
from tests.security.predictor_fixtures import *  # noqa: F403  (the predictor fixtures)
from tests.security.predictor_fixtures import openai_error
from universal_predictors.errors import InvalidRequest
from universal_predictors.generation import constraints
from universal_predictors.generation.constraints import MAX_SCHEMA_DEPTH
from universal_predictors.generation.planning import RequestPlanner
from universal_predictors.generation.protocol import ChatCompletionRequest
from universal_predictors.generation.service import GenerationService


def ref_chain(length: int) -> dict[str, Any]:
    """``$defs`` d0..d{length-1}, each referring to the previous; the root refers to the last."""
    defs: dict[str, Any] = {"d0": {"type": "string"}}
    for i in range(1, length):
        defs[f"d{i}"] = {"$ref": f"#/$defs/d{i - 1}"}
    return {"$ref": f"#/$defs/d{length - 1}", "$defs": defs}


def schema_request(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "chain", "schema": schema}},
    }


def test_a_4000_long_ref_chain_is_a_400_naming_the_depth_bound_and_the_model_lives(
    chat_predictor: PredictorProcess,
) -> None:
    with chat_predictor.client() as client:
        error = openai_error(client.post("/openai/v1/chat/completions", json=schema_request(ref_chain(4000))), 400)
        assert error["param"] == "response_format"
        assert f"at most {MAX_SCHEMA_DEPTH}" in error["message"]
        assert "$ref" in error["message"]
        assert chat_predictor.process.poll() is None
        short = client.post("/openai/v1/chat/completions", json=schema_request(ref_chain(8)))
    assert short.status_code == 200, short.text


def test_a_chain_just_over_the_depth_bound_is_refused_and_one_at_it_is_served(
    chat_predictor: PredictorProcess,
) -> None:
    # ref_chain(n) is n + 2 levels deep: the root, the $defs map, then the chain.
    with chat_predictor.client() as client:
        over = client.post("/openai/v1/chat/completions", json=schema_request(ref_chain(MAX_SCHEMA_DEPTH - 1)))
        at = client.post("/openai/v1/chat/completions", json=schema_request(ref_chain(MAX_SCHEMA_DEPTH - 2)))
    assert "nests 129 levels deep" in openai_error(over, 400)["message"]
    assert at.status_code == 200, at.text


#: Every chain shape at the depth bound, compiled on a thread with 1 MiB of stack (an eighth of what
#: Python's threads get): the margin that makes the bound safe. A crash is the child's SIGSEGV, not ours.
_AT_THE_BOUND = textwrap.dedent(
    """
    import json, threading
    from universal_predictors.generation import constraints as c

    def chain(make, n):
        defs = {"d0": {"type": "string"}}
        for i in range(1, n):
            defs[f"d{i}"] = make(f"#/$defs/d{i - 1}")
        return {"$ref": f"#/$defs/d{n - 1}", "$defs": defs}

    shapes = {
        "ref": lambda r: {"$ref": r},
        "items": lambda r: {"type": "array", "items": {"$ref": r}},
        "anyOf": lambda r: {"anyOf": [{"$ref": r}, {"type": "null"}]},
        "allOf": lambda r: {"allOf": [{"$ref": r}, {"type": "string"}]},
        "properties": lambda r: {"type": "object", "properties": {"a": {"$ref": r}}, "required": ["a"]},
    }
    compiled = []

    def run():
        for name, make in shapes.items():
            n = 1
            while c.schema_depth(chain(make, n + 1)) <= c.MAX_SCHEMA_DEPTH:
                n += 1
            assert c.schema_depth(chain(make, n)) >= c.MAX_SCHEMA_DEPTH - 2, name
            c.check_schema(chain(make, n))
            compiled.append(name)

    threading.stack_size(1024 * 1024)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    print(",".join(compiled))
    """
)


def test_every_ref_chain_shape_at_the_depth_bound_compiles_within_a_1_mib_stack() -> None:
    done = subprocess.run([sys.executable, "-c", _AT_THE_BOUND], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ref,items,anyOf,allOf,properties"


def test_the_finiteness_check_resolves_each_ref_once_whatever_the_order_of_the_defs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Linear, not a pass over every node per node made finite: ``$defs`` listed so that each refers to one
    visited later (the quadratic fixed point's worst order) cost 120 resolutions per ``$ref``."""
    resolved = 0
    resolve = constraints._resolve

    def counting(root: Any, ref: str) -> Any:
        nonlocal resolved
        resolved += 1
        return resolve(root, ref)

    monkeypatch.setattr(constraints, "_resolve", counting)
    chain = ref_chain(120)
    constraints._check_finite({"type": "object", "$defs": chain["$defs"]})
    assert resolved <= 119


def test_the_schema_check_runs_on_a_worker_thread_not_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[threading.Thread] = []

    def record(self: RequestPlanner, constraint: Any) -> None:
        threads.append(threading.current_thread())
        raise InvalidRequest("checked", param=constraint.param)

    monkeypatch.setattr(RequestPlanner, "check_constraint", record)
    service = GenerationService(SimpleNamespace(), "tiny-llama")  # type: ignore[arg-type]  # never reached
    body = ChatCompletionRequest.model_validate(schema_request(ref_chain(8)))
    with pytest.raises(InvalidRequest):
        asyncio.run(service.chat(None, body))  # type: ignore[arg-type]
    assert len(threads) == 1
    assert threads[0] is not threading.main_thread()
