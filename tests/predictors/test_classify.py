"""``task: classify`` on real predictor processes serving tiny random-weight BERTs built here.

Scores are pinned against the same model run in-process with transformers, so these tests check
correctness (softmax vs sigmoid, batching, padding, truncation), not just the response's shape.
"""

from __future__ import annotations

import functools
import gc
import json
import re
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.predictors.harness import PredictorProcess, running_predictor
from tests.predictors.tiny_bert import CLASSIFY_LABELS, MULTI_LABELS, build_sequence_classifier
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig
from universal_predictors.tasks.classify import ClassifyPredictor, score_function

TEXTS = [
    "I love this movie",
    "terrible bad movie!",
    "  why is the bank urgent?",
    "buy now, free money",
    "José lives in Paris",
    "",
]
#: Test predictors wait a little longer for company so concurrent requests reliably share batches.
ENGINE_ARGS = {"max_wait_ms": "20", "dtype": "float32"}


@pytest.fixture(scope="session")
def single_label_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sequence_classifier(tmp_path_factory.mktemp("bert-sentiment"))


@pytest.fixture(scope="session")
def multi_label_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sequence_classifier(tmp_path_factory.mktemp("bert-flags"), multi_label=True)


@pytest.fixture(scope="session")
def sentiment(single_label_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(
        model_name="sentiment", task=Task.CLASSIFY, source=str(single_label_dir), engine_args=ENGINE_ARGS
    )
    with running_predictor(config, tmp_path_factory.mktemp("classify-logs")) as predictor:
        yield predictor
        if predictor.url in _CLIENTS:
            _CLIENTS.pop(predictor.url).close()


@pytest.fixture(scope="session")
def flags(multi_label_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    config = PredictorConfig(
        model_name="flags", task=Task.CLASSIFY, source=str(multi_label_dir), engine_args=ENGINE_ARGS
    )
    with running_predictor(config, tmp_path_factory.mktemp("classify-logs")) as predictor:
        yield predictor
        if predictor.url in _CLIENTS:
            _CLIENTS.pop(predictor.url).close()


@functools.cache
def in_process(model_dir: Path) -> tuple[Any, Any]:
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    return AutoTokenizer.from_pretrained(model_dir), model


def reference_scores(model_dir: Path, text: str, function: str, truncate: bool = False) -> dict[str, float]:
    """The same model in-process, one text at a time, no padding: the ground truth."""
    tokenizer, model = in_process(model_dir)
    encoded = tokenizer(text, return_tensors="pt", truncation=truncate)
    with torch.no_grad():
        logits = model(**encoded).logits[0].double()
    scores = logits.softmax(-1) if function == "softmax" else logits.sigmoid()
    return {model.config.id2label[i]: float(s) for i, s in enumerate(scores)}


#: One HTTP client per predictor for the session (a new client per call costs a TLS context).
_CLIENTS: dict[str, httpx.Client] = {}


def http(predictor: PredictorProcess) -> httpx.Client:
    if predictor.url not in _CLIENTS:
        _CLIENTS[predictor.url] = predictor.client()
    return _CLIENTS[predictor.url]


def classify(predictor: PredictorProcess, **body: Any) -> dict[str, Any]:
    response = http(predictor).post("/v1/classify", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def batches_over_one(predictor: PredictorProcess) -> float:
    """How many forward passes held more than one text, from the batch-size histogram on /metrics."""
    with predictor.client() as client:
        text = client.get("/metrics").text
    name = predictor.config.model_name
    count = re.search(rf'universal_predictor_batch_size_count{{model="{name}"}} (\S+)', text)
    ones = re.search(rf'universal_predictor_batch_size_bucket{{le="1.0",model="{name}"}} (\S+)', text)
    assert count, text
    assert ones, text
    return float(count.group(1)) - float(ones.group(1))


def test_response_has_the_documented_shape_and_true_usage(sentiment: PredictorProcess, single_label_dir: Path) -> None:
    result = classify(sentiment, model="sentiment", texts=TEXTS)
    assert result["object"] == "list"
    assert result["model"] == "sentiment"
    assert [item["index"] for item in result["data"]] == list(range(len(TEXTS)))
    for item in result["data"]:
        assert isinstance(item["label"], str)
        assert isinstance(item["score"], float)
        assert [s["label"] for s in item["all_scores"]] != []
        assert sorted(s["label"] for s in item["all_scores"]) == sorted(CLASSIFY_LABELS)
        scores = [s["score"] for s in item["all_scores"]]
        assert scores == sorted(scores, reverse=True)
        assert item["all_scores"][0] == {"label": item["label"], "score": item["score"]}
        assert item["labels"] == [item["label"]]  # softmax without a threshold: the winner only
    tokenizer = AutoTokenizer.from_pretrained(single_label_dir)
    expected = sum(len(ids) for ids in tokenizer(TEXTS)["input_ids"])
    assert result["usage"] == {"prompt_tokens": expected, "total_tokens": expected}


def test_a_single_string_is_one_text(sentiment: PredictorProcess) -> None:
    one = classify(sentiment, texts="I love this movie")
    listed = classify(sentiment, texts=["I love this movie"])
    assert one["data"] == listed["data"]


def test_softmax_scores_sum_to_one_and_equal_the_model_run_in_process(
    sentiment: PredictorProcess, single_label_dir: Path
) -> None:
    result = classify(sentiment, texts=TEXTS)
    labels_seen = set()
    for text, item in zip(TEXTS, result["data"], strict=True):
        served = {s["label"]: s["score"] for s in item["all_scores"]}
        assert sum(served.values()) == pytest.approx(1.0, abs=1e-9)
        expected = reference_scores(single_label_dir, text, "softmax")
        assert served == pytest.approx(expected, abs=1e-5)
        assert item["label"] == max(expected, key=lambda label: expected[label])
        labels_seen.add(item["label"])
    assert len(labels_seen) > 1, "the tiny model should not give every text the same label"


def test_sigmoid_scores_are_independent_per_label_and_equal_the_model_run_in_process(
    flags: PredictorProcess, multi_label_dir: Path
) -> None:
    result = classify(flags, texts=TEXTS)
    sums = []
    for text, item in zip(TEXTS, result["data"], strict=True):
        served = {s["label"]: s["score"] for s in item["all_scores"]}
        assert set(served) == set(MULTI_LABELS)
        assert served == pytest.approx(reference_scores(multi_label_dir, text, "sigmoid"), abs=1e-5)
        sums.append(sum(served.values()))
    assert any(abs(total - 1.0) > 0.05 for total in sums), "sigmoid scores are not a distribution"


def test_multi_label_flags_every_label_at_or_over_the_threshold(flags: PredictorProcess) -> None:
    default = classify(flags, texts=TEXTS)["data"]
    lowered = classify(flags, texts=TEXTS, threshold=0.3)["data"]
    strict = classify(flags, texts=TEXTS, threshold=1.0)["data"]
    for at_half, at_03, at_1 in zip(default, lowered, strict, strict=True):
        assert at_half["labels"] == [s["label"] for s in at_half["all_scores"] if s["score"] >= 0.5]
        assert at_03["labels"] == [s["label"] for s in at_03["all_scores"] if s["score"] >= 0.3]
        assert at_1["labels"] == []
        assert at_half["all_scores"] == at_03["all_scores"]  # the threshold never hides scores
    assert any(0 < len(item["labels"]) < len(MULTI_LABELS) for item in default)
    assert sum(len(i["labels"]) for i in lowered) > sum(len(i["labels"]) for i in default)


def test_a_threshold_on_a_softmax_model_lists_the_labels_over_it(sentiment: PredictorProcess) -> None:
    for item in classify(sentiment, texts=TEXTS, threshold=0.2)["data"]:
        assert item["labels"] == [s["label"] for s in item["all_scores"] if s["score"] >= 0.2]
        assert item["label"] == item["all_scores"][0]["label"]  # the winner stays, even under the threshold


def test_top_k_keeps_the_k_highest_scores(sentiment: PredictorProcess, flags: PredictorProcess) -> None:
    full = classify(sentiment, texts=TEXTS)["data"]
    for k in (1, 2):
        limited = classify(sentiment, texts=TEXTS, top_k=k)["data"]
        for whole, cut in zip(full, limited, strict=True):
            assert cut["all_scores"] == whole["all_scores"][:k]
            assert (cut["label"], cut["score"]) == (whole["label"], whole["score"])
    beyond = classify(sentiment, texts=TEXTS, top_k=50)["data"]
    assert beyond == full
    flagged = classify(flags, texts=TEXTS, top_k=1, threshold=0.0)["data"]
    assert all(len(item["all_scores"]) == 1 and len(item["labels"]) == len(MULTI_LABELS) for item in flagged)


def test_the_same_input_twice_gives_identical_output(sentiment: PredictorProcess) -> None:
    assert classify(sentiment, texts=TEXTS)["data"] == classify(sentiment, texts=TEXTS)["data"]


def test_concurrent_requests_get_their_own_results_and_share_forward_passes(sentiment: PredictorProcess) -> None:
    texts = [f"{TEXTS[i % 5]} {'good ' * (i % 7)}".strip() for i in range(32)]
    alone = [classify(sentiment, texts=[t])["data"][0] for t in texts]
    before = batches_over_one(sentiment)
    with httpx.Client(base_url=sentiment.url, timeout=60) as client, ThreadPoolExecutor(32) as pool:
        responses = list(pool.map(lambda t: client.post("/v1/classify", json={"texts": [t]}), texts))
    for response, expected in zip(responses, alone, strict=True):
        got = response.json()["data"][0]
        assert got["label"] == expected["label"]
        assert [s["label"] for s in got["all_scores"]] == [s["label"] for s in expected["all_scores"]]
        assert [s["score"] for s in got["all_scores"]] == pytest.approx(
            [s["score"] for s in expected["all_scores"]], abs=1e-5
        )
    assert batches_over_one(sentiment) > before


def test_a_text_over_the_model_limit_is_a_400_naming_it_unless_truncate_is_sent(
    sentiment: PredictorProcess, single_label_dir: Path
) -> None:
    long = " ".join(["good"] * 100)
    with sentiment.client() as client:
        refused = client.post("/v1/classify", json={"texts": ["good", long]})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "texts[1]"
    assert "64" in refused.json()["error"]["message"]
    cut = classify(sentiment, texts=["good", long], truncate=True)
    assert [item["truncated"] for item in cut["data"]] == [False, True]
    served = {s["label"]: s["score"] for s in cut["data"][1]["all_scores"]}
    assert served == pytest.approx(reference_scores(single_label_dir, long, "softmax", truncate=True), abs=1e-5)
    assert cut["usage"]["prompt_tokens"] == 3 + 64


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[]", 400, None),
        (b"", 400, None),
        (b"{}", 400, "texts"),
        (b'{"texts": 5}', 400, "texts"),
        (b'{"texts": ["ok", 7]}', 400, "texts[1]"),
        (b'{"texts": []}', 400, "texts"),
        (b'{"texts": ["ok"], "top_k": 0}', 400, "top_k"),
        (b'{"texts": ["ok"], "top_k": "many"}', 400, "top_k"),
        (b'{"texts": ["ok"], "threshold": 1.5}', 400, "threshold"),
        (b'{"texts": ["ok"], "truncate": "perhaps"}', 400, "truncate"),
        (b'{"texts": ["ok"], "model": "other"}', 404, "model"),
        (b'{"texts": ["ok"], "model": 3}', 400, "model"),
        (b'{"texts": ["ok", "\\ud800"]}', 400, None),  # refused as JSON, before any field is read
    ],
)
def test_malformed_bodies_are_client_errors_naming_the_field(
    sentiment: PredictorProcess, body: bytes, status: int, param: str | None
) -> None:
    response = http(sentiment).post("/v1/classify", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert response.json()["error"]["param"] == param
    assert "Traceback" not in response.text


def test_more_texts_than_the_request_limit_is_a_413_naming_the_limit(sentiment: PredictorProcess) -> None:
    response = http(sentiment).post("/v1/classify", json={"texts": ["x"] * 1025})
    assert response.status_code == 413
    assert "1024" in response.json()["error"]["message"]


def test_kserve_v1_and_v2_take_strings_and_answer_json(sentiment: PredictorProcess) -> None:
    route = classify(sentiment, texts=TEXTS[:2])["data"]
    with sentiment.client() as client:
        v1 = client.post("/v1/models/sentiment:predict", json={"instances": TEXTS[:2]})
        v2 = client.post(
            "/v2/models/sentiment/infer",
            json={"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": TEXTS[:2]}]},
        )
        bad = client.post("/v1/models/sentiment:predict", json={"instances": ["ok", {"text": 1}]})
    assert v1.status_code == 200
    assert [{"index": i, **p} for i, p in enumerate(v1.json()["predictions"])] == route
    assert v2.status_code == 200
    assert [{"index": i, **json.loads(p)} for i, p in enumerate(v2.json()["outputs"][0]["data"])] == route
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "instances[1]"


def test_the_model_list_reports_labels_and_how_scores_are_made(
    sentiment: PredictorProcess, flags: PredictorProcess
) -> None:
    with sentiment.client() as client:
        [card] = client.get("/openai/v1/models").json()["data"]
    assert card["task"] == "classify"
    assert card["labels"] == CLASSIFY_LABELS
    assert card["score_function"] == "softmax"
    assert card["max_input_tokens"] == 64
    with flags.client() as client:
        [card] = client.get("/openai/v1/models").json()["data"]
    assert card["labels"] == MULTI_LABELS
    assert (card["problem_type"], card["score_function"]) == ("multi_label_classification", "sigmoid")


@pytest.mark.parametrize(
    ("problem_type", "num_labels", "expected"),
    [
        ("single_label_classification", 3, "softmax"),
        (None, 3, "softmax"),
        ("multi_label_classification", 3, "sigmoid"),
        (None, 1, "sigmoid"),
        ("regression", 1, "none"),
    ],
)
def test_the_score_function_follows_the_problem_type(problem_type: str | None, num_labels: int, expected: str) -> None:
    assert score_function(problem_type, num_labels) == expected


def test_unload_frees_the_model(single_label_dir: Path) -> None:
    predictor = ClassifyPredictor(
        PredictorConfig(model_name="m", task=Task.CLASSIFY, source=str(single_label_dir), engine_args={"device": "cpu"})
    )
    predictor.load()
    model = weakref.ref(predictor.model)
    predictor.unload()
    gc.collect()
    assert model() is None
    assert predictor.describe() == {}
