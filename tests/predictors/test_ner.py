"""``task: ner`` on a real predictor process serving a tiny BERT token classifier built here.

The classifier is constructed so known tokens get known labels (see ``tiny_bert.NER_TARGETS``), so the
entities below are facts about the model, and every strategy's output is pinned against transformers'
own token-classification pipeline run in-process on the same model.
"""

from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoModelForTokenClassification, AutoTokenizer, pipeline

from tests.predictors.harness import PredictorProcess, running_predictor
from tests.predictors.tiny_bert import NER_LABELS, build_token_classifier
from universal_predictors.catalog import Task
from universal_predictors.config import PredictorConfig

STRATEGIES = ["none", "simple", "first", "average", "max"]
#: Leading spaces, accents (precomposed and combining), punctuation, tabs, non-ASCII, unknown words.
TEXTS = [
    "John Smith works at Acme Corp in Paris.",
    "   José García, of ACME corp; visited London!!",
    "Dr. Jose\u0301 Garci\u0301a (Berlin)\tsaid: «hello» — to john smith…",
    "Mr Johnson and Goldberg visited New York",
    "nothing to see here",
    "",
    "ünïcödé 東京 john",
]


@pytest.fixture(scope="session")
def ner_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_token_classifier(tmp_path_factory.mktemp("bert-ner"))


@pytest.fixture(scope="session")
def ner(ner_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PredictorProcess]:
    # A non-default strategy as the engine arg, so requests that name none show it is honoured.
    engine_args = {"aggregation_strategy": "first", "max_wait_ms": "20", "dtype": "float32"}
    config = PredictorConfig(model_name="tiny-ner", task=Task.NER, source=str(ner_dir), engine_args=engine_args)
    with running_predictor(config, tmp_path_factory.mktemp("ner-logs")) as predictor:
        yield predictor
        if predictor.url in _CLIENTS:
            _CLIENTS.pop(predictor.url).close()


#: One HTTP client per predictor for the session (a new client per call costs a TLS context).
_CLIENTS: dict[str, httpx.Client] = {}


def http(predictor: PredictorProcess) -> httpx.Client:
    if predictor.url not in _CLIENTS:
        _CLIENTS[predictor.url] = predictor.client()
    return _CLIENTS[predictor.url]


def recognise(predictor: PredictorProcess, **body: Any) -> dict[str, Any]:
    response = http(predictor).post("/v1/ner", json=body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def spans(entities: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(e["label"], e["text"]) for e in entities]


@functools.cache
def reference_pipeline(ner_dir: Path, strategy: str) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(ner_dir)
    model = AutoModelForTokenClassification.from_pretrained(ner_dir).eval()
    return pipeline("token-classification", model=model, tokenizer=tokenizer, aggregation_strategy=strategy)


def test_response_has_the_documented_shape_and_true_usage(ner: PredictorProcess, ner_dir: Path) -> None:
    result = recognise(ner, model="tiny-ner", texts=TEXTS, aggregation_strategy="simple")
    assert result["object"] == "list"
    assert result["model"] == "tiny-ner"
    assert [item["index"] for item in result["data"]] == list(range(len(TEXTS)))
    for item in result["data"]:
        for entity in item["entities"]:
            assert set(entity) == {"text", "label", "start", "end", "score"}
            assert isinstance(entity["start"], int)
            assert isinstance(entity["end"], int)
            assert 0 < entity["score"] <= 1
            assert entity["label"] in {"PER", "ORG", "LOC"}
    tokens = sum(len(ids) for ids in AutoTokenizer.from_pretrained(ner_dir)(TEXTS)["input_ids"])
    assert result["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}


def test_constructed_tokens_come_back_as_their_entities(ner: PredictorProcess) -> None:
    data = recognise(ner, texts=TEXTS, aggregation_strategy="simple")["data"]
    assert spans(data[0]["entities"]) == [("PER", "John Smith"), ("ORG", "Acme Corp"), ("LOC", "Paris")]
    assert spans(data[1]["entities"]) == [("PER", "José García"), ("ORG", "ACME corp"), ("LOC", "London")]
    assert spans(data[2]["entities"]) == [
        ("PER", "Jose\u0301 Garci\u0301a"),
        ("LOC", "Berlin"),
        ("PER", "john smith"),
    ]
    assert data[4]["entities"] == []
    assert data[5]["entities"] == []
    assert spans(data[6]["entities"]) == [("PER", "john")]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_offsets_slice_the_original_text_back_to_the_entity(ner: PredictorProcess, strategy: str) -> None:
    data = recognise(ner, texts=TEXTS, aggregation_strategy=strategy)["data"]
    assert sum(len(item["entities"]) for item in data) >= 8
    for text, item in zip(TEXTS, data, strict=True):
        for entity in item["entities"]:
            assert 0 <= entity["start"] < entity["end"] <= len(text)
            assert text[entity["start"] : entity["end"]] == entity["text"]
        starts = [e["start"] for e in item["entities"]]
        assert starts == sorted(starts)


def test_aggregation_strategies_differ_where_the_model_was_built_to(ner: PredictorProcess) -> None:
    text = ["Mr Johnson and Goldberg"]
    found = {s: spans(recognise(ner, texts=text, aggregation_strategy=s)["data"][0]["entities"]) for s in STRATEGIES}
    # Johnson = john|##son (B-PER, I-ORG); Goldberg = gold|##berg (weak B-PER, confident B-ORG).
    assert found["none"] == [("B-PER", "John"), ("I-ORG", "son"), ("B-PER", "Gold"), ("B-ORG", "berg")]
    assert found["simple"] == [("PER", "John"), ("ORG", "son"), ("PER", "Gold"), ("ORG", "berg")]
    assert found["first"] == [("PER", "Johnson"), ("PER", "Goldberg")]
    assert found["max"] == [("PER", "Johnson"), ("ORG", "Goldberg")]
    assert found["average"] == [("PER", "Johnson"), ("ORG", "Goldberg")]
    scores = {
        s: [e["score"] for e in recognise(ner, texts=text, aggregation_strategy=s)["data"][0]["entities"]]
        for s in ("first", "average")
    }
    assert scores["average"][0] < scores["first"][0]  # averaging in the I-ORG piece lowers the PER score


def test_the_engine_arg_strategy_applies_when_a_request_names_none(ner: PredictorProcess) -> None:
    assert recognise(ner, texts=TEXTS) == recognise(ner, texts=TEXTS, aggregation_strategy="first")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_equals_the_transformers_pipeline_in_process(
    ner: PredictorProcess, ner_dir: Path, strategy: str
) -> None:
    # The pipeline guesses word boundaries from string lengths, so a combining accent (one more
    # character than the normalised token) glues two words together there; we use the tokenizer's word
    # ids. Compare on the texts where both agree, and pin the combining case separately below.
    texts = [text for text in TEXTS if unicodedata.is_normalized("NFC", text)]
    reference = reference_pipeline(ner_dir, strategy)
    data = recognise(ner, texts=texts, aggregation_strategy=strategy)["data"]
    for text, item in zip(texts, data, strict=True):
        expected = [
            (e.get("entity_group", e.get("entity")), int(e["start"]), int(e["end"]), float(e["score"]))
            for e in (reference(text) if text else [])
        ]
        got = [(e["label"], e["start"], e["end"], e["score"]) for e in item["entities"]]
        assert [g[:3] for g in got] == [e[:3] for e in expected], text
        assert [g[3] for g in got] == pytest.approx([e[3] for e in expected], abs=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_combining_accents_score_like_precomposed_ones(ner: PredictorProcess, strategy: str) -> None:
    decomposed = TEXTS[2]
    composed = unicodedata.normalize("NFC", decomposed)
    assert composed != decomposed
    found = recognise(ner, texts=[decomposed, composed], aggregation_strategy=strategy)["data"]
    assert [(e["label"], e["score"]) for e in found[0]["entities"]] == [
        (e["label"], e["score"]) for e in found[1]["entities"]
    ]
    assert [unicodedata.normalize("NFC", e["text"]) for e in found[0]["entities"]] == [
        e["text"] for e in found[1]["entities"]
    ]


def test_the_same_input_twice_gives_identical_output(ner: PredictorProcess) -> None:
    assert recognise(ner, texts=TEXTS) == recognise(ner, texts=TEXTS)


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


def test_concurrent_requests_get_their_own_entities_and_share_forward_passes(ner: PredictorProcess) -> None:
    texts = [f"{'the ' * (i % 6)}{TEXTS[i % 4]} and john {i}" for i in range(32)]
    alone = [recognise(ner, texts=[t], aggregation_strategy="average")["data"][0]["entities"] for t in texts]
    before = batches_over_one(ner)
    with httpx.Client(base_url=ner.url, timeout=60) as client, ThreadPoolExecutor(32) as pool:
        responses = list(
            pool.map(lambda t: client.post("/v1/ner", json={"texts": [t], "aggregation_strategy": "average"}), texts)
        )
    for response, expected in zip(responses, alone, strict=True):
        got = response.json()["data"][0]["entities"]
        assert [{k: v for k, v in e.items() if k != "score"} for e in got] == [
            {k: v for k, v in e.items() if k != "score"} for e in expected
        ]
        assert [e["score"] for e in got] == pytest.approx([e["score"] for e in expected], abs=1e-5)
    assert batches_over_one(ner) > before


def test_a_text_over_the_model_limit_is_a_400_naming_it_unless_truncate_is_sent(ner: PredictorProcess) -> None:
    long = "john smith " * 40 + "in paris"
    with ner.client() as client:
        refused = client.post("/v1/ner", json={"texts": ["john", long]})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "texts[1]"
    cut = recognise(ner, texts=["john", long], truncate=True, aggregation_strategy="simple")
    assert [item["truncated"] for item in cut["data"]] == [False, True]
    entities = cut["data"][1]["entities"]
    assert all(long[e["start"] : e["end"]] == e["text"] for e in entities)
    assert len(entities) == 31  # 62 word tokens fit between [CLS] and [SEP]; "in paris" is cut off
    assert cut["usage"]["prompt_tokens"] == 3 + 64


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"", 400, None),
        (b'"texts"', 400, None),
        (b'{"text": ["x"]}', 400, "texts"),
        (b'{"texts": null}', 400, "texts"),
        (b'{"texts": [["nested"]]}', 400, "texts[0]"),
        (b'{"texts": []}', 400, "texts"),
        (b'{"texts": ["x"], "aggregation_strategy": "longest"}', 400, "aggregation_strategy"),
        (b'{"texts": ["x"], "aggregation_strategy": 1}', 400, "aggregation_strategy"),
        (b'{"texts": ["x"], "model": "someone-else"}', 404, "model"),
        (b'{"texts": ["\\udfff"]}', 400, None),  # refused as JSON, before any field is read
    ],
)
def test_malformed_bodies_are_client_errors_naming_the_field(
    ner: PredictorProcess, body: bytes, status: int, param: str | None
) -> None:
    response = http(ner).post("/v1/ner", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status
    assert response.json()["error"]["param"] == param
    assert "Traceback" not in response.text


def test_kserve_v1_and_v2_take_strings_and_answer_json(ner: PredictorProcess) -> None:
    route = [item["entities"] for item in recognise(ner, texts=TEXTS[:3])["data"]]
    with ner.client() as client:
        v1 = client.post("/v1/models/tiny-ner:predict", json={"instances": TEXTS[:3]})
        v2 = client.post(
            "/v2/models/tiny-ner/infer",
            json={"inputs": [{"name": "text", "shape": [3], "datatype": "BYTES", "data": TEXTS[:3]}]},
        )
        bad = client.post("/v1/models/tiny-ner:predict", json={"instances": [3]})
    assert v1.status_code == 200
    assert [p["entities"] for p in v1.json()["predictions"]] == route
    assert v2.status_code == 200
    assert [json.loads(p)["entities"] for p in v2.json()["outputs"][0]["data"]] == route
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "instances[0]"


def test_the_model_list_reports_labels_entity_types_and_the_default_strategy(ner: PredictorProcess) -> None:
    with ner.client() as client:
        [card] = client.get("/openai/v1/models").json()["data"]
    assert card["task"] == "ner"
    assert card["labels"] == NER_LABELS
    assert card["entity_types"] == ["LOC", "ORG", "PER"]
    assert card["aggregation_strategy"] == "first"
    assert card["max_input_tokens"] == 64
