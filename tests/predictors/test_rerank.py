"""``task: rerank``: a tiny random cross-encoder built here, and MiniLM as a bi-encoder fallback."""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.predictors.harness import PredictorProcess

#: The session fixtures (extra predictor processes, in-process reference models) live there.
pytest_plugins = ["tests.predictors.fixtures_encoders"]

QUERY = "what is the capital of france"
DOCUMENTS = [
    "the weather today is rain",
    "paris is the capital of france",
    "the cat sat on the mat",
    "berlin is the capital of germany",
    "a dog runs quickly",
]


def rerank(predictor: PredictorProcess, body: dict[str, Any], path: str = "/openai/v1/rerank") -> httpx.Response:
    with predictor.client() as client:
        return client.post(path, json=body)


def in_process_scores(model_dir: Path, query: str, documents: list[str]) -> list[float]:
    """The pairs scored in this process by the same saved model: the reference."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True).eval()
    features = tokenizer([query] * len(documents), documents, padding=True, truncation="only_second",
                         max_length=64, return_tensors="pt")  # fmt: skip
    with torch.inference_mode():
        return [float(x) for x in torch.sigmoid(model(**features).logits[:, 0])]


def test_bi_encoder_fallback_puts_the_relevant_document_first(bi_encoder_predictor: PredictorProcess) -> None:
    documents = [
        "The Eiffel Tower was finished in 1889.",
        "Paris is the capital and largest city of France.",
        "Bananas are rich in potassium.",
        "Berlin is the capital of Germany.",
    ]
    response = rerank(bi_encoder_predictor, {"query": "What is the capital of France?", "documents": documents})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    assert results[0]["index"] == 1
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    assert "document" not in results[0]


def test_bi_encoder_scores_are_cosine_similarities_of_the_embeddings(
    bi_encoder_predictor: PredictorProcess, minilm_in_process: Any
) -> None:
    body = rerank(bi_encoder_predictor, {"query": QUERY, "documents": DOCUMENTS}).json()
    query, *docs = minilm_in_process.encode([QUERY, *DOCUMENTS])
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(float(docs[result["index"]] @ query), abs=1e-5)
    tokens = sum(len(x) for x in minilm_in_process.tokenizer([QUERY, *DOCUMENTS])["input_ids"])
    assert body["usage"]["total_tokens"] == tokens


def test_cross_encoder_scores_equal_the_model_in_process(
    cross_encoder_predictor: PredictorProcess, tiny_cross_encoder_dir: Path
) -> None:
    response = rerank(cross_encoder_predictor, {"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 200, response.text
    reference = in_process_scores(tiny_cross_encoder_dir, QUERY, DOCUMENTS)
    results = response.json()["results"]
    assert [r["index"] for r in results] == sorted(range(len(DOCUMENTS)), key=lambda i: -reference[i])
    for result in results:
        assert result["relevance_score"] == pytest.approx(reference[result["index"]], abs=1e-5)


def test_cross_encoder_batches_concurrent_requests_without_mixing_them(
    cross_encoder_predictor: PredictorProcess, tiny_cross_encoder_dir: Path, metric: Callable[..., float]
) -> None:
    queries = [f"{w} is the capital" for w in ("paris", "berlin", "what", "where", "who", "the", "a", "city")]
    requests = [(q, DOCUMENTS[i % 5 :] + DOCUMENTS[: i % 5]) for i, q in enumerate(queries * 2)]
    with cross_encoder_predictor.client() as client:
        before = client.get("/metrics").text

    def send(item: tuple[str, list[str]]) -> dict[int, float]:
        body = rerank(cross_encoder_predictor, {"query": item[0], "documents": item[1]}).json()
        return {r["index"]: r["relevance_score"] for r in body["results"]}

    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(pool.map(send, requests))
    for (query, documents), answer in zip(requests, answers, strict=True):
        reference = in_process_scores(tiny_cross_encoder_dir, query, documents)
        np.testing.assert_allclose([answer[i] for i in range(len(documents))], reference, atol=1e-5, rtol=0)
    with cross_encoder_predictor.client() as client:
        after = client.get("/metrics").text
    # max_batch_size=4: 80 pairs need at least 20 forward passes, each with more than one pair.
    name = "tiny-reranker"
    passes = metric(after, "universal_predictor_batch_size_count", model=name) - metric(
        before, "universal_predictor_batch_size_count", model=name
    )
    assert passes >= 20
    assert metric(after, "universal_predictor_batch_size_bucket", model=name, le="4.0") == metric(
        after, "universal_predictor_batch_size_count", model=name
    )


@pytest.mark.parametrize("path", ["/openai/v1/rerank", "/v1/rerank"])
@pytest.mark.parametrize("limit", ["top_n", "top_k"])
def test_top_n_or_top_k_keeps_the_best_and_return_documents_adds_text(
    cross_encoder_predictor: PredictorProcess, path: str, limit: str
) -> None:
    full = rerank(cross_encoder_predictor, {"query": QUERY, "documents": DOCUMENTS}, path).json()["results"]
    body = {"model": "tiny-reranker", "query": QUERY, "documents": [{"text": d} for d in DOCUMENTS],
            limit: 2, "return_documents": True}  # fmt: skip
    response = rerank(cross_encoder_predictor, body, path)
    assert response.status_code == 200
    top = response.json()["results"]
    assert [r["index"] for r in top] == [r["index"] for r in full[:2]]
    assert [r["document"]["text"] for r in top] == [DOCUMENTS[r["index"]] for r in top]


def test_long_documents_are_truncated_but_a_query_without_room_is_a_400(
    cross_encoder_predictor: PredictorProcess,
) -> None:
    long_document = "paris " * 500
    ok = rerank(cross_encoder_predictor, {"query": QUERY, "documents": [long_document, "rain"]})
    assert ok.status_code == 200
    assert ok.json()["usage"]["total_tokens"] <= 2 * 64
    too_long = rerank(cross_encoder_predictor, {"query": "paris " * 80, "documents": ["rain"]})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "query"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q"}, "documents"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": [5]}, "documents[0]"),
        ({"query": "q", "documents": ["a", {"txt": "b"}]}, "documents[1]"),
        ({"query": "q", "documents": ["a", ""]}, "documents[1]"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": "q", "documents": ["a"], "top_k": "many"}, "top_k"),
        ({"query": "q", "documents": ["a"], "return_documents": "perhaps"}, "return_documents"),
    ],
)
def test_malformed_bodies_are_400s_naming_the_field(
    cross_encoder_predictor: PredictorProcess, body: dict[str, Any], param: str
) -> None:
    response = rerank(cross_encoder_predictor, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert "Traceback" not in response.text


def test_conflicting_top_n_and_top_k_are_a_400(cross_encoder_predictor: PredictorProcess) -> None:
    response = rerank(cross_encoder_predictor, {"query": "q", "documents": ["a"], "top_n": 1, "top_k": 2})
    assert response.status_code == 400
    assert "top_k" in response.json()["error"]["message"]


def test_unknown_model_is_a_404(cross_encoder_predictor: PredictorProcess) -> None:
    response = rerank(cross_encoder_predictor, {"model": "other", "query": "q", "documents": ["a"]})
    assert response.status_code == 404


def test_models_list_reports_the_rerank_mode(
    cross_encoder_predictor: PredictorProcess, bi_encoder_predictor: PredictorProcess
) -> None:
    modes = {}
    for predictor in (cross_encoder_predictor, bi_encoder_predictor):
        with predictor.client() as client:
            [card] = client.get("/openai/v1/models").json()["data"]
        modes[card["id"]] = card["rerank_mode"]
        assert card["task"] == "rerank"
    assert modes == {"tiny-reranker": "cross-encoder", "minilm-reranker": "bi-encoder"}


def test_kserve_v1_and_v2_take_rerank_requests(cross_encoder_predictor: PredictorProcess) -> None:
    request = {"query": QUERY, "documents": DOCUMENTS, "top_n": 1}
    with cross_encoder_predictor.client() as client:
        v1 = client.post("/v1/models/tiny-reranker:predict", json={"instances": [request]})
        v2 = client.post(
            "/v2/models/tiny-reranker/infer",
            json={"inputs": [{"name": "request", "shape": [1], "datatype": "BYTES", "data": [json.dumps(request)]}]},
        )
        bad = client.post("/v1/models/tiny-reranker:predict", json={"instances": [{"query": "q"}]})
    expected = rerank(cross_encoder_predictor, request).json()["results"]
    assert v1.status_code == 200
    assert v1.json()["predictions"] == [expected]
    assert v2.status_code == 200
    assert json.loads(v2.json()["outputs"][0]["data"][0]) == expected
    assert bad.status_code == 400
    assert "documents" in bad.json()["error"]["message"]
