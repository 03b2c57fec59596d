"""Long texts on real encoder predictors (embed, rerank, classify, NER): what a text may cost is bounded before it
is paid. Issue 31, item 10: embeddings tokenised the whole input before the length check (a 2 MiB input took
1.17 GB, three 15 MiB ones 21.5 GB and an OOM kill). Now a text over the limit's characters is refused unread,
or cut to them when the request asks for truncation, and the tokenizer hands back one token past the limit at
most. Memory is the predictor process's own peak RSS (``VmHWM``, reset through ``clear_refs`` before each
request). The models: the tiny random BERTs of the limit tests, whose tokenizer says 48 tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.predictors.harness import PredictorProcess, running_predictor
from tests.predictors.tiny_bert import LIMITS, Head, build_limit_model
from tests.security.predictor_fixtures import openai_error
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig

LIMIT = LIMITS["bert"]
#: About 2 MiB of one-token words: 420,000 tokens (1.2 GB to tokenise whole, before the fix).
LONG_TEXT = "john " * 420_000
#: What one request of LONG_TEXT may add to the predictor's peak RSS (the body and its parse are a few MiB).
PEAK_BUDGET = 64 * 2**20

SERVED: dict[str, tuple[Task, Head, dict[str, str]]] = {
    "embed": (Task.EMBED, "embed", {}),
    "rerank-cross": (Task.RERANK, "cross-encoder", {}),
    "rerank-bi": (Task.RERANK, "embed", {"mode": "bi-encoder"}),
    "classify": (Task.CLASSIFY, "classify", {}),
    "ner": (Task.NER, "ner", {}),
}


@pytest.fixture(scope="module")
def predictor_for(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], PredictorProcess]]:
    """The predictor of a served task, started on first use, stopped with the module."""
    root = tmp_path_factory.mktemp("long-text-models")
    with contextlib.ExitStack() as stack:
        started: dict[str, PredictorProcess] = {}

        def get(served: str) -> PredictorProcess:
            if served not in started:
                task, head, engine_args = SERVED[served]
                source = root / head
                if not source.exists():
                    build_limit_model(source, "bert", head)
                config = PredictorConfig(model_name=served, task=task, source=str(source),
                                         engine_args={"dtype": "float32", **engine_args})  # fmt: skip
                started[served] = stack.enter_context(running_predictor(config, root / f"logs-{served}"))
            return started[served]

        yield get


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def post_measured(predictor: PredictorProcess, path: str, body: dict[str, Any]) -> tuple[httpx.Response, int]:
    """The answer to ``body`` and how far above its RSS before it the predictor's peak RSS rose meanwhile."""
    pid = predictor.process.pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the RSS now
    before = status_kib(pid, "VmRSS")
    with predictor.client(timeout=300) as client:
        response = client.post(path, json=body)
    return response, (status_kib(pid, "VmHWM") - before) * 1024


def assert_within_budget(rise: int) -> None:
    assert rise < PEAK_BUDGET, f"peak RSS rose {rise / 2**20:.0f} MiB, over {PEAK_BUDGET / 2**20:.0f} MiB"


#: served task -> (route, body around the long text, the param the refusal names, body asking to truncate).
REQUESTS: dict[str, tuple[str, dict[str, Any], str, dict[str, Any] | None]] = {
    "embed": ("/openai/v1/embeddings", {"model": "embed", "input": ["john", LONG_TEXT]}, "input[1]",
              {"model": "embed", "input": ["john", LONG_TEXT], "truncate": True}),
    "classify": ("/v1/classify", {"texts": ["john", LONG_TEXT]}, "texts[1]",
                 {"texts": ["john", LONG_TEXT], "truncate": True}),
    "ner": ("/v1/ner", {"texts": ["john", LONG_TEXT]}, "texts[1]", {"texts": ["john", LONG_TEXT], "truncate": True}),
    "rerank-cross": ("/v1/rerank", {"query": LONG_TEXT, "documents": ["paris"]}, "query",
                     {"query": "john", "documents": ["paris", LONG_TEXT]}),
    "rerank-bi": ("/v1/rerank", {"query": LONG_TEXT, "documents": ["paris"]}, "query",
                  {"query": "john", "documents": ["paris", LONG_TEXT]}),
}  # fmt: skip


@pytest.mark.parametrize("served", list(REQUESTS))
def test_a_text_too_long_for_the_limit_is_refused_before_it_is_tokenised(
    predictor_for: Callable[[str], PredictorProcess], served: str
) -> None:
    path, body, param, _ = REQUESTS[served]
    response, rise = post_measured(predictor_for(served), path, body)
    assert_within_budget(rise)
    error = openai_error(response, 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert f"{param} is {len(LONG_TEXT)} characters long" in error["message"]
    assert f"limit of {LIMIT - (4 if served == 'rerank-cross' else 0)} tokens" in error["message"]
    assert "Shorten" in error["message"]


@pytest.mark.parametrize("served", list(REQUESTS))
def test_a_long_text_sent_to_be_truncated_is_cut_to_the_limit_within_the_budget(
    predictor_for: Callable[[str], PredictorProcess], served: str
) -> None:
    path, _, _, body = REQUESTS[served]
    assert body is not None
    response, rise = post_measured(predictor_for(served), path, body)
    assert response.status_code == 200, response.text
    tokens = response.json()["usage"]["prompt_tokens"]
    # The short texts: [CLS] john [SEP] (3 tokens), the pair [CLS] john [SEP] paris [SEP] (5), john and paris (6).
    assert tokens == LIMIT + {"rerank-cross": 5, "rerank-bi": 6}.get(served, 3)
    if served in ("classify", "ner"):
        assert [item["truncated"] for item in response.json()["data"]] == [False, True]
    assert_within_budget(rise)


def test_a_text_just_over_the_limit_still_gets_its_exact_token_count(
    predictor_for: Callable[[str], PredictorProcess],
) -> None:
    """The cap on what the tokenizer hands back does not change the error for an ordinary over-long text."""
    text = " ".join(["john"] * (LIMIT + 10))
    with predictor_for("classify").client() as client:
        error = openai_error(client.post("/v1/classify", json={"texts": [text]}), 400)
    assert error["message"].startswith(f"texts[0] is {LIMIT + 12} tokens long, over this model's limit of {LIMIT}")
