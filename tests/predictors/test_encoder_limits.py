"""The input limit of embed, rerank, classify and NER, on real predictor processes: an input at the limit is
served, one token over it is a 400 ``context_length_exceeded`` with the same wording on every task.

Two families of tiny random-weight models (``tiny_bert.build_limit_model``), each limited by another rule:
a BERT whose tokenizer says 48 tokens (below its 64 positions), and a RoBERTa with 66 positions, pad id 1
and no tokenizer limit. RoBERTa numbers positions from ``pad_token_id + 1``, so its table holds 64 tokens:
an input of 65 would index past it (a 500 on the CPU, a poisoned CUDA context on a GPU), not a 400.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.predictors.harness import PredictorProcess, running_predictor
from tests.predictors.tiny_bert import LIMITS, Family, Head, build_limit_model
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig
from universal_predictors.encoders.limits import TRUNCATE_REMEDY

FAMILIES: tuple[Family, ...] = ("bert", "roberta")
#: Special tokens around one text (``[CLS] ... [SEP]``, ``<s> ... </s>``) and around a pair.
SPECIALS = 2
PAIR_SPECIALS = {"bert": 3, "roberta": 4}
#: The one wording of the error: the input, its length, the limit, then what to do.
WORDING = re.compile(r"^(?P<param>\S+) is (?P<length>\d+) tokens long, over this model's limit of (?P<limit>\d+) "
                     r"tokens\. (?P<remedy>.+)$")  # fmt: skip


def text_of(tokens: int) -> str:
    """A text of exactly ``tokens`` tokens with the special tokens (each word of the vocabulary is one)."""
    return " ".join(["john"] * (tokens - SPECIALS))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Family, Head], Path]:
    root = tmp_path_factory.mktemp("limit-models")
    heads: tuple[Head, ...] = ("embed", "classify", "cross-encoder", "ner")
    return {(f, h): build_limit_model(root / f"{f}-{h}", f, h) for f in FAMILIES for h in heads}


SERVED: dict[str, tuple[Task, Head, dict[str, str]]] = {
    "embed": (Task.EMBED, "embed", {}),
    "rerank-cross": (Task.RERANK, "cross-encoder", {}),
    "rerank-bi": (Task.RERANK, "embed", {"mode": "bi-encoder"}),
    "classify": (Task.CLASSIFY, "classify", {}),
    "ner": (Task.NER, "ner", {}),
}


@pytest.fixture(scope="module")
def predictor_for(
    model_dirs: dict[tuple[Family, Head], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[Family, str], PredictorProcess]]:
    """The predictor process of a family and served task, started on first use, stopped with the module."""
    with contextlib.ExitStack() as stack:
        started: dict[tuple[Family, str], PredictorProcess] = {}

        def get(family: Family, served: str) -> PredictorProcess:
            if (family, served) not in started:
                task, head, engine_args = SERVED[served]
                config = PredictorConfig(model_name=f"{family}-{served}", task=task,
                                         source=str(model_dirs[(family, head)]),
                                         engine_args={"dtype": "float32", **engine_args})  # fmt: skip
                logs = tmp_path_factory.mktemp(f"limits-{family}-{served}")
                started[(family, served)] = stack.enter_context(running_predictor(config, logs))
            return started[(family, served)]

        yield get


def post(predictor: PredictorProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    with predictor.client() as client:
        return client.post(path, json=body)


def refusal(response: httpx.Response, param: str, length: int, limit: int) -> str:
    """Assert the one context_length_exceeded error; return its remedy."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "context_length_exceeded", param)
    found = WORDING.match(error["message"])
    assert found is not None, error["message"]
    assert (found["param"], int(found["length"]), int(found["limit"])) == (param, length, limit)
    return found["remedy"]


@pytest.mark.parametrize("family", FAMILIES)
def test_embed_serves_an_input_at_the_limit_and_refuses_one_token_more(
    predictor_for: Callable[[Family, str], PredictorProcess], family: Family
) -> None:
    predictor, limit = predictor_for(family, "embed"), LIMITS[family]
    at = post(predictor, "/openai/v1/embeddings", {"model": predictor.config.model_name, "input": text_of(limit)})
    assert at.status_code == 200, at.text
    assert at.json()["usage"]["prompt_tokens"] == limit
    over = post(predictor, "/openai/v1/embeddings", {"model": predictor.config.model_name,
                                                     "input": ["john", text_of(limit + 1)]})  # fmt: skip
    assert refusal(over, "input[1]", limit + 1, limit) == TRUNCATE_REMEDY
    cut = post(predictor, "/openai/v1/embeddings", {"model": predictor.config.model_name,
                                                    "input": text_of(limit + 20), "truncate": True})  # fmt: skip
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == limit
    card = httpx.get(f"{predictor.url}/openai/v1/models", timeout=10).json()["data"][0]
    assert card["max_input_tokens"] == limit


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task", ["classify", "ner"])
def test_classify_and_ner_serve_a_text_at_the_limit_and_refuse_one_token_more(
    predictor_for: Callable[[Family, str], PredictorProcess], family: Family, task: str
) -> None:
    predictor, limit = predictor_for(family, task), LIMITS[family]
    at = post(predictor, f"/v1/{task}", {"texts": [text_of(limit)]})
    assert at.status_code == 200, at.text
    assert at.json()["usage"]["prompt_tokens"] == limit
    over = post(predictor, f"/v1/{task}", {"texts": ["john", text_of(limit + 1)]})
    assert refusal(over, "texts[1]", limit + 1, limit) == TRUNCATE_REMEDY
    cut = post(predictor, f"/v1/{task}", {"texts": [text_of(limit + 20)], "truncate": True})
    assert cut.status_code == 200, cut.text
    assert (cut.json()["usage"]["prompt_tokens"], cut.json()["data"][0]["truncated"]) == (limit, True)
    card = httpx.get(f"{predictor.url}/openai/v1/models", timeout=10).json()["data"][0]
    assert card["max_input_tokens"] == limit


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cross_encoder_takes_a_query_that_leaves_one_token_per_document_and_refuses_one_more(
    predictor_for: Callable[[Family, str], PredictorProcess], family: Family
) -> None:
    predictor, limit = predictor_for(family, "rerank-cross"), LIMITS[family]
    room = limit - PAIR_SPECIALS[family] - 1  # query tokens that still leave a document one token
    long_document = " ".join(["paris"] * 200)
    at = post(predictor, "/v1/rerank", {"query": " ".join(["john"] * room), "documents": [long_document, "paris"]})
    assert at.status_code == 200, at.text
    assert at.json()["usage"]["prompt_tokens"] == 2 * limit  # both pairs cut (or filled) to the limit
    over = post(predictor, "/v1/rerank", {"query": " ".join(["john"] * (room + 1)), "documents": ["paris"]})
    remedy = refusal(over, "query", room + 1, room)
    assert "document" in remedy


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bi_encoder_takes_a_query_at_the_limit_and_cuts_long_documents(
    predictor_for: Callable[[Family, str], PredictorProcess], family: Family
) -> None:
    predictor, limit = predictor_for(family, "rerank-bi"), LIMITS[family]
    at = post(predictor, "/v1/rerank", {"query": text_of(limit), "documents": [text_of(limit + 30), "paris"]})
    assert at.status_code == 200, at.text
    assert at.json()["usage"]["prompt_tokens"] == limit + limit + 3
    over = post(predictor, "/v1/rerank", {"query": text_of(limit + 1), "documents": ["paris"]})
    refusal(over, "query", limit + 1, limit)
